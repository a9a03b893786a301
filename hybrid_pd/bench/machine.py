"""How close an engine's figures are to the machine: a checkpoint's work per token (float32
multiply-adds of its linears, bytes of weights a decode step reads) and two measurements of
the CPUs the benchmark runs on (a GEMM's best float32 rate on operands in the cache, and
`memcpy`'s bandwidth). Used by `bench engine --peer vllm` to put GFLOP/s and GB/s beside
tokens/s."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

#: Bytes per element of the dtypes a benchmark runs.
_ELEMENT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def checkpoint_costs(path: Path, dtype: str) -> dict[str, float]:
    """From the checkpoint's safetensors headers: `flops_per_token` (2 x the elements of the
    layers' weight matrices: what a prompt token's linears cost; attention's own products
    and MoE routing not counted, every expert counted), `head_flops` (the vocabulary head,
    once per sequence: only the sampled rows are computed) and `decode_weight_bytes` (every
    weight a decode step reads at `dtype`: the layers and the head, not the embedding table
    where the head is separate)."""
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            for name in f.keys():
                shapes[name] = tuple(f.get_slice(name).get_shape())

    def count(shape: tuple[int, ...]) -> int:
        n = 1
        for s in shape:
            n *= s
        return n

    layers = sum(
        count(s) for n, s in shapes.items() if ".layers." in n and len(s) >= 2 and "conv" not in n
    )
    small = sum(count(s) for n, s in shapes.items() if ".layers." in n and len(s) < 2)
    embed = next((s for n, s in shapes.items() if n.endswith("embed_tokens.weight")), (0, 0))
    head = shapes.get("lm_head.weight", embed)
    return {
        "flops_per_token": 2.0 * layers,
        "head_flops": 2.0 * count(head),
        "decode_weight_bytes": float((layers + small + count(head)) * _ELEMENT_BYTES[dtype]),
    }


def gemm_peak_gflops(seconds: float = 0.5) -> float:
    """The best float32 rate of a GEMM on operands that stay in the cache (our panel kernel
    where it runs, else torch's), over torch's threads: a stand-in for the cores' float32
    multiply-add peak that the prefill figures are compared with."""
    from hybrid_pd.engine import cpu_kernels

    m, n, k = 96, 512, 256
    x, w = torch.randn(m, k), torch.randn(n, k)
    panels = cpu_kernels.pack_panels(w)

    def run() -> None:
        if panels is None or cpu_kernels.panel_linear(x, panels, n) is None:
            torch.mm(x, w.t())

    run()
    best, end = float("inf"), time.perf_counter() + seconds
    while time.perf_counter() < end:
        t = time.perf_counter()
        for _ in range(10):
            run()
        best = min(best, (time.perf_counter() - t) / 10)
    return 2.0 * m * n * k / best / 1e9


def memcpy_gb_per_s(size: int = 256 << 20, reps: int = 5) -> float:
    """Bytes one copy of `size` bytes moves per second (torch's copy, best of `reps`): the
    memory's speed that decode's weight reads are compared with."""
    src = torch.ones(size // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return size / best / 1e9


def machine_figures() -> dict[str, float]:
    """`gemm_peak_gflops` and `memcpy_gb_per_s` here, now."""
    return {
        "gemm_peak_gflops": round(gemm_peak_gflops(), 1),
        "memcpy_gb_per_s": round(memcpy_gb_per_s(), 1),
    }


def add_machine_ratios(row: dict[str, Any], costs: dict[str, float], machine: dict) -> None:
    """Beside a run row's tokens/s: prefill GFLOP/s (and its share of the GEMM peak) and
    decode GB/s of weights read (and its share of memcpy's), for both sides."""
    bs, prompt_len = row["batch_size"], row["prompt_len"]
    per_token = costs["flops_per_token"] + costs["head_flops"] / prompt_len
    for side in ("ours", "vllm"):
        gflops = row[f"{side}_prefill_tokens_per_s"] * per_token / 1e9
        row[f"{side}_prefill_gflops"] = round(gflops, 1)
        row[f"{side}_prefill_of_peak"] = round(gflops / machine["gemm_peak_gflops"], 3)
        steps = row[f"{side}_decode_tokens_per_s"] / bs
        gbs = steps * costs["decode_weight_bytes"] / 1e9
        row[f"{side}_decode_weight_gb_per_s"] = round(gbs, 2)
        row[f"{side}_decode_of_memcpy"] = round(gbs / machine["memcpy_gb_per_s"], 3)
