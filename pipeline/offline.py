"""One checkpoint ready for offline generation: model, processor, limits.

The thin layer `bin/epd-generate` calls; every failure a user can cause
(missing or unsupported model, unreadable image or video, prompt too long)
surfaces as an InputError with a one-line message.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from pipeline.generate import GenerationLimits, greedy_generate
from pipeline.media.video_cpu import DecodedVideo, decode_video
from pipeline.media.video_probe import VideoDecodeError
from pipeline.models.errors import ModelLoadError
from pipeline.models.loader import LoadedModel, load_model
from pipeline.models.tiny import default_model_dir
from pipeline.processing.image import ImageDecodeError, open_image, preprocess_images
from pipeline.processing.media_prompt import video_tokens_of
from pipeline.processing.processor import Processor


class InputError(Exception):
    """Something the user gave cannot be used; the message says what."""


@dataclass(frozen=True)
class GenerateRequest:
    prompt: str
    images: list[bytes]
    max_tokens: int
    ignore_eos: bool = False
    videos: list[bytes] = field(default_factory=list)   # after the images in the user message


@dataclass(frozen=True)
class GenerateResult:
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str


class OfflineModel:
    def __init__(self, loaded: LoadedModel, processor: Processor) -> None:
        self.loaded = loaded
        self.processor = processor

    @classmethod
    def load(cls, model_dir: Path | None, dtype: str = "float32", device: str = "cpu") -> OfflineModel:
        model_dir = Path(model_dir) if model_dir is not None else default_model_dir()
        try:
            loaded = load_model(model_dir, dtype=dtype, device=device)
            spec = loaded.model.spec
            processor = Processor.from_checkpoint(model_dir, spec.image_token_id, video_tokens_of(spec))
        except (ModelLoadError, FileNotFoundError, ValueError) as exc:
            raise InputError(str(exc)) from exc
        return cls(loaded, processor)

    def generate(self, request: GenerateRequest) -> GenerateResult:
        cfg = self.processor.image_config
        images = []
        for number, data in enumerate(request.images, start=1):
            try:
                images.append(open_image(data, cfg))
            except ImageDecodeError as exc:
                raise InputError(f"image {number}: {exc}") from exc
        videos = [self._decode_video(number, data) for number, data in enumerate(request.videos, start=1)]
        messages = [{"role": "user", "content": [{"type": "image"} for _ in images]
                     + [{"type": "video"} for _ in videos] + [{"type": "text", "text": request.prompt}]}]
        try:
            prompt = self.processor.chat_prompt(messages, [(im.height, im.width) for im in images],
                                                [v.plan for v in videos])
        except ValueError as exc:
            raise InputError(str(exc)) from exc
        self._check_context(len(prompt.token_ids), request.max_tokens)
        # In the prompt's item order: the images, then the videos.
        pixels = ([preprocess_images(images, cfg)[0]] if images else []) + [v.pixel_values for v in videos]
        pixel_values = torch.cat(pixels) if pixels else None
        limits = GenerationLimits(request.max_tokens, frozenset(self.processor.tokenizer.eos_token_ids),
                                  request.ignore_eos)
        token_ids = greedy_generate(self.loaded.model, prompt, pixel_values, limits)
        return GenerateResult(prompt.token_ids, token_ids, self.processor.tokenizer.decode(token_ids))

    def _decode_video(self, number: int, data: bytes) -> DecodedVideo:
        if self.processor.video_config is None:
            raise InputError("this model takes no video")
        try:
            return decode_video(data, self.processor.video_config)
        except VideoDecodeError as exc:
            raise InputError(f"video {number}: {exc}") from exc

    def _check_context(self, prompt_tokens: int, max_tokens: int) -> None:
        context = self.loaded.model.spec.language.max_context
        if prompt_tokens + max_tokens > context:
            raise InputError(
                f"the prompt has {prompt_tokens} tokens; with max tokens {max_tokens} it needs "
                f"{prompt_tokens + max_tokens}, more than the model's context of {context} tokens")
