"""The reference pipeline (Hugging Face transformers), assembled the way its
Qwen2.5-VL processor does it, for tests only.

AutoProcessor cannot be built on our CPU machines (it wants torchvision), so
this rebuilds its recipe from parts that load: the tokenizer's chat template,
the Pillow image processor, and the processor's placeholder expansion
(replace the i-th `<|image_pad|>` string with N_i copies, then tokenize).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

IMAGE_PAD = "<|image_pad|>"


@dataclass
class ReferenceInputs:
    input_ids: torch.Tensor          # [1, L]
    pixel_values: torch.Tensor | None
    image_grid_thw: torch.Tensor | None
    mm_token_type_ids: torch.Tensor  # [1, L]

    def generate_kwargs(self) -> dict:
        kwargs = dict(input_ids=self.input_ids, attention_mask=torch.ones_like(self.input_ids),
                      mm_token_type_ids=self.mm_token_type_ids)
        if self.pixel_values is not None:
            kwargs.update(pixel_values=self.pixel_values, image_grid_thw=self.image_grid_thw)
        return kwargs


class Reference:
    def __init__(self, model_dir: Path) -> None:
        from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.image_processor = Qwen2VLImageProcessorPil.from_pretrained(model_dir)
        self.model = Qwen2_5_VLForConditionalGeneration.from_pretrained(
            model_dir, dtype=torch.float32).eval()
        self.image_token_id = self.model.config.image_token_id

    def user_message(self, text: str, num_images: int) -> list[dict]:
        parts = [{"type": "image"} for _ in range(num_images)] + [{"type": "text", "text": text}]
        return [{"role": "user", "content": parts}]

    def inputs(self, text: str, images: list) -> ReferenceInputs:
        rendered = self.tokenizer.apply_chat_template(
            self.user_message(text, len(images)), tokenize=False, add_generation_prompt=True)
        pixel_values = grid = None
        if images:
            processed = self.image_processor(images=images, return_tensors="pt")
            pixel_values, grid = processed["pixel_values"], processed["image_grid_thw"]
            merge = self.image_processor.merge_size ** 2
            pieces = rendered.split(IMAGE_PAD)
            rendered = pieces[0]
            for i, piece in enumerate(pieces[1:]):
                rendered += IMAGE_PAD * int(grid[i].prod() // merge) + piece
        ids = torch.tensor([self.tokenizer(rendered)["input_ids"]])
        return ReferenceInputs(ids, pixel_values, grid, (ids == self.image_token_id).int())

    @torch.no_grad()
    def greedy(self, inputs: ReferenceInputs, max_new_tokens: int) -> list[int]:
        """Greedy continuation that does not stop at end-of-sequence tokens."""
        out = self.model.generate(**inputs.generate_kwargs(), max_new_tokens=max_new_tokens,
                                  min_new_tokens=0, do_sample=False, eos_token_id=None,
                                  pad_token_id=0)
        return out[0, inputs.input_ids.shape[1]:].tolist()

    @torch.no_grad()
    def logits(self, inputs: ReferenceInputs) -> torch.Tensor:
        return self.model(**inputs.generate_kwargs()).logits[0]
