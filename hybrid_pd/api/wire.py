"""Protobuf <-> the shared dataclasses, at the edge of the proxy and of the workers."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from hybrid_pd.api.card import ModelCard, ModelIdentity
from hybrid_pd.api.constraint import Constraint
from hybrid_pd.api.sampling import SamplingParams, TokenLogprob
from hybrid_pd.proto import worker_pb2 as pb

#: ModelCard fields the proto message carries under the same name and form.
_CARD_AS_IS = ("model", "path", "architecture", "max_model_len")


def same_named(source: Any, names: tuple[str, ...]) -> dict[str, Any]:
    """`source`'s fields `names`, as keyword arguments of the other side's type (a dataclass
    and its proto message that name those fields alike and hold them in the same form)."""
    return {n: getattr(source, n) for n in names}


def sampling_from_pb(msg: pb.Sampling) -> SamplingParams:
    """Raises ValueError (naming the field) for values SamplingParams refuses."""
    return SamplingParams(
        max_tokens=msg.max_tokens or 16,
        temperature=msg.temperature,
        top_k=msg.top_k,
        top_p=msg.top_p or 1.0,
        seed=msg.seed if msg.has_seed else None,
        stop_token_ids=tuple(msg.stop_token_ids),
        stop=tuple(msg.stop),
        ignore_eos=msg.ignore_eos,
        logprobs=msg.logprobs if msg.HasField("logprobs") else None,
        prompt_logprobs=msg.prompt_logprobs if msg.HasField("prompt_logprobs") else None,
        constraint=(
            Constraint(msg.constraint.kind, msg.constraint.value)
            if msg.HasField("constraint")
            else None
        ),
    )


def sampling_to_pb(p: SamplingParams) -> pb.Sampling:
    return pb.Sampling(
        max_tokens=p.max_tokens,
        temperature=p.temperature,
        top_k=p.top_k,
        top_p=p.top_p,
        has_seed=p.seed is not None,
        seed=p.seed or 0,
        stop_token_ids=list(p.stop_token_ids),
        stop=list(p.stop),
        ignore_eos=p.ignore_eos,
        logprobs=p.logprobs,
        prompt_logprobs=p.prompt_logprobs,
        constraint=(
            None
            if p.constraint is None
            else pb.Constraint(kind=p.constraint.kind, value=p.constraint.value)
        ),
    )


def logprob_to_pb(lp: TokenLogprob | None) -> pb.TokenLogprob:
    if lp is None:
        return pb.TokenLogprob(known=False)
    return pb.TokenLogprob(
        known=True,
        logprob=lp.logprob,
        top_ids=[t for t, _ in lp.top],
        top_logprobs=[v for _, v in lp.top],
    )


def logprob_from_pb(msg: pb.TokenLogprob) -> TokenLogprob | None:
    if not msg.known:
        return None
    return TokenLogprob(msg.logprob, tuple(zip(msg.top_ids, msg.top_logprobs, strict=True)))


def card_to_pb(card: ModelCard) -> pb.ModelCard:
    return pb.ModelCard(
        **same_named(card, _CARD_AS_IS),
        vocab_size=card.vocab_size or 0,
        eos_token_ids=list(card.eos_token_ids),
        identity=pb.ModelIdentity(**asdict(card.identity)),
    )


def card_from_pb(msg: pb.ModelCard) -> ModelCard:
    identity = msg.identity
    return ModelCard(
        **same_named(msg, _CARD_AS_IS),
        vocab_size=msg.vocab_size or None,
        eos_token_ids=tuple(msg.eos_token_ids),
        identity=ModelIdentity(identity.architecture, identity.parameters, identity.weights),
    )
