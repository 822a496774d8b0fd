"""The model's own tokenizer (`tokenizer.json` through `tokenizers`) and a streaming detokenizer.

Special tokens (bos, eos, pad, ...) are named in `tokenizer_config.json`, either as strings or as
AddedToken objects; chat templates see them as variables, so we read them the way transformers does.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

# The named special tokens transformers exposes to chat templates (`special_tokens_map`), in its order.
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")

REPLACEMENT_CHAR = "\ufffd"   # what a byte-level decoder yields for an incomplete UTF-8 sequence


class TokenizerError(ValueError):
    """A tokenizer folder we cannot use; the message names the file and the cause."""


def _token_content(value) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken dict."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def read_tokenizer_config(folder: Path) -> dict:
    path = Path(folder) / "tokenizer_config.json"
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TokenizerError(f"{path}: not readable JSON ({exc})") from exc
    if not isinstance(config, dict):
        raise TokenizerError(f"{path}: expected a JSON object, got {type(config).__name__}")
    return config


def special_tokens_map(config: dict) -> dict[str, str]:
    """{"bos_token": "<s>", ...} for the named special tokens that are set, as transformers' special_tokens_map."""
    tokens = {}
    for name in SPECIAL_TOKEN_NAMES:
        content = _token_content(config.get(name))
        if content is not None:
            tokens[name] = content
    return tokens


@dataclass(frozen=True)
class Tokenizer:
    """Encode and decode text with a model's tokenizer.json; knows the model's named special tokens."""

    backend: "tokenizers.Tokenizer"   # noqa: F821 (imported lazily)
    special_tokens: dict[str, str]    # bos_token/eos_token/... -> token text
    clean_up_tokenization_spaces: bool = False

    @classmethod
    def from_dir(cls, folder: str | Path) -> "Tokenizer":
        from tokenizers import AddedToken
        from tokenizers import Tokenizer as Backend

        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise TokenizerError(f"{folder}: no tokenizer.json (FreeToken needs a fast tokenizer file)")
        try:
            backend = Backend.from_file(str(path))
        except Exception as exc:   # tokenizers raises a bare Exception on malformed files
            raise TokenizerError(f"{path}: not a tokenizer the `tokenizers` library can load ({exc})") from exc
        config = read_tokenizer_config(folder)
        # Tokens that tokenizer_config.json declares but tokenizer.json lacks (older exports) are added as
        # transformers adds them, so that ids agree.
        missing = []
        for id_text, spec in sorted((config.get("added_tokens_decoder") or {}).items(), key=lambda kv: int(kv[0])):
            content = _token_content(spec)
            if content is not None and backend.token_to_id(content) is None:
                missing.append(AddedToken(content, special=bool(spec.get("special", True)),
                                          normalized=bool(spec.get("normalized", False)),
                                          lstrip=bool(spec.get("lstrip", False)), rstrip=bool(spec.get("rstrip", False)),
                                          single_word=bool(spec.get("single_word", False))))
        if missing:
            backend.add_tokens(missing)
        return cls(backend=backend, special_tokens=special_tokens_map(config),
                   clean_up_tokenization_spaces=bool(config.get("clean_up_tokenization_spaces", False)))

    # ---- ids -------------------------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(int(token_id))

    def special_id(self, name: str) -> int | None:
        """Id of a named special token, e.g. special_id("eos_token"); None when the model has none."""
        text = self.special_tokens.get(name)
        return None if text is None else self.backend.token_to_id(text)

    @property
    def bos_token_id(self) -> int | None:
        return self.special_id("bos_token")

    @property
    def eos_token_id(self) -> int | None:
        return self.special_id("eos_token")

    @property
    def added_tokens(self) -> dict[int, str]:
        """id -> text of every added token (special tokens and markers such as <think>)."""
        return {i: tok.content for i, tok in self.backend.get_added_tokens_decoder().items()}

    # ---- text ------------------------------------------------------------------------------------------

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """Text -> ids. Off by default: chat templates write BOS themselves (as apply_chat_template encodes)."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = False) -> str:
        text = self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)
        return clean_up_tokenization(text) if self.clean_up_tokenization_spaces else text


def clean_up_tokenization(text: str) -> str:
    """transformers' `clean_up_tokenization`, for the old tokenizers whose config asks for it."""
    for before, after in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                          (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(before, after)
    return text


class StreamDecoder:
    """Turns a stream of token ids into text deltas that never split a character.

    Byte-level BPE tokens can end in the middle of a UTF-8 sequence (an emoji is often 2-4 tokens),
    and some decoders (SentencePiece's metaspace) change a token's text depending on what precedes it.
    So each push decodes a short window of recent tokens twice -- with and without the new ones -- and
    emits the difference once it no longer ends in an incomplete character (U+FFFD). This is the
    prefix/read-offset scheme of transformers' TextStreamer and vLLM's incremental detokenizer.
    """

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = False):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._ids: list[int] = []
        self._prefix_offset = 0   # start of the context window
        self._read_offset = 0     # tokens before this have been emitted

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes ("" while a character is still incomplete)."""
        self._ids.append(int(token_id))
        return self._advance(final=False)

    def push_many(self, token_ids: Iterable[int]) -> str:
        return "".join(self.push(t) for t in token_ids)

    def flush(self) -> str:
        """At the end of the stream: whatever is left, incomplete characters shown as U+FFFD."""
        return self._advance(final=True)

    def _advance(self, *, final: bool) -> str:
        if self._read_offset >= len(self._ids):
            return ""
        before = self._decode(self._ids[self._prefix_offset:self._read_offset])
        after = self._decode(self._ids[self._prefix_offset:])
        if not final and (len(after) <= len(before) or after.endswith(REPLACEMENT_CHAR)):
            return ""   # nothing new yet, or the last character is still incomplete
        # The window's decode normally extends the previous one; if a decoder rewrote the start,
        # fall back to what is new past the common prefix.
        delta = after[len(before):] if after.startswith(before) else after[_common_prefix(before, after):]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return delta


def _common_prefix(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
