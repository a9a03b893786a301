"""Tool calls the model chose to make (tool_choice "auto"), in the Hermes format the Qwen3,
Qwen3.5 and Qwen3-Next chat templates teach:

    some text<tool_call>
    {"name": "get_weather", "arguments": {"city": "Oslo"}}
    </tool_call>

The text before the first `<tool_call>` is the reply's content; each well-formed block is
one call. A block that does not parse stays in the content (nothing is dropped). Nothing
constrains the output here: the model decides whether and what to call.
"""

from __future__ import annotations

import json
import re

from hybrid_pd.proxy.structured import call

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)(?:" + re.escape(CLOSE) + r"|\Z)", re.DOTALL)


def parse_calls(text: str) -> tuple[str | None, list[dict]]:
    """(content, tool calls) of a finished output; content None when only calls remain."""
    start = text.find(OPEN)
    if start < 0:
        return text, []
    calls, bad = [], []
    for m in _BLOCK.finditer(text, start):
        parsed = _one(m.group(1))
        if parsed is None:
            bad.append(m.group(0))
        else:
            calls.append(parsed)
    if not calls:
        return text, []
    content = text[:start] + "".join(bad)
    return (content if content.strip() else None), calls


def _one(block: str) -> dict | None:
    try:
        obj = json.loads(block.strip())
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", {})
    if isinstance(args, str):  # some models write the arguments as a JSON string
        return call(obj["name"], args)
    return call(obj["name"], json.dumps(args, ensure_ascii=False))


class HermesStream:
    """One streamed choice: content passes through until a `<tool_call>` may begin; from
    there the text is held and parsed when the output ends."""

    def __init__(self) -> None:
        self._held = ""  # text not sent: a possible start of OPEN, or everything after it
        self._calling = False

    def push(self, text: str) -> str:
        """Content that can be sent now."""
        self._held += text
        if self._calling:
            return ""
        at = self._held.find(OPEN)
        if at >= 0:
            self._calling = True
            out, self._held = self._held[:at], self._held[at:]
            return out
        keep = _partial_suffix(self._held, OPEN)
        cut = len(self._held) - keep
        out, self._held = self._held[:cut], self._held[cut:]
        return out

    def finish(self) -> tuple[str, list[dict]]:
        """(the rest of the content, the calls) once the output ended."""
        held, self._held = self._held, ""
        if not self._calling:
            return held, []
        _, calls = parse_calls(held)
        if not calls:
            return held, []
        rest = "".join(m.group(0) for m in _BLOCK.finditer(held) if _one(m.group(1)) is None)
        return rest, calls


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper start of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
