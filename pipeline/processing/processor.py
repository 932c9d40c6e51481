"""Everything between a chat request and model inputs, for one checkpoint:
tokenizer, chat template, image and video preprocessing settings.

A prompt needs only each image's size and each video's plan (its header):
the number of visual tokens follows from them, so a proxy can render and
tokenize from headers while the pixels are decoded and encoded elsewhere.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.processing.chat_template import ChatTemplate
from pipeline.processing.image import ImageProcessorConfig, image_grid_thw
from pipeline.processing.media_prompt import VideoTokens, expand_media_placeholders, label_video_text
from pipeline.processing.tokenizer import Tokenizer
from pipeline.processing.video import VideoPlan
from pipeline.processing.video_config import (
    INTERVAL_VIDEO_DEFAULTS, TIMESTAMP_VIDEO_DEFAULTS, VideoProcessorConfig)

Grid = tuple[int, int, int]


@dataclass(frozen=True)
class MultimodalPrompt:
    """Prompt token ids; item i (an image or a video, in prompt order) has
    vision input grid grids[i] and fills the placeholder runs image_spans
    (start, length) that are its own (one, or one per temporal patch where
    the model takes frame runs: ModelSpec.span_rows). seconds_per_grid[i]:
    the seconds one temporal patch of video i spans, None for an image
    (empty: every item is an image)."""

    token_ids: list[int]
    image_spans: list[tuple[int, int]]
    grids: list[Grid]
    seconds_per_grid: tuple[float | None, ...] = ()
    span_items: tuple[int, ...] = ()   # the item of each run; empty: run i is item i

    def item_of_span(self) -> list[int]:
        return list(self.span_items) or list(range(len(self.image_spans)))


def video_config_of(model_dir: Path, video: VideoTokens | None) -> VideoProcessorConfig | None:
    """The checkpoint's video settings over the defaults of the reference
    video processor its model pairs with: the timestamped variant for a
    model that takes frame runs; None for a model without video."""
    if video is None:
        return None
    defaults = TIMESTAMP_VIDEO_DEFAULTS if video.frame_runs else INTERVAL_VIDEO_DEFAULTS
    return VideoProcessorConfig.from_checkpoint(model_dir, defaults)


class Processor:
    def __init__(self, tokenizer: Tokenizer, template: ChatTemplate, image_config: ImageProcessorConfig,
                 image_token_id: int, video: VideoTokens | None = None,
                 video_config: VideoProcessorConfig | None = None) -> None:
        self.tokenizer = tokenizer
        self.template = template
        self.image_config = image_config
        self.image_token_id = image_token_id
        self.video = video
        self.video_config = video_config

    @classmethod
    def from_checkpoint(cls, model_dir: Path, image_token_id: int, video: VideoTokens | None = None,
                        chat_template: str | None = None, image_overrides: dict[str, int] | None = None) -> Processor:
        """`video`: the model's video tokens (media_prompt.video_tokens_of); None: images only.
        `chat_template`: a template's source to use instead of the checkpoint's.
        `image_overrides`: the server's image settings (--mm-processor-kwargs)."""
        return cls(Tokenizer.from_checkpoint(model_dir), ChatTemplate.from_checkpoint(model_dir, chat_template),
                   ImageProcessorConfig.from_checkpoint(model_dir, image_overrides), image_token_id, video,
                   video_config_of(model_dir, video))

    def media_placeholder(self, kind: str) -> str:
        """The text a chat template writes for one "image" or "video" part:
        the placeholder token, inside the vision start and end tokens where
        the model has them (for templates that take content as a string)."""
        token = self.image_token_id if kind == "image" else self.video.video_token_id if self.video else None
        if token is None:
            raise ValueError("this model takes no video")
        ids = [token] if self.video is None else [self.video.start_token_id, token, self.video.end_token_id]
        return "".join(self.tokenizer.token_text(t) for t in ids)

    def image_grid(self, height: int, width: int) -> Grid:
        return image_grid_thw(height, width, self.image_config)

    def chat_prompt(self, messages: Sequence[Mapping[str, Any]], image_sizes: Sequence[tuple[int, int]],
                    videos: Sequence[VideoPlan] = (), tools: Sequence[Mapping[str, Any]] | None = None,
                    add_generation_prompt: bool = True, template_kwargs: Mapping[str, Any] | None = None,
                    continue_final_message: bool = False, add_special_tokens: bool = False,
                    documents: Sequence[Mapping[str, Any]] | None = None,
                    template: ChatTemplate | None = None) -> MultimodalPrompt:
        """Token ids for a chat whose image parts, in order, have these
        (height, width) sizes and whose video parts these plans
        (processing.video.plan_video); the generation prompt is added unless
        `add_generation_prompt` is off. `tools`: the chat template's tools
        (function definitions); `template_kwargs`: more template variables;
        `continue_final_message`: see ChatTemplate.render; `add_special_tokens`:
        the tokenizer's own (a BOS) around the rendered text; `documents`: the
        template's (retrieved texts, for templates that take them); `template`:
        one to render with instead of the checkpoint's (a request's own)."""
        if videos and self.video is None:
            raise ValueError("this model takes no video")
        grids = [self.image_grid(h, w) for h, w in image_sizes]
        merge = self.image_config.merge_size ** 2
        counts = [t * h * w // merge for t, h, w in grids]
        text = (template or self.template).render(messages, add_generation_prompt=add_generation_prompt, tools=tools,
                                    documents=documents, continue_final_message=continue_final_message,
                                    **(template_kwargs or {}))
        if self.video is not None:
            text = label_video_text(text, videos, self.tokenizer, self.video)
        ids = expand_media_placeholders(self.tokenizer.encode(text, add_special_tokens), counts, videos,
                                        self.image_token_id, self.video)
        items = [(grids[i], None) if kind == "image" else (tuple(videos[i].grid), videos[i].seconds_per_step)
                 for kind, i in ids.items]
        return MultimodalPrompt(ids.token_ids, ids.spans, [g for g, _ in items],
                                tuple(s for _, s in items) if videos else (), tuple(ids.span_items))
