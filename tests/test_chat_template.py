"""Chat-template rendering and prompt ids against transformers, on the
tiny Qwen-style tokenizer's checkpoint folder."""

from __future__ import annotations

import copy
import json

import jinja2
import pytest

from pipeline.processing.chat_template import ChatTemplate
from pipeline.processing.prompt import build_prompt_ids, expand_image_placeholders
from tokenizer_cases import (CONVERSATIONS, IMAGE_PAD, IMAGE_URL, MULTI_TURN, ONE_IMAGE, TEXT_ONLY, TWO_IMAGES,
                             as_openai, copy_checkpoint)

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


@pytest.mark.parametrize("final", ["The answer is", [{"type": "text", "text": "Sure, "}], "  padded words  "])
def test_continue_final_message_matches_reference(template, hf_tok, final):
    """transformers' continue_final_message: the prompt ends inside the final
    message (no end of turn), string or text parts, spaces as the template writes them."""
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": final}]
    reference = hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=False,
                                           continue_final_message=True)
    ours = template.render(messages, add_generation_prompt=False, continue_final_message=True)
    assert ours == reference and not ours.endswith("<|im_end|>\n")
    with pytest.raises(ValueError, match="cannot both be set"):
        template.render(messages, continue_final_message=True)
    with pytest.raises(ValueError, match="text to continue"):
        template.render([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": [IMAGE_URL]}],
                        add_generation_prompt=False, continue_final_message=True)


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


def test_chat_template_environment_matches_reference(tokenizer_dir, tmp_path, hf_tok):
    # A template using each helper transformers provides, checked against it.
    source = (
        "{{ bos_token }}{% set ns = namespace(n=0) %}"
        "{% if tools %}TOOLS={{ tools | tojson }}\n{% endif %}"
        "{% for d in documents or [] %}DOC {{ d.title }}: {{ d.text }}\n{% endfor %}"
        "{% for m in messages %}{% if m.role == 'skip' %}{% continue %}{% endif %}"
        "{% set ns.n = ns.n + 1 %}{% generation %}{{ m.role }}={{ m.content | tojson }}{% endgeneration %}\n"
        "{% endfor %}{{ dict(a=ns.n) | tojson }}{{ eos_token }}"
    )
    ckpt = copy_checkpoint(tokenizer_dir, tmp_path / "ckpt")
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


def test_chat_template_errors(template, tokenizer_dir, tmp_path):
    with pytest.raises(ValueError, match="empty conversation"):
        template.render([])
    failing = ChatTemplate({"default": "{{ raise_exception('no ' + messages[0].role) }}"}, {})
    with pytest.raises(jinja2.TemplateError, match="no user"):
        failing.render(TEXT_ONLY)
    with pytest.raises(jinja2.exceptions.SecurityError):
        ChatTemplate({"default": "{% set ns = namespace() %}{% set ns._x = 1 %}"}, {}).render(TEXT_ONLY)
    with pytest.raises(ValueError, match="does not compile"):
        ChatTemplate({"default": "{% for %}"}, {})
    ckpt = copy_checkpoint(tokenizer_dir, tmp_path / "ckpt")
    (ckpt / "chat_template.jinja").unlink()
    with pytest.raises(ValueError, match="no chat template"):
        ChatTemplate.from_checkpoint(ckpt)


def test_chat_template_load_order(tokenizer_dir, tmp_path):
    ckpt = copy_checkpoint(tokenizer_dir, tmp_path / "ckpt")
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
