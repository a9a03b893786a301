"""Parse and validate OpenAI request bodies into token ids + SamplingParams."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from hybrid_pd.api.sampling import INT64_MAX, SamplingParams
from hybrid_pd.proxy.errors import ProxyError, bad_request
from hybrid_pd.proxy.structured import FIELDS as STRUCTURED_FIELDS
from hybrid_pd.proxy.structured import Structured, ToolMode, parse_structured

#: Sampling fields a SamplingParams error message starts with (to name the bad `param`).
_PARAM_NAMES = ("max_tokens", "temperature", "top_k", "top_p", "seed", "stop_token_ids", "stop")

#: Fields honoured (or refused with a reason below when set to something other than the
#: default); `user`, `metadata`, `store` and `service_tier` are bookkeeping and change nothing.
_COMMON_FIELDS = frozenset(
    {
        "model", "stream", "stream_options", "max_tokens", "temperature", "top_p", "top_k",
        "seed", "stop", "stop_token_ids", "ignore_eos", "return_token_ids", "n", "logprobs",
        "presence_penalty", "frequency_penalty", "logit_bias", "user", "metadata", "store",
        "service_tier",
    }
) | STRUCTURED_FIELDS  # fmt: skip
_FIELDS = {
    "completion": _COMMON_FIELDS | {"prompt", "echo", "suffix", "best_of"},
    "chat": _COMMON_FIELDS
    | {
        "messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
        "parallel_tool_calls", "functions", "function_call", "modalities",
        "audio", "prediction", "reasoning_effort", "web_search_options",
    },
}  # fmt: skip
#: Chat features this server does not have, refused when asked for (never silently ignored).
_UNSUPPORTED_CHAT = {
    "functions": "the legacy 'functions' field is not supported: use 'tools'",
    "function_call": "the legacy 'function_call' field is not supported: use 'tool_choice'",
    "audio": "audio output is not supported",
    "prediction": "predicted outputs are not supported",
    "web_search_options": "web search is not supported",
    "reasoning_effort": "reasoning_effort is not supported",
}
#: Roles a chat message may have; anything else is refused, never rendered.
ROLES = ("system", "developer", "user", "assistant", "tool")
#: Bounds on list fields, far above any real use (each element costs work per token).
MAX_STOP = 64
MAX_STOP_TOKEN_IDS = 1024
#: Most choices one request may ask for.
MAX_N = 16


def _check_fields(body: dict, kind: str) -> None:
    unknown = sorted(k for k in body if k not in _FIELDS[kind])
    if unknown:
        names = ", ".join(repr(k) for k in unknown[:8])
        raise bad_request(f"unknown field(s) {names}", param=unknown[0])
    if body.get("logit_bias"):
        raise bad_request("logit_bias is not supported", param="logit_bias")
    if kind != "chat":
        return
    for name, why in _UNSUPPORTED_CHAT.items():
        if body.get(name) not in (None, [], {}):
            raise bad_request(why, param=name)
    modalities = body.get("modalities")
    if modalities is not None and modalities != ["text"]:
        raise bad_request("only the text modality is supported", param="modalities")


@dataclass(frozen=True)
class ModelContext:
    #: Ids clients may pass as `model`; the first is the one listed.
    names: tuple[str, ...]
    tokenizer: Any  # hybrid_pd.api.tokenizer.Tokenizer or None
    max_model_len: int
    vocab_size: int | None
    default_chat_max_tokens: int = 256


@dataclass(frozen=True)
class GenerationRequest:
    kind: str  # "completion" or "chat"
    model: str  # as the client named it (one of ModelContext.names)
    prompt_ids: list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool
    return_token_ids: bool
    #: Choices to generate (independent requests; choice i samples with seed + i).
    n: int = 1
    #: Completions: the prompt's text (and, with logprobs, its logprobs) come first.
    echo: bool = False
    #: max_tokens 0 with echo: score the prompt only (one token is generated, not shown).
    prompt_only: bool = False
    #: Chat with forced tool calls: the reply presents the output as `tool_calls`.
    tools: ToolMode | None = None


def check_model(body: dict, ctx: ModelContext) -> str:
    model = body.get("model")
    if model is None:
        raise bad_request("you must provide a model parameter", param="model")
    if not isinstance(model, str):
        raise bad_request("'model' must be a string", param="model")
    if model not in ctx.names:
        raise model_not_found(model, ctx.names)
    return model


def model_not_found(model: str, names: tuple[str, ...]) -> ProxyError:
    served = ", ".join(f"`{n}`" for n in names)
    return ProxyError(
        404,
        f"The model `{model}` does not exist. This server serves {served}.",
        param="model",
        code="model_not_found",
    )


def parse_completion(body: Any, ctx: ModelContext) -> GenerationRequest:
    body = _object(body)
    check_model(body, ctx)
    _check_fields(body, "completion")
    if "prompt" not in body or body["prompt"] is None:
        raise bad_request("you must provide a prompt", param="prompt")
    if body.get("suffix"):
        raise bad_request("suffix is not supported", param="suffix")
    if body.get("best_of") not in (None, 1):
        raise bad_request("best_of must be 1 (only one completion per request)", param="best_of")
    prompt_ids = _prompt_ids(body["prompt"], ctx)
    max_tokens = _opt_int(body, "max_tokens")
    echo = bool(_opt_bool(body, "echo"))
    if echo and _opt_bool(body, "stream"):
        raise bad_request("echo is not supported with stream=true", param="echo")
    prompt_only = echo and max_tokens == 0
    logprobs = _opt_int(body, "logprobs")
    req = _request(
        "completion",
        body,
        ctx,
        prompt_ids,
        16 if max_tokens is None else max(max_tokens, int(prompt_only)),
        parse_structured(body, "completion"),
        logprobs=logprobs,
        prompt_logprobs=logprobs if echo else None,
    )
    return dataclasses.replace(req, echo=echo, prompt_only=prompt_only)


def parse_chat(body: Any, ctx: ModelContext) -> GenerationRequest:
    body = _object(body)
    check_model(body, ctx)
    _check_fields(body, "chat")
    messages = body.get("messages")
    if messages is None:
        raise bad_request("you must provide messages", param="messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty list", param="messages")
    if ctx.tokenizer is None:
        raise bad_request("this model has no tokenizer: use /v1/completions with token ids")
    rendered = [_message(m, i) for i, m in enumerate(messages)]
    _check_text_length(sum(len(m["content"]) for m in rendered), ctx, "messages")
    structured = parse_structured(body, "chat")
    try:
        text = ctx.tokenizer.apply_chat_template(rendered, tools=structured.declared)
    except Exception as e:  # jinja errors, raise_exception() in the template
        raise bad_request(f"cannot apply the chat template: {e}", param="messages") from e
    prompt_ids = _check_ids(ctx.tokenizer.encode(text), ctx, "messages")
    max_tokens = _opt_int(body, "max_completion_tokens")
    if max_tokens is None:
        max_tokens = _opt_int(body, "max_tokens")
    if max_tokens is None:
        room = ctx.max_model_len - len(prompt_ids)
        max_tokens = max(1, min(ctx.default_chat_max_tokens, room))
    top = _opt_int(body, "top_logprobs")
    if _opt_bool(body, "logprobs"):
        logprobs = top or 0
    elif top:
        raise bad_request("top_logprobs needs logprobs=true", param="top_logprobs")
    else:
        logprobs = None
    return _request("chat", body, ctx, prompt_ids, max_tokens, structured, logprobs=logprobs)


def _request(
    kind: str,
    body: dict,
    ctx: ModelContext,
    prompt_ids: list[int],
    max_tokens: int,
    structured: Structured,
    logprobs: int | None = None,
    prompt_logprobs: int | None = None,
) -> GenerationRequest:
    n = _opt_int(body, "n")
    n = 1 if n is None else n
    if not 1 <= n <= MAX_N:
        raise bad_request(f"n must be in [1, {MAX_N}], got {n}", param="n")
    for name in ("presence_penalty", "frequency_penalty"):
        if _opt_float(body, name) not in (None, 0.0):
            raise bad_request(f"{name} is not supported (only 0)", param=name)
    stream = _opt_bool(body, "stream") or False
    include_usage = False
    options = body.get("stream_options")
    if options is not None:
        if not isinstance(options, dict):
            raise bad_request("'stream_options' must be an object", param="stream_options")
        if not stream:
            raise bad_request("stream_options needs stream=true", param="stream_options")
        include_usage = bool(_opt_bool(options, "include_usage"))
    stop = body.get("stop")
    if stop is None:
        stop = ()
    elif isinstance(stop, str):
        stop = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        if len(stop) > MAX_STOP:
            raise bad_request(f"at most {MAX_STOP} stop strings", param="stop")
        stop = tuple(stop)
    else:
        raise bad_request("'stop' must be a string or a list of strings", param="stop")
    if stop and ctx.tokenizer is None:
        raise bad_request("stop strings need a tokenizer", param="stop")
    stop_ids = body.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or not all(_is_int(t) for t in stop_ids):
        raise bad_request("'stop_token_ids' must be a list of integers", param="stop_token_ids")
    if len(stop_ids) > MAX_STOP_TOKEN_IDS:
        raise bad_request(f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids", param="stop_token_ids")
    temperature = _opt_float(body, "temperature")
    top_p = _opt_float(body, "top_p")
    top_k = _opt_int(body, "top_k")
    try:
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if temperature is None else temperature,
            top_p=1.0 if top_p is None else top_p,
            top_k=0 if top_k is None or top_k == -1 else top_k,
            seed=_opt_int(body, "seed"),
            stop=stop,
            stop_token_ids=tuple(stop_ids),
            ignore_eos=bool(_opt_bool(body, "ignore_eos")),
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            constraint=structured.constraint,
        )
    except ValueError as e:
        msg = str(e)
        param = next((p for p in _PARAM_NAMES if msg.startswith(p)), None)
        if param == "max_tokens" and kind == "chat" and "max_completion_tokens" in body:
            param = "max_completion_tokens"
        if msg.startswith(("logprobs", "prompt_logprobs")):
            param = "top_logprobs" if kind == "chat" else "logprobs"
        raise bad_request(msg, param=param) from e
    total = len(prompt_ids) + params.max_tokens
    if total > ctx.max_model_len:
        where = "messages" if kind == "chat" else "prompt"
        raise bad_request(
            f"This model's maximum context length is {ctx.max_model_len} tokens. However, you "
            f"requested {total} tokens ({len(prompt_ids)} in the {where}, {params.max_tokens} "
            f"for the completion). Please reduce the length of the {where} or max_tokens.",
            param=where,
            code="context_length_exceeded",
        )
    return GenerationRequest(
        kind,
        body["model"],
        prompt_ids,
        params,
        stream,
        include_usage,
        bool(_opt_bool(body, "return_token_ids")),
        n,
        tools=structured.tools,
    )


# -- field helpers --------------------------------------------------------------------------
def _object(body: Any) -> dict:
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    return body


def _prompt_ids(prompt: Any, ctx: ModelContext) -> list[int]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if ctx.tokenizer is None:
            raise bad_request("this model has no tokenizer: send the prompt as token ids")
        if not prompt:
            raise bad_request("the prompt is empty", param="prompt")
        _check_text_length(len(prompt), ctx, "prompt")
        return _check_ids(ctx.tokenizer.encode(prompt), ctx, "prompt")
    if isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        return _check_ids([int(t) for t in prompt], ctx, "prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(p, str | list) for p in prompt):
        raise bad_request("only one prompt per request is supported", param="prompt")
    raise bad_request(
        "'prompt' must be a non-empty string or a non-empty list of token ids", param="prompt"
    )


def _check_text_length(chars: int, ctx: ModelContext, param: str) -> None:
    """Refuse, without tokenizing it, text too long to fit in any case: tokenizing megabytes
    only to refuse them costs seconds."""
    limit = ctx.max_model_len * ctx.tokenizer.max_token_chars
    if chars > limit:
        raise bad_request(
            f"This model's maximum context length is {ctx.max_model_len} tokens. The {param} "
            f"has {chars} characters, more than {ctx.max_model_len} tokens of this tokenizer "
            f"can hold ({limit}). Please reduce the length of the {param}.",
            param=param,
            code="context_length_exceeded",
        )


def _check_ids(ids: list[int], ctx: ModelContext, param: str) -> list[int]:
    if not ids:
        raise bad_request(f"the {param} is empty", param=param)
    vocab = ctx.vocab_size or INT64_MAX
    if any(not 0 <= t < vocab for t in ids):
        raise bad_request(f"prompt token ids must be in [0, {vocab})", param=param)
    return ids


def _message(m: Any, i: int) -> dict[str, Any]:
    """Only what the template renders: a known role and text content (an assistant's
    earlier tool calls and a tool result's call id too, for templates that show them)."""
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise bad_request(f"messages[{i}] needs a string 'role'", param="messages")
    if m["role"] not in ROLES:
        raise bad_request(
            f"messages[{i}].role must be one of {', '.join(ROLES)}; got {m['role']!r}",
            param="messages",
        )
    unknown = sorted(set(m) - {"role", "content", "name", "tool_calls", "tool_call_id"})
    if unknown:
        raise bad_request(f"messages[{i}]: unknown field(s) {unknown}", param="messages")
    out: dict[str, Any] = {"role": m["role"], "content": _content(m.get("content"), i)}
    calls = m.get("tool_calls")
    if calls:
        if m["role"] != "assistant" or not isinstance(calls, list):
            raise bad_request(
                f"messages[{i}]: tool_calls must be a list, on an assistant message",
                param="messages",
            )
        out["tool_calls"] = [_past_call(c, i) for c in calls]
    if isinstance(m.get("tool_call_id"), str):
        out["tool_call_id"] = m["tool_call_id"]
    return out


def _past_call(c: Any, i: int) -> dict:
    fn = c.get("function") if isinstance(c, dict) else None
    if (
        not isinstance(fn, dict)
        or not isinstance(fn.get("name"), str)
        or not isinstance(fn.get("arguments"), str)
    ):
        raise bad_request(
            f"messages[{i}]: each tool call needs function.name and function.arguments strings",
            param="messages",
        )
    return {"id": c.get("id"), "type": "function", "function": dict(fn)}


def _content(content: Any, i: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise bad_request(
                    f"messages[{i}]: only text content parts are supported", param="messages"
                )
            if not isinstance(part.get("text"), str):
                raise bad_request(
                    f"messages[{i}]: a text part needs a string 'text'", param="messages"
                )
            parts.append(part["text"])
        return "".join(parts)
    if content is None:
        return ""
    raise bad_request(f"messages[{i}].content must be a string or a list", param="messages")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _opt_int(body: dict, name: str) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if not _is_int(v):
        raise bad_request(f"'{name}' must be an integer, got {v!r}", param=name)
    return v


def _opt_float(body: dict, name: str) -> float | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise bad_request(f"'{name}' must be a number, got {v!r}", param=name)
    return float(v)


def _opt_bool(body: dict, name: str) -> bool | None:
    v = body.get(name)
    if v is None:
        return None
    if not isinstance(v, bool):
        raise bad_request(f"'{name}' must be a boolean, got {v!r}", param=name)
    return v


# -- /tokenize and /detokenize (as vLLM offers them) -------------------------------------------
def parse_tokenize(body: Any, ctx: ModelContext) -> list[int]:
    """Token ids of `prompt` (a string), or of `messages` rendered by the chat template."""
    body = _object(body)
    if "model" in body:
        check_model(body, ctx)
    unknown = sorted(set(body) - {"model", "prompt", "messages", "add_generation_prompt"})
    if unknown:
        raise bad_request(f"unknown field(s) {unknown}", param=unknown[0])
    if ctx.tokenizer is None:
        raise bad_request("this model has no tokenizer")
    if ("prompt" in body) == ("messages" in body):
        raise bad_request("give exactly one of 'prompt' and 'messages'", param="prompt")
    if "prompt" in body:
        if not isinstance(body["prompt"], str):
            raise bad_request("'prompt' must be a string", param="prompt")
        _check_text_length(len(body["prompt"]), ctx, "prompt")
        return ctx.tokenizer.encode(body["prompt"])
    messages = body["messages"]
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty list", param="messages")
    if _opt_bool(body, "add_generation_prompt") is False:
        raise bad_request("add_generation_prompt false is not supported", param="messages")
    rendered = [_message(m, i) for i, m in enumerate(messages)]
    _check_text_length(sum(len(m["content"]) for m in rendered), ctx, "messages")
    try:
        return ctx.tokenizer.encode(ctx.tokenizer.apply_chat_template(rendered))
    except Exception as e:  # jinja errors, raise_exception() in the template
        raise bad_request(f"cannot apply the chat template: {e}", param="messages") from e


def parse_detokenize(body: Any, ctx: ModelContext) -> str:
    body = _object(body)
    if "model" in body:
        check_model(body, ctx)
    unknown = sorted(set(body) - {"model", "tokens"})
    if unknown:
        raise bad_request(f"unknown field(s) {unknown}", param=unknown[0])
    if ctx.tokenizer is None:
        raise bad_request("this model has no tokenizer")
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(_is_int(t) for t in tokens):
        raise bad_request("'tokens' must be a list of token ids", param="tokens")
    vocab = ctx.vocab_size or INT64_MAX
    if any(not 0 <= t < vocab for t in tokens):
        raise bad_request(f"token ids must be in [0, {vocab})", param="tokens")
    return ctx.tokenizer.decode(tokens, skip_special_tokens=False)
