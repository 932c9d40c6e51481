"""--chat-template-content-format (vLLM's flag): auto finds whether a chat
template loops over a message's content parts (openai) or takes it as a
string; a string template gets each list flattened, text and media
placeholders in part order, so a plain template still sees every image;
openai and string force either. Through the proxy's HTTP API (a scripted
generator): the prompt the generator gets, /tokenize, the start-up flags."""

from __future__ import annotations

import base64

import pytest
from jinja2 import Environment

from conftest import image_bytes, random_image
from pipeline.launch import cli
from pipeline.models.loader import load_config
from pipeline.processing.content_format import flattened, loops_over_content
from pipeline.processing.media_prompt import video_tokens_of
from pipeline.processing.processor import Processor
from pipeline.proxy.requests import ModelInfo
from scripted_generator import serve_scripted
from test_reasoning_flags import proxy_flags_of
from tool_templates import QWEN3_VL_TOOLS

CHAT = "/v1/chat/completions"
OUTPUTS = {"hi": "Hello."}
# A template that writes each message's content as it is: a string, never parts.
STRING_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                   "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def tree(source: str):
    return Environment().parse(source)


@pytest.mark.parametrize("source, loops", [
    (STRING_TEMPLATE, False),
    (QWEN3_VL_TOOLS, True),
    ("{% for m in messages %}{% for p in m['content'] %}{{ p.text }}{% endfor %}{% endfor %}", True),
    ("{% for m in messages %}{% for p in m.content | selectattr('type') %}x{% endfor %}{% endfor %}", True),
    ("{% for m in messages %}{% for c in m.contents %}x{% endfor %}{{ m.content }}{% endfor %}", False),
    ("{% for m in messages %}{% set c = m.content %}{% for p in c %}x{% endfor %}{% endfor %}", True),
    ("{% macro f(a, b) %}{% for p in b %}x{% endfor %}{% endmacro %}{% for m in messages %}{{ f(m.content, [1]) }}"
     "{% endfor %}", False),   # the content goes to a, and the loop is over b
])
def test_auto_finds_a_loop_over_a_messages_content(source, loops):
    assert loops_over_content(tree(source)) is loops


def test_a_list_flattens_to_its_parts_in_order_joined_by_newlines():
    messages = [{"role": "user", "content": [{"type": "text", "text": "look"}, {"type": "image"},
                                             {"type": "text", "text": "and"}, {"type": "video"}]},
                {"role": "assistant", "content": "as it was"}]
    out = flattened(messages, lambda kind: f"<{kind}>")
    assert out == [{"role": "user", "content": "look\n<image>\nand\n<video>"},
                   {"role": "assistant", "content": "as it was"}]
    assert messages[0]["content"][1] == {"type": "image"}   # the caller's messages are not edited


def model_with(tiny_dir, template: str | None, content_format: str) -> ModelInfo:
    family, config = load_config(tiny_dir)
    spec = family.spec(config)
    processor = Processor.from_checkpoint(tiny_dir, spec.image_token_id, video_tokens_of(spec), template)
    return ModelInfo("tiny", processor, 4096, b"salt", aggregated=True, content_format=content_format)


def parts(*texts: str, image: bytes | None = None) -> list[dict]:
    out = [{"type": "text", "text": t} for t in texts]
    if image is not None:
        url = "data:image/png;base64," + base64.b64encode(image).decode()
        out.insert(1, {"type": "image_url", "image_url": {"url": url}})
    return out


def prompt_of(model, generator) -> str:
    return model.processor.tokenizer.decode(generator.requests[-1].prompt_token_ids, skip_special_tokens=False)


def test_a_string_template_sees_text_parts_joined_and_each_image_as_its_placeholder(tiny_dir):
    model = model_with(tiny_dir, STRING_TEMPLATE, "auto")
    image = image_bytes(random_image(56, 84, seed=3))
    placeholder = model.processor.media_placeholder("image")
    assert placeholder == "<|vision_start|><|image_pad|><|vision_end|>"

    async def scenario(client, generator):
        assert (await client.post(CHAT, json={"model": "tiny", "messages": [
            {"role": "user", "content": parts("[hi] first", "second")}]})).status == 200
        assert "<|im_start|>user\n[hi] first\nsecond<|im_end|>" in prompt_of(model, generator)
        assert (await client.post(CHAT, json={"model": "tiny", "messages": [
            {"role": "user", "content": parts("[hi] look", "at this", image=image)}]})).status == 200
        prompt = prompt_of(model, generator)
        pads = prompt.count("<|image_pad|>")
        assert prompt.count("<|vision_start|>") == 1 and pads == 2 * 3   # 56x84: 2x3 merged patches
        assert f"[hi] look\n<|vision_start|>{'<|image_pad|>' * pads}<|vision_end|>\nat this" in prompt
        shown = await (await client.post("/tokenize", json={"model": "tiny", "messages": [
            {"role": "user", "content": parts("[hi] first", "second")}]})).json()
        text = model.processor.tokenizer.decode(shown["tokens"], skip_special_tokens=False)
        assert "[hi] first\nsecond" in text

    serve_scripted(model, scenario, OUTPUTS)


@pytest.mark.parametrize("template, content_format, expected", [
    (None, "auto", "[hi] first second"),             # Qwen's template loops over the parts
    (None, "string", "[hi] first\n second"),          # forced: flattened even so
    (STRING_TEMPLATE, "openai", "'text': '[hi] first'"),   # forced: the parts as a list, as the flag says
])
def test_the_flag_forces_either_format(tiny_dir, template, content_format, expected):
    model = model_with(tiny_dir, template, content_format)

    async def scenario(client, generator):
        assert (await client.post(CHAT, json={"model": "tiny", "messages": [
            {"role": "user", "content": parts("[hi] first", " second")}]})).status == 200
        assert expected in prompt_of(model, generator)

    serve_scripted(model, scenario, OUTPUTS)


def test_epd_launch_and_its_config_file_pass_the_format_to_the_proxy(tiny_dir, tmp_path):
    args = cli.parse_args([str(tiny_dir), "--device", "cpu", "--chat-template-content-format", "openai"])
    assert "--chat-template-content-format=openai" in proxy_flags_of(args)
    assert not any("content-format" in f for f in proxy_flags_of(cli.parse_args([str(tiny_dir), "--device", "cpu"])))
    path = tmp_path / "epd.yaml"
    path.write_text("chat-template-content-format: string\n")
    args = cli.parse_args(["--config", str(path), str(tiny_dir), "--device", "cpu"])
    assert "--chat-template-content-format=string" in proxy_flags_of(args)
    with pytest.raises(SystemExit):
        cli.parse_args([str(tiny_dir), "--chat-template-content-format", "xml"])
