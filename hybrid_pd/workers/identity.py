"""The model's identity: what peers compare before they exchange KV."""

from __future__ import annotations

import hashlib

from hybrid_pd.api.card import ModelIdentity
from hybrid_pd.kvcache.tp_layout import TP_CONFIG_KEY


def model_identity(hf_config: dict, model) -> ModelIdentity:
    """Architecture, size and a checksum of the first weights: peers must serve one model."""
    arch = (hf_config.get("architectures") or ["?"])[0]
    params = list(model.parameters())
    # the first parameter (the embedding) is whole on every tensor-parallel rank
    head = params[0].detach().flatten()[:4096].float().cpu().numpy().tobytes()
    digest = hashlib.sha256(head).hexdigest()[:16]
    tp = hf_config.get(TP_CONFIG_KEY)
    n = tp["parameters"] if tp else sum(p.numel() for p in params)
    return ModelIdentity(architecture=arch, parameters=int(n), weights=digest)
