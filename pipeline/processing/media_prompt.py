"""Placeholders of images and videos in a rendered prompt -> token ids and
each item's placeholder runs, in prompt order.

As for images (prompt.py), a placeholder is a special token the tokenizer
splits out before any BPE, so one copy in the text may stand for N in the
ids and the text around it tokenizes the same. A video's placeholder
expands in one of two ways, as the reference processor of its checkpoint
does:
- one run of all its tokens;
- a run per temporal patch (`frame_runs`), each written as the patch's
  timestamp label, the vision start token, the run, the vision end token.
  Each patch then carries its own start and end, so the chat template's
  pair around the placeholder is dropped, as the reference processor does
  (transformers 5.25 and later; 5.24 kept that pair, nesting every patch
  inside it). The labels are text, so they are put in before tokenizing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pipeline.processing.tokenizer import Tokenizer
from pipeline.processing.video import VideoPlan, timestamp_label


@dataclass(frozen=True)
class VideoTokens:
    """A checkpoint's video placeholder, and how a video's expands."""

    video_token_id: int
    start_token_id: int
    end_token_id: int
    frame_runs: bool


def video_tokens_of(spec) -> VideoTokens | None:
    """A model's video tokens from its ModelSpec (None if it names no video token)."""
    if spec.video_token_id is None:
        return None
    return VideoTokens(spec.video_token_id, spec.vision_start_token_id, spec.vision_end_token_id, spec.frame_spans)


@dataclass(frozen=True)
class MediaPromptIds:
    """token_ids; spans[k] = (start, length) of the k-th placeholder run,
    which belongs to item span_items[k]; items: per item in prompt order,
    ("image", i) or ("video", j), i and j counting each kind in its own
    order; an item's runs follow each other."""

    token_ids: list[int]
    spans: list[tuple[int, int]]
    items: list[tuple[str, int]]
    span_items: list[int]


def label_video_text(text: str, plans: Sequence[VideoPlan], tokenizer: Tokenizer, video: VideoTokens) -> str:
    """The rendered prompt with each video placeholder written out for its
    plan: unchanged for one run, one labelled placeholder per temporal
    patch for frame runs. ValueError if the placeholders and the videos differ in number."""
    placeholder = tokenizer.token_text(video.video_token_id)
    pieces = text.split(placeholder)
    if len(pieces) - 1 != len(plans):
        raise ValueError(f"the prompt has {len(pieces) - 1} video placeholder(s) ({placeholder}) but "
                         f"{len(plans)} video(s) were given; each video needs exactly one")
    if not video.frame_runs:
        return text
    start, end = tokenizer.token_text(video.start_token_id), tokenizer.token_text(video.end_token_id)
    pieces = text.replace(start + placeholder + end, placeholder).split(placeholder)
    out = [pieces[0]]
    for plan, piece in zip(plans, pieces[1:]):
        out += [f"{timestamp_label(t)}{start}{placeholder}{end}" for t in plan.timestamps] + [piece]
    return "".join(out)


def expand_media_placeholders(token_ids: Sequence[int], image_token_counts: Sequence[int],
                              plans: Sequence[VideoPlan], image_token_id: int,
                              video: VideoTokens | None) -> MediaPromptIds:
    """Each image placeholder id becomes its count of ids, each video run
    its plan's (all tokens, or one temporal patch's for frame runs)."""
    runs = [[plan.tokens_per_step] * plan.grid[0] if video.frame_runs else [plan.num_tokens]
            for plan in plans] if video is not None else []
    video_id = video.video_token_id if video is not None else None
    _check_counts(token_ids, image_token_counts, image_token_id, runs, video_id)
    expanded: list[int] = []
    spans: list[tuple[int, int]] = []
    items: list[tuple[str, int]] = []
    span_items: list[int] = []
    images = iter(enumerate(image_token_counts))
    pending = iter([(j, length, k == 0) for j, lengths in enumerate(runs) for k, length in enumerate(lengths)])
    for token_id in token_ids:
        if token_id == image_token_id:
            index, count = next(images)
            items.append(("image", index))
        elif token_id == video_id:
            index, count, first = next(pending)
            if first:
                items.append(("video", index))
        else:
            expanded.append(token_id)
            continue
        spans.append((len(expanded), count))
        span_items.append(len(items) - 1)
        expanded.extend([token_id] * count)
    return MediaPromptIds(expanded, spans, items, span_items)


def _check_counts(token_ids, image_token_counts, image_token_id, runs, video_id) -> None:
    placeholders = sum(1 for t in token_ids if t == image_token_id)
    if placeholders != len(image_token_counts):
        raise ValueError(
            f"the prompt has {placeholders} image placeholder(s) (token id {image_token_id}) "
            f"but {len(image_token_counts)} image token count(s) were given; each image needs exactly one")
    for i, count in enumerate(image_token_counts):
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"image_token_counts[{i}] must be a positive int, got {count!r}")
    video_placeholders = sum(1 for t in token_ids if t == video_id) if video_id is not None else 0
    if video_placeholders != sum(len(r) for r in runs):
        raise ValueError(f"the prompt has {video_placeholders} video placeholder run(s) where the videos "
                         f"take {sum(len(r) for r in runs)}")
