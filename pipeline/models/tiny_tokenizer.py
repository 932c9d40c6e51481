"""Writes a tiny Qwen2-style tokenizer for the tiny random test checkpoint.

The files mirror a real Qwen2.5-VL-Instruct checkpoint (tokenizer.json,
tokenizer_config.json, chat_template.jinja, generation_config.json) so the
whole text path (template, tokenizer, placeholder expansion, detokenizer) runs
against the same formats as production, only with a vocabulary under 512 ids.
Qwen3-VL uses the same tokenizer; its chat template is here too.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors
from tokenizers.models import BPE
from tokenizers.trainers import BpeTrainer

# Qwen2's pre-tokenizer split: contractions, letter runs (with one leading
# non-letter), single digits, punctuation runs, newlines, other whitespace.
QWEN2_PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Qwen's special tokens, in the order (and so the relative ids) of the real vocabulary.
QWEN_SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)

# Regular (BPE) tokens, the 256 byte symbols included; the specials follow.
REGULAR_VOCAB_SIZE = 448

_CORPUS = (
    "The quick brown fox jumps over the lazy dog. A picture is worth a thousand words, "
    "and a short caption is worth reading twice. What do you see in this image? "
    "I see a red car parked next to a tall green tree, and two people walking a small dog.",
    "Vision-language models read images and text together. An encoder turns each image "
    "into a sequence of patch embeddings; the language model then attends to those "
    "embeddings as if they were ordinary tokens in the prompt. Serving such a model "
    "means scheduling the encoder, the prefill and the decode steps so that none of "
    "them waits for the others longer than it has to.",
    "Describe the weather in the photo. It looks cloudy, with light rain over the hills "
    "and a few birds flying low. The temperature is probably around 12 degrees, and "
    "the road is wet. There are 3 cars, 2 bicycles and 1 bus in the street.",
    "Please answer the question with a single word. Count the apples on the table: "
    "there are seven apples, four oranges and one banana. Yes, no, maybe; it's hard to "
    "say, isn't it? We'll see what they've done and what you'd like to do next.",
    "Numbers such as 2024, 3.14159 and 1,000,000 are split into single digits. Code "
    "like `print(\"hello, world\")` or x = y + 2 * z, and symbols like #, @, %, & and ... "
    "appear now and then.\n\nNew lines separate paragraphs.\n",
)


# The Qwen2-VL / Qwen2.5-VL chat format. Every tag trims the template's own
# whitespace ("-"), so only the quoted strings reach the output.
QWEN2_VL_CHAT_TEMPLATE = r"""{%- set image_count = namespace(value=0) -%}
{%- set video_count = namespace(value=0) -%}
{%- for message in messages -%}
    {%- if loop.first and message['role'] != 'system' -%}
        {{- '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' -}}
    {%- endif -%}
    {{- '<|im_start|>' + message['role'] + '\n' -}}
    {%- if message['content'] is string -%}
        {{- message['content'] -}}
    {%- else -%}
        {%- for content in message['content'] -%}
            {%- if content['type'] == 'image' or 'image' in content or 'image_url' in content -%}
                {%- set image_count.value = image_count.value + 1 -%}
                {%- if add_vision_id -%}
                    {{- 'Picture ' + image_count.value|string + ': ' -}}
                {%- endif -%}
                {{- '<|vision_start|><|image_pad|><|vision_end|>' -}}
            {%- elif content['type'] == 'video' or 'video' in content -%}
                {%- set video_count.value = video_count.value + 1 -%}
                {%- if add_vision_id -%}
                    {{- 'Video ' + video_count.value|string + ': ' -}}
                {%- endif -%}
                {{- '<|vision_start|><|video_pad|><|vision_end|>' -}}
            {%- elif 'text' in content -%}
                {{- content['text'] -}}
            {%- endif -%}
        {%- endfor -%}
    {%- endif -%}
    {{- '<|im_end|>\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|im_start|>assistant\n' -}}
{%- endif -%}
"""


# The Qwen3-VL-Instruct chat format, written for the synthetic folders and
# tests in the trimming style of the template above. What it carries over
# from the published Qwen3-VL template, as differences from the Qwen2.5-VL one:
# - no default system prompt: a system turn is written only when the first
#   message is a system message, and system messages elsewhere are dropped;
# - system content may be a list of parts, of which only the text is written;
# - an assistant turn writes only the text of its parts (no image placeholder).
# Like the template above it leaves out tools, tool calls and tool turns,
# which the published template renders and these checkpoints never need.
QWEN3_VL_CHAT_TEMPLATE = r"""{%- if messages[0]['role'] == 'system' -%}
    {{- '<|im_start|>system\n' -}}
    {%- if messages[0]['content'] is string -%}
        {{- messages[0]['content'] -}}
    {%- else -%}
        {%- for part in messages[0]['content'] if 'text' in part -%}
            {{- part['text'] -}}
        {%- endfor -%}
    {%- endif -%}
    {{- '<|im_end|>\n' -}}
{%- endif -%}
{%- set image_count = namespace(value=0) -%}
{%- set video_count = namespace(value=0) -%}
{%- for message in messages -%}
    {%- if message['role'] == 'user' -%}
        {{- '<|im_start|>user\n' -}}
        {%- if message['content'] is string -%}
            {{- message['content'] -}}
        {%- else -%}
            {%- for content in message['content'] -%}
                {%- if content['type'] == 'image' or 'image' in content or 'image_url' in content -%}
                    {%- set image_count.value = image_count.value + 1 -%}
                    {%- if add_vision_id -%}
                        {{- 'Picture ' + image_count.value|string + ': ' -}}
                    {%- endif -%}
                    {{- '<|vision_start|><|image_pad|><|vision_end|>' -}}
                {%- elif content['type'] == 'video' or 'video' in content -%}
                    {%- set video_count.value = video_count.value + 1 -%}
                    {%- if add_vision_id -%}
                        {{- 'Video ' + video_count.value|string + ': ' -}}
                    {%- endif -%}
                    {{- '<|vision_start|><|video_pad|><|vision_end|>' -}}
                {%- elif 'text' in content -%}
                    {{- content['text'] -}}
                {%- endif -%}
            {%- endfor -%}
        {%- endif -%}
        {{- '<|im_end|>\n' -}}
    {%- elif message['role'] == 'assistant' -%}
        {{- '<|im_start|>assistant\n' -}}
        {%- if message['content'] is string -%}
            {{- message['content'] -}}
        {%- else -%}
            {%- for part in message['content'] if 'text' in part -%}
                {{- part['text'] -}}
            {%- endfor -%}
        {%- endif -%}
        {{- '<|im_end|>\n' -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|im_start|>assistant\n' -}}
{%- endif -%}
"""


def _build_untrained() -> Tokenizer:
    tokenizer = Tokenizer(
        BPE(
            unk_token=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
            byte_fallback=False,
        )
    )
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tokenizer.post_processor = processors.ByteLevel(
        add_prefix_space=False, trim_offsets=False, use_regex=False
    )
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _train(tokenizer: Tokenizer) -> None:
    trainer = BpeTrainer(
        vocab_size=REGULAR_VOCAB_SIZE,
        min_frequency=1,
        show_progress=False,
        # Sorted so the alphabet's ids never depend on set iteration order.
        initial_alphabet=sorted(pre_tokenizers.ByteLevel.alphabet()),
        special_tokens=[],
    )
    tokenizer.train_from_iterator(list(_CORPUS), trainer=trainer)
    if tokenizer.get_vocab_size() != REGULAR_VOCAB_SIZE:
        # The corpus must be rich enough to fill the vocabulary; otherwise the
        # special tokens' ids would shift and the tiny checkpoint's shapes change.
        raise RuntimeError(
            f"tiny tokenizer trained to {tokenizer.get_vocab_size()} tokens, expected {REGULAR_VOCAB_SIZE}"
        )


def _tokenizer_config(special_ids: dict[str, int]) -> dict:
    added_tokens_decoder = {
        str(token_id): {
            "content": token,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for token, token_id in special_ids.items()
    }
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added_tokens_decoder,
        "additional_special_tokens": list(QWEN_SPECIAL_TOKENS[1:]),
        "bos_token": None,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 32768,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


def _qwen_layout(tokenizer_json: dict) -> dict:
    # The Python ByteLevel decoder ignores its options and serializes defaults;
    # write Qwen's values so the file reads like a real checkpoint's (decoding
    # does not depend on them).
    tokenizer_json["decoder"] = {
        "type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False
    }
    return tokenizer_json


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def write_tiny_tokenizer(out_dir: Path) -> dict[str, int]:
    """Write the tiny tokenizer files into `out_dir` (created if needed).

    Returns the id of each special token, plus "vocab_size" (regular and
    special tokens together). The output is byte-identical run to run.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = _build_untrained()
    _train(tokenizer)
    tokenizer.add_special_tokens(
        [AddedToken(token, special=True, normalized=False) for token in QWEN_SPECIAL_TOKENS]
    )
    special_ids = {token: tokenizer.token_to_id(token) for token in QWEN_SPECIAL_TOKENS}

    _write_json(out_dir / "tokenizer.json", _qwen_layout(json.loads(tokenizer.to_str())))
    _write_json(out_dir / "tokenizer_config.json", _tokenizer_config(special_ids))
    (out_dir / "chat_template.jinja").write_text(QWEN2_VL_CHAT_TEMPLATE, encoding="utf-8")
    endoftext, im_end = special_ids["<|endoftext|>"], special_ids["<|im_end|>"]
    _write_json(
        out_dir / "generation_config.json",
        {"bos_token_id": endoftext, "eos_token_id": [im_end, endoftext], "pad_token_id": endoftext},
    )
    return {**special_ids, "vocab_size": tokenizer.get_vocab_size(with_added_tokens=True)}
