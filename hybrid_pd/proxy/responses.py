"""OpenAI response bodies: whole responses and streamed chunks (SSE), logprobs included."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field

from hybrid_pd.api.sampling import TokenLogprob
from hybrid_pd.proxy.hermes import HermesStream, parse_calls
from hybrid_pd.proxy.protocol import GenerationRequest
from hybrid_pd.proxy.structured import new_call_id, tool_calls_of


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


@dataclass
class Choice:
    """One choice's whole output."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    reason: str = "stop"
    logprobs: list[TokenLogprob | None] | None = None


class ResponseBuilder:
    """Bodies for one request: `whole(...)` or `chunk(...)`s in the endpoint's format."""

    def __init__(self, req: GenerationRequest, model: str, request_id: str, tokenizer=None) -> None:
        self.req = req
        self.model = model
        self.id = request_id
        self.created = int(time.time())
        self.chat = req.kind == "chat"
        self.tokenizer = tokenizer
        #: Completions streams: characters sent so far per choice (logprobs' text_offset).
        self._offsets: dict[int, int] = {}
        #: Streams with forced tool calls: per choice, the call id sent (a named function's
        #: arguments stream as they come) or the text held back ("required": the list of
        #: calls is sent whole when it ends).
        self._call_ids: dict[int, str] = {}
        self._held: dict[int, str] = {}
        self._hermes: dict[int, HermesStream] = {}

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    # -- whole ------------------------------------------------------------------------------
    def whole(self, choices: list[Choice], prompt_logprobs=None) -> dict:
        body = self._head("chat.completion" if self.chat else "text_completion")
        out = []
        for c in choices:
            ids, logprobs, text = c.token_ids, c.logprobs, c.text
            if self.req.prompt_only:
                ids, logprobs, text = [], [] if logprobs is not None else None, ""
            if self.chat:
                message, reason = self._message(text, c.reason)
                item = {
                    "index": c.index,
                    "message": message,
                    "logprobs": self._chat_logprobs(ids, logprobs),
                    "finish_reason": reason,
                }
            else:
                lp = None
                if logprobs is not None:
                    if self.req.echo:
                        prompt = self.req.prompt_ids
                        lp = self._completion_logprobs(
                            prompt + ids, (prompt_logprobs or [None] * len(prompt)) + logprobs, 0
                        )
                    else:
                        lp = self._completion_logprobs(ids, logprobs, 0)
                if self.req.echo:
                    text = self._decode(self.req.prompt_ids) + text
                item = {"index": c.index, "text": text, "logprobs": lp, "finish_reason": c.reason}
            if self.req.return_token_ids:
                item["token_ids"] = list(ids)
            out.append(item)
        if self.req.return_token_ids:
            body["prompt_token_ids"] = list(self.req.prompt_ids)
        body["choices"] = out
        produced = 0 if self.req.prompt_only else sum(len(c.token_ids) for c in choices)
        body["usage"] = usage(len(self.req.prompt_ids), produced)
        return body

    def _message(self, text: str, reason: str) -> tuple[dict, str]:
        """A whole chat choice's message and finish reason, tool calls parsed out."""
        mode = self.req.tools
        plain = {"role": "assistant", "content": text}
        if mode is None:
            return plain, reason
        if mode.auto:
            content, calls = parse_calls(text)
        else:
            content, calls = None, (tool_calls_of(mode, text) if reason == "stop" else None)
        if not calls:
            return plain, reason
        message = {"role": "assistant", "content": content, "tool_calls": calls}
        return message, ("tool_calls" if reason == "stop" else reason)

    # -- streams ----------------------------------------------------------------------------
    def first_chunk(self) -> dict | None:
        """Chat streams open with the assistant role (one entry per choice)."""
        if not self.chat:
            return None
        body = self._head("chat.completion.chunk")
        body["choices"] = [
            {
                "index": i,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
            for i in range(self.req.n)
        ]
        if self.req.return_token_ids:
            body["prompt_token_ids"] = list(self.req.prompt_ids)
        return body

    def chunk(
        self,
        text: str,
        token_ids: list[int],
        reason: str | None,
        logprobs: list[TokenLogprob | None] | None = None,
        index: int = 0,
    ) -> dict | None:
        """One chunk's body; None when it has nothing to send (text held back)."""
        if self.chat and self.req.tools is not None:
            delta, reason = self._tool_delta(text, reason, index)
            if not delta and reason is None and logprobs is None and not self.req.return_token_ids:
                return None
            lp = self._chat_logprobs(token_ids, logprobs)
            choice = {"index": index, "delta": delta, "logprobs": lp, "finish_reason": reason}
            body = self._head("chat.completion.chunk")
        elif self.chat:
            delta = {"content": text} if text or reason is None else {}
            lp = self._chat_logprobs(token_ids, logprobs)
            choice = {"index": index, "delta": delta, "logprobs": lp, "finish_reason": reason}
            body = self._head("chat.completion.chunk")
        else:
            lp = None
            if logprobs is not None:
                start = self._offsets.get(index, 0)
                lp = self._completion_logprobs(token_ids, logprobs, start)
            self._offsets[index] = self._offsets.get(index, 0) + len(text)
            choice = {"index": index, "text": text, "logprobs": lp, "finish_reason": reason}
            body = self._head("text_completion")
        if self.req.return_token_ids:
            choice["token_ids"] = list(token_ids)
        body["choices"] = [choice]
        if self.req.include_usage:
            body["usage"] = None
        return body

    def _tool_delta(self, text: str, reason: str | None, index: int) -> tuple[dict, str | None]:
        """A forced tool call's stream: a named function's arguments as deltas of one call;
        "required" holds the text back and sends the calls when the output ends. An output
        cut short (max_tokens) ends as plain content with its own reason."""
        mode = self.req.tools
        if mode.auto:
            stream = self._hermes.setdefault(index, HermesStream())
            content = stream.push(text)
            calls: list[dict] = []
            if reason is not None:
                rest, calls = stream.finish()
                content += rest
            delta: dict = {"content": content} if content else {}
            if calls:
                delta["tool_calls"] = [{"index": i, **c} for i, c in enumerate(calls)]
                reason = "tool_calls" if reason == "stop" else reason
            return delta, reason
        if mode.name is not None:
            if index not in self._call_ids:
                self._call_ids[index] = new_call_id()
                head = {"id": self._call_ids[index], "type": "function"}
                fn = {"name": mode.name, "arguments": text}
                delta = {"tool_calls": [{"index": 0, **head, "function": fn}]}
            elif text:
                delta = {"tool_calls": [{"index": 0, "function": {"arguments": text}}]}
            else:
                delta = {}
            return delta, ("tool_calls" if reason == "stop" else reason)
        held = self._held.get(index, "") + text
        if reason is None:
            self._held[index] = held
            return {}, None
        self._held.pop(index, None)
        calls = tool_calls_of(mode, held) if reason == "stop" else None
        if calls is None:
            return ({"content": held} if held else {}), reason
        return {"tool_calls": [{"index": i, **c} for i, c in enumerate(calls)]}, "tool_calls"

    def usage_chunk(self, completion_tokens: int) -> dict:
        body = self._head("chat.completion.chunk" if self.chat else "text_completion")
        body["choices"] = []
        body["usage"] = usage(len(self.req.prompt_ids), completion_tokens)
        return body

    # -- logprobs ---------------------------------------------------------------------------
    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids) if self.tokenizer is not None else ""

    def _token(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.token_text(token_id)

    def _completion_logprobs(self, ids: list[int], logprobs: list, start: int) -> dict:
        """The legacy completions shape: parallel lists; each top_logprobs entry holds the
        best alternatives and the chosen token."""
        tokens = [self._token(t) for t in ids]
        offsets = []
        for tok in tokens:
            offsets.append(start)
            start += len(tok)
        top = []
        for tok, lp in zip(tokens, logprobs, strict=True):
            if lp is None:
                top.append(None)
                continue
            entry: dict[str, float] = {}
            for text, v in [*((self._token(a), v) for a, v in lp.top), (tok, lp.logprob)]:
                entry[text] = max(v, entry.get(text, v))  # two tokens may read alike
            top.append(entry)
        return {
            "tokens": tokens,
            "token_logprobs": [None if lp is None else lp.logprob for lp in logprobs],
            "top_logprobs": top,
            "text_offset": offsets,
        }

    def _chat_logprobs(self, ids: list[int], logprobs: list | None) -> dict | None:
        if logprobs is None:
            return None
        content = []
        for t, lp in zip(ids, logprobs, strict=True):
            tok = self._token(t)
            content.append(
                {
                    "token": tok,
                    "logprob": None if lp is None else lp.logprob,
                    "bytes": list(tok.encode("utf-8")),
                    "top_logprobs": []
                    if lp is None
                    else [
                        {"token": s, "logprob": v, "bytes": list(s.encode("utf-8"))}
                        for s, v in ((self._token(a), v) for a, v in lp.top)
                    ],
                }
            )
        return {"content": content}
