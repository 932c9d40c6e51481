"""Chat messages -> prompt token ids, with each image's placeholder expanded.

The reference (transformers' processor of these checkpoints) renders the
template, replaces the i-th `<|image_pad|>` string with N_i copies, then
tokenizes. We tokenize first and expand the i-th placeholder id instead: the
placeholder is a special (added) token, which the tokenizer splits out before
any normalization or BPE, so N copies of the string become exactly N copies
of the id and the text around it tokenizes the same either way. This lets the
token count of each image be decided after the (cacheable) text is tokenized.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pipeline.processing.chat_template import ChatTemplate
from pipeline.processing.tokenizer import Tokenizer


@dataclass(frozen=True)
class PromptIds:
    """Prompt token ids and where each image's embeddings go.

    image_spans[i] = (start, length): token_ids[start:start + length] are the
    placeholder ids that image i's encoder output replaces, in image order.
    """

    token_ids: list[int]
    image_spans: list[tuple[int, int]]


def expand_image_placeholders(
    token_ids: Sequence[int], image_token_counts: Sequence[int], image_token_id: int
) -> PromptIds:
    """Replace the i-th `image_token_id` with image_token_counts[i] copies of it."""
    placeholders = sum(1 for token_id in token_ids if token_id == image_token_id)
    if placeholders != len(image_token_counts):
        raise ValueError(
            f"the prompt has {placeholders} image placeholder(s) (token id {image_token_id}) "
            f"but {len(image_token_counts)} image token count(s) were given; each image needs exactly one"
        )
    for i, count in enumerate(image_token_counts):
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"image_token_counts[{i}] must be a positive int, got {count!r}")

    expanded: list[int] = []
    spans: list[tuple[int, int]] = []
    counts = iter(image_token_counts)
    for token_id in token_ids:
        if token_id == image_token_id:
            count = next(counts)
            spans.append((len(expanded), count))
            expanded.extend([image_token_id] * count)
        else:
            expanded.append(token_id)
    return PromptIds(token_ids=expanded, image_spans=spans)


def build_prompt_ids(
    tokenizer: Tokenizer,
    template: ChatTemplate,
    messages: Sequence[Mapping[str, Any]],
    image_token_counts: Sequence[int],
    image_token_id: int,
    add_generation_prompt: bool = True,
) -> PromptIds:
    """Render `messages`, tokenize, and expand image placeholders.

    image_token_counts[i] is the number of LLM tokens image i becomes (after the
    vision encoder's patch merge). Raises ValueError when the rendered prompt
    holds a different number of placeholders than there are counts; note that,
    as in the reference, a placeholder string typed in message text counts too.
    """
    text = template.render(messages, add_generation_prompt=add_generation_prompt)
    return expand_image_placeholders(tokenizer.encode(text), image_token_counts, image_token_id)
