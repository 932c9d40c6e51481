"""Tokenization and detokenization against transformers.

transformers is the oracle only (the library code never imports it); every
check runs on the tiny Qwen-style tokenizer written into a temp folder.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import time
import unicodedata

import pytest
from tokenizers.pre_tokenizers import ByteLevel

from pipeline.models.tiny_tokenizer import (
    QWEN2_PRETOKENIZE_REGEX,
    QWEN_SPECIAL_TOKENS,
    REGULAR_VOCAB_SIZE,
    write_tiny_tokenizer,
)
from pipeline.processing.detokenize import IncrementalDetokenizer
from pipeline.processing.tokenizer import Tokenizer
from tokenizer_cases import REPO_ROOT, TEXTS, copy_checkpoint

# --- the tiny tokenizer ---------------------------------------------------------------------------


def test_tiny_tokenizer_layout(tmp_path):
    ids = write_tiny_tokenizer(tmp_path)
    assert ids["vocab_size"] == REGULAR_VOCAB_SIZE + len(QWEN_SPECIAL_TOKENS) < 512
    assert 400 <= REGULAR_VOCAB_SIZE <= 480
    assert [ids[token] for token in QWEN_SPECIAL_TOKENS] == list(range(REGULAR_VOCAB_SIZE, ids["vocab_size"]))

    tokenizer_json = json.loads((tmp_path / "tokenizer.json").read_text())
    vocab = tokenizer_json["model"]["vocab"]
    assert len(vocab) == REGULAR_VOCAB_SIZE
    assert set(ByteLevel.alphabet()) <= set(vocab)
    assert tokenizer_json["normalizer"] == {"type": "NFC"}
    split, byte_level = tokenizer_json["pre_tokenizer"]["pretokenizers"]
    assert (split["type"], split["behavior"], byte_level["type"]) == ("Split", "Isolated", "ByteLevel")
    assert (byte_level["add_prefix_space"], byte_level["use_regex"]) == (False, False)
    assert tokenizer_json["decoder"]["type"] == "ByteLevel"

    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "Qwen2Tokenizer"
    assert config["eos_token"] == "<|im_end|>"
    assert (config["pad_token"], config["bos_token"]) == ("<|endoftext|>", None)
    assert {int(k): v["content"] for k, v in config["added_tokens_decoder"].items()} == {
        ids[token]: token for token in QWEN_SPECIAL_TOKENS
    }
    generation = json.loads((tmp_path / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [ids["<|im_end|>"], ids["<|endoftext|>"]]
    assert generation["pad_token_id"] == ids["<|endoftext|>"]


def test_tiny_tokenizer_is_deterministic_and_fast(tmp_path):
    start = time.perf_counter()
    write_tiny_tokenizer(tmp_path / "a")
    assert time.perf_counter() - start < 2.0
    write_tiny_tokenizer(tmp_path / "b")
    # A second process has a different hash seed, which would expose any
    # dependence on set or dict iteration order in training.
    code = f"from pipeline.models.tiny_tokenizer import write_tiny_tokenizer as w; w({str(tmp_path / 'c')!r})"
    env = {**os.environ, "PYTHONHASHSEED": "12345", "PYTHONPATH": str(REPO_ROOT)}
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO_ROOT, env=env)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        reference = (tmp_path / "a" / name).read_bytes()
        assert (tmp_path / "b" / name).read_bytes() == reference, name
        assert (tmp_path / "c" / name).read_bytes() == reference, name


# --- tokenizer --------------------------------------------------------------------------------


def test_pretokenizer_regex_is_qwen2s(hf_tok):
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    assert QWEN2_PRETOKENIZE_REGEX == PRETOKENIZE_REGEX


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_reference(tok, hf_tok, text):
    assert tok.encode(text) == hf_tok.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("text", TEXTS)
def test_decode_matches_reference(tok, hf_tok, text):
    ids = hf_tok.encode(text, add_special_tokens=False)
    for skip in (True, False):
        assert tok.decode(ids, skip_special_tokens=skip) == hf_tok.decode(ids, skip_special_tokens=skip)
    # NFC is the only lossy step, so a round trip gives back the normalized text.
    assert tok.decode(ids, skip_special_tokens=False) == unicodedata.normalize("NFC", text)


def test_decode_of_arbitrary_ids_matches_reference(tok, hf_tok):
    # Random ids include lone UTF-8 continuation bytes and cut characters.
    rng = random.Random(0)
    for _ in range(200):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 12))]
        for skip in (True, False):
            ours = tok.decode(ids, skip_special_tokens=skip)
            assert ours == hf_tok.decode(ids, skip_special_tokens=skip), ids


def test_special_tokens_and_ids(tok, hf_tok, tokenizer_dir):
    assert tok.vocab_size == len(hf_tok)
    for token in QWEN_SPECIAL_TOKENS:
        assert tok.token_id(token) == hf_tok.convert_tokens_to_ids(token)
        assert tok.encode(f"x{token}y") == [*tok.encode("x"), tok.token_id(token), *tok.encode("y")]
    assert tok.eos_token_ids == (tok.token_id("<|im_end|>"), tok.token_id("<|endoftext|>"))
    assert tok.pad_token_id == hf_tok.pad_token_id
    assert tok.special_tokens_map == hf_tok.special_tokens_map
    with pytest.raises(ValueError, match="not in the vocabulary"):
        tok.token_id("<|no_such_token|>")


def test_eos_ids_without_generation_config(tokenizer_dir, tmp_path):
    ckpt = copy_checkpoint(tokenizer_dir, tmp_path / "ckpt")
    (ckpt / "generation_config.json").unlink()
    tok = Tokenizer.from_checkpoint(ckpt)
    assert tok.eos_token_ids == (tok.token_id("<|im_end|>"),)


def test_added_tokens_come_from_tokenizer_config_when_tokenizer_json_lacks_them(tokenizer_dir, tmp_path, hf_tok):
    ckpt = copy_checkpoint(tokenizer_dir, tmp_path / "ckpt")
    tokenizer_json = json.loads((ckpt / "tokenizer.json").read_text())
    tokenizer_json["added_tokens"] = []
    (ckpt / "tokenizer.json").write_text(json.dumps(tokenizer_json))
    tok = Tokenizer.from_checkpoint(ckpt)
    text = "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>hi<|im_end|>"
    ids = tok.encode(text)
    assert ids == hf_tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == hf_tok.decode(ids, skip_special_tokens=True) == "user\nhi"

    config = json.loads((ckpt / "tokenizer_config.json").read_text())
    decoder = config["added_tokens_decoder"]
    decoder["500"] = decoder.pop(str(tok.token_id("<|video_pad|>")))
    (ckpt / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="<\\|video_pad\\|>.* id 500"):
        Tokenizer.from_checkpoint(ckpt)


def test_loading_errors(tokenizer_dir, tmp_path):
    ckpt = copy_checkpoint(tokenizer_dir, tmp_path / "ckpt")
    (ckpt / "tokenizer.json").unlink()
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_checkpoint(ckpt)
    (ckpt / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="tokenizer.json"):
        Tokenizer.from_checkpoint(ckpt)
    shutil.copy(tokenizer_dir / "tokenizer.json", ckpt / "tokenizer.json")
    (ckpt / "tokenizer_config.json").write_text("[1, 2")
    with pytest.raises(ValueError, match="tokenizer_config.json"):
        Tokenizer.from_checkpoint(ckpt)
    config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    config["eos_token"] = "<|missing|>"
    (ckpt / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="eos_token"):
        Tokenizer.from_checkpoint(ckpt)


# --- incremental detokenizer ------------------------------------------------------------------------


class _CountingTokenizer:
    """Wraps a Tokenizer and records how many ids each decode call sees."""

    def __init__(self, inner: Tokenizer):
        self.inner, self.max_ids = inner, 0

    def decode(self, ids, skip_special_tokens=True):
        ids = list(ids)
        self.max_ids = max(self.max_ids, len(ids))
        return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)


def stream(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    return [detok.push(token_id) for token_id in ids] + [detok.flush()]


@pytest.mark.parametrize(
    "text",
    [
        "Emoji 😀👍🏽 and family 👨‍👩‍👧 then 中文字符和日本語のテキスト, done.",
        "<|im_start|>assistant\n你好😀<|im_end|>tail é",
        "plain ascii only, " * 20,
    ],
)
@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_incremental_detokenizer_streams_whole_characters(tok, hf_tok, text, skip_special_tokens):
    ids = tok.encode(text)
    counting = _CountingTokenizer(tok)
    chunks = stream(IncrementalDetokenizer(counting, skip_special_tokens=skip_special_tokens), ids)
    assert all("\ufffd" not in chunk for chunk in chunks)
    assert "".join(chunks) == hf_tok.decode(ids, skip_special_tokens=skip_special_tokens)
    # The window stays a few tokens long however long the output grows.
    assert counting.max_ids <= 12 < len(ids)


def test_incremental_detokenizer_flushes_a_cut_character(tok):
    ids = tok.encode("ok 😀")
    cut = ids[:-1]  # the emoji's last byte never arrives
    detok = IncrementalDetokenizer(tok)
    pushed = "".join(detok.push(token_id) for token_id in cut)
    assert "\ufffd" not in pushed
    tail = detok.flush()
    assert tail.endswith("\ufffd")
    assert pushed + tail == tok.decode(cut)
    assert detok.flush() == ""
