"""C kernels for the CPU path, built at first use and called through ctypes.

Some work runs in PyTorch only as many small operations: the state layers' recurrences
(the gated delta rule of a prompt costs about 5x in its chunked PyTorch form what one pass
over each head's state per token costs in C, where the state stays in the cache), and
element-wise chains (act(gate) * up, the norms) that PyTorch runs as a pass and a temporary
per operation. And one linear runs slower in a library than the memory allows: one input
row (`gemv`), where a one-sequence decode step waits on memory and the GEMM leaves the
core's prefetchers short; and a few rows (`panel_linear`, float32), where oneDNN's
small-row kernels read the weights at 12-14 GB/s. Decode attention (`decode_attention`)
reads each sequence's keys and values where they lie in the pool, where PyTorch would
first gather them into a padded copy and mask it. Those kernels live in
`csrc/cpu_kernels.c`, plain C11 without PyTorch headers. An engine on the CPU compiles the
file when it starts (`$CC` or `cc`, `-O3 -march=native`, well under a second) into a cache
folder (`HYBRID_PD_KERNEL_CACHE`, default `~/.cache/hybrid-pd/kernels`), named by a digest
of the source, the flags, the compiler and the CPU, so a changed file or another machine
builds its own. Processes that start
together may both build: each writes a file of its own and renames it into place.

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

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "cpu_kernels.c"
FLAGS = ("-O3", "-march=native", "-ffp-contract=fast", "-std=c11", "-shared", "-fPIC")
#: Below this many state elements times tokens a call is not split over threads.
_SPLIT_MIN_WORK = 1 << 20
#: Below this many elements an element-wise kernel (`act_mul`, the norms) is not split.
_ROWS_SPLIT_MIN = 1 << 16

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False
_why_not = ""
#: The library runs its OpenMP splits on torch's own runtime (see `library`).
_shared_openmp = False


def enabled_by_env() -> bool:
    return os.environ.get("HYBRID_PD_CPU_KERNELS", "1").strip().lower() not in ("0", "off", "no")


def _cpu_identity() -> str:
    """The CPU model and feature flags (what -march=native compiles for)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    keep = [ln for ln in text.splitlines() if ln.startswith(("model name", "flags", "Features"))]
    return "\n".join(dict.fromkeys(keep))


def _cache_dir() -> Path:
    given = os.environ.get("HYBRID_PD_KERNEL_CACHE")
    return Path(given) if given else Path.home() / ".cache" / "hybrid-pd" / "kernels"


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")


def torch_openmp() -> bool:
    """Whether torch's intra-op threads are OpenMP's (its CPU builds for Linux): then the
    kernels are built with OpenMP and split over those threads (`kernel_threads`)."""
    if not enabled_by_env() or os.environ.get("HYBRID_PD_KERNEL_OPENMP", "1") == "0":
        return False
    return "OpenMP" in torch.__config__.parallel_info() and sys.platform.startswith("linux")


def _flags() -> tuple[str, ...]:
    return FLAGS + (("-fopenmp",) if torch_openmp() else ())


def _openmp_runtimes() -> set[str]:
    """The files of the OpenMP runtimes this process has loaded (Linux)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return set()
    names = ("libgomp", "libiomp", "libomp")
    return {ln.split()[-1] for ln in maps.splitlines() if any(n in ln for n in names)}


def _build() -> Path:
    """The shared library for this source, CPU and compiler, built if not cached."""
    cc = _compiler()
    if cc is None:
        raise OSError("no C compiler (cc, gcc or $CC) on PATH")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=False)
    flags = _flags()
    key = hashlib.sha256(
        b"\0".join(
            s.encode()
            for s in (SOURCE.read_text(), " ".join(flags), version.stdout, _cpu_identity())
        )
    ).hexdigest()[:24]
    folder = _cache_dir()
    target = folder / f"cpu_kernels-{key}.so"
    if target.exists():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=folder)
    os.close(fd)
    try:
        done = subprocess.run(
            [cc, *flags, "-o", tmp, str(SOURCE), "-lm"],
            capture_output=True,
            text=True,
            check=False,
            timeout=120,
        )
        if done.returncode != 0:
            raise OSError(f"{cc} failed: {done.stderr.strip()[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _declare(lib: ctypes.CDLL) -> None:
    i, p, long_ = ctypes.c_int, ctypes.c_void_p, ctypes.c_long
    lib.gdn_recurrent.argtypes = [i] * 5 + [p, *[long_] * 3] * 3 + [p, p, long_, long_, p, p, i]
    lib.gdn_recurrent.restype = i
    lib.gdn_step.argtypes = [i] * 5 + [p, *[long_] * 3] * 3 + [p, p, long_, long_, p, long_, p]
    lib.gdn_step.argtypes += [i]
    lib.gdn_step.restype = i
    lib.ssd_step.argtypes = [i] * 5 + [p, *[long_] * 3] * 2 + [p, long_, long_, p, p, p]
    lib.ssd_step.argtypes += [long_, long_, p, i]
    lib.ssd_step.restype = i
    lib.ssd_scan.argtypes = [i, p, *[i] * 4, p, p, *[long_] * 3, p, long_, long_, p, p, p]
    lib.ssd_scan.argtypes += [long_, long_, p, i]
    lib.ssd_scan.restype = i
    for name in ("norm_gate_f32", "norm_gate_bf16"):
        getattr(lib, name).argtypes = [long_, i, i, p, long_, long_, p, long_, long_, p]
        getattr(lib, name).argtypes += [ctypes.c_float, p, i]
        getattr(lib, name).restype = i
    for name in ("gate_norm_f32", "gate_norm_bf16"):
        getattr(lib, name).argtypes = [long_, i, i, p, long_, p, long_, p, ctypes.c_float, p, i]
        getattr(lib, name).restype = i
    lib.rms_norm_f32.argtypes = [long_, long_, p, long_, p, ctypes.c_float, ctypes.c_float, p, i]
    lib.rms_norm_f32.restype = None
    lib.rms_norm_bf16.argtypes = [
        long_, long_, p, long_, p, ctypes.c_float, ctypes.c_float, p, i, i,
    ]  # fmt: skip
    lib.rms_norm_bf16.restype = None
    lib.l2_norm_f32.argtypes = [long_, i, i, p, long_, ctypes.c_float, ctypes.c_float, p, i]
    lib.l2_norm_f32.restype = None
    for name in ("act_mul_f32", "act_mul_bf16"):
        getattr(lib, name).argtypes = [long_, long_, p, long_, p, long_, p, i, i]
        getattr(lib, name).restype = None
    for name in ("gemv_f32", "gemv_bf16"):
        getattr(lib, name).argtypes = [long_, p, p, p, p, long_, i]
        getattr(lib, name).restype = None
    lib.panel_linear_f32.argtypes = [long_] * 3 + [p, p, long_, p, p, i]
    lib.panel_linear_f32.restype = None
    for name in ("decode_attention_f32", "decode_attention_bf16"):
        getattr(lib, name).argtypes = [i] * 5 + [p, long_, long_, p] + [long_] * 4 + [p] * 3
        getattr(lib, name).argtypes += [ctypes.c_float, ctypes.c_float, p, p, long_, i]
        getattr(lib, name).restype = i
    lib.conv_silu_f32.argtypes = [long_, long_, i, p, long_, p, p, p, p, i]
    lib.conv_silu_f32.restype = None
    lib.conv_step_silu_f32.argtypes = [long_, long_, i, p, long_, p, long_, p, p, p, i]
    lib.conv_step_silu_f32.restype = None
    lib.norm_rope_f32.argtypes = [long_, i, i, i, p, long_, long_, p, ctypes.c_float]
    lib.norm_rope_f32.argtypes += [ctypes.c_float, p, p, long_, p, i]
    lib.norm_rope_f32.restype = i
    for name in ("prompt_attention_f32", "prompt_attention_bf16"):
        fn = getattr(lib, name)
        fn.argtypes = [i] * 5 + [p, long_, long_, p] + [long_] * 4
        fn.argtypes += [p, i, p, i, ctypes.c_float, ctypes.c_float, p, p, i]
        fn.restype = i


def library() -> ctypes.CDLL | None:
    """The loaded kernels, or None (disabled, or the build failed: logged once)."""
    global _lib, _tried, _why_not
    if _tried:
        return _lib
    with _lock:
        if _tried:
            return _lib
        if not enabled_by_env():
            _why_not = "HYBRID_PD_CPU_KERNELS=0"
        else:
            try:
                path = _build()
                before = _openmp_runtimes()
                lib = ctypes.CDLL(str(path))
                _declare(lib)
                _lib = lib
                _check_openmp(before)
                logger.info("CPU kernels: %s (OpenMP: %s)", path, _shared_openmp)
            # AttributeError: a library without a function this module declares (the source
            # changed under a running install)
            except (OSError, AttributeError, subprocess.SubprocessError) as e:
                _why_not = str(e)
                logger.warning("CPU kernels unavailable, using the PyTorch path: %s", e)
        _tried = True
    return _lib


def _check_openmp(before: set[str]) -> None:
    """Split over threads only where the library found torch's OpenMP runtime already
    loaded (the loader then binds the library to it): a second runtime would start a
    second set of threads competing with torch's."""
    global _shared_openmp
    after, wanted = _openmp_runtimes(), torch_openmp()
    _shared_openmp = wanted and bool(before) and after == before
    if wanted and not _shared_openmp:
        logger.warning(
            "the CPU kernels did not share torch's OpenMP runtime (%s loaded); they run "
            "on one thread",  # and with several torch threads `threads_match` is False
            sorted(after - before) or "none",
        )


def kernel_threads() -> int:
    """How many threads the kernels may split their work over: torch's intra-op count
    where they share its OpenMP threads (`library`), else 1."""
    return torch.get_num_threads() if library() is not None and _shared_openmp else 1


def threads_match() -> bool:
    """Whether a split kernel runs on as many threads as torch's operations: always with
    one torch thread or a shared runtime. Where not, `panel_linear` and `decode_attention`
    are not used (one thread beside torch's idle ones lost to oneDNN and SDPA)."""
    return kernel_threads() == torch.get_num_threads()


def status(build: bool = True) -> str:
    """`on`, or `off (why)`, for logs and stats; builds the kernels if not tried yet (with
    `build=False`: `not loaded` then)."""
    if not _tried and not build:
        return "not loaded"
    return "on" if library() is not None else f"off ({_why_not})"


def _split_threads(units: int, work: int, least: int = _SPLIT_MIN_WORK) -> int:
    """Threads for a call over `units` independent units (state heads, sequences, rows):
    torch's (`kernel_threads`) when the work (state elements times tokens, or elements)
    pays for a split, else 1."""
    return max(1, min(kernel_threads(), units)) if work >= least else 1


def _vector_or_none(t: torch.Tensor | None, n: int, dtype: torch.dtype) -> bool:
    """Whether `t` (a bias, a norm's weight) is None or a contiguous [n] tensor of `dtype` on
    the CPU, as the kernels take it."""
    return t is None or (
        t.dtype is dtype and t.device.type == "cpu" and t.shape == (n,) and t.is_contiguous()
    )


def _ptr(t: torch.Tensor | None) -> int | None:
    """The data pointer of an optional argument (NULL for None)."""
    return None if t is None else t.data_ptr()


def _f32(t: torch.Tensor) -> bool:
    return t.dtype == torch.float32 and t.device.type == "cpu"


def gdn_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> torch.Tensor | None:
    """The gated delta rule over n tokens of one sequence, in C; None where the kernel does
    not apply (then use the PyTorch path). q/k [n, Hk, dk] (normalised and scaled), v
    [n, Hv, dv], g/beta [n, Hv], all float32 on the CPU, any strides (g and beta the same).
    `state` [Hv, dk, dv] float32, contiguous, is updated in place. Returns o [n, Hv, dv].
    The same sums as `delta_rule_step` token after token (fused multiply-adds aside)."""
    if not all(_f32(t) for t in (q, k, v, g, beta, state)) or not state.is_contiguous():
        return None
    n, hk, dk = q.shape
    hv, dv = v.shape[1], v.shape[2]
    if k.shape != q.shape or v.shape[0] != n or g.shape != (n, hv) or beta.shape != g.shape:
        return None
    if beta.stride() != g.stride() or state.shape != (hv, dk, dv) or hv % hk or dv > 1024:
        return None
    lib = library()
    if lib is None:
        return None
    out = q.new_empty(n, hv, dv)

    code = lib.gdn_recurrent(
        n, hk, hv, dk, dv,
        q.data_ptr(), *q.stride(), k.data_ptr(), *k.stride(), v.data_ptr(), *v.stride(),
        g.data_ptr(), beta.data_ptr(), *g.stride(), state.data_ptr(), out.data_ptr(),
        _split_threads(hv, n * dk * dv * hv),
    )  # fmt: skip
    if code:
        raise RuntimeError(f"gdn_recurrent refused its arguments (code {code})")
    return out


def gdn_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> torch.Tensor | None:
    """One decode token for each of S sequences, in C; None where the kernel does not
    apply. q/k [S, Hk, dk] (normalised and scaled), v [S, Hv, dv], g/beta [S, Hv] (the same
    strides), float32 on the CPU; `state` [S, Hv, dk, dv], each sequence's block contiguous
    (sequences may lie apart, as gathered rows do), updated in place. Returns o [S, Hv, dv]:
    `gdn_recurrent`'s arithmetic for one token, so the same bits as in a prompt."""
    if not all(_f32(t) for t in (q, k, v, g, beta, state)):
        return None
    seqs, hk, dk = q.shape
    hv, dv = v.shape[1], v.shape[2]
    if k.shape != q.shape or v.shape[0] != seqs or g.shape != (seqs, hv):
        return None
    if beta.shape != g.shape or beta.stride() != g.stride() or hv % hk or dv > 1024:
        return None
    if state.shape != (seqs, hv, dk, dv) or state.stride()[1:] != (dk * dv, dv, 1):
        return None
    lib = library()
    if lib is None:
        return None
    out = q.new_empty(seqs, hv, dv)
    code = lib.gdn_step(
        seqs, hk, hv, dk, dv,
        q.data_ptr(), *q.stride(), k.data_ptr(), *k.stride(), v.data_ptr(), *v.stride(),
        g.data_ptr(), beta.data_ptr(), *g.stride(), state.data_ptr(), state.stride(0),
        out.data_ptr(), _split_threads(seqs, seqs * hv * dk * dv),
    )  # fmt: skip
    if code:
        raise RuntimeError(f"gdn_step refused its arguments (code {code})")
    return out


def _ssd_operands(x, dt, a_coef, b, c, state) -> bool:
    """Whether Mamba2's operands fit the C kernels: float32 on the CPU, x [T, H, P],
    dt [T, H], a_coef [H] contiguous, b and c [T, G, N] with the same strides, N contiguous,
    G dividing H."""
    if not all(_f32(t) for t in (x, dt, a_coef, b, c, state)) or x.dim() != 3:
        return False
    rows, heads = x.shape[0], x.shape[1]
    if dt.shape != (rows, heads) or a_coef.shape != (heads,) or not a_coef.is_contiguous():
        return False
    if b.dim() != 3 or b.shape[0] != rows or heads % b.shape[1]:
        return False
    return c.shape == b.shape and c.stride() == b.stride() and b.stride(-1) == 1


def ssd_step(
    x: torch.Tensor,
    dt: torch.Tensor,
    a_coef: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    state: torch.Tensor,
) -> torch.Tensor | None:
    """One decode step of Mamba2's SSD for S sequences, in C, one pass over each state; None
    where the kernel does not apply. x [S, H, P], dt [S, H], a_coef [H], b/c [S, G, N] (the
    same strides; head h reads group h // (H / G)), state [S, H, P, N] with its last dim
    contiguous (rows gathered from the pool may be strided), all float32 on the CPU.
    `state` is updated in place. Returns y [S, H, P] (no D term): `_ssd_step`'s values, the
    sum over N in another order."""
    if not _ssd_operands(x, dt, a_coef, b, c, state) or state.stride(-1) != 1:
        return None
    seqs, heads, hd = x.shape
    if state.shape != (seqs, heads, hd, b.shape[2]):
        return None
    groups, ns = b.shape[1], b.shape[2]
    lib = library()
    if lib is None:
        return None
    y = x.new_empty(seqs, heads, hd)
    code = lib.ssd_step(
        seqs, heads, hd, ns, groups,
        state.data_ptr(), *state.stride()[:3], x.data_ptr(), *x.stride(),
        dt.data_ptr(), *dt.stride(), a_coef.data_ptr(), b.data_ptr(), c.data_ptr(),
        *b.stride()[:2], y.data_ptr(), _split_threads(seqs, seqs * heads * hd * ns),
    )  # fmt: skip
    if code:
        raise RuntimeError(f"ssd_step refused its arguments (code {code})")
    return y


def ssd_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    a_coef: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    state: torch.Tensor,
    lengths: list[int],
) -> torch.Tensor | None:
    """Mamba2's SSD over the prompts of S sequences packed one after another (sequence i has
    lengths[i] tokens), in C, token by token; None where the kernel does not apply. x
    [T, H, P], dt [T, H], a_coef [H], b/c [T, G, N] (the same strides), all float32 on the
    CPU. `state` [S, H, P, N], contiguous: each sequence's state at its start, updated in
    place to its state at the end. Returns y [T, H, P] (no D term): the values of the
    chunked scan (`mamba2._ssd_packed`), summed as the recurrence does."""
    if not _ssd_operands(x, dt, a_coef, b, c, state) or not state.is_contiguous():
        return None
    total, heads, hd = x.shape
    groups, ns = b.shape[1], b.shape[2]
    seqs = len(lengths)
    if state.shape != (seqs, heads, hd, ns) or sum(lengths) != total:
        return None
    lib = library()
    if lib is None:
        return None
    y = x.new_empty(total, heads, hd)
    lens = (ctypes.c_int * seqs)(*lengths)

    code = lib.ssd_scan(
        seqs, lens, heads, hd, ns, groups,
        state.data_ptr(), x.data_ptr(), *x.stride(), dt.data_ptr(), *dt.stride(),
        a_coef.data_ptr(), b.data_ptr(), c.data_ptr(), *b.stride()[:2], y.data_ptr(),
        _split_threads(heads, total * heads * hd * ns),
    )  # fmt: skip
    if code:
        raise RuntimeError(f"ssd_scan refused its arguments (code {code})")
    return y


def l2_norm(x: torch.Tensor, heads: int, scale: float, eps: float) -> torch.Tensor | None:
    """Each of the `heads` heads side by side in x's rows L2-normed, then times `scale`:
    (x * rsqrt(sum(x^2) + eps)) * scale per head, in one C pass; None where the kernel does
    not apply. x [T, heads * dim] float32 on the CPU, rows of any stride, the channels
    contiguous. Returns [T, heads, dim] (the delta rule's q and k)."""
    if x.dtype is not torch.float32 or x.device.type != "cpu" or x.dim() != 2:
        return None
    tokens, width = x.shape
    if heads < 1 or width % heads or x.stride(1) != 1 or not x.numel():
        return None
    lib = library()
    if lib is None:
        return None
    dim = width // heads
    out = x.new_empty(tokens, heads, dim)
    lib.l2_norm_f32(
        tokens, heads, dim, x.data_ptr(), x.stride(0), scale, eps, out.data_ptr(),
        _split_threads(tokens, tokens * width, _ROWS_SPLIT_MIN),
    )  # fmt: skip
    return out


#: The activations `act_mul` takes, by the name its callers use.
ACTIVATIONS = ("silu", "gelu_tanh")


def act_mul(act: str, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor | None:
    """act(gate) * up in one pass, in C, for act "silu" or "gelu_tanh" (GELU's tanh form);
    None where the kernel does not apply. gate and up [rows, cols], float32 or bfloat16 on
    the CPU, rows of any stride (the halves of one projection), columns contiguous. bfloat16
    is computed in float32 and rounded once (PyTorch rounds act(gate) first); the exp inside
    within 2 ulp of float32's."""
    if act not in ACTIVATIONS or gate.dtype not in (torch.float32, torch.bfloat16):
        return None
    if up.dtype is not gate.dtype or gate.dim() != 2 or up.shape != gate.shape:
        return None
    if gate.device.type != "cpu" or up.device.type != "cpu":
        return None
    if gate.stride(1) != 1 or up.stride(1) != 1:
        return None
    lib = library()
    if lib is None:
        return None
    rows, cols = gate.shape
    out = gate.new_empty(rows, cols)
    fn = lib.act_mul_f32 if gate.dtype is torch.float32 else lib.act_mul_bf16
    fn(
        rows, cols, gate.data_ptr(), gate.stride(0), up.data_ptr(), up.stride(0),
        out.data_ptr(), ACTIVATIONS.index(act),
        _split_threads(rows, rows * cols, _ROWS_SPLIT_MIN),
    )  # fmt: skip
    return out


def norm_gate(
    x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor | None:
    """Qwen3.5's gated RMS norm, (weight * x rsqrt(mean(x^2) + eps)) * silu(z) per vector
    of the last dim, in one C pass; None where the kernel does not apply. x and z
    [T, H, dim] (the last dim contiguous), weight [dim], all float32 or all bfloat16 on the
    CPU. In bfloat16 it rounds where `GatedRMSNorm.forward` does. Returns [T, H, dim]."""
    if x.dtype not in (torch.float32, torch.bfloat16) or x.device.type != "cpu":
        return None
    if z.dtype is not x.dtype or weight.dtype is not x.dtype or z.device.type != "cpu":
        return None
    if x.dim() != 3 or z.shape != x.shape or weight.shape != x.shape[-1:]:
        return None
    if x.stride(-1) != 1 or z.stride(-1) != 1 or not weight.is_contiguous():
        return None
    lib = library()
    if lib is None:
        return None
    tokens, heads, dim = x.shape
    out = x.new_empty(tokens, heads, dim)
    fn = lib.norm_gate_f32 if x.dtype is torch.float32 else lib.norm_gate_bf16
    code = fn(
        tokens, heads, dim, x.data_ptr(), *x.stride()[:2], z.data_ptr(), *z.stride()[:2],
        weight.data_ptr(), eps, out.data_ptr(),
        _split_threads(tokens, tokens * heads * dim, _ROWS_SPLIT_MIN),
    )  # fmt: skip
    if code:
        raise RuntimeError(f"norm_gate refused its arguments (code {code})")
    return out


def gate_norm(
    y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, group: int, eps: float
) -> torch.Tensor | None:
    """Mamba2's gated RMS norm, weight * norm(y * silu(z)) over groups of `group` channels,
    in one C pass; None where the kernel does not apply. y [T, inner] float32, z [T, inner]
    and weight [inner] both float32 or both bfloat16, on the CPU, rows of any stride, the
    channels contiguous. Returns [T, inner] float32, as `mamba2.GatedRMSNorm` computes."""
    if y.dtype is not torch.float32 or z.dtype not in (torch.float32, torch.bfloat16):
        return None
    if weight.dtype is not z.dtype or y.dim() != 2 or z.shape != y.shape:
        return None
    if any(t.device.type != "cpu" for t in (y, z, weight)) or not weight.is_contiguous():
        return None
    if y.stride(1) != 1 or z.stride(1) != 1 or weight.shape != y.shape[1:]:
        return None
    lib = library()
    if lib is None:
        return None
    tokens, inner = y.shape
    out = y.new_empty(tokens, inner)
    fn = lib.gate_norm_f32 if z.dtype is torch.float32 else lib.gate_norm_bf16
    code = fn(
        tokens, inner, group, y.data_ptr(), y.stride(0), z.data_ptr(), z.stride(0),
        weight.data_ptr(), eps, out.data_ptr(),
        _split_threads(tokens, tokens * inner, _ROWS_SPLIT_MIN),
    )  # fmt: skip
    if code:
        return None  # a group the kernel does not take (over 1,024 channels)
    return out


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0, after_cast=False
) -> torch.Tensor | None:
    """x * rsqrt(mean(x^2) + eps) * (weight + offset) over the last dim, in one C pass;
    None where the kernel does not apply. x and weight both float32 or both bfloat16, on the
    CPU; x of any leading shape whose rows lie a fixed stride apart (the last dim
    contiguous), weight contiguous. In bfloat16 it computes in float32 and rounds where
    `models.common.RMSNorm` does: once at the end, or with `after_cast` the normalised x
    and weight + offset first, then their product. One call instead of F.rms_norm's several
    operations: what a one-token decode step pays per norm (about 36 against 4 us at 512
    channels); in bfloat16 instead of five operations and two casts."""
    dtype = x.dtype
    if dtype not in (torch.float32, torch.bfloat16) or weight.dtype is not dtype:
        return None
    if x.dim() < 1 or x.device.type != "cpu" or weight.device.type != "cpu":
        return None
    if not weight.is_contiguous():
        return None
    dim = x.shape[-1]
    if weight.shape != (dim,) or x.stride(-1) != 1 or not x.numel():
        return None
    if x.dim() == 1:
        rows, row_stride = 1, dim
    elif x.dim() == 2:
        rows, row_stride = x.shape[0], x.stride(0)
    elif x.is_contiguous():
        rows, row_stride = x.numel() // dim, dim
    else:
        return None
    lib = library()
    if lib is None:
        return None
    out = x.new_empty(x.shape)
    threads = _split_threads(rows, rows * dim, _ROWS_SPLIT_MIN)
    args = (rows, dim, x.data_ptr(), row_stride, weight.data_ptr(), offset, eps, out.data_ptr())
    if dtype is torch.float32:
        lib.rms_norm_f32(*args, threads)
    else:
        lib.rms_norm_bf16(*args, int(bool(after_cast)), threads)
    return out


def conv_silu(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, first: torch.Tensor
) -> torch.Tensor | None:
    """A prompt's depthwise causal convolution then SiLU, in one C pass; None where the
    kernel does not apply. x [W, C] float32 on the CPU (rows a stride apart, channels
    contiguous): the sequences' windows; weight [K, C] contiguous (tap k of channel c);
    bias [C] or None; first [T] int64: the row of x where output t's first tap reads.
    Returns [T, C]: silu(bias + sum over k of x[first + k] weight[k]), summed tap after tap
    from the bias as PyTorch's shifted multiply-adds sum (within float32 rounding)."""
    if not all(_f32(t) for t in (x, weight)) or x.dim() != 2 or weight.dim() != 2:
        return None
    taps, channels = weight.shape
    if x.shape[1] != channels or x.stride(1) != 1 or not weight.is_contiguous():
        return None
    if not _vector_or_none(bias, channels, torch.float32):
        return None
    if first.dtype is not torch.int64 or first.device.type != "cpu" or first.dim() != 1:
        return None
    if not first.is_contiguous() or not first.numel():
        return None
    if int(first.min()) < 0 or int(first.max()) + taps > x.shape[0]:
        return None
    lib = library()
    if lib is None:
        return None
    rows = first.numel()
    out = x.new_empty(rows, channels)
    lib.conv_silu_f32(
        rows, channels, taps, x.data_ptr(), x.stride(0), first.data_ptr(), weight.data_ptr(),
        _ptr(bias), out.data_ptr(), _split_threads(rows, rows * channels * taps, _ROWS_SPLIT_MIN),
    )  # fmt: skip
    return out


def conv_step_silu(
    state: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor | None:
    """One new token of each of S sequences through a depthwise causal convolution then
    SiLU, in C, with `conv_silu`'s arithmetic per output (a token's output is the same bits
    in a prompt and in a decode step); None where the kernel does not apply. state [S, C,
    K - 1] float32 (the latest inputs, oldest first; sequences a stride apart, the rest
    contiguous) is shifted in place to take x [S, C] (rows a stride apart); weight [C, K]
    contiguous (conv1d's); bias [C] or None. Returns [S, C]."""
    if not all(_f32(t) for t in (state, x, weight)) or state.dim() != 3 or x.dim() != 2:
        return None
    seqs, channels, kept = state.shape
    if weight.shape != (channels, kept + 1) or not weight.is_contiguous():
        return None
    if x.shape != (seqs, channels) or x.stride(1) != 1 or not seqs:
        return None
    if state.stride(2) != 1 or state.stride(1) != kept:
        return None
    if not _vector_or_none(bias, channels, torch.float32):
        return None
    lib = library()
    if lib is None:
        return None
    out = x.new_empty(seqs, channels)
    lib.conv_step_silu_f32(
        seqs, channels, kept + 1, state.data_ptr(), state.stride(0), x.data_ptr(), x.stride(0),
        weight.data_ptr(), _ptr(bias), out.data_ptr(),
        _split_threads(seqs, seqs * channels * (kept + 1), _ROWS_SPLIT_MIN),
    )  # fmt: skip
    return out


def norm_rope(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    offset: float = 0.0,
) -> torch.Tensor | None:
    """Each head of x [T, H, D] RMS-normed (`rms_norm`'s form; `weight` None: not normed),
    then rotated by cos / sin [T, 1, R] (rotate-half layout, `models.rope.rotate`) on its
    first R dims, in one C pass; None where the kernel does not apply. float32 on the CPU;
    x's heads may lie in a wider row (a view of a fused q / k / v output). Returns [T, H, D]
    contiguous."""
    if x.dtype is not torch.float32 or x.device.type != "cpu" or x.dim() != 3 or not x.numel():
        return None
    tokens, heads, dim = x.shape
    if x.stride(2) != 1 or cos.shape != sin.shape or cos.dim() != 3:
        return None
    if cos.shape[0] != tokens or cos.shape[1] != 1 or cos.shape[2] > dim or cos.shape[2] % 2:
        return None
    for t in (cos, sin):
        if t.dtype is not torch.float32 or t.device.type != "cpu" or t.stride(2) != 1:
            return None
    if cos.stride(0) != sin.stride(0):
        return None
    if not _vector_or_none(weight, dim, torch.float32):
        return None
    lib = library()
    if lib is None:
        return None
    out = x.new_empty(tokens, heads, dim)
    code = lib.norm_rope_f32(
        tokens, heads, dim, cos.shape[2], x.data_ptr(), x.stride(0), x.stride(1),
        _ptr(weight), offset, eps, cos.data_ptr(), sin.data_ptr(), cos.stride(0), out.data_ptr(),
        _split_threads(tokens, tokens * heads * dim, _ROWS_SPLIT_MIN),
    )  # fmt: skip
    if code:
        return None  # a head too wide for the kernel
    return out


#: Fewest weight elements a one-row linear splits over threads for.
_GEMV_SPLIT_MIN = 1 << 18


def gemv(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor | None:
    """`F.linear(x, weight, bias)` for one row of x, in C; None where the kernel does not
    apply (then use the library's GEMM). x [1, k] or [k]; weight [n, k] contiguous, float32
    or bfloat16 (x and bias the same), on the CPU. The sums are float32 in a fixed order:
    they agree with a GEMM to rounding, not bit for bit. With several torch threads the
    rows are split over them. What a one-sequence decode step spends most of its time on:
    every weight is read once, and the kernel prefetches the next rows while it sums (see
    `gemv` in the C source)."""
    if x.dtype is not weight.dtype or x.dtype not in (torch.float32, torch.bfloat16):
        return None
    if x.device.type != "cpu" or weight.device.type != "cpu" or weight.dim() != 2:
        return None
    n, k = weight.shape
    if x.shape not in ((1, k), (k,)) or not weight.is_contiguous():
        return None
    if not _vector_or_none(bias, n, x.dtype):
        return None
    lib = library()
    if lib is None:
        return None
    bf16 = x.dtype is torch.bfloat16
    xf = x.reshape(k).float().contiguous() if bf16 else x.reshape(k).contiguous()
    y = x.new_empty((*x.shape[:-1], n))
    fn = lib.gemv_bf16 if bf16 else lib.gemv_f32
    threads = _split_threads(n // 64, n * k, _GEMV_SPLIT_MIN)
    fn(k, weight.data_ptr(), xf.data_ptr(), _ptr(bias), y.data_ptr(), n, threads)
    return y


def _attention_operands(q, cache, sinks, *indices) -> tuple | None:
    """(Hq, Hkv, D, `sinks` as contiguous float32 or None) when q [rows, Hq, D] and the
    layer's pool [N, 2, B, Hkv, D] fit the attention kernels (on the CPU, D contiguous, Hq
    a multiple of Hkv), `sinks` is None or [Hq] on the CPU, and each (tensor, dtype) of
    `indices` is a contiguous CPU tensor of that dtype; else None."""
    if q.device.type != "cpu" or cache.device.type != "cpu" or q.dim() != 3 or cache.dim() != 5:
        return None
    _, hq, d = q.shape
    hkv = cache.shape[3]
    if cache.shape[1] != 2 or cache.shape[4] != d or hq % hkv:
        return None
    if q.stride(2) != 1 or cache.stride(4) != 1:
        return None
    for t, dtype in indices:
        if t.dtype is not dtype or t.device.type != "cpu" or not t.is_contiguous():
            return None
    if sinks is not None:
        if sinks.shape != (hq,) or sinks.device.type != "cpu":
            return None
        sinks = sinks.float().contiguous()
    return hq, hkv, d, sinks


def decode_attention(
    q: torch.Tensor,
    cache: torch.Tensor,
    read: torch.Tensor,
    lo: torch.Tensor,
    hi: torch.Tensor,
    scale: float,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """One query token per sequence attending to its keys in the paged pool, in C, read
    where they lie; None where the kernel does not apply. q [S, Hq, D]; cache the layer's
    pool [N, 2, B, Hkv, D] (K then V of each block), both float32 or both bfloat16 on the
    CPU, D contiguous. Sequence s reads blocks `read[s W : (s + 1) W]` (int64, W =
    len(read) / S) as one run of W B slots and sees slots lo[s] .. hi[s] of it (int32).
    `softcap`: scores become tanh(score / softcap) softcap; `sinks` [Hq]: a logit per query
    head in each softmax's denominator (gpt-oss). Returns [S, Hq, D] in q's type: what
    gathering the blocks and SDPA over the visible slots compute, summed in float32 in
    another order. The sequences are split over torch's threads (`kernel_threads`); where
    the kernels cannot share them (`threads_match`) it declines."""
    if q.dtype not in (torch.float32, torch.bfloat16) or cache.dtype is not q.dtype:
        return None
    if not threads_match():
        return None
    indices = ((read, torch.int64), (lo, torch.int32), (hi, torch.int32))
    found = _attention_operands(q, cache, sinks, *indices)
    if found is None:
        return None
    hq, hkv, d, sinks = found
    seqs = q.shape[0]
    if not seqs or read.numel() % seqs or lo.shape != (seqs,) or hi.shape != (seqs,):
        return None
    lib = library()
    if lib is None:
        return None
    width, bs = read.numel() // seqs, cache.shape[2]
    out = q.new_empty(seqs, hq, d)
    fn = lib.decode_attention_f32 if q.dtype is torch.float32 else lib.decode_attention_bf16
    code = fn(
        hq, hkv, d, bs, width, q.data_ptr(), q.stride(0), q.stride(1), cache.data_ptr(),
        cache.stride(0), cache.stride(1), cache.stride(2), cache.stride(3), read.data_ptr(),
        lo.data_ptr(), hi.data_ptr(), scale, softcap or 0.0,
        _ptr(sinks), out.data_ptr(), seqs,
        min(kernel_threads(), seqs),
    )  # fmt: skip
    if code:
        raise RuntimeError(f"decode_attention refused its arguments (code {code})")
    return out


#: Score rows per unit of `prompt_attention`'s work (ROWS_TARGET in the C source).
_PROMPT_ROWS = 128


def prompt_attention(
    q: torch.Tensor,
    cache: torch.Tensor,
    read: torch.Tensor,
    first: int,
    lo: torch.Tensor,
    own: int,
    scale: float,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """A prompt chunk's n queries attending to their keys in the paged pool, in C, read
    where they lie; None where the kernel does not apply. q [n, Hq, D]; cache the layer's
    pool [N, 2, B, Hkv, D], both float32 or both bfloat16 (computed in float32, the output
    rounded once) on the CPU, D contiguous. Keys are numbered along
    the blocks `read` (int64) from slot `first` of the first; query i sees keys lo[i] ..
    own + i (int32 `lo`, never decreasing). `softcap` and `sinks` as in `decode_attention`.
    Returns [n, Hq, D]: what SDPA with the causal (window, chunk) mask computes, summed in
    float32 in another order, each key chunk's scores with a running max (no n x keys
    matrix). Work splits over torch's threads (`kernel_threads`) by KV head and block of
    queries, each computed whole by one thread: the result does not depend on the count;
    where the kernels cannot share torch's threads (`threads_match`) it declines."""
    if q.dtype not in (torch.float32, torch.bfloat16) or cache.dtype is not q.dtype:
        return None
    if not threads_match():
        return None
    found = _attention_operands(q, cache, sinks, (read, torch.int64), (lo, torch.int32))
    if found is None:
        return None
    hq, hkv, d, sinks = found
    n = q.shape[0]
    if not n or lo.shape != (n,):
        return None
    lib = library()
    if lib is None:
        return None
    g = hq // hkv
    per = max(1, _PROMPT_ROWS // g)
    units = hkv * -(-n // per)
    keys = own + n - int(lo[0])
    out = q.new_empty(n, hq, d)
    fn = lib.prompt_attention_f32 if q.dtype is torch.float32 else lib.prompt_attention_bf16
    code = fn(
        hq, hkv, d, cache.shape[2], n, q.data_ptr(), q.stride(0), q.stride(1),
        cache.data_ptr(), cache.stride(0), cache.stride(1), cache.stride(2), cache.stride(3),
        read.data_ptr(), first, lo.data_ptr(), own, scale, softcap or 0.0,
        _ptr(sinks), out.data_ptr(),
        _split_threads(units, n * keys * hq * d),
    )  # fmt: skip
    if code:
        raise RuntimeError(f"prompt_attention refused its arguments (code {code})")
    return out


#: Output columns per panel of `pack_panels` (PANEL in the C source).
PANEL = 32


def pack_panels(weight: torch.Tensor) -> torch.Tensor | None:
    """`weight` [n, k] (float32, CPU) reordered for `panel_linear`: [ceil(n / PANEL), k,
    PANEL], panel p holding output columns p PANEL .. p PANEL + PANEL - 1 (zeros past n),
    or None where the kernels do not apply. The same values, as much memory (plus the
    padding of the last panel)."""
    if weight.dtype is not torch.float32 or weight.device.type != "cpu" or weight.dim() != 2:
        return None
    if library() is None:
        return None
    n, k = weight.shape
    count = -(-n // PANEL)
    padded = weight.detach().new_zeros(count * PANEL, k)
    padded[:n] = weight.detach()
    return padded.view(count, PANEL, k).transpose(1, 2).contiguous()


def panel_linear(
    x: torch.Tensor, panels: torch.Tensor, n: int, bias: torch.Tensor | None = None
) -> torch.Tensor | None:
    """`F.linear(x, weight, bias)` with the weight as `pack_panels` made it (`n` its output
    features), in C; None where the kernel does not apply. x [..., k] float32 on the CPU;
    bias [n] float32 or None. Each output is one float32 sum over k in order, so a row's
    result does not depend on the other rows, nor on the thread count; it agrees with a
    library GEMM to rounding. The panels are split over torch's threads (`kernel_threads`;
    `onednn.pack_weight` packs panels only where `threads_match`)."""
    if x.dtype is not torch.float32 or x.device.type != "cpu" or x.dim() < 1 or not x.numel():
        return None
    count, k, width = panels.shape
    if width != PANEL or x.shape[-1] != k or not -PANEL < n - count * PANEL <= 0:
        return None
    if not _vector_or_none(bias, n, torch.float32):
        return None
    if not panels.is_contiguous() or panels.dtype is not torch.float32:
        return None
    lib = library()
    if lib is None:
        return None
    rows = x.reshape(-1, k)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    m = rows.shape[0]
    y = x.new_empty(m, n)
    lib.panel_linear_f32(
        m, n, k, panels.data_ptr(), rows.data_ptr(), rows.stride(0),
        _ptr(bias), y.data_ptr(),
        min(kernel_threads(), count),
    )  # fmt: skip
    return y.view(*x.shape[:-1], n)
