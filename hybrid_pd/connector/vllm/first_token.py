"""The prefill's first token in the decode server's reply.

vLLM's own P/D routers (its example proxy, llm-d's sidecar, Dynamo) send the prompt to the
prefill server with `max_tokens: 1`, keep only the `kv_transfer_params` of that reply, and
give the client the decode server's reply. Decode continues from the prefill's first token
(`SchedulerHalf.on_new_request` appends it to the prompt, so the next token is computed in
the single-instance order), so its reply would start at the second token.

A connector cannot add tokens to a reply, so this module does the least it can: it wraps
the engine-core scheduler's `update_from_output` (once per process, only where our
connector is the scheduler's connector) and puts the first token in front of the tokens of
the request's first output. Everything the front end does with tokens then sees it: the
detokenizer, stop strings, `n` counting, usage. A request's kv_transfer_params may opt out
(`REPLY_KEY: false`): hybrid-pd's own proxy already streamed that token to its client.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

logger = logging.getLogger(__name__)

#: kv_transfer_params key of a decode request: false keeps the first token out of the reply.
REPLY_KEY = "reply_first_token"


class FirstTokens:
    """First tokens owed to requests' replies (the scheduler half fills it, the wrapped
    `update_from_output` pays it out)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._due: dict[str, int] = {}
        self._ended: set[str] = set()

    def owe(self, request_id: str, token: int) -> None:
        with self._lock:
            self._due[request_id] = token

    def ended(self, request_id: str) -> None:
        """The request finished: what is still owed goes with its last output (or is
        dropped at the next step if it had none)."""
        with self._lock:
            if request_id in self._due:
                self._ended.add(request_id)

    def pay(self, outputs: dict[int, Any]) -> None:
        """Put each owed token in front of its request's first output's tokens."""
        with self._lock:
            if not self._due:
                return
            for client_outputs in outputs.values():
                for out in client_outputs.outputs:
                    token = self._due.get(out.request_id)
                    if token is None or not (out.new_token_ids or out.finish_reason):
                        continue
                    del self._due[out.request_id]
                    if not out.new_token_ids:  # ended without a token (an error, an abort)
                        continue
                    out.new_token_ids = [token, *out.new_token_ids]
                    if out.new_logprobs is not None:  # never asked: such requests compute alone
                        logger.error("request %s: logprobs with a prepended token", out.request_id)
            for request_id in self._ended:  # aborted before their first output
                self._due.pop(request_id, None)
            self._ended.clear()

    def __len__(self) -> int:
        return len(self._due)


def install() -> None:
    """Wrap vLLM's `Scheduler.update_from_output` (idempotent). The wrapper pays the first
    tokens of the scheduler's connector when that connector has `first_tokens`."""
    from vllm.v1.core.sched.scheduler import Scheduler

    if getattr(Scheduler.update_from_output, "_hybrid_pd_first_tokens", False):
        return
    original = Scheduler.update_from_output

    def update_from_output(self, scheduler_output, model_runner_output):
        outputs = original(self, scheduler_output, model_runner_output)
        owed = getattr(self.connector, "first_tokens", None)
        if isinstance(owed, FirstTokens):
            owed.pay(outputs)
        return outputs

    update_from_output._hybrid_pd_first_tokens = True
    update_from_output.__wrapped__ = original
    Scheduler.update_from_output = update_from_output
