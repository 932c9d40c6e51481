"""A copy of the tiny checkpoint that thinks in Qwen3's way, for the
reasoning-parser tests: `<think>` and `</think>` as tokens of their own (not
special, as in Qwen3's tokenizer, so they stay in the decoded text), and the
tiny checkpoint's chat template, after a system turn of ours listing the
tools, that takes `enable_thinking`: when it is false the
generation prompt closes an empty reasoning, `<think>\\n\\n</think>\\n\\n`, as
Qwen3's template does. With `weights`, the embedding and output rows of the
two tokens are added too (random, seeded), so the model itself can write them.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from pipeline.models.tiny_tokenizer import QWEN2_VL_CHAT_TEMPLATE

THINK_TOKENS = ("<think>", "</think>")

# The tiny checkpoint's template, after a system turn listing the tools, with
# a generation prompt that closes an empty reasoning when thinking is off.
_TOOLS_TURN = r"""{%- if tools -%}
{{- '<|im_start|>system\nTools, one call a <tool_call> block:\n' -}}
{%- for tool in tools -%}{{- tool | tojson -}}{{- '\n' -}}{%- endfor -%}
{{- '<|im_end|>\n' -}}
{%- endif -%}
"""
_THINKING_OFF = r"""
    {%- if enable_thinking is defined and enable_thinking is false -%}{{- '<think>\n\n</think>\n\n' -}}{%- endif -%}
{%- endif -%}
"""
_PROMPT_END = "{%- endif -%}\n"
assert QWEN2_VL_CHAT_TEMPLATE.endswith(_PROMPT_END)
THINKING_TEMPLATE = _TOOLS_TURN + QWEN2_VL_CHAT_TEMPLATE[:-len(_PROMPT_END)] + _THINKING_OFF.lstrip("\n")


def with_thinking(tiny_dir: Path, out_dir: Path, weights: bool = False) -> Path:
    """A copy of `tiny_dir` in `out_dir` with the think tokens and template; returns out_dir."""
    shutil.copytree(tiny_dir, out_dir)
    config_path = out_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    decoder = config["added_tokens_decoder"]
    first = max(int(i) for i in decoder) + 1
    for offset, token in enumerate(THINK_TOKENS):
        decoder[str(first + offset)] = {"content": token, "lstrip": False, "normalized": False, "rstrip": False,
                                        "single_word": False, "special": False}
    config_path.write_text(json.dumps(config, indent=2))
    (out_dir / "chat_template.jinja").write_text(THINKING_TEMPLATE)
    if weights:
        _add_rows(out_dir, first + len(THINK_TOKENS))
    return out_dir


def _add_rows(out_dir: Path, vocab_size: int) -> None:
    model_config = json.loads((out_dir / "config.json").read_text())
    model_config["vocab_size"] = vocab_size
    (out_dir / "config.json").write_text(json.dumps(model_config, indent=2))
    tensors = load_file(out_dir / "model.safetensors")
    generator = torch.Generator().manual_seed(0)
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        table = tensors[name]
        extra = torch.randn((vocab_size - table.shape[0], table.shape[1]), generator=generator) * 0.1
        tensors[name] = torch.cat([table, extra.to(table.dtype)])
    save_file(tensors, out_dir / "model.safetensors", metadata={"format": "pt"})
