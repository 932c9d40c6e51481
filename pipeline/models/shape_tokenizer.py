"""A synthetic word-level tokenizer for random-weight model shapes.

No real Qwen tokenizer can be downloaded, yet a random-weight model needs one
whose special tokens sit at the real ids (the model config names them) and
that can decode ANY id of the embedding table, since random weights sample
arbitrary ids. So every id in [0, vocab) is a vocabulary entry: the specials
at their real ids, a few hundred common words (the ones epd-bench's random
prompts and the chat template use, so text costs about one token per word),
and "w<id>" filler for the rest. Text splits on whitespace and punctuation;
an unknown word becomes <unk> (id 0). With no decoder, the tokenizers
library joins tokens with single spaces, so every regular id decodes to
non-empty text and a stream never holds back a half character.
"""

from __future__ import annotations

import json
import string
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, pre_tokenizers
from tokenizers.models import WordLevel

from pipeline.prompt_words import WORDS
from pipeline.models.tiny_tokenizer import QWEN2_VL_CHAT_TEMPLATE, _tokenizer_config

UNKNOWN = "<unk>"
# Words of the default system prompt and of the chat roles.
_TEMPLATE_WORDS = ("system", "user", "assistant", "You", "are", "a", "helpful", "Picture", "Video")
_EXTRA_WORDS = ("image", "picture", "describe", "Describe", "what", "What", "in", "this", "is", "the")


def _regular_words() -> list[str]:
    """Word entries in a fixed order, without duplicates."""
    words = [UNKNOWN, *string.punctuation, *string.digits, *string.ascii_letters,
             *WORDS, *_TEMPLATE_WORDS, *_EXTRA_WORDS]
    return list(dict.fromkeys(words))


def build_vocab(special_ids: dict[str, int], vocab_size: int) -> dict[str, int]:
    """token -> id covering every id in [0, vocab_size) exactly once."""
    taken = set(special_ids.values())
    if len(taken) != len(special_ids) or not all(0 <= i < vocab_size for i in taken):
        raise ValueError(f"special token ids must be distinct and below the vocabulary size {vocab_size}")
    free_ids = [i for i in range(vocab_size) if i not in taken]
    words = _regular_words()
    vocab = dict(zip(words, free_ids))
    vocab.update((f"w{token_id}", token_id) for token_id in free_ids[len(words):])
    vocab.update(special_ids)
    if len(vocab) != vocab_size:
        raise ValueError(f"vocabulary of {vocab_size} ids is too small for the words and specials")
    return vocab


def build_tokenizer(special_ids: dict[str, int], vocab_size: int) -> Tokenizer:
    tokenizer = Tokenizer(WordLevel(build_vocab(special_ids, vocab_size), unk_token=UNKNOWN))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    # Already in the vocabulary, so they keep their ids; adding them makes the
    # splitter cut them out of text before the pre-tokenizer sees it.
    tokenizer.add_special_tokens(
        [AddedToken(token, special=True, normalized=False) for token in special_ids])
    return tokenizer


def write_shape_tokenizer(out_dir: Path, special_ids: dict[str, int], vocab_size: int,
                          eos_token: str = "<|im_end|>", pad_token: str = "<|endoftext|>",
                          chat_template: str = QWEN2_VL_CHAT_TEMPLATE) -> None:
    """tokenizer.json, tokenizer_config.json, chat_template.jinja and
    generation_config.json in the layout of a Qwen-VL-Instruct checkpoint."""
    out_dir = Path(out_dir)
    tokenizer = build_tokenizer(special_ids, vocab_size)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    config = _tokenizer_config(special_ids)
    config.update(eos_token=eos_token, pad_token=pad_token)
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out_dir / "chat_template.jinja").write_text(chat_template, encoding="utf-8")
    eos, pad = special_ids[eos_token], special_ids[pad_token]
    generation = {"bos_token_id": pad, "eos_token_id": [eos, pad], "pad_token_id": pad}
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
