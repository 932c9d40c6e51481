"""Prompt rendering, tokenization and detokenization against transformers.

transformers is the oracle only (the library code never imports it); every
check runs on the tiny Qwen-style tokenizer written into a temp folder.
"""

from __future__ import annotations

import copy
import json
import os
import random
import shutil
import subprocess
import sys
import time
import unicodedata
from pathlib import Path

import jinja2
import pytest
from tokenizers.pre_tokenizers import ByteLevel

from pipeline.models.tiny_tokenizer import (
    QWEN2_PRETOKENIZE_REGEX,
    QWEN_SPECIAL_TOKENS,
    REGULAR_VOCAB_SIZE,
    write_tiny_tokenizer,
)
from pipeline.processing.chat_template import ChatTemplate
from pipeline.processing.detokenize import IncrementalDetokenizer
from pipeline.processing.prompt import build_prompt_ids, expand_image_placeholders
from pipeline.processing.tokenizer import Tokenizer

REPO_ROOT = Path(__file__).resolve().parents[1]
IMAGE_PAD = "<|image_pad|>"

TEXTS = [
    "",
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "   leading and trailing spaces   ",
    "tabs\tand\nnew\r\nlines\n\n\n  indented\n",
    "multiple     spaces\u3000ideographic space",
    "digits 0123456789 and 3.14159, 1,000,000 and 2024-11-29",
    "contractions: it's, I'M, we'll, they've, you'd, she's, DON'T",
    "punctuation!!! ??? ... --- ((([[{}]]))) #@%&*",
    "unicode: café, naïve, Zürich, Ελληνικά, русский, עברית, العربية",
    "decomposed e\u0301 vs composed \u00e9 (NFC)",
    "CJK: 你好，世界！こんにちは 안녕하세요",
    "emoji: 😀 👍🏽 👨‍👩‍👧 🇯🇵",
    "code: def f(x):\n    return x ** 2  # comment\n",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more<|image_pad|><|image_pad|>end",
    "almost special <|im_start| and <im_end|> and <|unknown|>",
    "a<|vision_start|><|image_pad|><|vision_end|>b",
]

IMAGE_URL = {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}
TEXT_ONLY = [{"role": "user", "content": "Describe a sunny day."}]
ONE_IMAGE = [
    {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is in this picture?"}]}
]
TWO_IMAGES = [
    {
        "role": "user",
        "content": [
            {"type": "text", "text": "Compare "},
            {"type": "image"},
            {"type": "text", "text": " with "},
            {"type": "image"},
            {"type": "text", "text": "."},
        ],
    }
]
WITH_SYSTEM = [
    {"role": "system", "content": "You answer in one word."},
    {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Animal?"}]},
]
MULTI_TURN = [
    {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]},
    {"role": "assistant", "content": "A cat sitting on a mat."},
    {"role": "user", "content": [{"type": "text", "text": "And this one?"}, {"type": "image"}]},
    {"role": "assistant", "content": [{"type": "text", "text": "A dog. 🐶"}]},
    {"role": "user", "content": "Which is bigger?"},
]
CONVERSATIONS = {
    "text_only": TEXT_ONLY,
    "one_image": ONE_IMAGE,
    "two_images": TWO_IMAGES,
    "system": WITH_SYSTEM,
    "multi_turn": MULTI_TURN,
}


def as_openai(messages: list[dict]) -> list[dict]:
    """The same conversation with OpenAI image_url parts in place of {"type": "image"}."""
    out = copy.deepcopy(messages)
    for message in out:
        if isinstance(message["content"], list):
            parts = message["content"]
            message["content"] = [IMAGE_URL if part.get("type") == "image" else part for part in parts]
    return out


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny_tokenizer")
    write_tiny_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def hf_tok(model_dir):
    os.environ["HF_HUB_OFFLINE"] = "1"
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(model_dir))


@pytest.fixture(scope="module")
def tok(model_dir) -> Tokenizer:
    return Tokenizer.from_checkpoint(model_dir)


@pytest.fixture(scope="module")
def template(model_dir) -> ChatTemplate:
    return ChatTemplate.from_checkpoint(model_dir)


def copy_checkpoint(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


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


def test_special_tokens_and_ids(tok, hf_tok, model_dir):
    assert tok.vocab_size == len(hf_tok)
    for token in QWEN_SPECIAL_TOKENS:
        assert tok.token_id(token) == hf_tok.convert_tokens_to_ids(token)
        assert tok.encode(f"x{token}y") == [*tok.encode("x"), tok.token_id(token), *tok.encode("y")]
    assert tok.eos_token_ids == (tok.token_id("<|im_end|>"), tok.token_id("<|endoftext|>"))
    assert tok.pad_token_id == hf_tok.pad_token_id
    assert tok.special_tokens_map == hf_tok.special_tokens_map
    with pytest.raises(ValueError, match="not in the vocabulary"):
        tok.token_id("<|no_such_token|>")


def test_eos_ids_without_generation_config(model_dir, tmp_path):
    ckpt = copy_checkpoint(model_dir, tmp_path / "ckpt")
    (ckpt / "generation_config.json").unlink()
    tok = Tokenizer.from_checkpoint(ckpt)
    assert tok.eos_token_ids == (tok.token_id("<|im_end|>"),)


def test_added_tokens_come_from_tokenizer_config_when_tokenizer_json_lacks_them(model_dir, tmp_path, hf_tok):
    ckpt = copy_checkpoint(model_dir, tmp_path / "ckpt")
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


def test_loading_errors(model_dir, tmp_path):
    ckpt = copy_checkpoint(model_dir, tmp_path / "ckpt")
    (ckpt / "tokenizer.json").unlink()
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_checkpoint(ckpt)
    (ckpt / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="tokenizer.json"):
        Tokenizer.from_checkpoint(ckpt)
    shutil.copy(model_dir / "tokenizer.json", ckpt / "tokenizer.json")
    (ckpt / "tokenizer_config.json").write_text("[1, 2")
    with pytest.raises(ValueError, match="tokenizer_config.json"):
        Tokenizer.from_checkpoint(ckpt)
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    config["eos_token"] = "<|missing|>"
    (ckpt / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="eos_token"):
        Tokenizer.from_checkpoint(ckpt)


# --- chat template --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_reference(template, hf_tok, name, add_generation_prompt):
    messages = CONVERSATIONS[name]
    reference = hf_tok.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert template.render(messages, add_generation_prompt=add_generation_prompt) == reference
    assert template.render(as_openai(messages), add_generation_prompt=add_generation_prompt) == reference


def test_chat_template_add_vision_id_matches_reference(template, hf_tok):
    reference = hf_tok.apply_chat_template(
        MULTI_TURN, tokenize=False, add_generation_prompt=True, add_vision_id=True
    )
    assert "Picture 2: " in reference
    assert template.render(as_openai(MULTI_TURN), add_vision_id=True) == reference


def test_chat_template_drops_none_fields_and_keeps_input(template, hf_tok):
    messages = [
        {"role": "user", "content": "hi", "name": None},
        {"role": "assistant", "content": None, "tool_calls": None},
        {"role": "user", "content": [IMAGE_URL, {"type": "text", "text": "and?"}]},
    ]
    before = copy.deepcopy(messages)
    reference = hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert template.render(messages) == reference
    assert messages == before


def test_chat_template_environment_matches_reference(model_dir, tmp_path, hf_tok):
    # A template using each helper transformers provides, checked against it.
    source = (
        "{{ bos_token }}{% set ns = namespace(n=0) %}"
        "{% if tools %}TOOLS={{ tools | tojson }}\n{% endif %}"
        "{% for d in documents or [] %}DOC {{ d.title }}: {{ d.text }}\n{% endfor %}"
        "{% for m in messages %}{% if m.role == 'skip' %}{% continue %}{% endif %}"
        "{% set ns.n = ns.n + 1 %}{% generation %}{{ m.role }}={{ m.content | tojson }}{% endgeneration %}\n"
        "{% endfor %}{{ dict(a=ns.n) | tojson }}{{ eos_token }}"
    )
    ckpt = copy_checkpoint(model_dir, tmp_path / "ckpt")
    (ckpt / "chat_template.jinja").write_text(source)
    config = json.loads((ckpt / "tokenizer_config.json").read_text())
    config["bos_token"] = "<|endoftext|>"
    (ckpt / "tokenizer_config.json").write_text(json.dumps(config))
    transformers = pytest.importorskip("transformers")
    reference_tok = transformers.AutoTokenizer.from_pretrained(str(ckpt))

    messages = [{"role": "user", "content": "<b>&'x'</b> 你好"}, {"role": "skip", "content": "-"}]
    tools = [{"type": "function", "function": {"name": "f", "description": "<tag>"}}]
    documents = [{"title": "T", "text": "body"}]
    reference = reference_tok.apply_chat_template(messages, tools=tools, documents=documents, tokenize=False)
    ours = ChatTemplate.from_checkpoint(ckpt).render(messages, tools=tools, documents=documents)
    assert ours == reference
    assert ours.startswith("<|endoftext|>TOOLS=")


def test_chat_template_errors(template, model_dir, tmp_path):
    with pytest.raises(ValueError, match="empty conversation"):
        template.render([])
    failing = ChatTemplate({"default": "{{ raise_exception('no ' + messages[0].role) }}"}, {})
    with pytest.raises(jinja2.TemplateError, match="no user"):
        failing.render(TEXT_ONLY)
    with pytest.raises(jinja2.exceptions.SecurityError):
        ChatTemplate({"default": "{% set ns = namespace() %}{% set ns._x = 1 %}"}, {}).render(TEXT_ONLY)
    with pytest.raises(ValueError, match="does not compile"):
        ChatTemplate({"default": "{% for %}"}, {})
    ckpt = copy_checkpoint(model_dir, tmp_path / "ckpt")
    (ckpt / "chat_template.jinja").unlink()
    with pytest.raises(ValueError, match="no chat template"):
        ChatTemplate.from_checkpoint(ckpt)


def test_chat_template_load_order(model_dir, tmp_path):
    ckpt = copy_checkpoint(model_dir, tmp_path / "ckpt")
    config_path = ckpt / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = [
        {"name": "tool_use", "template": "tools"},
        {"name": "default", "template": "config"},
    ]
    config_path.write_text(json.dumps(config))
    (ckpt / "chat_template.json").write_text(json.dumps({"chat_template": "legacy json"}))

    assert ChatTemplate.from_checkpoint(ckpt).render(TEXT_ONLY).startswith("<|im_start|>system")
    (ckpt / "chat_template.jinja").unlink()
    assert ChatTemplate.from_checkpoint(ckpt).render(TEXT_ONLY) == "legacy json"
    (ckpt / "chat_template.json").unlink()
    from_config = ChatTemplate.from_checkpoint(ckpt)
    assert from_config.render(TEXT_ONLY) == "config"
    assert from_config.render(TEXT_ONLY, tools=[]) == "tools"


# --- prompt ids -------------------------------------------------------------------------------


def reference_prompt_ids(hf_tok, messages: list[dict], counts: list[int]) -> list[int]:
    """What the Qwen2.5-VL processor does: render, replace each pad string by N copies, tokenize."""
    text = hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    pieces = text.split(IMAGE_PAD)
    assert len(pieces) == len(counts) + 1
    expanded = pieces[0] + "".join(IMAGE_PAD * n + piece for n, piece in zip(counts, pieces[1:]))
    return hf_tok(expanded, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize(
    ("name", "counts"),
    [("text_only", []), ("one_image", [4]), ("two_images", [1, 7]), ("system", [16]), ("multi_turn", [3, 5])],
)
def test_build_prompt_ids_matches_reference(tok, template, hf_tok, name, counts):
    messages = CONVERSATIONS[name]
    pad_id = tok.token_id(IMAGE_PAD)
    prompt = build_prompt_ids(tok, template, as_openai(messages), counts, pad_id)
    assert prompt.token_ids == reference_prompt_ids(hf_tok, messages, counts)
    assert [length for _, length in prompt.image_spans] == counts
    covered = set()
    for start, length in prompt.image_spans:
        assert prompt.token_ids[start : start + length] == [pad_id] * length
        assert prompt.token_ids[start - 1] == tok.token_id("<|vision_start|>")
        assert prompt.token_ids[start + length] == tok.token_id("<|vision_end|>")
        covered.update(range(start, start + length))
    assert {i for i, t in enumerate(prompt.token_ids) if t == pad_id} == covered


@pytest.mark.parametrize(
    "text", ["a<|image_pad|>b", " <|image_pad|> ", "x\n<|image_pad|>\n\ny", "<|image_pad|>12<|image_pad|>é"]
)
def test_expanding_ids_equals_expanding_the_string(tok, hf_tok, text):
    # The placeholder is a special token, so the text around it is tokenized
    # on its own and expansion commutes with tokenization even next to letters.
    counts = [3, 2][: text.count(IMAGE_PAD)]
    pieces = text.split(IMAGE_PAD)
    expanded_text = pieces[0] + "".join(IMAGE_PAD * n + piece for n, piece in zip(counts, pieces[1:]))
    ids = expand_image_placeholders(tok.encode(text), counts, tok.token_id(IMAGE_PAD)).token_ids
    assert ids == hf_tok.encode(expanded_text, add_special_tokens=False)


def test_placeholder_count_mismatch_raises(tok, template):
    pad_id = tok.token_id(IMAGE_PAD)
    with pytest.raises(ValueError, match="2 image placeholder.*1 image token count"):
        build_prompt_ids(tok, template, TWO_IMAGES, [4], pad_id)
    with pytest.raises(ValueError, match="0 image placeholder.*1 image token count"):
        build_prompt_ids(tok, template, TEXT_ONLY, [4], pad_id)
    with pytest.raises(ValueError, match="positive int"):
        build_prompt_ids(tok, template, ONE_IMAGE, [0], pad_id)


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
