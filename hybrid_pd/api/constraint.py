"""What a constrained request's output must match: a JSON schema, any JSON object, a regular
expression or one of a list of strings (no torch).

A `Constraint` travels inside SamplingParams (and the wire's `Sampling`) from the proxy to
every worker that samples for the request: the prefill worker (first token), the decode
worker, and any worker a stream migrates to. Each builds its own matcher from it (the
grammar library is llguidance, `grammar()` is its grammar text) and replays the tokens
already produced before it samples, so the output is the same wherever it was made.

`check()` compiles the grammar without a tokenizer: the proxy calls it (in a thread) to
answer a bad schema with 400 before any worker sees it; a worker compiles it again with
its tokenizer (`engine.grammar`), and refuses it with INVALID_ARGUMENT if that fails.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

#: The kinds of constraint, and what `value` holds for each.
KINDS = {
    "json_schema": "a JSON schema (JSON text)",
    "json_object": "nothing (any JSON object)",
    "regex": "a regular expression",
    "choice": "a JSON list of strings",
}
#: Longest `value` accepted (characters): a bigger schema is refused, never compiled.
MAX_CONSTRAINT_CHARS = 64 * 1024
#: Most strings a choice may list.
MAX_CHOICES = 1024
#: JSON output is compact (no whitespace between tokens): a model cannot wander in an
#: unbounded run of spaces, and the output is one canonical text per value.
_JSON_OPTIONS = {"whitespace_flexible": False}


@dataclass(frozen=True)
class Constraint:
    """A request's output must match this. `kind` is one of KINDS; `value` as KINDS says.
    Checked on construction for shape and size only (`check()` compiles it)."""

    kind: str
    value: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(
                f"constraint kind must be one of {', '.join(KINDS)}, got {self.kind!r}"
            )
        if not isinstance(self.value, str):
            raise ValueError("constraint value must be a string")
        if len(self.value) > MAX_CONSTRAINT_CHARS:
            raise ValueError(
                f"the {self.kind} is too large: {len(self.value)} characters, "
                f"at most {MAX_CONSTRAINT_CHARS}"
            )
        if self.kind == "json_object" and self.value:
            raise ValueError("a json_object constraint takes no value")
        if self.kind in ("json_schema", "regex", "choice") and not self.value:
            raise ValueError(f"a {self.kind} constraint needs a value")
        if self.kind == "choice":
            choices = _choices(self.value)
            if not choices or len(choices) > MAX_CHOICES:
                raise ValueError(f"choice must list 1 to {MAX_CHOICES} strings")
            if any(not c for c in choices):
                raise ValueError("choice strings must not be empty")
        if self.kind == "json_schema":
            try:
                schema = json.loads(self.value)
            except ValueError as e:
                raise ValueError(f"the JSON schema is not valid JSON: {e}") from None
            if not isinstance(schema, dict | bool):
                raise ValueError("a JSON schema must be an object (or a boolean)")

    @classmethod
    def json_schema(cls, schema: dict | bool) -> Constraint:
        """From a parsed schema (its keys keep their order: properties come out in it)."""
        return cls("json_schema", json.dumps(schema, separators=(",", ":"), ensure_ascii=False))

    @classmethod
    def choice(cls, choices: list[str]) -> Constraint:
        if not isinstance(choices, list) or not all(isinstance(c, str) for c in choices):
            raise ValueError("choice must be a list of strings")
        return cls("choice", json.dumps(choices, ensure_ascii=False))

    def grammar(self) -> str:
        """llguidance's grammar text for this constraint (not yet compiled)."""
        import llguidance

        if self.kind == "json_schema":
            return llguidance.LLMatcher.grammar_from_json_schema(self.value, defaults=_JSON_OPTIONS)
        if self.kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema(
                '{"type":"object"}', defaults=_JSON_OPTIONS
            )
        if self.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(self.value)
        lark = "start: " + " | ".join(json.dumps(c) for c in _choices(self.value))
        return llguidance.LLMatcher.grammar_from_lark(lark)

    def check(self) -> None:
        """Compile without a tokenizer; ValueError naming the problem if it does not."""
        import llguidance

        try:
            grammar = self.grammar()
        except (ValueError, TypeError) as e:
            raise ValueError(f"invalid {self.kind}: {e}") from None
        error = llguidance.LLMatcher.validate_grammar(grammar, limits=parser_limits())
        if error:
            raise ValueError(f"invalid {self.kind}: {_first_line(error)}")


def parser_limits():
    """The grammar library's resource limits (its defaults bound compile and mask work);
    errors name the problem without echoing the whole grammar back."""
    import llguidance

    return llguidance.LLParserLimits(verbose_errors=False)


def _choices(value: str) -> list[str]:
    try:
        choices = json.loads(value)
    except ValueError:
        raise ValueError("choice must be a JSON list of strings") from None
    if not isinstance(choices, list) or not all(isinstance(c, str) for c in choices):
        raise ValueError("choice must be a JSON list of strings")
    return choices


def _first_line(message: str, limit: int = 500) -> str:
    line = message.strip().splitlines()[0] if message.strip() else "cannot compile"
    return line[:limit]
