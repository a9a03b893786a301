"""C kernels for the CPU path, built at first use and called through ctypes.

Some work runs in PyTorch only as many small operations: the state layers' recurrences
(the gated delta rule of a prompt costs about 5x in its chunked PyTorch form what one pass
over each head's state per token costs in C, where the state stays in the cache), and
element-wise chains (act(gate) * up, the norms) that PyTorch runs as a pass and a temporary
per operation. And one linear runs slower in a library than the memory allows: one input
row (`gemv`), where a one-sequence decode step waits on memory and the GEMM leaves the
core's prefetchers short; and a few rows (`panel_linear`, float32), where oneDNN's
small-row kernels read the weights at 12-14 GB/s (bfloat16 too where the processor has no
bfloat16 kernels: summed in float32, about 4x `F.linear` there). Decode attention
(`decode_attention`) reads each sequence's keys and values where they lie in the pool,
where PyTorch would first gather them into a padded copy and mask it. Those kernels live in
`csrc/`, plain C11 without PyTorch headers, one file per family beside this package's
wrapper module for it:

    scans.c / scans.py            gdn_recurrent, gdn_step, ssd_scan, ssd_step, conv_silu,
                                  conv_step_silu (state scans and convolutions)
    norms.c / norms.py            rms_norm, norm_gate, gate_norm, l2_norm, norm_rope
    activations.c / .py           act_mul
    linears.c / linears.py        gemv, pack_panels + panel_linear
    decode_attention.c,           decode_attention, prompt_attention (attention.py)
    prompt_attention.c
    common.h, panel_tile.h        shared helpers (thread split, bfloat16, exp, the panel tile)

An engine on the CPU compiles them when it starts (`loader.py`: every `.c` to an object by
`$CC` or `cc` calls side by side, slowest first, then one link; `-O3` and the flags of the
instruction set level the CPU runs, `isa()`: avx512 (`-march=x86-64-v4`), avx2
(`-march=x86-64-v3`), generic, or native off x86; `HYBRID_PD_CPU_ISA` overrides) into one
shared library in a cache folder (`HYBRID_PD_KERNEL_CACHE`, default
`~/.cache/hybrid-pd/kernels`), named by the level and a digest of the sources and headers,
the flags and the compiler, so a changed file or another level builds its own, and machines
of one level share one. The first process builds under a file lock while the others wait;
`build_ahead` starts that build in a thread of a process that will not run the kernels
itself (`serve`, before its workers exist). The sources choose their vector paths and
register tiles by the level's macros (`__AVX512F__`, `__AVX2__`); `panel_width()` says what
the panels are.
`signatures.py` declares the C functions to ctypes.

Every kernel has a pure-PyTorch counterpart, which stays the reference (the tests compare
the two; for `gemv` and `panel_linear` that is oneDNN's GEMM) and the path everywhere
else: tensors not on the CPU, a machine without a C compiler (one warning, then PyTorch),
or `HYBRID_PD_CPU_KERNELS=0`; `panel_linear` and `decode_attention` also only where the
kernels run as many threads as torch (`threads_match`). Both workers of a P/D pair must
take the same path for P/D output to equal a single engine's: they do when they run the
same build on the same kind of machine (as the layout fingerprint already demands).

Threads: where torch's intra-op threads are OpenMP's (`torch_openmp`), the library is built
with OpenMP and shares torch's runtime (the loader binds it to the libgomp torch loaded):
a kernel splits its work over torch's own threads, which spin between torch's operations
and carry the engine's subnormal flush mode (see `threads.py`), instead of competing with
them. Each output is computed by one thread in the same order whatever the count, so the
results do not depend on it. `HYBRID_PD_KERNEL_OPENMP=0` builds without OpenMP (one
thread).
"""

from __future__ import annotations

import sys
import types

from hybrid_pd.engine.cpu_kernels import loader
from hybrid_pd.engine.cpu_kernels.activations import ACTIVATIONS, act_mul
from hybrid_pd.engine.cpu_kernels.attention import decode_attention, prompt_attention
from hybrid_pd.engine.cpu_kernels.linears import gemv, pack_panels, panel_linear, panel_width
from hybrid_pd.engine.cpu_kernels.loader import (
    FLAGS,
    ISA_FLAGS,
    build_ahead,
    enabled_by_env,
    isa,
    kernel_threads,
    library,
    status,
    supported_isas,
    threads_match,
    torch_openmp,
)
from hybrid_pd.engine.cpu_kernels.loader import _build as _build  # for the tests, as before
from hybrid_pd.engine.cpu_kernels.loader import _openmp_runtimes as _openmp_runtimes
from hybrid_pd.engine.cpu_kernels.norms import gate_norm, l2_norm, norm_gate, norm_rope, rms_norm
from hybrid_pd.engine.cpu_kernels.scans import (
    conv_silu,
    conv_step_silu,
    gdn_recurrent,
    gdn_step,
    ssd_scan,
    ssd_step,
)

__all__ = [
    "ACTIVATIONS",
    "FLAGS",
    "ISA_FLAGS",
    "act_mul",
    "build_ahead",
    "conv_silu",
    "conv_step_silu",
    "decode_attention",
    "enabled_by_env",
    "gate_norm",
    "gdn_recurrent",
    "gdn_step",
    "gemv",
    "isa",
    "kernel_threads",
    "l2_norm",
    "library",
    "norm_gate",
    "norm_rope",
    "pack_panels",
    "panel_linear",
    "panel_width",
    "prompt_attention",
    "rms_norm",
    "ssd_scan",
    "ssd_step",
    "status",
    "supported_isas",
    "threads_match",
    "torch_openmp",
]


def _through_to_loader(name: str) -> property:
    """`loader.<name>`, read and written through the package: setting
    `cpu_kernels._shared_openmp` takes effect in `loader`, as when the package was one module
    (the tests set it)."""
    return property(
        lambda _: getattr(loader, name),
        lambda _, value: setattr(loader, name, value),
        doc=f"`loader.{name}`",
    )


class _Package(types.ModuleType):
    """This package, whose loader state lives in `loader`."""

    _lib = _through_to_loader("_lib")
    _tried = _through_to_loader("_tried")
    _why_not = _through_to_loader("_why_not")
    _shared_openmp = _through_to_loader("_shared_openmp")


sys.modules[__name__].__class__ = _Package
