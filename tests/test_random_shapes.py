"""Random-weight model shapes: the weightless folder (config, processor
config, synthetic tokenizer at Qwen's real ids), the model parts, and the
whole stack through `bin/epd-launch --random-weights` on the CPU."""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import sys
import urllib.request

import numpy as np
import pytest
import torch

from conftest import REPO, image_bytes, random_image
from pipeline.prompt_words import WORDS
from pipeline.models.loader import load_config
from pipeline.models.shape_configs import QWEN25_VL_SPECIAL_IDS, QWEN25_VL_VOCAB_SIZE, shape_config
from pipeline.models.shape_folder import check_folder_matches, write_shape_folder
from pipeline.models.shapes import random_model
from pipeline.processing.detokenize import IncrementalDetokenizer
from pipeline.processing.processor import Processor
from pipeline.processing.tokenizer import Tokenizer
from stack import free_port

TINY_SHAPE = "qwen2.5-vl-tiny"


@pytest.fixture(scope="module")
def folder_3b(tmp_path_factory):
    # Only the weightless folder: the 3B weights are never made in CI.
    return write_shape_folder("qwen2.5-vl-3b", tmp_path_factory.mktemp("qwen2.5-vl-3b"))


def test_special_tokens_round_trip_at_real_ids(folder_3b):
    tokenizer = Tokenizer.from_checkpoint(folder_3b)
    assert tokenizer.vocab_size == QWEN25_VL_VOCAB_SIZE
    assert tokenizer.eos_token_ids == (151645, 151643)
    assert tokenizer.pad_token_id == 151643
    for token, token_id in QWEN25_VL_SPECIAL_IDS.items():
        assert tokenizer.token_id(token) == token_id
        assert tokenizer.encode(token) == [token_id]
        assert tokenizer.decode([token_id], skip_special_tokens=False) == token
    user = tokenizer.encode("user")
    assert tokenizer.encode("<|im_start|>user\n") == [151644, *user] and len(user) == 1


def test_any_id_decodes_and_bench_text_is_one_token_per_word(folder_3b):
    tokenizer = Tokenizer.from_checkpoint(folder_3b)
    ids = np.random.default_rng(0).integers(0, QWEN25_VL_VOCAB_SIZE, 2000).tolist()
    ids += [0, 151642, 151664, 151665, QWEN25_VL_VOCAB_SIZE - 1]
    specials = set(QWEN25_VL_SPECIAL_IDS.values())
    for token_id in ids:  # every regular id is visible text, so streams never stall
        if token_id not in specials:
            assert tokenizer.decode([token_id]).strip()
    streamed = IncrementalDetokenizer(tokenizer)
    text = "".join(streamed.push(i) for i in ids) + streamed.flush()
    assert text == tokenizer.decode(ids)
    prompt = " ".join(WORDS[::3])
    assert len(tokenizer.encode(prompt)) == len(WORDS[::3])


def test_folder_config_and_processor_match_the_shape(folder_3b):
    _, config = load_config(folder_3b)
    assert config.image_token_id == 151655 and config.text.vocab_size == QWEN25_VL_VOCAB_SIZE
    assert json.loads((folder_3b / "config.json").read_text()) == shape_config("qwen2.5-vl-3b")
    processor = Processor.from_checkpoint(folder_3b, config.image_token_id)
    settings = json.loads((folder_3b / "preprocessor_config.json").read_text())
    assert (settings["min_pixels"], settings["max_pixels"], settings["patch_size"], settings["merge_size"]) == (
        3136, 12845056, 14, 2)
    assert processor.image_grid(640, 640) == (1, 46, 46)  # 529 visual tokens
    prompt = processor.chat_prompt(
        [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}},
                                      {"type": "text", "text": "the of and"}]}], [(640, 640)])
    (start, length), = prompt.image_spans
    assert length == 529 and set(prompt.token_ids[start:start + length]) == {151655}
    assert prompt.token_ids[start - 1] == 151652 and prompt.token_ids[start + length] == 151653
    check_folder_matches("qwen2.5-vl-3b", folder_3b)
    with pytest.raises(ValueError, match="has hidden_size=2048, the shape has 64"):
        check_folder_matches(TINY_SHAPE, folder_3b)


def test_random_model_parts():
    cpu = torch.device("cpu")
    tower = random_model(TINY_SHAPE, torch.float32, cpu, part="visual").model
    language = random_model(TINY_SHAPE, torch.float32, cpu, part="language").model
    full = random_model(TINY_SHAPE, torch.float32, cpu).model
    assert not any(p.is_meta for p in tower.parameters())
    assert all(p.is_meta for p in language.visual.parameters())
    assert not any(p.is_meta for p in language.model.parameters())
    assert not any(p.is_meta for p in full.parameters())
    assert full.model.embed_tokens.weight.shape == (QWEN25_VL_VOCAB_SIZE, 64)
    with pytest.raises(ValueError, match="unknown model shape"):
        random_model("no-such-shape", torch.float32, cpu)


# ---- the whole stack ---------------------------------------------------------------

def chat_with_image(port: int, max_tokens: int) -> dict:
    url = "data:image/png;base64," + base64.b64encode(image_bytes(random_image(224, 224, seed=5))).decode()
    body = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                      {"type": "text", "text": "describe the image"}]}],
            "max_tokens": max_tokens, "ignore_eos": True}
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.load(response)


@pytest.fixture(scope="module")
def shape_cache(tmp_path_factory):
    """One cache folder for the stack tests: the shape's folder is written once."""
    return tmp_path_factory.mktemp("epd-cache")


# A 224x224 image's visual tokens: 14-pixel patches -> 16x16 patches -> 64
# tokens; 16-pixel patches -> 14x14 -> 49.
IMAGE_TOKENS = {TINY_SHAPE: 64, "qwen3-vl-tiny": 49}


@pytest.mark.parametrize("shape", sorted(IMAGE_TOKENS))
@pytest.mark.parametrize("layout", [["--encoders", "1"], ["--mode", "aggregated"]], ids=["epd", "aggregated"])
def test_epd_launch_random_weights_answers_an_image_chat(tmp_path, shape_cache, layout, shape):
    port = free_port()
    env = {**os.environ, "EPD_CACHE_DIR": str(shape_cache)}
    launcher = subprocess.Popen(
        [sys.executable, str(REPO / "bin" / "epd-launch"), "--random-weights", shape, "--device", "cpu",
         "--port", str(port), "--generators", "1", *layout, "--log-dir", str(tmp_path / "logs"),
         "--ready-timeout", "90"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)
    try:
        for line in launcher.stdout:  # ends by itself: the launcher gives up after --ready-timeout
            if line.startswith("EPD ready"):
                break
        answer = chat_with_image(port, max_tokens=5)
        assert answer["usage"]["completion_tokens"] == 5 and answer["usage"]["prompt_tokens"] > IMAGE_TOKENS[shape]
        assert answer["model"] == f"{shape}-v1"
        assert len(answer["choices"][0]["message"]["content"].split()) == 5
        launcher.send_signal(signal.SIGINT)
        assert launcher.wait(timeout=30) == 0
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()
        launcher.stdout.close()
