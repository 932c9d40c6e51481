"""Attention for mixed steps on CUDA: prefill chunks and decodes together.

The reference backend attends one sequence at a time: a step with one
prefill chunk and 31 decodes makes 32 attention calls (plus two gathers
each) per layer, over a thousand small kernels per forward for work that is
mostly one long prefill. Here the decode rows of a step attend in one
batched call (keys gathered by block table into a padded [rows, L] layout,
masked by length), and only the chunks with several query tokens attend
alone, with the same calls as the reference. The CPU path keeps the
reference backend, which the equality tests pin to transformers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pipeline.engine.paged_attention import PagedKVCache, ReferencePagedAttention, StepLayout
from pipeline.models.attention import causal_attention


class MixedStepAttention(ReferencePagedAttention):
    def __init__(self, cache: PagedKVCache, layout: StepLayout) -> None:
        super().__init__(cache, layout)
        device = layout.slot_mapping.device
        decodes = [i for i, s in enumerate(layout.sequences) if s.query_len == 1]
        self.chunks = [(s, layout.context_slots[i]) for i, s in enumerate(layout.sequences) if s.query_len > 1]
        self.decode_rows = None
        if decodes:
            lengths = [layout.sequences[i].context_len + 1 for i in decodes]
            width = max(lengths)
            # Padding reads slot 0 and is masked out: any slot is a valid address.
            gather = torch.zeros(len(decodes), width, dtype=torch.long)
            for row, i in enumerate(decodes):
                gather[row, :lengths[row]] = layout.context_slots[i].cpu()
            self.gather = gather.view(-1).to(device, non_blocking=True)
            self.mask = (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None])[:, None, None, :].to(
                device, non_blocking=True)
            self.decode_rows = torch.tensor([layout.sequences[i].offset for i in decodes]).to(device, non_blocking=True)
            self.shape = (len(decodes), width)

    def attend(self, layer, q, k, v):
        k_slots, v_slots = self.cache.layer_slots(layer)
        k_slots.index_copy_(0, self.layout.slot_mapping, k)
        v_slots.index_copy_(0, self.layout.slot_mapping, v)
        out = torch.empty_like(q)
        if self.decode_rows is not None:
            rows, width = self.shape
            keys = k_slots.index_select(0, self.gather).view(rows, width, *k.shape[1:]).transpose(1, 2)
            values = v_slots.index_select(0, self.gather).view(rows, width, *v.shape[1:]).transpose(1, 2)
            query = q.index_select(0, self.decode_rows)[:, :, None, :]
            attended = F.scaled_dot_product_attention(query, keys, values, attn_mask=self.mask,
                                                      scale=q.shape[-1] ** -0.5,
                                                      enable_gqa=keys.shape[1] != q.shape[1])
            out.index_copy_(0, self.decode_rows, attended[:, :, 0, :])
        group = q.shape[1] // k.shape[1]
        for seq, slots in self.chunks:
            # Heads repeated for grouped queries: SDPA's flash kernel takes
            # equal head counts, while `enable_gqa` can fall back to the
            # math kernel, whose [heads, n, n] scores cost tens of ms per
            # 2k-token prefill.
            keys = k_slots.index_select(0, slots).transpose(0, 1).repeat_interleave(group, 0)[None]
            values = v_slots.index_select(0, slots).transpose(0, 1).repeat_interleave(group, 0)[None]
            query = q[seq.offset:seq.offset + seq.query_len].transpose(0, 1)[None]
            out[seq.offset:seq.offset + seq.query_len] = causal_attention(
                query, keys, values, seq.context_len)[0].transpose(0, 1)
        return out
