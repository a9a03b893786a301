"""Bandwidth of the UCX data plane between two local processes.

    python -m hybrid_pd.bench.ucx --sizes 1M,16M,64M --repeats 5 --split 16

`measure_pair` spawns a peer process (the sender) with its own UcxTransport; this process
receives. For each size it measures
  raw        one buffer as one plain ucxx tag message (no bookkeeping of this package),
  1 region   the same buffer through UcxTransport.send / post_recv,
  k regions  the same total split into k non-adjacent regions (k messages),
timing the sender from submission to completion (a rendezvous send completes once the
receiver has pulled the data) with the receive already posted. The peer runs with
UCX_PROTO_INFO=y and reports the transports UCX chose for tagged messages, so `shm` says
whether shared memory / CMA carried the data. Network interfaces are limited to loopback
unless UCX_NET_DEVICES is set.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import re
import statistics
import tempfile
import time

import torch

from hybrid_pd.bench.raw_ucx import raw_bandwidth
from hybrid_pd.connector.ucx import UcxTransport

SHM_TRANSPORTS = {"sysv", "posix", "cma", "xpmem", "knem", "cuda_ipc", "self"}
_PIPE_TIMEOUT = 120.0


def _ucx_options() -> dict[str, str]:
    return {} if "UCX_NET_DEVICES" in os.environ else {"NET_DEVICES": "lo"}


def _split(buf: torch.Tensor, size: int, k: int) -> list[torch.Tensor]:
    """k regions of size // k bytes each, with a gap of the same length between them."""
    chunk = size // k
    return [buf[2 * i * chunk : (2 * i + 1) * chunk] for i in range(k)]


def _parse_proto_info(text: str) -> list[str]:
    """Transports in the 'tagged message' tables that UCX_PROTO_INFO=y prints."""
    found: list[str] = []
    in_tag_table = False
    for line in text.splitlines():
        if "tagged message" in line:
            in_tag_table = True
            continue
        if in_tag_table and re.search(r"\|\s*$", line) and "|" in line:
            cells = [c.strip() for c in line.strip().split("|") if c.strip()]
            if cells and "/" in cells[-1] and cells[-1] not in found:
                found.append(cells[-1])
        elif in_tag_table and "+---" not in line and "|" not in line:
            in_tag_table = False
    return found


def _peer(conn, max_bytes: int, polling: bool) -> None:
    """The sending side; UCX's protocol tables go to a file that is parsed on request."""
    torch.set_num_threads(1)
    log = tempfile.NamedTemporaryFile("w+", suffix=".ucxlog", delete=False)
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    os.environ["UCX_PROTO_INFO"] = "y"
    t = UcxTransport(ucx_options=_ucx_options(), polling=polling)
    try:
        t.start()
        conn.send(t.address)
        if not conn.poll(_PIPE_TIMEOUT):
            return
        peer = conn.recv()
        src = torch.randint(0, 256, (2 * max_bytes,), dtype=torch.uint8)
        while conn.poll(_PIPE_TIMEOUT):
            cmd, *args = conn.recv()
            if cmd == "exit":
                break
            if cmd == "raw":
                size, tag, repeats = args
                times = raw_bandwidth(t, peer, tag, src[:size], repeats=repeats, send=True)
                conn.send(times)
            elif cmd == "send":
                size, k, tag = args
                regions = [src[:size]] if k == 1 else _split(src, size, k)
                t0 = time.perf_counter()
                t.send(peer, tag, regions, 60.0)
                conn.send(time.perf_counter() - t0)
            elif cmd == "transports":
                with open(log.name) as f:
                    conn.send(_parse_proto_info(f.read()))
    finally:
        t.close()
        log.close()
        os.unlink(log.name)


def _row(mode: str, size: int, times: list[float], transports: list[str]) -> dict:
    best, med = min(times), statistics.median(times)
    return {
        "mode": mode,
        "bytes": size,
        "gbps_best": size / best / 1e9,
        "gbps_median": size / med / 1e9,
        "seconds": times,
        "transports": transports,
        "shm": any(tr.split("/")[0] in SHM_TRANSPORTS for tr in transports)
        and not any(tr.startswith("tcp/") for tr in transports),
    }


def measure_pair(
    sizes: list[int], repeats: int, split: int = 16, polling: bool = False
) -> list[dict]:
    """GB/s of moving each size from a spawned peer process into this one (see module doc).
    One dict per (size, mode): mode, bytes, gbps_best, gbps_median, seconds, transports, shm.
    `polling`: both sides' UCX progress threads busy-poll instead of sleeping on events."""
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_peer, args=(child, max(sizes), polling), daemon=True)
    t = UcxTransport(ucx_options=_ucx_options(), polling=polling)
    rows: list[dict] = []

    def answer():
        if not conn.poll(_PIPE_TIMEOUT):
            raise TimeoutError("benchmark peer did not answer")
        return conn.recv()

    try:
        proc.start()
        child.close()
        t.start()
        peer = answer()
        conn.send(t.address)
        dst = torch.zeros(2 * max(sizes), dtype=torch.uint8)
        tag = 1 << 32
        results: list[tuple[str, int, list[float]]] = []
        for size in sizes:
            # raw ucxx: the receiver posts each next receive as soon as one completes
            conn.send(("raw", size, tag, repeats + 1))
            raw_bandwidth(t, peer, tag, dst[:size], repeats=repeats + 1, send=False)
            results.append(("raw", size, answer()[1:]))  # the first one warms up
            tag += repeats + 1
            for k in (1, split):
                times = []
                for _ in range(repeats):
                    regions = [dst[:size]] if k == 1 else _split(dst, size, k)
                    handle = t.post_recv(peer, tag, regions)
                    conn.send(("send", size, k, tag))
                    seconds = answer()
                    handle.wait(60.0)
                    times.append(seconds)
                    tag += k
                results.append(("1 region" if k == 1 else f"{k} regions", size, times))
        conn.send(("transports",))
        transports = answer()
        rows = [_row(mode, size, times, transports) for mode, size, times in results]
        conn.send(("exit",))
        proc.join(30)
    finally:
        t.close()
        if proc.is_alive():
            proc.terminate()
            proc.join(5)
        conn.close()
    return rows


def _size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="1M,16M,64M")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--split", type=int, default=16)
    p.add_argument("--polling", action="store_true", help="busy-polling UCX progress threads")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    rows = measure_pair([_size(s) for s in a.sizes.split(",")], a.repeats, a.split, a.polling)
    if a.json:
        print(json.dumps(rows, indent=1))
        return
    print(f"transports: {', '.join(rows[0]['transports'])}  shm={rows[0]['shm']}")
    print(f"{'size':>10} {'mode':>11} {'GB/s best':>10} {'GB/s median':>12}")
    for r in rows:
        size = f"{r['bytes'] / (1 << 20):g} MiB"
        print(f"{size:>10} {r['mode']:>11} {r['gbps_best']:>10.2f} {r['gbps_median']:>12.2f}")


if __name__ == "__main__":
    main()
