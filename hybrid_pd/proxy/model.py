"""The served model as the proxy knows it: learned from the workers' model cards.

The proxy never loads the model: max_model_len, vocabulary and the checkpoint folder come
from the first worker that describes itself (at startup, or on the first request when no
worker was up then). Only the tokenizer is loaded here, with `tokenizers`.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from hybrid_pd.api.card import ModelCard
from hybrid_pd.api.tokenizer import Tokenizer
from hybrid_pd.api.wire import card_from_pb
from hybrid_pd.proxy.config import ProxyConfig
from hybrid_pd.proxy.errors import ProxyError
from hybrid_pd.proxy.protocol import ModelContext
from hybrid_pd.proxy.routing import WorkerPool

logger = logging.getLogger(__name__)


class ServedModel:
    def __init__(self, config: ProxyConfig, pool: WorkerPool) -> None:
        self.config = config
        self.pool = pool
        self.card: ModelCard | None = None
        self._ctx: ModelContext | None = None
        self._lock = asyncio.Lock()

    @property
    def names(self) -> tuple[str, ...]:
        """The ids clients may pass as `model`; the first is the one listed."""
        if self.config.served_model_names:
            return self.config.served_model_names
        if self.card is None:
            return ()
        return tuple(dict.fromkeys((self.card.default_name, self.card.model)))

    @property
    def ctx(self) -> ModelContext | None:
        return self._ctx

    def learn(self) -> ModelContext | None:
        """Blocking: ask the workers for their card (once each); None when none answers."""
        msg = self.pool.describe()
        if msg is None:
            return None
        card = card_from_pb(msg)
        folder = Path(self.config.model_path or card.path)
        tokenizer = Tokenizer(folder) if (folder / "tokenizer.json").exists() else None
        if tokenizer is None:
            logger.warning("no tokenizer.json in %s: only token-id prompts are served", folder)
        limit = card.max_model_len
        if self.config.max_model_len is not None:
            limit = min(limit, self.config.max_model_len)
        self.card = card
        self._ctx = ModelContext(
            self.names,
            tokenizer,
            limit,
            card.vocab_size,
            self.config.default_chat_max_tokens,
        )
        logger.info(
            "serving %s as %s (max_model_len %d)", card.architecture, ", ".join(self.names), limit
        )
        return self._ctx

    async def context(self) -> ModelContext:
        """The model context, learned now if no worker had answered before (503 if none
        answers now either)."""
        if self._ctx is not None:
            return self._ctx
        async with self._lock:
            if self._ctx is None and await asyncio.to_thread(self.learn) is None:
                raise ProxyError(
                    503,
                    "no worker is available to serve this model yet",
                    code="no_worker",
                    kind="no_worker",
                    retry_after_s=1,
                )
        return self._ctx
