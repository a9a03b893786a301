"""The ctypes signatures of the kernels' C functions: ints, longs, floats and raw pointers,
in the order of the C prototypes (csrc/*.c)."""

from __future__ import annotations

import ctypes


def declare(lib: ctypes.CDLL) -> None:
    """Set the ctypes signature of every function the library exports (by source file:
    scans.c, norms.c, activations.c, linears.c, decode_attention.c, prompt_attention.c).
    AttributeError where the library lacks one."""
    i, p, long_ = ctypes.c_int, ctypes.c_void_p, ctypes.c_long
    # scans.c
    lib.gdn_recurrent.argtypes = [i] * 5 + [p, *[long_] * 3] * 3 + [p, p, long_, long_, p, p, i]
    lib.gdn_recurrent.restype = i
    lib.gdn_step.argtypes = [i] * 5 + [p, *[long_] * 3] * 3 + [p, p, long_, long_, p, long_, p, p]
    lib.gdn_step.argtypes += [i]
    lib.gdn_step.restype = i
    lib.ssd_step.argtypes = [i] * 5 + [p, *[long_] * 3, p, p, *[long_] * 3]
    lib.ssd_step.argtypes += [p, long_, long_, p, p, p]
    lib.ssd_step.argtypes += [long_, long_, p, i]
    lib.ssd_step.restype = i
    lib.ssd_scan.argtypes = [i, p, *[i] * 4, p, p, *[long_] * 3, p, long_, long_, p, p, p]
    lib.ssd_scan.argtypes += [long_, long_, p, i]
    lib.ssd_scan.restype = i
    lib.conv_silu_f32.argtypes = [long_, long_, i, p, long_, p, p, p, p, i]
    lib.conv_silu_f32.restype = None
    lib.conv_step_silu_f32.argtypes = [long_, long_, i, p, long_, p, p, long_, p, p, p, i]
    lib.conv_step_silu_f32.restype = None
    # norms.c
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
    lib.norm_rope_f32.argtypes = [long_, i, i, i, p, long_, long_, p, ctypes.c_float]
    lib.norm_rope_f32.argtypes += [ctypes.c_float, p, p, long_, p, i]
    lib.norm_rope_f32.restype = i
    # activations.c
    for name in ("act_mul_f32", "act_mul_bf16"):
        getattr(lib, name).argtypes = [long_, long_, p, long_, p, long_, p, i, i]
        getattr(lib, name).restype = None
    # linears.c
    for name in ("gemv_f32", "gemv_bf16"):
        getattr(lib, name).argtypes = [long_, p, p, p, p, long_, i]
        getattr(lib, name).restype = None
    lib.panel_linear_f32.argtypes = [long_] * 3 + [p, p, long_, p, p, i]
    lib.panel_linear_f32.restype = None
    lib.panel_linear_bf16.argtypes = [long_] * 3 + [p, p, long_, p, p, i]
    lib.panel_linear_bf16.restype = i
    lib.panel_width.argtypes = []
    lib.panel_width.restype = i
    # decode_attention.c
    for name in ("decode_attention_f32", "decode_attention_bf16"):
        getattr(lib, name).argtypes = [i] * 5 + [p, long_, long_, p] + [long_] * 4 + [p] * 3
        getattr(lib, name).argtypes += [ctypes.c_float, ctypes.c_float, p, p, long_, i]
        getattr(lib, name).restype = i
    # prompt_attention.c
    for name in ("prompt_attention_f32", "prompt_attention_bf16"):
        fn = getattr(lib, name)
        fn.argtypes = [i] * 5 + [p, long_, long_, p] + [long_] * 4
        fn.argtypes += [p, i, p, i, ctypes.c_float, ctypes.c_float, p, p, i]
        fn.restype = i
