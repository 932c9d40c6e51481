"""The paged KV cache as a pool of fixed-size blocks.

Only bookkeeping: which block ids are free. The model runner owns the tensors
that the ids index. Allocation is all or nothing, so a failed request leaves
the pool exactly as it was.
"""

from __future__ import annotations


def blocks_needed(num_tokens: int, block_size: int) -> int:
    """Blocks that hold `num_tokens` tokens."""
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    return -(-num_tokens // block_size)


def num_blocks_for_memory(budget_bytes: int, num_layers: int, kv_heads: int, head_dim: int,
                          dtype_bytes: int, block_size: int) -> int:
    """How many blocks fit in `budget_bytes`: each block holds K and V for
    `block_size` tokens in every layer."""
    for name, value in (("num_layers", num_layers), ("kv_heads", kv_heads),
                        ("head_dim", head_dim), ("dtype_bytes", dtype_bytes),
                        ("block_size", block_size)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if budget_bytes < 0:
        raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
    bytes_per_block = 2 * num_layers * kv_heads * head_dim * dtype_bytes * block_size
    return budget_bytes // bytes_per_block


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # A stack with the lowest id on top: allocation order is deterministic,
        # which keeps test expectations and debugging simple.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._used: set[int] = set()

    def allocate(self, n: int) -> list[int] | None:
        """`n` block ids, or None (and nothing taken) if fewer are free."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > len(self._free):
            return None
        ids = [self._free.pop() for _ in range(n)]
        self._used.update(ids)
        return ids

    def free(self, block_ids: list[int]) -> None:
        """Give blocks back. Freeing a block that is not allocated (double
        free, unknown id, or the same id twice in one call) raises ValueError
        and frees nothing."""
        ids = list(block_ids)
        bad = [b for b in ids if b not in self._used]
        if bad or len(set(ids)) != len(ids):
            raise ValueError(f"blocks {bad or ids} are not allocated (double free?)")
        self._used.difference_update(ids)
        self._free.extend(reversed(ids))

    def is_allocated(self, block_id: int) -> bool:
        return block_id in self._used

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)
