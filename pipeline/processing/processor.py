"""Everything between a chat request and model inputs, for one checkpoint:
tokenizer, chat template and image preprocessing settings.

A prompt needs only each image's size: the number of visual tokens follows
from (height, width), so a proxy can render and tokenize from image headers
while the pixels are decoded and encoded elsewhere.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.processing.chat_template import ChatTemplate
from pipeline.processing.image import ImageProcessorConfig, image_grid_thw
from pipeline.processing.prompt import build_prompt_ids
from pipeline.processing.tokenizer import Tokenizer

Grid = tuple[int, int, int]


@dataclass(frozen=True)
class MultimodalPrompt:
    """Prompt token ids; image i's embeddings replace
    token_ids[start:start+length] for image_spans[i], and its vision input
    has patch grid grids[i]."""

    token_ids: list[int]
    image_spans: list[tuple[int, int]]
    grids: list[Grid]


class Processor:
    def __init__(self, tokenizer: Tokenizer, template: ChatTemplate, image_config: ImageProcessorConfig,
                 image_token_id: int) -> None:
        self.tokenizer = tokenizer
        self.template = template
        self.image_config = image_config
        self.image_token_id = image_token_id

    @classmethod
    def from_checkpoint(cls, model_dir: Path, image_token_id: int) -> Processor:
        return cls(Tokenizer.from_checkpoint(model_dir), ChatTemplate.from_checkpoint(model_dir),
                   ImageProcessorConfig.from_checkpoint(model_dir), image_token_id)

    def image_grid(self, height: int, width: int) -> Grid:
        return image_grid_thw(height, width, self.image_config)

    def chat_prompt(self, messages: Sequence[Mapping[str, Any]],
                    image_sizes: Sequence[tuple[int, int]]) -> MultimodalPrompt:
        """Token ids for a chat whose image parts, in order, have these
        (height, width) sizes; the generation prompt is added."""
        grids = [self.image_grid(h, w) for h, w in image_sizes]
        merge = self.image_config.merge_size ** 2
        counts = [t * h * w // merge for t, h, w in grids]
        ids = build_prompt_ids(self.tokenizer, self.template, messages, counts, self.image_token_id)
        return MultimodalPrompt(ids.token_ids, ids.image_spans, grids)
