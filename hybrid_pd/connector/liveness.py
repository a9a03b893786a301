"""Whether a process on this host is still alive, without racing its pid's reuse.

A one-sided read on one host is a CMA read (`process_vm_readv`) of the owner's memory, and
UCX aborts the reading process when that owner is gone (endpoints without peer error
handling, the ones that get shared memory and CMA). So a reader first checks the owner:
`ProcessWatch` holds a pidfd of it, opened only once the pid's start time proves it is
the same process, and answers `alive()` with a zero-timeout poll.
"""

from __future__ import annotations

import os
import select

_BOOT_ID = "/proc/sys/kernel/random/boot_id"


def boot_id() -> str:
    """This host's boot id ('' where the kernel does not say)."""
    try:
        with open(_BOOT_ID) as f:
            return f.read().strip()
    except OSError:
        return ""


def start_ticks(pid: int) -> int:
    """When process `pid` started, in clock ticks since boot (0: not visible here)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return 0
    fields = stat[stat.rfind(")") + 2 :].split()  # after "pid (comm) "
    return int(fields[19]) if len(fields) > 19 else 0


class ProcessWatch:
    """A process of this host, watched through a pidfd (`watch`), closed when the watch
    is dropped (never while a reader may still ask it: the fd number could be reused)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def alive(self) -> bool:
        if self.fd < 0:
            return False
        ready, _, _ = select.select([self.fd], [], [], 0)
        return not ready  # a pidfd turns readable when its process exits

    def __del__(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def watch(pid: int, ticks: int) -> ProcessWatch | None:
    """A watch on process `pid` of this host if it is the one that started at `ticks`;
    None when it is gone, is another process, or cannot be watched here."""
    if pid <= 0 or not ticks or not hasattr(os, "pidfd_open"):
        return None
    try:
        fd = os.pidfd_open(pid)
    except OSError:
        return None
    if start_ticks(pid) != ticks:  # the pid now names another process
        os.close(fd)
        return None
    return ProcessWatch(fd)
