"""Shared by the tokenizer and chat-template tests: the texts and
conversations checked against transformers, and the tiny Qwen-style
tokenizer written into a temp folder (with its fixtures)."""

from __future__ import annotations

import copy
import os
import shutil
from pathlib import Path

import pytest

from pipeline.models.tiny_tokenizer import write_tiny_tokenizer
from pipeline.processing.chat_template import ChatTemplate
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
def tokenizer_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny_tokenizer")
    write_tiny_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def hf_tok(tokenizer_dir):
    os.environ["HF_HUB_OFFLINE"] = "1"
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(tokenizer_dir))


@pytest.fixture(scope="module")
def tok(tokenizer_dir) -> Tokenizer:
    return Tokenizer.from_checkpoint(tokenizer_dir)


@pytest.fixture(scope="module")
def template(tokenizer_dir) -> ChatTemplate:
    return ChatTemplate.from_checkpoint(tokenizer_dir)


def copy_checkpoint(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst
