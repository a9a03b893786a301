"""What a vLLM server process leaves behind, and a guard that ends it with its owner.

vLLM puts its ZMQ sockets and its torch.distributed file store (`vllm_dist_<id>`) in the
system's temp folder, and a tensor-parallel CPU server maps its communicator's shared memory
as `/dev/shm/vllm_dist_<id>-...`. Stopped by signal, it removes none of them.
`own_temp_dir` gives each server a folder of its own for the first two, and
`remove_temp_dir` removes that folder and the segments named after any store in it.

A server runs in a session of its own (so that it is paused, continued and stopped as one
process group), so it would outlive an owner that dies without stopping it: a Ray actor
killed or crashed, whose replacement then finds the old server on its ports. The owner
therefore starts the server through this module:

    python -m hybrid_pd.workers.vllm_guard --temp-dir DIR -- <server command...>

The guard starts the command in its own process group and waits for it, exiting as the
command did (same code, or the same signal). Signals sent to the group reach the command
as before; the guard itself ignores SIGTERM and SIGINT and waits. It reads its stdin, a pipe
that only the owner holds open: end of file there means the owner has gone, and the guard
stops the group (SIGTERM, SIGKILL after `STOP_GRACE_S`) and removes the server's temp
folder. Standard library only: the guard runs under whichever Python starts it."""

from __future__ import annotations

import argparse
import getpass
import glob
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

SHM_DIR = Path("/dev/shm")
#: Seconds a stopped server gets to exit after SIGTERM before its group is killed.
STOP_GRACE_S = 30.0


def own_temp_dir(env: dict) -> Path:
    """A new folder for what a vLLM process leaves in the system's temp folder, set in `env`
    as VLLM_RPC_BASE_PATH (its ZMQ sockets) and TMPDIR (its file store). Torch's compile
    cache stays where it would be without the new TMPDIR, so compiled runs still share it.
    The caller removes it with `remove_temp_dir` once the process has ended."""
    folder = Path(tempfile.mkdtemp(prefix="hybrid-pd-vllm-"))
    env.setdefault(
        "TORCHINDUCTOR_CACHE_DIR",
        str(Path(tempfile.gettempdir()) / f"torchinductor_{getpass.getuser()}"),
    )
    env["VLLM_RPC_BASE_PATH"] = str(folder)
    env["TMPDIR"] = str(folder)
    return folder


def remove_temp_dir(folder: Path) -> None:
    """Remove a folder from `own_temp_dir`, and the shared-memory segments named after any
    file store in it, once its process has ended (a segment still mapped lives on until
    its last user exits; only its name goes)."""
    for store in folder.glob("vllm_dist_*"):
        for segment in SHM_DIR.glob(f"{glob.escape(store.name)}-*"):
            segment.unlink(missing_ok=True)
    shutil.rmtree(folder, ignore_errors=True)


def guarded(command: list[str], temp_dir: Path) -> list[str]:
    """`command` run under the guard (see the module's doc); start it with stdin=PIPE and
    keep that pipe open for as long as the server may live."""
    return [
        sys.executable, "-m", "hybrid_pd.workers.vllm_guard",
        "--temp-dir", str(temp_dir), "--", *command,
    ]  # fmt: skip


def _stop_group(child: subprocess.Popen) -> None:
    """The owner is gone: end the server and everything else in this process group. A
    guard that does not lead its group (started without a session of its own) ends its
    command only: the group is then its starter's."""
    if os.getpgid(0) != os.getpid():
        child.send_signal(signal.SIGCONT)
        child.terminate()
        try:
            child.wait(STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait(10)
        return
    os.killpg(0, signal.SIGCONT)  # a paused server cannot exit
    os.killpg(0, signal.SIGTERM)  # the guard's own handler does nothing
    try:
        child.wait(STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        pass
    deadline = time.monotonic() + 10.0
    me = os.getpid()
    while (others := [p for p in group_members(os.getpgid(0)) if p != me]) and (
        time.monotonic() < deadline
    ):
        for pid in others:  # the command's own children may outlive it
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.1)
    child.wait(10)


def group_members(pgid: int) -> list[int]:
    """The live (not zombie) processes of process group `pgid` (Linux /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            # the fields after the command name's closing parenthesis: state, ppid, pgrp
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            found.append(int(entry.name))
    return found


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hybrid_pd.workers.vllm_guard")
    p.add_argument("--temp-dir", required=True, type=Path)
    p.add_argument("command", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        p.error("no command to guard")
    for sig in (signal.SIGTERM, signal.SIGINT):  # the group's signals are for the command
        signal.signal(sig, lambda *_: None)  # a handler (not SIG_IGN): the command inherits none
    child = subprocess.Popen(command, stdin=subprocess.DEVNULL)
    owner_gone = threading.Event()

    def watch_owner() -> None:
        try:
            while os.read(0, 4096):  # unbuffered: no lock for shutdown to trip on
                pass
        except OSError:
            pass
        if child.poll() is None:
            owner_gone.set()
            _stop_group(child)
            remove_temp_dir(args.temp_dir)

    watcher = threading.Thread(target=watch_owner, daemon=True)
    watcher.start()
    code = child.wait()
    if owner_gone.is_set():  # let the watcher finish stopping the group and cleaning up
        watcher.join(STOP_GRACE_S + 30.0)
    if code < 0:  # end the way the command ended, so the owner sees the same status
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    return code


if __name__ == "__main__":
    sys.stdout.flush()
    os._exit(main())  # the watcher may still be reading: no interpreter shutdown
