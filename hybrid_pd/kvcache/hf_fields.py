"""Reading one architecture's Hugging Face config values for `hf_configs`: `Fields` (sizes
with defaults, validated as positive integers; None counts as missing) and `Dtypes` (the KV,
conv-state and SSM-state dtypes a config implies; rules in `hf_configs`' docstring)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from hybrid_pd.kvcache.specs import normalize_dtype

_MISSING = object()


@dataclass(frozen=True)
class Dtypes:
    """The dtypes of a model's caches: attention KV, conv state, SSM / recurrent state."""

    kv: str
    conv: str
    ssm: str


@dataclass(frozen=True)
class Fields:
    """Config values of one architecture; None counts as missing."""

    arch: str
    values: Mapping[str, Any]
    defaults: Mapping[str, Any] = field(default_factory=dict)

    def get(self, key: str, default: Any = None) -> Any:
        value = self.values.get(key)
        if value is not None:
            return value
        return self.defaults.get(key, default)

    def require(self, key: str) -> Any:
        value = self.get(key, _MISSING)
        if value is _MISSING:
            raise ValueError(f"{self.arch}: config is missing required field {key!r}")
        return value

    def size(self, key: str, *aliases: str) -> int:
        """Positive int from `key`, else from the first alias present."""
        for name in (key, *aliases):
            if self.get(name) is not None:
                return self._check_size(name, self.get(name))
        raise ValueError(f"{self.arch}: config is missing required field {key!r}")

    def opt_size(self, key: str) -> int | None:
        value = self.get(key)
        return None if value is None else self._check_size(key, value)

    def _check_size(self, key: str, value: Any) -> int:
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(
                f"{self.arch}: field {key!r} must be a positive integer, got {value!r}"
            )
        return value

    def num_layers(self) -> int:
        return self.size("num_hidden_layers")

    def kv_heads(self) -> int:
        """``num_key_value_heads``, falling back to ``num_attention_heads`` (pre-GQA configs)."""
        return self.size("num_key_value_heads", "num_attention_heads")

    def head_dim(self, *aliases: str, derive: bool = True) -> int:
        """Explicit head dim, else ``hidden_size // num_attention_heads`` when `derive`."""
        for name in ("head_dim", *aliases):
            if self.get(name) is not None:
                return self.size(name)
        if not derive:
            return self.size("head_dim")
        hidden, heads = self.size("hidden_size"), self.size("num_attention_heads")
        if hidden % heads:
            raise ValueError(
                f"{self.arch}: hidden_size {hidden} is not a multiple of {heads} heads"
            )
        return hidden // heads


def read_dtypes(config: Mapping[str, Any], text: Mapping[str, Any], kv_dtype: str | None) -> Dtypes:
    """The cache dtypes of `config` (`text` is its language-model part); `kv_dtype`
    overrides the attention KV dtype only."""

    def lookup(*keys: str) -> str | None:
        for source in (text, config):
            for key in keys:
                value = source.get(key)
                if value is not None and value != "auto":
                    try:
                        return normalize_dtype(value)
                    except ValueError as exc:
                        raise ValueError(f"config field {key!r}: {exc}") from exc
        return None

    model = lookup("dtype", "torch_dtype") or "bfloat16"
    ssm = lookup("mamba_ssm_dtype") or lookup("mamba_ssm_cache_dtype") or model
    kv = normalize_dtype(kv_dtype) if kv_dtype is not None else model
    return Dtypes(kv=kv, conv=model, ssm=ssm)
