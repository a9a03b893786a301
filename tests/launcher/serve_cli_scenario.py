"""Run inside a fresh network namespace (only loopback): the `hybrid-pd serve` command as an
operator runs it. One serve process: its console while it starts, a request (its access-log
line), a stream still running when SIGTERM comes (it must finish), then the exit.
Prints one JSON line."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx

PORT = 8000
PROMPT = "A prompt long enough to take the prefill pool and then the decode pool."


def main() -> int:
    from hybrid_pd.api.tokenizer import Tokenizer
    from hybrid_pd.engine.tiny import resolve_model

    cmd = [sys.executable, "-m", "hybrid_pd.launcher.cli", "serve", "--port", str(PORT)]
    cmd += ["--kv-memory", "32MiB", "--threads", "1", "--max-migrations", "0"]
    t0 = time.monotonic()
    proc = subprocess.Popen(
        cmd,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"},
        start_new_session=True,
    )
    out: list[str] = []
    err: list[str] = []
    ready = threading.Event()

    def read(stream, lines: list[str]) -> None:
        for line in stream:
            lines.append(line.rstrip("\n"))
            if line.startswith("hybrid-pd serving"):
                ready.set()
        ready.set()  # the process ended

    readers = [
        threading.Thread(target=read, args=(proc.stdout, out), daemon=True),
        threading.Thread(target=read, args=(proc.stderr, err), daemon=True),
    ]
    for r in readers:
        r.start()
    result: dict = {"prompt_tokens": len(Tokenizer(resolve_model("tiny")).encode(PROMPT))}
    try:
        ready.wait(300)
        result["ready_s"] = round(time.monotonic() - t0, 1)
        url = f"http://127.0.0.1:{PORT}"
        body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
        reply = httpx.post(url + "/v1/completions", json=body, timeout=120)
        result["completion_status"] = reply.status_code
        result["completion_id"] = reply.json().get("id")
        result["completion_tokens"] = reply.json()["usage"]["completion_tokens"]
        # A stream in flight when SIGTERM comes: it must run to its end.
        streamed = {**body, "max_tokens": 48, "stream": True, "ignore_eos": True}
        chunks = 0
        with httpx.stream("POST", url + "/v1/completions", json=streamed, timeout=120) as s:
            for line in s.iter_lines():
                if line.startswith("data: {"):
                    chunks += 1
                    if chunks == 1:
                        proc.send_signal(signal.SIGTERM)
                        t_term = time.monotonic()
                        time.sleep(0.5)  # the listening socket is closed by now
                        try:
                            httpx.get(url + "/health", timeout=5)
                            result["new_connection_refused"] = False
                        except httpx.ConnectError:
                            result["new_connection_refused"] = True
                elif line == "data: [DONE]":
                    result["stream_done"] = True
        result["stream_chunks"] = chunks
        result["stream_status"] = s.status_code
        proc.wait(120)
        result["exit_after_sigterm_s"] = round(time.monotonic() - t_term, 1)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
        for r in readers:
            r.join(10)
    result["returncode"] = proc.returncode
    result["stdout"] = out
    result["stderr"] = err
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
