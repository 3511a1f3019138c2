"""Tokenizers: a checkpoint's `tokenizer.json`, the byte-level tokenizer of the built-in model, and
incremental detokenization for streaming output."""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from collections.abc import Sequence
from pathlib import Path

from common.model.registry import resolve_model

__all__ = [
    "Tokenizer",
    "HFTokenizer",
    "ByteTokenizer",
    "IncrementalDetokenizer",
    "load_tokenizer",
]


class Tokenizer(ABC):
    """Text <-> token ids.

    `vocab_size` counts the tokenizer's own ids (special tokens included); a model's embedding
    table may be padded beyond it.
    """

    @abstractmethod
    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; special-token names in the text become their ids.

        add_special_tokens=False leaves out what the tokenizer's post-processor would add (a
        BOS, say): a rendered chat template has written its special tokens already.
        """

    @abstractmethod
    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """Text of `ids`; invalid or incomplete UTF-8 becomes U+FFFD."""

    @property
    @abstractmethod
    def vocab_size(self) -> int: ...

    @property
    @abstractmethod
    def eos_token_ids(self) -> tuple[int, ...]:
        """Tokens that end generation (empty when the checkpoint names none)."""

    @property
    @abstractmethod
    def bos_token_id(self) -> int | None: ...


class ByteTokenizer(Tokenizer):
    """The built-in model's tokenizer: ids 0..255 are the UTF-8 bytes, then four special tokens.

    encode never adds BOS/EOS itself, like the Qwen tokenizers, so prompts look the same to the
    engine whichever tokenizer serves them.
    """

    EOS_TOKEN_ID = 256
    MASK_TOKEN_ID = 257  # reserved for the speculative draft's mask token
    BOS_TOKEN_ID = 258
    PAD_TOKEN_ID = 259
    SPECIAL_TOKENS = {
        EOS_TOKEN_ID: "<|endoftext|>",
        MASK_TOKEN_ID: "<|mask|>",
        BOS_TOKEN_ID: "<|bos|>",
        PAD_TOKEN_ID: "<|pad|>",
    }
    _SPECIAL_IDS = {name: i for i, name in SPECIAL_TOKENS.items()}
    _SPECIAL_RE = re.compile("(" + "|".join(re.escape(n) for n in SPECIAL_TOKENS.values()) + ")")

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        ids: list[int] = []
        # Splitting on the names mirrors how `tokenizers` treats added special tokens, so a
        # prompt containing "<|endoftext|>" means the same to both tokenizer kinds.
        for piece in self._SPECIAL_RE.split(text):
            special = self._SPECIAL_IDS.get(piece)
            if special is not None:
                ids.append(special)
            else:
                ids.extend(piece.encode("utf-8"))
        return ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        parts: list[str] = []
        run = bytearray()
        for i in ids:
            i = int(i)
            if 0 <= i < 256:
                run.append(i)
                continue
            if i not in self.SPECIAL_TOKENS:
                raise ValueError(f"token id {i} is outside the vocabulary of {self.vocab_size}")
            if skip_special_tokens:
                # Skipped tokens do not break a byte run: the bytes on either side decode as
                # if the special token were absent, as in `tokenizers`.
                continue
            parts.append(run.decode("utf-8", errors="replace"))
            run.clear()
            parts.append(self.SPECIAL_TOKENS[i])
        parts.append(run.decode("utf-8", errors="replace"))
        return "".join(parts)

    @property
    def vocab_size(self) -> int:
        return 256 + len(self.SPECIAL_TOKENS)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return (self.EOS_TOKEN_ID,)

    @property
    def bos_token_id(self) -> int | None:
        return self.BOS_TOKEN_ID


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    with path.open(encoding="utf-8") as f:
        data = json.load(f)
    return data if isinstance(data, dict) else {}


def _as_id_list(value: object) -> list[int]:
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def token_content(value: object) -> str | None:
    """A special token's text: tokenizer_config.json stores it as a string or an AddedToken
    dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


class HFTokenizer(Tokenizer):
    """A checkpoint's `tokenizer.json`, through the `tokenizers` library.

    encode passes add_special_tokens=True, which adds nothing of our own: the tokenizer's
    post-processor decides (Qwen's adds no BOS; a Llama-style one adds its BOS). That is what
    `transformers` does by default, so token ids match the model's training and the HF oracle.

    eos_token_ids is the union, in this order, of tokenizer_config.json's `eos_token` and the
    `eos_token_id` of generation_config.json and config.json (or its `text_config`): chat models
    end turns with a token that only some of these files name.
    """

    def __init__(self, path: str | Path) -> None:
        from tokenizers import Tokenizer as _RawTokenizer

        path = Path(path)
        directory = path.parent if path.is_file() else path
        tokenizer_file = path if path.is_file() else path / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise ValueError(f"no tokenizer.json at {path}")
        self._tok = _RawTokenizer.from_file(str(tokenizer_file))

        tok_cfg = _read_json(directory / "tokenizer_config.json")
        gen_cfg = _read_json(directory / "generation_config.json")
        model_cfg = _read_json(directory / "config.json")
        text_cfg = model_cfg.get("text_config")
        text_cfg = text_cfg if isinstance(text_cfg, dict) else {}

        eos: list[int] = []
        name = token_content(tok_cfg.get("eos_token"))
        if name is not None and self._tok.token_to_id(name) is not None:
            eos.append(self._tok.token_to_id(name))
        for cfg in (gen_cfg, model_cfg, text_cfg):
            eos.extend(_as_id_list(cfg.get("eos_token_id")))
        self._eos = tuple(dict.fromkeys(eos))

        bos: int | None = None
        name = token_content(tok_cfg.get("bos_token"))
        if name is not None:
            bos = self._tok.token_to_id(name)
        for cfg in (gen_cfg, model_cfg, text_cfg):
            if bos is None:
                ids = _as_id_list(cfg.get("bos_token_id"))
                bos = ids[0] if ids else None
        self._bos = bos

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._eos

    @property
    def bos_token_id(self) -> int | None:
        return self._bos


class IncrementalDetokenizer:
    """Turns a stream of token ids into a stream of final text.

    Uses the prefix-offset / read-offset scheme of vLLM and TGI: decode a short window of recent
    ids twice, with and without the ids not yet emitted, and emit the difference. Decoding a window
    rather than each token alone keeps context-dependent decoders (leading-space handling) right,
    and output is held back while the window's text ends in U+FFFD, since that usually means a
    UTF-8 character whose remaining bytes are still to come.

    prompt_ids, when given, serve only as context for the first tokens; their text is not emitted.
    Without a prompt, the concatenation of all pushes and `flush` equals
    `tokenizer.decode(all pushed ids)`.
    """

    # Context the vLLM detokenizer takes from the end of the prompt.
    _PROMPT_CONTEXT = 5

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        prompt_ids: Sequence[int] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = [int(i) for i in prompt_ids]
        self._read = len(self._ids)
        self._prefix = max(self._read - self._PROMPT_CONTEXT, 0)

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip)

    def push(self, token_id: int) -> str:
        """Add one token; return the text that became final (possibly empty)."""
        self._ids.append(int(token_id))
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        new_text = self._decode(self._ids[self._prefix :])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            self._prefix = self._read
            self._read = len(self._ids)
            return new_text[len(prefix_text) :]
        return ""

    def flush(self) -> str:
        """Return whatever is still held back (incomplete UTF-8 comes out as U+FFFD)."""
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        new_text = self._decode(self._ids[self._prefix :])
        self._prefix = self._read
        self._read = len(self._ids)
        return new_text[len(prefix_text) :]


class TokenIdsOnly(Tokenizer):
    """For a checkpoint that ships no tokenizer: requests must bring token ids, and outputs carry
    token ids with empty text. ``encode`` says so instead of guessing a vocabulary."""

    def __init__(self, path: str) -> None:
        self.path = path

    @property
    def vocab_size(self) -> int:
        return 0

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return ()

    @property
    def bos_token_id(self) -> int | None:
        return None

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        raise ValueError(f"model {self.path!r} has no tokenizer.json: send token ids, not text")

    def decode(self, ids, *, skip_special_tokens: bool = True) -> str:
        return ""


def load_tokenizer(model_path_or_name: str, *, allow_missing: bool = False) -> Tokenizer:
    """"tiny" -> the built-in ByteTokenizer; a directory with tokenizer.json (or a built-in
    checkpoint's name) -> HFTokenizer; a checkpoint directory without one ->
    :class:`TokenIdsOnly` if ``allow_missing``."""
    if model_path_or_name == "tiny":
        return ByteTokenizer()
    model_path_or_name = resolve_model(model_path_or_name)
    path = Path(model_path_or_name)
    if path.is_dir() and (path / "tokenizer.json").is_file():
        return HFTokenizer(path)
    if path.is_dir() and allow_missing:
        return TokenIdsOnly(model_path_or_name)
    if path.is_dir():
        raise ValueError(f"{model_path_or_name!r} is a directory without a tokenizer.json")
    raise ValueError(
        f"cannot load a tokenizer for {model_path_or_name!r}: expected 'tiny' or a checkpoint "
        "directory containing tokenizer.json"
    )
