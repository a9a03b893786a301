"""Our Worker API in vLLM's terms: a completion request's body, its logprobs read back, the
kv_transfer_params vLLM's connector takes, and the model card of a vLLM server's checkpoint.
Plain functions, used by `vllm_worker.py`."""

from __future__ import annotations

import json
from pathlib import Path

from hybrid_pd.api.card import ModelCard, ModelIdentity
from hybrid_pd.api.params import KVTransferParams
from hybrid_pd.api.sampling import SamplingParams, TokenLogprob

#: Where vLLM's connector keeps our params inside its kv_transfer_params.
PARAMS_KEY = "hybrid_pd"


def _body(model: str, prompt, params: SamplingParams, max_tokens: int) -> dict:
    """A vLLM completions request for token-id `prompt` with `params`."""
    body = {
        "model": model,
        "prompt": list(prompt),
        "max_tokens": max_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k or -1,
        "ignore_eos": params.ignore_eos,
        "return_token_ids": True,
        "skip_special_tokens": False,
    }
    if params.seed is not None:
        body["seed"] = params.seed
    if params.stop:
        body["stop"] = list(params.stop)
    if params.stop_token_ids:
        body["stop_token_ids"] = list(params.stop_token_ids)
    if params.logprobs is not None:
        body["logprobs"] = params.logprobs
    if params.prompt_logprobs is not None:
        body["prompt_logprobs"] = params.prompt_logprobs
    if params.logprobs is not None or params.prompt_logprobs is not None:
        body["return_tokens_as_token_ids"] = True
    return body


def _token_id(name: str) -> int:
    """vLLM's name of a token under `return_tokens_as_token_ids`: "token_id:<id>"."""
    prefix, _, number = name.partition(":")
    if prefix != "token_id":
        raise ValueError(f"token {name!r} is not named by id")
    return int(number)


def _output_logprobs(choice: dict, k: int) -> list[TokenLogprob]:
    """The choice's generated tokens' logprobs (OpenAI completions form, tokens by id), each
    with its `k` best alternatives, best first (vLLM adds the chosen token to them when it
    is not among the best; our engine does not)."""
    lp = choice["logprobs"]
    out = []
    for chosen, top in zip(lp["token_logprobs"], lp["top_logprobs"], strict=True):
        ranked = sorted(((_token_id(t), v) for t, v in (top or {}).items()), key=lambda p: -p[1])
        out.append(TokenLogprob(float(chosen), tuple(ranked[:k])))
    return out


def _prompt_logprobs(choice: dict, prompt: list[int], k: int) -> list[TokenLogprob | None]:
    """vLLM's prompt logprobs: per position a dict id -> {logprob, rank} holding the prompt
    token and the k best; the first position has none."""
    out: list[TokenLogprob | None] = []
    for pos, entry in enumerate(choice["prompt_logprobs"]):
        if entry is None:
            out.append(None)
            continue
        chosen = entry[str(prompt[pos])]["logprob"]
        best = sorted(
            ((int(t), v["logprob"], v["rank"]) for t, v in entry.items() if v["rank"] <= k),
            key=lambda x: x[2],
        )
        out.append(TokenLogprob(float(chosen), tuple((t, float(v)) for t, v, _ in best)))
    return out


def _vllm_params(kv: KVTransferParams) -> dict:
    """Our params as vLLM's connector expects them in a decode request."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": kv.engine_id,
        "remote_request_id": kv.request_id,
        PARAMS_KEY: kv.to_dict(),
        # our proxy streamed the prefill's first token already: decode's reply starts after it
        "reply_first_token": False,
    }


def _card(model: str, max_model_len: int) -> ModelCard:
    folder = Path(model)
    config = json.loads((folder / "config.json").read_text())
    text = config.get("text_config") or config
    eos = text.get("eos_token_id", config.get("eos_token_id"))
    eos_ids = tuple(eos) if isinstance(eos, list) else (eos,) if isinstance(eos, int) else ()
    architecture = (config.get("architectures") or ["?"])[0]
    return ModelCard(
        model=model,
        path=str(folder.resolve()),
        architecture=architecture,
        max_model_len=max_model_len,
        vocab_size=text.get("vocab_size"),
        eos_token_ids=eos_ids,
        # vLLM loads the weights itself: no digest of them here
        identity=ModelIdentity(architecture=architecture),
    )
