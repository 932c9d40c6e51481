"""The reasoning parsers that vLLM names after model families
(`--reasoning-parser NAME`), as data for pipeline/proxy/reasoning.py, which
splits answers the same way for each: what differs is only whether a chat
template variable turns thinking off.

- deepseek_r1: DeepSeek-R1's format; no variable turns thinking off.
- qwen3: Qwen3's (Qwen3-VL's thinking checkpoints too); its templates take
  `enable_thinking`, and false writes an empty, closed reasoning into the
  prompt (`<think>\\n\\n</think>\\n\\n`). vLLM's qwen3 parser reads the same
  variable.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ThinkingFormat:
    off_variable: str | None = None   # the chat-template variable whose false turns thinking off


REASONING_PARSERS = {
    "deepseek_r1": ThinkingFormat(),
    "qwen3": ThinkingFormat(off_variable="enable_thinking"),
}
