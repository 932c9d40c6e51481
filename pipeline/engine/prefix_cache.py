"""Automatic prefix caching: KV blocks kept by their content after use.

A full block of a request's tokens is named by a chained hash: the hash of
the block before it, the block's token ids, and, for image or video placeholder
positions, which rows of which item fill them (placeholder ids are the same
for every image; the content hash of the item is what differs). So equal
names mean equal tokens, equal media and equal positions from the start of
the prompt, and equal KV in every layer. A request's cache_salt (vLLM's)
starts its chain, so only requests with the same salt share blocks. Prompt
blocks are named as they are computed; the blocks its output filled when
the request ends or is preempted (a chat's next turn has them in its prompt).

`PrefixCachingPool` has BlockPool's interface (kv_blocks.py) and keeps
the names of blocks no request holds any more. Such a block counts as free;
until it is allocated again (unnamed blocks first, then the least recently
freed, a prompt's last blocks before its first), a request whose prompt
starts the same way can take it back. `PrefixCache` is the scheduler's
side: a new request's longest named prefix, the names of its blocks as they
are computed, and the hit counters behind vLLM's prefix cache metrics.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import xxhash

from pipeline.engine.kv_blocks import BlockPool
from pipeline.engine.request import PENDING_TOKEN, Request


def block_name(parent: bytes, token_bytes: bytes, media: list[tuple[str, int, int]]) -> bytes:
    """The name of one full block: its token ids as int64 bytes; `media`
    lists (item key, its first row in this block, the block position it
    starts at) for each placeholder run in it."""
    h = xxhash.xxh3_128(parent)
    h.update(token_bytes)
    for key, row, at in media:
        h.update(f"|{key}:{row}@{at}".encode())
    return h.digest()


def chain_start(request: Request) -> bytes:
    """The parent of a request's first block. A salt starts a chain of its
    own: no name of a salted prompt equals an unsalted one's, or another salt's."""
    return xxhash.xxh3_128(b"salt|" + request.cache_salt.encode()).digest() if request.cache_salt else b""


def block_names(request: Request, block_size: int, first: int, last: int, parent: bytes) -> list[bytes]:
    """The names of the request's full blocks [first, last) over its prompt
    and then its output tokens; `parent` is block first - 1's name (or the
    chain's start)."""
    tokens = np.asarray(request.token_ids_between(first * block_size, last * block_size), dtype=np.int64).tobytes()
    width = block_size * 8
    spans = request.image_spans   # sorted, not overlapping; all in the prompt
    names: list[bytes] = []
    next_span = 0   # the first span that does not end before this block
    for block in range(first, last):
        lo, hi = block * block_size, (block + 1) * block_size
        while next_span < len(spans) and spans[next_span].end <= lo:
            next_span += 1
        media = []
        for span in spans[next_span:]:
            if span.start >= hi:
                break
            media.append((span.key, span.offset + max(lo - span.start, 0), max(span.start - lo, 0)))
        at = (block - first) * width
        parent = block_name(parent, tokens[at:at + width], media)
        names.append(parent)
    return names


def prompt_block_names(request: Request, block_size: int) -> list[bytes]:
    """The names of the prompt's full blocks, first to last."""
    return block_names(request, block_size, 0, request.num_prompt_tokens // block_size, chain_start(request))


class PrefixCachingPool(BlockPool):
    """KV block ids: free, held by requests (counted: a cached block may be
    held by several), or free but named, kept for reuse until allocated."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        super().__init__(num_blocks, block_size)   # its _free: the unnamed blocks; _used is not kept here
        del self._used
        self._refs: dict[int, int] = {}   # held blocks -> how many requests hold them
        self._cached: OrderedDict[int, None] = OrderedDict()   # named, held by none; oldest first
        self._name_of: dict[int, bytes] = {}
        self._block_of: dict[bytes, int] = {}

    def allocate(self, n: int) -> list[int] | None:
        """`n` block ids, or None (and nothing taken) if fewer are free.
        Unnamed blocks go first; then the named ones freed longest ago lose their names."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > self.num_free:
            return None
        ids = []
        for _ in range(n):
            if self._free:
                block = self._free.pop()
            else:
                block, _ = self._cached.popitem(last=False)
                del self._block_of[self._name_of.pop(block)]
            self._refs[block] = 1
            ids.append(block)
        return ids

    def free(self, block_ids: list[int]) -> None:
        """One request lets go of its blocks (in order, first block first).
        A block not held (double free, unknown id, the same id twice in one
        call) raises ValueError and frees nothing."""
        ids = list(block_ids)
        bad = [b for b in ids if b not in self._refs]
        if bad or len(set(ids)) != len(ids):
            raise ValueError(f"blocks {bad or ids} are not allocated (double free?)")
        for block in reversed(ids):   # a prompt's last blocks are the first to lose their names
            self._refs[block] -= 1
            if self._refs[block]:
                continue
            del self._refs[block]
            if block in self._name_of:
                self._cached[block] = None
            else:
                self._free.append(block)

    def take_cached(self, names: list[bytes]) -> list[int]:
        """The blocks of the longest run of `names` from the first, each now
        held once more (a block free but named is held again)."""
        taken = []
        for name in names:
            block = self._block_of.get(name)
            if block is None:
                break
            if block in self._cached:
                del self._cached[block]
            self._refs[block] = self._refs.get(block, 0) + 1
            taken.append(block)
        return taken

    def name(self, block: int, name: bytes) -> None:
        """A held block now holds the KV its name says. Where another block
        already has that name (two equal prompts computed in one step), the
        first keeps it and this one stays unnamed."""
        if block not in self._refs:
            raise ValueError(f"block {block} is not allocated")
        if name not in self._block_of and block not in self._name_of:
            self._block_of[name] = block
            self._name_of[block] = name

    def is_allocated(self, block_id: int) -> bool:
        return block_id in self._refs

    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._cached)

    @property
    def num_used(self) -> int:
        return len(self._refs)

    @property
    def num_cached(self) -> int:
        """Named blocks, held or not."""
        return len(self._name_of)


class PrefixCache:
    """The scheduler's side: what a request can reuse, and naming its blocks
    as they are computed. Counters (in tokens, as vLLM's): `queries`, the
    prompt tokens of requests admitted, and `hits`, those found cached."""

    def __init__(self, pool: PrefixCachingPool) -> None:
        self.pool = pool
        self.block_size = pool.block_size
        self._names: dict[str, list[bytes]] = {}    # request id -> its prompt's block names
        self.queries = 0
        self.hits = 0

    def reuse(self, request: Request) -> int:
        """For a request with nothing computed and no blocks: take the
        blocks of its longest cached prompt prefix (always leaving a token
        to compute, whose logits give the next token) as its first blocks.
        Returns the tokens reused, now counted as computed."""
        if request.num_computed_tokens or len(request.block_ids):
            raise ValueError(f"request {request.request_id} already has KV")
        names = self._names_of(request)
        usable = min(len(names), (request.num_tokens - 1) // self.block_size)
        if request.sampling_params.prompt_logprobs is not None:
            usable = 0   # its prompt's logprobs need every position computed (engine/prompt_logprobs.py)
        blocks = self.pool.take_cached(names[:usable])
        if blocks:
            request.block_ids.extend(blocks)
            request.num_computed_tokens = len(blocks) * self.block_size
        return request.num_computed_tokens

    def undo(self, request: Request) -> None:
        """Give back what reuse() took (the request was not admitted after all)."""
        if len(request.block_ids):
            self.pool.free(request.block_ids.tolist())
            request.block_ids.clear()
        request.num_computed_tokens = 0

    def admitted(self, request: Request, reused: int) -> None:
        self.queries += request.num_prompt_tokens
        self.hits += reused
        if not request.num_preemptions:   # as vLLM's num_cached_tokens: what its first admission found
            request.num_cached_tokens = reused

    def computed(self, request: Request, chunk_start: int) -> None:
        """A chunk from `chunk_start` was computed: name the prompt blocks it
        filled (those before it were named when they filled, or reused named)."""
        done = min(request.num_computed_tokens, request.num_prompt_tokens) // self.block_size
        first = chunk_start // self.block_size   # may have filled before; naming it again changes nothing
        if done <= first:
            return
        names = self._names_of(request)
        blocks = request.block_ids.view()
        for i in range(first, done):
            self.pool.name(int(blocks[i]), names[i])

    def retire(self, request: Request) -> None:
        """Before its blocks are freed (it finished or was preempted): name
        the full blocks of its output whose KV is computed, so that they
        outlive it as its prompt's do. A chat's next turn carries this answer
        in its prompt, and a preempted request finds them again. A block
        holding a token still on the device would stay unnamed; none does
        today, as decode ahead reads a step's tokens before a request can end
        or be preempted (engine/ahead.py); the check keeps a wrong name out
        should that order change."""
        bs = self.block_size
        names = self._names_of(request)
        start = request.num_prompt_tokens // bs   # the first block with output in it
        done = min(request.num_computed_tokens, request.num_tokens) // bs
        filled = request.token_ids_between(start * bs, done * bs)
        if PENDING_TOKEN in filled:
            done = start + filled.index(PENDING_TOKEN) // bs
        if done > len(names):
            names += block_names(request, bs, len(names), done, names[-1] if names else chain_start(request))
        blocks = request.block_ids.view()
        for i in range(start, done):
            self.pool.name(int(blocks[i]), names[i])

    def forget(self, request: Request) -> None:
        self._names.pop(request.request_id, None)

    def _names_of(self, request: Request) -> list[bytes]:
        names = self._names.get(request.request_id)
        if names is None:
            names = self._names[request.request_id] = prompt_block_names(request, self.block_size)
        return names
