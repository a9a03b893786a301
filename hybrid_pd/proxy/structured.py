"""Structured output and forced tool calls in OpenAI (and vLLM) request bodies, turned into
one `Constraint` the workers apply, plus how the reply must present the output.

    response_format {"type": "json_object" | "json_schema"}    -> JSON (schema) constraint
    structured_outputs {"json" | "regex" | "choice" | "json_object"}, guided_json /
    guided_regex / guided_choice (vLLM's fields)                -> the same constraints
    tools + tool_choice {"type": "function", "function": {"name"}} -> the function's
        parameters schema; the reply carries the output as that call's `arguments`
    tools + tool_choice "required"                               -> a JSON list of
        {"name", "parameters"} objects, one of the tools each; the reply's `tool_calls`
    tools + tool_choice "auto" (or none given)                   -> no constraint; the
        reply's `tool_calls` are the Hermes-format calls the model wrote, if any

At most one of these may be given. Every constraint is compiled here (without a tokenizer,
on the proxy's parsing threads) so a bad schema gets a 400 naming the field before any
worker sees it.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from hybrid_pd.api.constraint import Constraint
from hybrid_pd.proxy.errors import bad_request

#: Request fields this module reads (the protocol's field lists include them).
FIELDS = frozenset(
    {"response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice"}
)
#: Most tools one request may declare.
MAX_TOOLS = 128


@dataclass(frozen=True)
class ToolMode:
    """The reply presents the output as tool calls. `name`: the forced function (the output
    is its arguments); None: "required" (the output is a JSON list of calls). `auto`: the
    model may call tools in the Hermes format (`proxy/hermes.py`), nothing is forced."""

    name: str | None
    auto: bool = False


@dataclass(frozen=True)
class Structured:
    constraint: Constraint | None = None
    tools: ToolMode | None = None
    #: The declared tools as the chat template takes them (None: none declared).
    declared: list[dict] | None = None


def parse_structured(body: dict, kind: str) -> Structured:
    """The body's constraint and tool mode; ProxyError(400) naming the field when a value
    is malformed, unsupported, or does not compile."""
    found: list[tuple[str, Constraint]] = []
    fmt = body.get("response_format")
    if fmt is not None:
        c = _response_format(fmt)
        if c is not None:
            found.append(("response_format", c))
    if body.get("structured_outputs") is not None:
        found.append(("structured_outputs", _structured_outputs(body["structured_outputs"])))
    for name in ("guided_json", "guided_regex", "guided_choice"):
        if body.get(name) is not None:
            found.append((name, _guided(name, body[name])))
    declared, tools = None, None
    if kind == "chat":
        declared = _tools(body.get("tools"))
        tools, c = _tool_choice(body.get("tool_choice"), declared, body)
        if c is not None:
            found.append(("tool_choice", c))
    if tools is not None and tools.auto and found:
        raise bad_request(
            f"tool_choice 'auto' cannot be combined with {found[0][0]}", param="tool_choice"
        )
    if len(found) > 1:
        names = ", ".join(n for n, _ in found)
        raise bad_request(f"give at most one output constraint, got {names}", param=found[1][0])
    if not found:
        return Structured(tools=tools, declared=declared)
    param, constraint = found[0]
    try:
        constraint.check()
    except ValueError as e:
        raise bad_request(str(e), param=param) from None
    return Structured(constraint, tools, declared)


def _make(param: str, build, *args) -> Constraint:
    try:
        return build(*args)
    except ValueError as e:
        raise bad_request(f"{param}: {e}", param=param) from None


def _schema(param: str, value: Any) -> Constraint:
    """A schema given as an object, or as JSON text."""
    if isinstance(value, str):
        return _make(param, Constraint, "json_schema", value)
    if not isinstance(value, dict | bool):
        raise bad_request(f"{param}: a JSON schema must be an object", param=param)
    return _make(param, Constraint.json_schema, value)


def _response_format(fmt: Any) -> Constraint | None:
    param = "response_format"
    if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
        raise bad_request("'response_format' must be an object with a 'type'", param=param)
    kind = fmt["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint("json_object")
    if kind != "json_schema":
        raise bad_request(
            f"response_format type must be text, json_object or json_schema; got {kind!r}",
            param=param,
        )
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict):
        raise bad_request("response_format json_schema needs a 'json_schema' object", param=param)
    if not isinstance(spec.get("name", ""), str):
        raise bad_request("json_schema.name must be a string", param=param)
    if not isinstance(spec.get("strict", False), bool | None):
        raise bad_request("json_schema.strict must be a boolean", param=param)
    if "schema" not in spec:
        raise bad_request("json_schema needs a 'schema'", param=param)
    return _schema(param, spec["schema"])


def _structured_outputs(value: Any) -> Constraint:
    param = "structured_outputs"
    if not isinstance(value, dict):
        raise bad_request("'structured_outputs' must be an object", param=param)
    given = {k: v for k, v in value.items() if v not in (None, False)}
    supported = {"json", "regex", "choice", "json_object"}
    other = sorted(set(given) - supported)
    if other:
        raise bad_request(
            f"structured_outputs: {other[0]!r} is not supported "
            "(supported: json, regex, choice, json_object)",
            param=param,
        )
    if len(given) != 1:
        raise bad_request("structured_outputs needs exactly one of its kinds", param=param)
    key, v = next(iter(given.items()))
    if key == "json":
        return _schema(param, v)
    if key == "json_object":
        return Constraint("json_object")
    if key == "regex":
        return _regex(param, v)
    return _choice(param, v)


def _guided(name: str, value: Any) -> Constraint:
    if name == "guided_json":
        return _schema(name, value)
    if name == "guided_regex":
        return _regex(name, value)
    return _choice(name, value)


def _regex(param: str, value: Any) -> Constraint:
    if not isinstance(value, str):
        raise bad_request(f"{param}: the regex must be a string", param=param)
    return _make(param, Constraint, "regex", value)


def _choice(param: str, value: Any) -> Constraint:
    return _make(param, Constraint.choice, value)


def _tools(tools: Any) -> list[dict] | None:
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise bad_request(f"'tools' must be a list of at most {MAX_TOOLS} tools", param="tools")
    names = set()
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(fn, dict):
            raise bad_request(
                f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}", param="tools"
            )
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise bad_request(f"tools[{i}].function needs a 'name'", param="tools")
        if fn["name"] in names:
            raise bad_request(f"tools[{i}]: the name {fn['name']!r} is used twice", param="tools")
        names.add(fn["name"])
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise bad_request(f"tools[{i}].function.parameters must be an object", param="tools")
    return tools


def _parameters(tool: dict) -> dict:
    return tool["function"].get("parameters") or {"type": "object", "properties": {}}


def _tool_choice(
    choice: Any, tools: list[dict] | None, body: dict
) -> tuple[ToolMode | None, Constraint | None]:
    param = "tool_choice"
    if choice is None:
        if tools is None:
            return None, None
        choice = "auto"
    if choice == "none":
        return None, None
    if tools is None:
        raise bad_request("tool_choice needs 'tools'", param=param)
    if choice == "auto":
        return ToolMode(None, auto=True), None
    if choice == "required":
        items = [
            {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "enum": [t["function"]["name"]]},
                    "parameters": _parameters(t),
                },
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for t in tools
        ]
        schema: dict = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
        if body.get("parallel_tool_calls") is False:
            schema["maxItems"] = 1
        return ToolMode(None), _make(param, Constraint.json_schema, schema)
    fn = choice.get("function") if isinstance(choice, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(fn, dict):
        raise bad_request(
            "tool_choice must be 'none', 'required' or "
            "{'type': 'function', 'function': {'name': ...}}",
            param=param,
        )
    name = fn.get("name")
    tool = next((t for t in tools if t["function"]["name"] == name), None)
    if tool is None:
        raise bad_request(f"tool_choice names {name!r}, which is not in 'tools'", param=param)
    return ToolMode(name), _make(param, Constraint.json_schema, _parameters(tool))


def tool_calls_of(mode: ToolMode, text: str) -> list[dict] | None:
    """The reply's `tool_calls` for a finished output (None when the output is not a
    complete call list, e.g. cut by max_tokens)."""
    if mode.name is not None:
        return [call(mode.name, text)]
    try:
        calls = json.loads(text)
    except ValueError:
        return None
    if not isinstance(calls, list):
        return None
    return [call(c["name"], json.dumps(c["parameters"], ensure_ascii=False)) for c in calls]


def call(name: str, arguments: str, call_id: str | None = None) -> dict:
    """One entry of `tool_calls` (a fresh id unless given)."""
    return {
        "id": call_id or new_call_id(),
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]
