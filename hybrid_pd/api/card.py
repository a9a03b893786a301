"""The model card: what a worker serves, as the proxy needs to know it."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class ModelIdentity:
    """What peers compare before they exchange KV: they must serve one model."""

    architecture: str = ""
    #: Parameters of the whole model (every tensor-parallel rank's share together).
    parameters: int = 0
    #: sha256 of the first weights (the embedding), 16 hex digits.
    weights: str = ""

    def key(self) -> str:
        """The identity as one string (sorted JSON): the `model` of a worker's KV layout,
        part of its fingerprint and compared at the handshake."""
        return json.dumps(
            {
                "architecture": self.architecture,
                "parameters": self.parameters,
                "weights": self.weights,
            },
            sort_keys=True,
        )


@dataclass(frozen=True)
class ModelCard:
    """Reported by every worker (the Describe RPC); the engine's own reading of the
    checkpoint, so the proxy never loads the model or re-derives the engine's limits."""

    #: The name or folder the worker was started with.
    model: str
    #: Checkpoint folder on the worker's host (tokenizer.json, tokenizer_config.json).
    path: str
    architecture: str
    #: Prompt + output tokens one request may hold.
    max_model_len: int
    #: Token ids a prompt may hold: [0, vocab_size); None when unknown.
    vocab_size: int | None
    eos_token_ids: tuple[int, ...] = ()
    #: Architecture, parameter count and a weights digest: workers must agree on it.
    identity: ModelIdentity = field(default_factory=ModelIdentity)

    def __post_init__(self) -> None:
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must be at least 2, got {self.max_model_len}")
        if self.vocab_size is not None and self.vocab_size < 1:
            raise ValueError(f"vocab_size must be positive, got {self.vocab_size}")

    @property
    def default_name(self) -> str:
        """The id clients use when the operator names none: `tiny` stays `tiny`, a
        checkpoint folder is known by its last component (not the whole path)."""
        name = Path(self.model.rstrip("/")).name
        return name or self.model
