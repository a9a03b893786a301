"""The built-in `tiny` model: a small random Qwen3.5 checkpoint made on first use.

Weights come from a fixed seed, and the tokenizer is byte-level (ids 0-255 are the bytes,
256 = <bos>, 257 = <eos>, 258 = <pad>), so every command works with no download. The
checkpoint is written once into the user's cache folder (`$HYBRID_PD_CACHE`, else
`$XDG_CACHE_HOME/hybrid-pd`, else `~/.cache/hybrid-pd`).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

TINY_NAME = "tiny"
_VERSION = "tiny-qwen3.5-v1"
_SEED = 20261130
_SPECIALS = {"<bos>": 256, "<eos>": 257, "<pad>": 258}
_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def cache_root() -> Path:
    if os.environ.get("HYBRID_PD_CACHE"):
        return Path(os.environ["HYBRID_PD_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "hybrid-pd"


def resolve_model(name_or_path: str) -> Path:
    """`tiny` -> the built-in checkpoint (made if missing); anything else -> that folder."""
    if name_or_path == TINY_NAME:
        return ensure_tiny()
    path = Path(name_or_path)
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"{name_or_path} is not a checkpoint folder (no config.json)")
    return path


def ensure_folder(folder: Path, marker: str, write: Callable[[Path], None]) -> Path:
    """`folder`, made on first use: `write` fills a temporary sibling, which is then renamed
    into place (atomic: concurrent first uses keep one complete copy). A folder that holds
    the file `marker` is complete and returned as it is."""
    if (folder / marker).exists():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
    try:
        write(tmp)
        try:
            tmp.rename(folder)
        except OSError:
            if not (folder / marker).exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def ensure_tiny(root: Path | None = None) -> Path:
    return ensure_folder(
        (root or cache_root()) / _VERSION, "model.safetensors", write_tiny_checkpoint
    )


def write_tiny_checkpoint(folder: Path, overrides: dict | None = None) -> None:
    """The built-in checkpoint; `overrides` change its config.json first (other sizes)."""
    from safetensors.torch import save_file

    from hybrid_pd.engine.models.qwen3_5 import Qwen3_5ForCausalLM, tiny_qwen3_5_config

    # An untied head: with tied embeddings a random model keeps predicting its input token.
    config = {**tiny_qwen3_5_config(), "tie_word_embeddings": False, **(overrides or {})}
    with torch.device("meta"):
        model = Qwen3_5ForCausalLM(config)
    gen = torch.Generator().manual_seed(_SEED)
    tensors = {}
    for name, param in sorted(model.named_parameters()):
        tensors[name] = _init_tensor(name, tuple(param.shape), gen)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    write_byte_tokenizer(folder, (overrides or {}).get("vocab_size"))


def _init_tensor(name: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """Deterministic values; scales chosen so greedy output varies from token to token."""
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "A_log":
        return torch.log(torch.empty(shape).uniform_(1.0, 8.0, generator=gen))
    if leaf == "dt_bias":
        return torch.ones(shape)
    if len(shape) == 1:  # norm weights: (1 + w) norms start near zero, plain ones near one
        base = 1.0 if "norm" in name and "layernorm" not in name and "q_norm" not in name else 0
        return base + 0.1 * torch.randn(shape, generator=gen)
    std = 1.0 if "embed" in name else 2.0 / max(1, shape[-1]) ** 0.5
    return std * torch.randn(shape, generator=gen)


def _bytes_to_unicode() -> dict[int, str]:
    """Byte -> printable character map of byte-level BPE tokenizers."""
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars = list(keep)
    extra = 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(keep, (chr(c) for c in chars), strict=True))


def write_byte_tokenizer(folder: Path, vocab_size: int | None = None) -> None:
    """Byte-level tokenizer: ids 0-255 are bytes, then <bos> <eos> <pad>; `vocab_size`
    pads it with special <unused_N> tokens so every id a model may sample decodes."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {ch: b for b, ch in _bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True) for t in _SPECIALS])
    first = 256 + len(_SPECIALS)
    extra = [f"<unused_{i}>" for i in range(first, vocab_size or first)]
    tok.add_special_tokens([AddedToken(t, special=True) for t in extra])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": "<bos>",
                "eos_token": "<eos>",
                "pad_token": "<pad>",
                "add_bos_token": False,
                # The generic class: a model-specific one (e.g. GemmaTokenizer) would
                # rebuild the pipeline around its own pre-tokenizer.
                "tokenizer_class": "PreTrainedTokenizerFast",
                "chat_template": _CHAT_TEMPLATE,
            },
            indent=2,
        )
    )
