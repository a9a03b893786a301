"""Incremental detokenization with stop strings, for streamed and whole responses.

The text sent so far is always a prefix of the final text, which equals the engine's own
(`decode(output ids)` cut at the first stop string): a trailing incomplete UTF-8 sequence
and any tail that could begin a stop string are held back until the next tokens decide.
"""

from __future__ import annotations

_REPLACEMENT = "\ufffd"


class TextStream:
    def __init__(self, tokenizer, stop: tuple[str, ...] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(s for s in stop if s)
        self.token_ids: list[int] = []
        self.sent = 0  # characters of the text already handed out
        self.stopped = False  # a stop string was found: the text is final

    def push(self, ids: list[int]) -> str:
        """Add tokens; returns the new text that is safe to send."""
        self.token_ids += ids
        if self.tokenizer is None or self.stopped:
            return ""
        text = self.tokenizer.decode(self.token_ids)
        cut = self._find_stop(text)
        if cut is not None:
            self.stopped = True
            return self._take(text[:cut], cut)
        hold = len(text) - len(text.rstrip(_REPLACEMENT))
        for s in self.stop:
            for k in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:k]):
                    hold = max(hold, k)
                    break
        return self._take(text, len(text) - hold)

    def flush(self) -> str:
        """The request ended without a stop string: everything left."""
        if self.tokenizer is None or self.stopped:
            return ""
        text = self.tokenizer.decode(self.token_ids)
        return self._take(text, len(text))

    def _find_stop(self, text: str) -> int | None:
        hits = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        return min(hits) if hits else None

    def _take(self, text: str, upto: int) -> str:
        if upto <= self.sent:
            return ""
        out = text[self.sent : upto]
        self.sent = upto
        return out
