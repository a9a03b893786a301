"""OpenAI response bodies: whole responses and streamed chunks (SSE)."""

from __future__ import annotations

import json
import time
import uuid

from hybrid_pd.proxy.protocol import GenerationRequest


def new_id(kind: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex


def finish_reason(worker_reason: str) -> str:
    """The workers' reasons ("length", "stop", ...) as OpenAI's ("length" or "stop")."""
    return "length" if worker_reason == "length" else "stop"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def sse(payload: dict | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n"


class ResponseBuilder:
    """Bodies for one request: `whole(...)` or `chunk(...)`s in the endpoint's format."""

    def __init__(self, req: GenerationRequest, model: str, request_id: str) -> None:
        self.req = req
        self.model = model
        self.id = request_id
        self.created = int(time.time())
        self.chat = req.kind == "chat"

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def whole(self, text: str, token_ids: list[int], reason: str) -> dict:
        if self.chat:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": reason,
            }
            body = self._head("chat.completion")
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
            body = self._head("text_completion")
        if self.req.return_token_ids:
            choice["token_ids"] = list(token_ids)
            body["prompt_token_ids"] = list(self.req.prompt_ids)
        body["choices"] = [choice]
        body["usage"] = usage(len(self.req.prompt_ids), len(token_ids))
        return body

    def first_chunk(self) -> dict | None:
        """Chat streams open with the assistant role."""
        if not self.chat:
            return None
        body = self._head("chat.completion.chunk")
        body["choices"] = [
            {
                "index": 0,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
        ]
        if self.req.return_token_ids:
            body["prompt_token_ids"] = list(self.req.prompt_ids)
        return body

    def chunk(self, text: str, token_ids: list[int], reason: str | None) -> dict:
        if self.chat:
            delta = {"content": text} if text or reason is None else {}
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
            body = self._head("chat.completion.chunk")
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
            body = self._head("text_completion")
        if self.req.return_token_ids:
            choice["token_ids"] = list(token_ids)
        body["choices"] = [choice]
        if self.req.include_usage:
            body["usage"] = None
        return body

    def usage_chunk(self, completion_tokens: int) -> dict:
        body = self._head("chat.completion.chunk" if self.chat else "text_completion")
        body["choices"] = []
        body["usage"] = usage(len(self.req.prompt_ids), completion_tokens)
        return body
