"""The proxy is a process of its own that never loads torch or the model: it learns what it
serves from the workers' model cards, and still gives the single engine's tokens."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import httpx
import pytest

from hybrid_pd.engine.sampling import SamplingParams
from tests.proxy.conftest import free_address

pytestmark = pytest.mark.timeout(120)

#: Run as `python -c`: make torch (and the other heavy stacks) unimportable, then run `body`.
BLOCKER = textwrap.dedent(
    """
    import sys

    class _Refuse:
        HEAVY = {"torch", "numpy", "transformers", "safetensors", "ray", "ucxx"}

        def find_spec(self, name, path=None, target=None):
            if name.partition(".")[0] in self.HEAVY:
                raise ImportError(f"{name} may not be imported by the proxy")

    sys.meta_path.insert(0, _Refuse())
    """
)


def test_proxy_package_imports_without_torch():
    code = BLOCKER + textwrap.dedent(
        """
        import hybrid_pd.launcher.cli, hybrid_pd.proxy.__main__, hybrid_pd.proxy.server
        heavy = sorted(m for m in sys.modules if m.partition(".")[0] in _Refuse.HEAVY)
        assert not heavy, heavy
        print("ok")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_proxy_process_without_torch_serves_exact_tokens(workers, tiny_path, reference):
    """`hybrid-pd proxy` in front of running workers, torch unimportable in its process:
    it names the model after the checkpoint folder, answers with the engine's greedy
    tokens, and exits 0 on SIGTERM."""
    address = free_address()
    port = address.rpartition(":")[2]
    decode = [w.address for w in workers]
    argv = ["proxy", "--port", port, "--decode", *decode]
    code = BLOCKER + f"from hybrid_pd.launcher.cli import main\nsys.exit(main({argv!r}))\n"
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        url = f"http://{address}"
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                models = httpx.get(url + "/v1/models", timeout=5)
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline, "the proxy did not start"
                time.sleep(0.2)
        assert models.status_code == 200
        names = [m["id"] for m in models.json()["data"]]
        assert names == [tiny_path.name, str(tiny_path)]
        card = httpx.get(f"{url}/v1/models/{tiny_path.name}", timeout=5).json()
        assert card["max_model_len"] == reference.max_model_len
        assert httpx.get(f"{url}/v1/models/nope", timeout=5).status_code == 404

        prompt = "A torch-free front door"
        want = reference.generate([prompt], SamplingParams(max_tokens=10))[0]
        body = {
            "model": tiny_path.name,
            "prompt": prompt,
            "max_tokens": 10,
            "temperature": 0,
            "return_token_ids": True,
        }
        r = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["token_ids"] == want.token_ids and choice["text"] == want.text
        assert r.json()["model"] == tiny_path.name
        rss_kib = _rss_kib(proc.pid)
        print(f"torch-free proxy RSS: {rss_kib / 1024:.0f} MiB")
        assert rss_kib < 400 * 1024  # torch alone costs more than this
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            rc = proc.wait()
    assert rc == 0, proc.stdout.read()


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError("no VmRSS")
