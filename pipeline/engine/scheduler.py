"""One step of continuous batching, planned on the CPU.

`schedule()` returns a StepPlan (plain data); the runner executes it, `update()` applies the
sampled tokens. Checked every step: the token budget, max_num_seqs, KV blocks, the encoder
cache and, in aggregated mode, the local encode budget.

Images: a request never waits inside a batch for an embedding that is not in
the local encoder cache. Its chunk stops right before such a span, so the
text in front of the image still runs; if nothing is left, a running request
keeps its place and sits out the step, and a waiting one moves to the back of
the queue so the requests behind it go first.

Encoder-cache users: a request is a user of every image key it still has to
read, from the moment it is added (an embedding that arrives while its request
waits is kept, not dropped) until it has computed past the key's last span or
ends. A preempted request recomputes from token 0, so it becomes a user of all
its keys again: embeddings still cached stay, and keys it had already consumed
and that are gone are listed in `StepPlan.refetch_keys` (encoded again by the
plan in aggregated mode).

Liveness under encoder-cache pressure: the cache could fill with embeddings
that blocked requests only need later, while every request waits for an image
that does not fit. So room is made for an image some request reads *next*
(its first unconsumed span) by evicting entries that are nobody's next image,
then, for a running request, waiting requests' next images. Next images of
running requests and the spans of chunks already planned are never evicted.
Evicted keys that are still needed are refetched (or re-encoded).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from pipeline.engine.embedding_room import admit_arrived, keys_read, next_keys
from pipeline.engine.encoder_cache import EncoderCache
from pipeline.engine.admission import check_admissible
from pipeline.engine.kv_blocks import BlockPool, blocks_needed
from pipeline.engine.plan import Chunk, FinishedRequest, SchedulerConfig, StepPlan
from pipeline.engine.prefix_cache import PrefixCache, PrefixCachingPool
from pipeline.engine.queue_order import admit, enqueue, settle
from pipeline.engine.request import PENDING_TOKEN, ImageSpan, Request, RequestStatus, stop_status

__all__ = ["Chunk", "FinishedRequest", "PENDING_TOKEN", "Scheduler", "SchedulerConfig", "StepPlan"]


@dataclass
class _Budget:
    tokens: int
    encode_tokens: int


@dataclass
class _Draft:
    num_tokens: int = 0
    encodes: list[ImageSpan] = field(default_factory=list)   # aggregated: one per key
    protected: set[str] | None = None   # set when the encodes need evictions first

    @property
    def encode_tokens(self) -> int:
        return sum(s.item_tokens for s in self.encodes)


class Scheduler:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        # With prefix caching, computed prompt blocks outlive their requests (prefix_cache.py).
        self.prefix: PrefixCache | None = None
        if config.prefix_caching:
            self.block_pool = PrefixCachingPool(config.num_blocks, config.block_size)
            self.prefix = PrefixCache(self.block_pool)
        else:
            self.block_pool = BlockPool(config.num_blocks, config.block_size)
        self.encoder_cache = EncoderCache(config.encoder_cache_tokens)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []   # in queue_order's order: the last is preempted first
        self._requests: dict[str, Request] = {}
        self._cache_keys: dict[str, set[str]] = {}   # request id -> keys it is a user of
        self._refetch: list[str] = []         # evicted between steps, still needed
        self._in_flight: set[str] = set()     # keys the last plan reads until update()
        self.stats = {"yields_total": 0, "preemptions_total": 0}

    # -------------------------------------------------------------- requests

    def add_request(self, request: Request) -> None:
        """Queue a new request. ValueError if it can never run here."""
        if request.request_id in self._requests:
            raise ValueError(f"request {request.request_id} is already scheduled")
        check_admissible(self.config, request)
        self._requests[request.request_id] = request
        enqueue(self.waiting, request, self.config.policy)
        self._sync_cache_users(request)

    def abort(self, request_id: str) -> bool:
        """End a request and free what it holds; False if it is unknown."""
        return self.finish(request_id, RequestStatus.FINISHED_ABORTED) is not None

    def finish(self, request_id: str, status: RequestStatus) -> FinishedRequest | None:
        """End a request for a reason decided elsewhere (a stop string, an
        error); frees blocks, cache uses and its queue slot. None if unknown."""
        if not status.is_finished:
            raise ValueError(f"finish() needs a finished status, got {status}")
        request = self._requests.get(request_id)
        return None if request is None else self._finish(request, status)

    def embedding_available(self, key: str) -> bool:
        return self.encoder_cache.contains(key)

    def admit_embedding(self, key: str, num_tokens: int, payload: object = None) -> bool:
        """An embedding arrived (disaggregated mode). If the cache is full and
        some request reads `key` next, entries needed only later are evicted
        (and listed in the next plan's refetch_keys). False: keep it pending
        and offer it again after a later step. ValueError if its token count
        differs from a placeholder run of a request that needs it. Call it
        between steps; the keys of a plan not yet updated are never evicted."""
        admitted, evicted = admit_arrived(self.encoder_cache, self._requests, self.running, self.waiting,
                                          self._in_flight, key, num_tokens, payload)
        self._refetch += [k for k in evicted if self.encoder_cache.is_needed(k) and k not in self._refetch]
        return admitted

    def get_request(self, request_id: str) -> Request | None:
        return self._requests.get(request_id)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    # ------------------------------------------------------------ scheduling

    def schedule(self, prefill: bool = True) -> StepPlan:
        """The next step. prefill=False: a decode-only step; requests with
        prompt tokens left sit it out (engine/pacing.py)."""
        self.encoder_cache.free_unused()
        plan = StepPlan(refetch_keys=self._refetch)
        self._refetch = []
        budget = _Budget(self.config.max_num_batched_tokens, self.config.local_encode_tokens)
        self._schedule_running(plan, budget, prefill)
        if prefill and not plan.preempted:   # blocks were short for running requests: admit nobody
            self._schedule_waiting(plan, budget)
            settle(self.waiting, self.config.policy)
        self._in_flight = keys_read(plan)
        return plan

    def _schedule_running(self, plan: StepPlan, budget: _Budget, prefill: bool) -> None:
        i = 0
        while i < len(self.running) and budget.tokens > 0:
            request = self.running[i]
            if not prefill and not request.is_decoding:
                i += 1
                continue
            draft = self._draft_chunk(request, budget, plan)
            if draft.num_tokens == 0:
                self._note_yield(request, plan)   # keeps its place in the running list
                i += 1
                continue
            if not self._allocate_or_preempt(request, draft.num_tokens, plan):
                return   # it preempted itself: it was the last running request
            self._commit(request, draft, budget, plan)
            i += 1

    def _schedule_waiting(self, plan: StepPlan, budget: _Budget) -> None:
        # Each waiting request is looked at once per step, so one that moves
        # to the back is not met again.
        for _ in range(len(self.waiting)):
            if budget.tokens == 0 or len(self.running) >= self.config.max_num_seqs:
                return
            request = self.waiting[0]
            reused = self.prefix.reuse(request) if self.prefix else 0   # tentative until admitted
            draft = self._draft_chunk(request, budget, plan)
            if draft.num_tokens == 0:
                self._undo_reuse(request)
                self.waiting.rotate(-1)
                self._note_yield(request, plan)
                continue
            if not self._grow_blocks(request, draft.num_tokens):
                self._undo_reuse(request)
                return   # no preemption to admit; later arrivals do not jump the queue
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            admit(self.running, request, self.config.policy)
            if self.prefix:
                self.prefix.admitted(request, reused)
                self._sync_cache_users(request)   # images inside the reused prefix are not read
            self._commit(request, draft, budget, plan)

    def _undo_reuse(self, request: Request) -> None:
        if self.prefix and request.num_computed_tokens:
            self.prefix.undo(request)

    def _draft_chunk(self, request: Request, budget: _Budget, plan: StepPlan) -> _Draft:
        """The longest next chunk within the token budget that reads only local
        embeddings (or, in aggregated mode, ones it can encode this step)."""
        start = request.num_computed_tokens
        end = start + min(request.num_tokens - start, budget.tokens)
        draft = _Draft()
        for span in request.spans_in(start, end):
            if self.encoder_cache.contains(span.key) or any(e.key == span.key for e in draft.encodes):
                continue
            if self._can_encode(request, span, draft, budget, plan):
                draft.encodes.append(span)
                if draft.protected is None:
                    continue
                end = min(end, span.end)   # it needs evictions: read nothing past it
                break
            end = max(span.start, start)   # stop right before the missing image
            break
        draft.num_tokens = end - start
        return draft

    def _can_encode(self, request: Request, span: ImageSpan, draft: _Draft, budget: _Budget,
                    plan: StepPlan) -> bool:
        total = draft.encode_tokens + span.item_tokens
        if not self.config.aggregated or total > budget.encode_tokens:
            return False
        if self.encoder_cache.fits(total):
            return True
        # Keep what this chunk reads up to the end of `span` (the chunk then
        # stops there); the request's later images may go.
        protected = {s.key for s in request.spans_in(request.num_computed_tokens, span.end)}
        protected |= keys_read(plan) | next_keys(self.running)
        if request.status is RequestStatus.WAITING:
            protected |= next_keys(self.waiting)
        if self.encoder_cache.free_tokens + self.encoder_cache.evictable_tokens(protected) < total:
            return False
        draft.protected = protected
        return True

    def _commit(self, request: Request, draft: _Draft, budget: _Budget, plan: StepPlan) -> None:
        if draft.protected is not None and self.encoder_cache.make_room(
                draft.encode_tokens, draft.protected, next_keys(self.waiting)) is None:
            raise RuntimeError("encoder cache could not make the room the draft counted on")
        for span in draft.encodes:
            # Reserve the space now; the runner fills it before the forward.
            if not self.encoder_cache.admit(span.key, span.item_tokens):
                raise RuntimeError(f"encoder cache refused {span.key} after the draft checked it fits")
            budget.encode_tokens -= span.item_tokens
            plan.encode_keys.append(span.key)
        start, n = request.num_computed_tokens, draft.num_tokens
        budget.tokens -= n
        plan.chunks.append(Chunk(request.request_id, start, n, request.spans_in(start, start + n),
                                 sample=start + n == request.num_tokens))

    # ------------------------------------------------------------- KV blocks

    def _grow_blocks(self, request: Request, num_new_tokens: int) -> bool:
        """Blocks for `num_new_tokens` more tokens; all or nothing."""
        total = request.num_computed_tokens + num_new_tokens
        missing = blocks_needed(total, self.config.block_size) - len(request.block_ids)
        if missing <= 0:
            return True
        ids = self.block_pool.allocate(missing)
        if ids is None:
            return False
        request.block_ids.extend(ids)
        return True

    def _allocate_or_preempt(self, request: Request, num_new_tokens: int, plan: StepPlan) -> bool:
        """Preempt from the tail of the running list until `request` gets its
        blocks; False if it had to preempt `request` itself."""
        while not self._grow_blocks(request, num_new_tokens):
            victim = self.running[-1]
            self._preempt(victim, plan)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request, plan: StepPlan) -> None:
        consumed_before = request.num_computed_tokens
        self.running.remove(request)
        self._free_blocks(request)
        request.num_computed_tokens = 0   # recompute: the KV is gone (bar prefix-cached blocks, found again)
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        enqueue(self.waiting, request, self.config.policy, preempted=True)
        self._sync_cache_users(request)
        plan.preempted.append(request.request_id)
        self.stats["preemptions_total"] += 1
        if not self.config.aggregated:
            for span in request.image_spans:
                gone = span.end <= consumed_before and not self.encoder_cache.contains(span.key)
                if gone and span.key not in plan.refetch_keys:
                    plan.refetch_keys.append(span.key)

    def _free_blocks(self, request: Request) -> None:
        if request.block_ids:
            if self.prefix:
                self.prefix.retire(request)   # its output's computed blocks are kept too
            self.block_pool.free(request.block_ids.tolist())
            request.block_ids.clear()

    # ---------------------------------------------------------------- update

    def update(self, plan: StepPlan, sampled: dict[str, int]) -> list[FinishedRequest]:
        """Apply an executed plan: advance progress, append sampled tokens for
        chunks due a sample, end stopped requests. Chunks of requests that
        ended after the plan was made are skipped."""
        due = [c.request_id for c in plan.chunks if c.sample and (r := self._requests.get(c.request_id)) is not None
               and r.status is RequestStatus.RUNNING]
        if missing := [rid for rid in due if rid not in sampled]:
            raise ValueError(f"no sampled token for request {missing[0]}")
        self.advance(plan)
        return self.resolve({rid: sampled[rid] for rid in due})

    def advance(self, plan: StepPlan) -> None:
        """update()'s first half, for a plan whose sampled tokens are still on
        the device (engine/ahead.py): progress advances, and each sampled
        chunk's request gets PENDING_TOKEN until resolve() has the real one."""
        self._in_flight = set()
        for chunk in plan.chunks:
            request = self._requests.get(chunk.request_id)
            if request is None or request.status is not RequestStatus.RUNNING:
                continue
            if request.num_computed_tokens != chunk.start:
                raise RuntimeError(f"stale plan for {chunk.request_id}: chunk starts at {chunk.start}, "
                                   f"{request.num_computed_tokens} tokens computed")
            request.num_computed_tokens += chunk.num_tokens
            if self.prefix and chunk.start < request.num_prompt_tokens:
                self.prefix.computed(request, chunk.start)
            if chunk.sample:
                request.output_token_ids.append(PENDING_TOKEN)
            self._sync_cache_users(request)

    def resolve(self, sampled: dict[str, int]) -> list[FinishedRequest]:
        """The second half: pending tokens become the sampled ones; the
        requests they stop end; those that ended since (aborts) are skipped."""
        finished: list[FinishedRequest] = []
        for request_id, token in sampled.items():
            request = self._requests.get(request_id)
            if request is None or request.status is not RequestStatus.RUNNING:
                continue
            if not request.output_token_ids or request.output_token_ids[-1] != PENDING_TOKEN:
                raise RuntimeError(f"request {request_id} has no pending token to resolve")
            request.output_token_ids[-1] = token
            status = stop_status(request)
            if status is not None:
                finished.append(self._finish(request, status))
        return finished

    def can_decode_ahead(self, request_ids: set[str], prefill: bool = True) -> bool:
        """The next plan can be made before the last one's tokens are read:
        nobody is refetched or waits, every running request decodes (it was in
        `request_ids`, the last plan's), and one more token each fits in the
        free blocks (a preempted request would recompute a pending token).
        prefill=False, a decode-only plan: only the decoding requests count."""
        decoding = [r for r in self.running if r.is_decoding]
        if self._refetch or not decoding or (prefill and (self.waiting or len(decoding) < len(self.running))) \
                or any(r.request_id not in request_ids for r in decoding):
            return False
        size = self.config.block_size
        needing = sum(1 for r in decoding if blocks_needed(r.num_computed_tokens + 1, size) > len(r.block_ids))
        return needing <= self.block_pool.num_free and len(decoding) <= self.config.max_num_batched_tokens

    def prefill_due(self) -> bool:
        return bool(self.waiting) or not all(r.is_decoding for r in self.running)

    def any_decoding(self) -> bool:
        return any(r.is_decoding for r in self.running)

    def _finish(self, request: Request, status: RequestStatus) -> FinishedRequest:
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self._free_blocks(request)
        if self.prefix:
            self.prefix.forget(request)
        request.status = status
        request.finish_reason = status.finish_reason
        self._sync_cache_users(request)
        del self._requests[request.request_id]
        return FinishedRequest(request.request_id, status, status.finish_reason,
                               tuple(request.output_token_ids), request.num_prompt_tokens,
                               request.num_preemptions, request.num_cached_tokens)

    def _sync_cache_users(self, request: Request) -> None:
        """Make the request a user of exactly the keys it still has to read."""
        rid = request.request_id
        if rid not in self._cache_keys and request.num_computed_tokens >= request.images_end:
            return   # holds no keys and needs none: every decoding request, every step
        needed = set() if request.status.is_finished else request.keys_still_needed()
        held = self._cache_keys.pop(rid, set())
        for key in sorted(needed - held):
            self.encoder_cache.add_user(key, rid)
        for key in sorted(held - needed):   # sorted: a deterministic freed-key order
            self.encoder_cache.release_user(key, rid)
        if needed:
            self._cache_keys[rid] = needed

    def _note_yield(self, request: Request, plan: StepPlan) -> None:
        plan.yielded.append(request.request_id)
        self.stats["yields_total"] += 1

