"""The kernels built for each instruction set level this CPU runs (avx512, avx2, generic):
the level is chosen from the CPU and `HYBRID_PD_CPU_ISA`, keys the cache, and every level
computes the same results (each against PyTorch; the same bits on the levels with fused
multiply-adds; the greedy tokens of two models equal across levels)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from hybrid_pd.engine import cpu_kernels

LEVELS = [lv for lv in ("avx512", "avx2", "generic") if lv in cpu_kernels.supported_isas()]

# Run in a process per level: the kernels' outputs against PyTorch (the largest relative
# error) and their bits (a digest), and the greedy tokens of the built-in Qwen3.5-like model
# (GDN + attention) and of a small Granite-4.0-H-like one (Mamba2 + attention).
_PROBE = r"""
import hashlib, json, sys, tempfile
from pathlib import Path
import torch
from hybrid_pd.engine import cpu_kernels as ck
from hybrid_pd.engine.models.mamba2 import _ssd_step
torch.manual_seed(0)
out = {"isa": ck.isa(), "status": ck.status(), "width": ck.panel_width(), "err": {}}
bits = hashlib.sha256()
def rel(got, want):
    return ((got.double() - want.double()).abs().max() / (want.double().abs().max() + 1)).item()
for m, n, k in [(1, 100, 64), (7, 96, 130), (256, 200, 768)]:
    w, x, b = torch.randn(n, k), torch.randn(m, k), torch.randn(n)
    y = ck.panel_linear(x, ck.pack_panels(w), n, b)
    out["err"][f"panel {m}x{n}x{k}"] = rel(y, torch.nn.functional.linear(x, w, b))
    bits.update(y.numpy().tobytes())
    yb = ck.panel_linear(x.bfloat16(), ck.pack_panels(w.bfloat16()), n, b.bfloat16())
    wide = ck.panel_linear(x.bfloat16().float(), ck.pack_panels(w.bfloat16().float()), n,
                           b.bfloat16().float())
    out["err"][f"bf16 panel {m}x{n}x{k}"] = rel(yb, wide.bfloat16())  # bit for bit: 0
    bits.update(yb.view(torch.int16).numpy().tobytes())
    g = ck.gemv(x[0], w, b)
    out["err"][f"gemv {n}x{k}"] = rel(g, torch.nn.functional.linear(x[0], w, b))
    bits.update(g.numpy().tobytes())
x, dt = torch.randn(4, 8, 64), torch.rand(4, 8) * 0.5
bc, cc, a = torch.randn(4, 1, 128), torch.randn(4, 1, 128), -torch.rand(8) * 4
state = torch.randn(4, 8, 64, 128)
want_y, want_s = _ssd_step(x, dt, a, bc, cc, state.clone(), in_place=True)
y = ck.ssd_step(x, dt, a, bc, cc, state)
out["err"]["ssd_step d_state 128"] = max(rel(y, want_y), rel(state, want_s))
bits.update(y.numpy().tobytes() + state.numpy().tobytes())
out["bits"] = bits.hexdigest()

from hybrid_pd.bench.checkpoints import build
from hybrid_pd.engine.engine import Engine, EngineConfig
from hybrid_pd.engine.loader import load_model
from hybrid_pd.engine.sampling import SamplingParams
from hybrid_pd.engine.tiny import resolve_model
root = Path(sys.argv[1])
out["tokens"] = {}
models = [("qwen3.5 tiny", resolve_model("tiny")), ("granite", build("granite", root, 64))]
for name, path in models:
    model, config, tok = load_model(path, dtype="float32")
    engine = Engine(model, config, EngineConfig(kv_memory_bytes=1 << 26), tok)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (40, 75)]
    res = engine.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))
    out["tokens"][name] = [list(r.token_ids) for r in res]
print(json.dumps(out))
"""


def _run(level: str, root) -> dict:
    env = {**os.environ, "HYBRID_PD_CPU_ISA": level}
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, str(root)],
        env=env, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_level_follows_the_cpu_and_the_override(monkeypatch):
    levels = cpu_kernels.supported_isas()
    assert levels[-1] == "generic"
    monkeypatch.delenv("HYBRID_PD_CPU_ISA", raising=False)
    assert cpu_kernels.isa() == levels[0]
    for level in levels:
        monkeypatch.setenv("HYBRID_PD_CPU_ISA", level)
        assert cpu_kernels.isa() == level
    monkeypatch.setenv("HYBRID_PD_CPU_ISA", "no-such-level")
    assert cpu_kernels.isa() == levels[0]
    # the flags are explicit per level: a shared cache never holds one machine's -march=native
    assert "-march=native" not in cpu_kernels.loader._flags("avx2")
    assert "-march=x86-64-v3" in cpu_kernels.loader._flags("avx2")


@pytest.mark.skipif(len(LEVELS) < 2, reason="this CPU runs one x86 level only")
def test_each_level_builds_its_own_library():
    # the shared cache (the levels' libraries are built once for this whole suite)
    code = "from hybrid_pd.engine import cpu_kernels; print(cpu_kernels._build())"
    paths = []
    for level in LEVELS[:2]:
        env = {**os.environ, "HYBRID_PD_CPU_ISA": level}
        done = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
        )
        assert done.returncode == 0, done.stderr[-2000:]
        paths.append(done.stdout.strip())
    assert paths[0] != paths[1]
    assert [f"-{lv}-" in p for lv, p in zip(LEVELS, paths, strict=False)] == [True, True]


@pytest.mark.slow
def test_every_level_computes_the_same(tmp_path):
    runs = {level: _run(level, tmp_path / level) for level in LEVELS}
    for level, run in runs.items():
        assert run["isa"] == level and run["status"] == "on", run
        for what, err in run["err"].items():
            assert err <= 1e-5, (level, what, err)
    first = runs[LEVELS[0]]
    for level, run in runs.items():
        # the same terms in the same order on the levels with fused multiply-adds (the tiles
        # only change which sums share registers): the same bits. `generic` (x86-64 without
        # FMA) rounds each product apart: within the tolerance above, other bits.
        if level != "generic":
            assert run["bits"] == first["bits"], (level, LEVELS[0])
        assert run["tokens"] == first["tokens"], (level, LEVELS[0])
