"""Loaded by every Python process of the vLLM peer (`bench engine --peer vllm`) where
`HYBRID_PD_PEER_CPU_ISA=avx2` is in its environment: `peer.VllmPeer` then puts this folder
first on the peer's PYTHONPATH, so the front end, the engine core and the model worker all
import it at start-up, before vLLM.

vLLM's CPU build ships its C++ kernels (the Mamba2 chunk scan, attention, the causal
convolution) three times, for AVX2, AVX-512 and AVX-512 with bfloat16, and picks one from
what the processor reports (`torch.cpu._is_avx512_supported` and friends), not from
ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA or MKL_ENABLE_INSTRUCTIONS. Those variables hold
PyTorch, oneDNN and MKL to AVX2, but on an AVX-512 machine vLLM's own kernels stay AVX-512.
Here the processor's AVX-512 (and AMX) report reads False, so vLLM loads its AVX2 build:
an AVX2 machine emulated on both sides alike.
"""

import os

if os.environ.get("HYBRID_PD_PEER_CPU_ISA", "").strip().lower() == "avx2":
    import torch

    for _name in (
        "_is_avx512_supported",
        "_is_avx512_bf16_supported",
        "_is_avx512_vnni_supported",
        "_is_amx_tile_supported",
        "_is_amx_fp16_supported",
    ):
        if hasattr(torch.cpu, _name):
            setattr(torch.cpu, _name, lambda: False)
