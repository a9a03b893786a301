"""Tokenizer: `tokenizer.json` through the `tokenizers` library, chat template if present."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

_REPLACEMENT = "\ufffd"


class Tokenizer:
    def __init__(self, folder: str | Path) -> None:
        from tokenizers import Tokenizer as _Tok

        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.exists():
            raise FileNotFoundError(f"{folder} has no tokenizer.json")
        self._tok = _Tok.from_file(str(path))
        cfg_path = folder / "tokenizer_config.json"
        cfg: dict[str, Any] = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
        self.chat_template: str | None = cfg.get("chat_template")
        self.bos_token = _token_text(cfg.get("bos_token"))
        self.eos_token = _token_text(cfg.get("eos_token"))
        self.eos_token_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        self.add_bos = bool(cfg.get("add_bos_token", False))
        self._max_token_chars: int | None = None

    @property
    def max_token_chars(self) -> int:
        """An upper bound on the characters one token stands for (its vocabulary entry's
        length, plus one for a word-start marker): a text of c characters encodes to at
        least c / max_token_chars tokens (for tokenizers that do not delete text)."""
        if self._max_token_chars is None:
            vocab = self._tok.get_vocab(with_added_tokens=True)
            self._max_token_chars = max(map(len, vocab), default=1) + 1
        return self._max_token_chars

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def to_json(self) -> str:
        """The tokenizer as `tokenizer.json` text (what the grammar library reads)."""
        return self._tok.to_str()

    def encode(self, text: str) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if self.add_bos and self.bos_token:
            bos = self._tok.token_to_id(self.bos_token)
            if bos is not None:
                ids = [bos, *ids]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """One token as text for logprobs: decoded when it decodes on its own, else its
        vocabulary entry (a piece of a multi-byte character), else `<token N>`."""
        text = self._tok.decode([token_id], skip_special_tokens=False)
        if text and _REPLACEMENT not in text:
            return text
        return self._tok.id_to_token(token_id) or f"<token {token_id}>"

    def apply_chat_template(
        self, messages: list[dict[str, Any]], tools: list[dict] | None = None
    ) -> str:
        """Render chat messages to a prompt string (with the generation prompt appended);
        `tools`: the declared tools, for templates that describe them to the model."""
        for m in messages:
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise ValueError("each message needs a 'role' and a 'content'")
        if not self.chat_template:
            text = "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages)
            return text + "<|assistant|>\n"
        import jinja2

        env = jinja2.Environment(autoescape=False, trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        return env.from_string(self.chat_template).render(
            messages=messages,
            add_generation_prompt=True,
            tools=tools,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
        )


def _raise(message: str):
    raise ValueError(message)


def _token_text(tok: Any) -> str | None:
    if isinstance(tok, dict):
        return tok.get("content")
    return tok
