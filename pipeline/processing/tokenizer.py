"""Text <-> token ids for a Hugging Face checkpoint, without transformers.

The backend is the `tokenizers` library loaded from `tokenizer.json`; the
named special tokens and end-of-sequence ids come from `tokenizer_config.json`
and `generation_config.json`, read the way transformers reads them.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from tokenizers import AddedToken
from tokenizers import Tokenizer as BackendTokenizer

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
GENERATION_CONFIG_FILE = "generation_config.json"

# The named special tokens transformers exposes to chat templates
# (`special_tokens_map`); extra special tokens are not among them.
NAMED_SPECIAL_TOKENS = (
    "bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token"
)


def read_json_file(path: Path, *, required: bool) -> dict[str, Any]:
    """Read a JSON object from `path`; a missing optional file reads as {}."""
    if not path.is_file():
        if required:
            raise FileNotFoundError(f"{path} not found")
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def read_tokenizer_config(model_dir: Path) -> dict[str, Any]:
    # transformers loads a checkpoint without tokenizer_config.json (all
    # defaults), so a missing file is not an error here either.
    return read_json_file(Path(model_dir) / TOKENIZER_CONFIG_FILE, required=False)


def _token_content(value: Any, field: str, config_path: Path) -> str | None:
    # Older configs store tokens as serialized AddedToken dicts.
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    raise ValueError(f"{config_path}: {field} must be a string, null or an AddedToken dict, got {value!r}")


def named_special_tokens(config: Mapping[str, Any], config_path: Path) -> dict[str, str]:
    """The named special tokens (bos_token, eos_token, ...) that are set, as strings."""
    tokens = {}
    for field in NAMED_SPECIAL_TOKENS:
        content = _token_content(config.get(field), field, config_path)
        if content is not None:
            tokens[field] = content
    return tokens


def _load_backend(model_dir: Path) -> BackendTokenizer:
    path = model_dir / TOKENIZER_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} not found: the checkpoint needs a fast-tokenizer file (tokenizer.json); "
            "slow-tokenizer files (vocab.json/merges.txt, *.model) are not supported"
        )
    try:
        return BackendTokenizer.from_file(str(path))
    except Exception as exc:  # the Rust loader raises a bare Exception on any parse error
        raise ValueError(f"{path} is not a valid tokenizers file: {exc}") from exc


_ADDED_TOKEN_FLAGS = ("single_word", "lstrip", "rstrip", "normalized", "special")


def _sync_added_tokens(backend: BackendTokenizer, config: Mapping[str, Any], config_path: Path) -> None:
    # transformers adds the tokens of `added_tokens_decoder` that tokenizer.json
    # lacks; an id that disagrees with tokenizer.json means the files don't match.
    decoder = config.get("added_tokens_decoder") or {}
    for raw_id, spec in sorted(decoder.items(), key=lambda item: int(item[0])):
        if not isinstance(spec, Mapping) or not isinstance(spec.get("content"), str):
            raise ValueError(
                f"{config_path}: added_tokens_decoder[{raw_id}] must be an AddedToken dict, got {spec!r}"
            )
        token_id, content = int(raw_id), spec["content"]
        existing = backend.token_to_id(content)
        if existing is None:
            flags = {key: spec[key] for key in _ADDED_TOKEN_FLAGS if key in spec}
            backend.add_tokens([AddedToken(content, **flags)])
            existing = backend.token_to_id(content)
        if existing != token_id:
            raise ValueError(
                f"{config_path}: added token {content!r} has id {token_id}, "
                f"but tokenizer.json gives it id {existing}"
            )


def _eos_ids_from_generation_config(model_dir: Path) -> list[int]:
    path = model_dir / GENERATION_CONFIG_FILE
    eos = read_json_file(path, required=False).get("eos_token_id")
    if eos is None:
        return []
    ids = eos if isinstance(eos, list) else [eos]
    if not all(isinstance(token_id, int) and not isinstance(token_id, bool) for token_id in ids):
        raise ValueError(f"{path}: eos_token_id must be an int or a list of ints, got {eos!r}")
    return ids


class Tokenizer:
    """Encodes and decodes text for one checkpoint; immutable after loading.

    `encode` adds no special tokens of its own (these checkpoints' tokenizers
    add no BOS or EOS), and special-token strings inside the text become
    their single ids, as in transformers.
    """

    def __init__(
        self, backend: BackendTokenizer, special_tokens: Mapping[str, str], eos_token_ids: Iterable[int]
    ):
        self._backend = backend
        self._special_tokens = dict(special_tokens)
        self._eos_token_ids = tuple(dict.fromkeys(eos_token_ids))  # ordered, no duplicates

    @classmethod
    def from_checkpoint(cls, model_dir: str | Path) -> Tokenizer:
        model_dir = Path(model_dir)
        config_path = model_dir / TOKENIZER_CONFIG_FILE
        config = read_tokenizer_config(model_dir)
        backend = _load_backend(model_dir)
        _sync_added_tokens(backend, config, config_path)
        # transformers ignores this flag for BPE models (it would strip real
        # spaces before punctuation) and we only decode BPE models.
        if config.get("clean_up_tokenization_spaces") and type(backend.model).__name__ != "BPE":
            raise ValueError(
                f"{config_path}: clean_up_tokenization_spaces=true is only supported for BPE models"
            )
        backend.encode_special_tokens = bool(config.get("split_special_tokens", False))

        special_tokens = named_special_tokens(config, config_path)
        for field, content in special_tokens.items():
            if backend.token_to_id(content) is None:
                raise ValueError(f"{config_path}: {field} {content!r} is not in the vocabulary")
        eos_ids = _eos_ids_from_generation_config(model_dir)
        if "eos_token" in special_tokens:
            eos_ids.append(backend.token_to_id(special_tokens["eos_token"]))
        return cls(backend, special_tokens, eos_ids)

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included (transformers' `len(tokenizer)`)."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Ids that end generation: generation_config's eos ids, then the tokenizer's eos."""
        return self._eos_token_ids

    @property
    def pad_token_id(self) -> int | None:
        pad = self._special_tokens.get("pad_token")
        return None if pad is None else self.token_id(pad)

    @property
    def special_tokens_map(self) -> dict[str, str]:
        """Named special tokens that are set (bos_token, eos_token, ...), as chat templates see them."""
        return dict(self._special_tokens)

    def added_tokens(self) -> dict[str, tuple[int, bool]]:
        """Each added token's text -> (its id, whether it is special)."""
        return {token.content: (token_id, token.special)
                for token_id, token in self._backend.get_added_tokens_decoder().items()}

    def to_json(self) -> str:
        """The tokenizer as tokenizer.json holds it (for the grammar matchers)."""
        return self._backend.to_str()

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """The text's ids; with add_special_tokens, those the tokenizer's post-processor
        adds around it (a BOS, say; many add none)."""
        if not isinstance(text, str):
            raise TypeError(f"encode expects a str, got {type(text).__name__}")
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """The string of one token (a special token's name, e.g. a placeholder)."""
        text = self._backend.id_to_token(token_id)
        if text is None:
            raise ValueError(f"token id {token_id} is not in the vocabulary")
        return text

    def token_id(self, token: str) -> int:
        token_id = self._backend.token_to_id(token)
        if token_id is None:
            raise ValueError(f"token {token!r} is not in the vocabulary")
        return token_id
