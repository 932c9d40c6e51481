"""The generator's engine: schedule -> execute -> update, one step at a time.

Holds the scheduler (plain CPU planning), the runner (the model), per-request
text state, and the embeddings that arrived before there was room for them.
It does no I/O: the generator process feeds it requests and embeddings and
ships its outputs.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import replace

import torch

from pipeline.engine.admission import check_params
from pipeline.engine.config import EngineConfig
from pipeline.engine.decode_graphs import DecodeGraphs
from pipeline.engine.kv_blocks import num_blocks_for_memory
from pipeline.engine.mixed_graphs import MixedGraphs
from pipeline.engine.output import RequestOutput, Resumed, TextState
from pipeline.engine.pacing import PrefillPacer, prefill_allowed
from pipeline.engine.paged_attention import PagedKVCache
from pipeline.engine.plan import FinishedRequest, SchedulerConfig
from pipeline.engine.request import ImageSpan, Request, RequestStatus
from pipeline.sampling_params import SamplingParams
from pipeline.models.spec import span_rows
from pipeline.engine.runner import ModelRunner, PromptGeometry
from pipeline.engine.ahead import DecodeAhead
from pipeline.engine.choose import choose
from pipeline.engine.grammar import Grammars
from pipeline.engine.live import LiveRequest
from pipeline.engine.penalties import PenaltyPool, uses_penalties
from pipeline.engine.sampler import SamplingRow, bad_word_bans, make_generator
from pipeline.engine.scheduler import Scheduler
from pipeline.engine.step_profile import StepProfile, step_kind
from pipeline.prefill_signal import signalling
from pipeline.processing.processor import MultimodalPrompt
from pipeline.processing.tokenizer import Tokenizer

log = logging.getLogger("epd.engine")


class Engine:
    def __init__(self, model: torch.nn.Module, tokenizer: Tokenizer, config: EngineConfig,
                 device: torch.device) -> None:
        lang = model.spec.language
        dtype = next(model.parameters()).dtype
        num_blocks = num_blocks_for_memory(config.kv_cache_bytes, lang.num_layers, lang.kv_heads, lang.head_dim,
                                           torch.empty(0, dtype=dtype).element_size(), config.block_size)
        self.config = config
        self.model = model
        self.tokenizer = tokenizer
        self.scheduler = Scheduler(SchedulerConfig(
            config.max_num_batched_tokens, config.max_num_seqs, config.block_size, num_blocks,
            config.encoder_cache_tokens, config.aggregated,
            config.local_encode_tokens if config.aggregated else 0, config.prefix_caching,
            config.scheduling_policy))
        # One block more than the scheduler hands out: the null block that
        # padding rows of a fast decode step read and write.
        kv = PagedKVCache(lang.num_layers, num_blocks + 1, config.block_size, lang.kv_heads, lang.head_dim,
                          dtype, device)
        decode = None
        if config.fast_decode or (config.fast_decode is None and device.type == "cuda"):
            model.fuse()
            max_len = min(lang.max_context, num_blocks * config.block_size)
            decode = DecodeGraphs(model, kv, num_blocks, config.max_num_seqs, max_len, device,
                                  use_graphs=config.cuda_graphs, matmul=config.decode_matmul)
            self._configure_dependent_launch(decode.fused, device)   # before any graph is captured
            started = time.monotonic()
            captured = decode.capture_up_to(config.capture_decode_len)
            if captured:
                log.info("captured %d decode graphs in %.1f s", captured, time.monotonic() - started)
        elif config.decode_matmul not in (None, "cublas"):
            raise ValueError(f"EngineConfig.decode_matmul={config.decode_matmul!r} needs fast decode, "
                             f"which is off here (fast_decode={config.fast_decode}, device {device})")
        self.runner = ModelRunner(model, kv, device, decode, self._mixed(model, kv, num_blocks, decode, device))
        self.live: dict[str, LiveRequest] = {}
        self.penalties = PenaltyPool(lang.vocab_size, config.max_num_seqs, device)
        self._grammars: Grammars | None = None   # made on the first request with a grammar (about 1 s)
        self.pending_embeddings: dict[str, tuple[torch.Tensor, float]] = {}
        self.refetch: list[str] = []
        self.profile = StepProfile()   # per-window step timings, for the generator's log
        self.last_step_idle = False   # the last step ran nothing (every request waits on images)
        self.ahead = DecodeAhead()   # a decode step in flight, read by the next step (engine/ahead.py)
        self._decode_ahead = config.decode_ahead if config.decode_ahead is not None else device.type == "cuda"
        self._arrivals = 0
        hold_s = config.prefill_pacing_max_hold_ms / 1e3
        self.pacer = PrefillPacer(None if config.prefill_pacing_ms is None else config.prefill_pacing_ms / 1e3, hold_s)
        # Called with True before a step with prefill tokens is launched and
        # with False once its logits are read (pipeline/prefill_signal.py).
        self.on_prefill: Callable[[bool], None] | None = None

    def _configure_dependent_launch(self, fused: bool, device: torch.device) -> None:
        wanted = self.config.dependent_launch
        if fused:
            from pipeline.kernels.dependent_launch import configure   # imports triton: only where it runs
            if configure(wanted, device):
                log.info("small decode batches' kernels launched with programmatic dependent launch")
        elif wanted:
            raise ValueError("EngineConfig.dependent_launch needs the fused decode kernels, which are off here")

    def _mixed(self, model, kv: PagedKVCache, num_blocks: int, decode: DecodeGraphs | None,
               device: torch.device) -> MixedGraphs | None:
        config = self.config
        if config.fast_mixed is False or (config.fast_mixed is None and (decode is None or not decode.fused)):
            return None
        if decode is None:
            raise ValueError("fast_mixed needs fast_decode (the fused projections and the null block)")
        max_len = min(model.spec.language.max_context, num_blocks * config.block_size)
        mixed = MixedGraphs(model, kv, num_blocks, config.max_num_batched_tokens, config.max_num_seqs, max_len,
                            device, use_graphs=config.cuda_graphs)
        started = time.monotonic()
        captured = mixed.capture_all()
        if captured:
            log.info("captured %d mixed-step graphs in %.1f s", captured, time.monotonic() - started)
        return mixed

    # ---------------------------------------------------------------- inputs

    def add_request(self, request_id: str, prompt: MultimodalPrompt, image_keys: list[str],
                    params: SamplingParams,
                    image_inputs: list[tuple[torch.Tensor, tuple[int, int, int]]] | None = None,
                    resumed: Resumed | None = None, cache_salt: str = "", priority: int = 0) -> None:
        """Queue a request. `image_keys[i]` names the embedding of image i
        (its content hash). In aggregated mode `image_inputs[i]` is image i's
        (pixel_values, grid), encoded here when the scheduler says so. `resumed`: it was
        moved here after those tokens (its prompt ends with them). `cache_salt`, `priority`: see Request."""
        if len(image_keys) != len(prompt.image_spans):
            raise ValueError(f"{len(image_keys)} image keys for {len(prompt.image_spans)} image spans")
        check_params(params, self.model.spec.language.vocab_size, self.tokenizer.eos_token_ids,
                     self.config.max_logprobs)
        if resumed and params.prompt_logprobs is not None:
            # Its prompt's logprobs went out with its first token, before the move.
            params = replace(params, prompt_logprobs=None)
        rows = span_rows(self.model.spec, prompt.grids, prompt.image_spans)
        spans = tuple(ImageSpan(start, length, key, r.offset, r.item_tokens)
                      for (start, length), key, r in zip(prompt.image_spans, image_keys, rows))
        items = {(r.item, key) for r, key in zip(rows, image_keys)}
        if len(items) != len({r.item for r in rows}):
            raise ValueError("the placeholder runs of one video carry different keys")
        request = Request(request_id, list(prompt.token_ids), spans, params,
                          tuple(self.tokenizer.eos_token_ids), self._arrivals, cache_salt=cache_salt,
                          priority=priority)
        self._arrivals += 1
        positions, delta = self.model.prompt_positions(len(prompt.token_ids), prompt.image_spans, prompt.grids,
                                                       list(prompt.seconds_per_grid) or None)
        inputs = dict(zip(image_keys, image_inputs)) if image_inputs else {}
        earlier = resumed.token_ids if resumed else ()
        # As vLLM, EOS is checked first: one also asked for as a stop token ends the request for itself.
        eos_named = frozenset() if params.ignore_eos else frozenset(request.eos_token_ids)
        if tuple(prompt.token_ids[len(prompt.token_ids) - len(earlier):]) != earlier:
            raise ValueError("a resumed request's prompt must end with the tokens it had produced")
        matcher = self.grammars().matcher(params.grammar) if params.grammar else None   # GrammarError: a 400
        if matcher is not None and earlier and not matcher.consume_tokens(list(earlier)):
            raise ValueError(f"the grammar refuses the tokens produced before the move: {matcher.get_error()}")
        text = TextState.of(self.tokenizer, params, resumed)
        self.scheduler.add_request(request)
        self.live[request_id] = LiveRequest(PromptGeometry(positions, delta), text,
                                            make_generator(params, len(earlier)), inputs, matcher=matcher,
                                            earlier_output=earlier,
                                            stop_token_ids=frozenset(params.stop_token_ids) - eos_named,
                                            prompt_logprobs=None if params.prompt_logprobs is None else {})

    def add_embedding(self, key: str, embedding: torch.Tensor) -> None:
        """An image embedding arrived; kept pending until a request needs it
        and the cache has room. ValueError if its length disagrees with a
        request's placeholder run, or if its rows are not as wide as this
        model's (an encoder serving another model)."""
        width = self.model.spec.embedding_width
        if embedding.dim() != 2 or embedding.shape[1] != width:
            raise ValueError(f"image embedding {key} has shape {tuple(embedding.shape)}; this model takes "
                             f"[tokens, {width}] rows (is its encoder serving another model?)")
        if not self._admit(key, embedding) and not self._passed_by_all(key):
            self.pending_embeddings[key] = (embedding, time.monotonic())

    def _passed_by_all(self, key: str) -> bool:
        """Requests here read `key`, and each has computed past it (a cached prefix): it is dropped."""
        if self.scheduler.encoder_cache.is_needed(key):
            return False
        requests = (self.scheduler.get_request(rid) for rid in self.live)
        return any(span.key == key for r in requests if r is not None for span in r.image_spans)

    def _admit(self, key: str, embedding: torch.Tensor) -> bool:
        # One that no request needs yet (it beat its request here) waits in
        # pending: admitted now, the next step's cleanup of unused entries
        # would free it before its request arrived.
        return (self.scheduler.encoder_cache.is_needed(key)
                and self.scheduler.admit_embedding(key, embedding.shape[0], embedding))

    def abort(self, request_id: str) -> bool:
        self._forget(request_id)
        request = self.scheduler.get_request(request_id)
        keys = {span.key for span in request.image_spans} if request is not None else set()
        aborted = self.scheduler.abort(request_id)
        # Its pending embeddings that no one else needs go now, not after
        # orphan_embedding_ttl: they hold device memory, and a generator
        # counts them against its room for more (generator/parking.py).
        for key in keys:
            if key in self.pending_embeddings and not self.scheduler.encoder_cache.is_needed(key):
                del self.pending_embeddings[key]
        return aborted

    def has_work(self) -> bool:
        return self.scheduler.has_unfinished() or self.ahead.launched is not None

    def grammars_if_any(self) -> Grammars | None:
        """The grammar matchers' home, once a request has had a grammar."""
        return self._grammars

    # ------------------------------------------------- what the generator asks

    def embedding_needed(self, key: str) -> bool:
        """Some request here still needs the embedding of `key`."""
        return self.scheduler.encoder_cache.is_needed(key)

    def embedding_users(self, key: str) -> frozenset[str]:
        """The ids of the requests that need the embedding of `key`."""
        return self.scheduler.encoder_cache.users(key)

    def holds_embedding(self, key: str) -> bool:
        """The embedding of `key` is here: in the cache, or pending."""
        return self.scheduler.embedding_available(key) or key in self.pending_embeddings

    def has_room_for(self, tokens: int) -> bool:
        """An embedding of `tokens` rows fits beside the cache and the pending
        ones (always, with nothing pending: a large one is never stuck)."""
        if not self.pending_embeddings:
            return True
        cache = self.scheduler.encoder_cache
        pending = sum(embedding.shape[0] for embedding, _ in self.pending_embeddings.values())
        return cache.used_tokens + pending + tokens <= cache.capacity_tokens

    def take_refetches(self) -> list[str]:
        """The keys evicted (or lost to a preemption) since the last call."""
        keys, self.refetch = self.refetch, []
        return keys

    def request_image_tokens(self, request_id: str, key: str) -> int | None:
        """How many rows of `key`'s embedding the request takes; None if the
        request is not here or does not use `key`."""
        request = self.scheduler.get_request(request_id)
        spans = [s for s in request.image_spans if s.key == key] if request is not None else []
        return spans[0].item_tokens if spans else None

    def load(self) -> dict[str, float]:
        """Gauges of the queues and caches, for the generator's stats."""
        scheduler = self.scheduler
        return {"kv_blocks_used": float(scheduler.block_pool.num_used),
                "kv_blocks_total": float(scheduler.block_pool.num_used + scheduler.block_pool.num_free),
                "kv_block_size": float(scheduler.config.block_size),
                "running": float(scheduler.num_running), "waiting": float(scheduler.num_waiting),
                "encoder_cache_tokens": float(scheduler.encoder_cache.used_tokens),
                "pending_embeddings": float(len(self.pending_embeddings))}

    def counters(self) -> dict[str, int]:
        """Counters since start: scheduler yields and preemptions, prefix cache tokens, step profile."""
        stats = self.scheduler.stats
        prefix = self.scheduler.prefix
        cached = {"prefix_cache_queries": prefix.queries, "prefix_cache_hits": prefix.hits} if prefix else {}
        return {"yields": stats["yields_total"], "preemptions": stats["preemptions_total"],
                "decode_ahead_steps": self.ahead.steps, "prefill_held_steps": self.pacer.held_steps,
                **cached, **self.profile.counters(), **self.profile.iteration_counters()}

    # ------------------------------------------------------------------ step

    def step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        self._admit_pending()
        prefill = prefill_allowed(self.pacer, self.scheduler, time.monotonic())
        if self.ahead.launched is not None:
            self.last_step_idle = False
            outputs = self.ahead.step(self, prefill)
            if outputs:
                self.pacer.on_tokens(time.monotonic(), mixed=False)
            return outputs
        plan = self.scheduler.schedule(prefill)
        self.last_step_idle = not plan.chunks and not plan.encode_keys
        self.refetch += plan.refetch_keys
        t1 = time.perf_counter()
        if plan.encode_keys:
            self._encode_locally(plan.encode_keys)
        t2 = time.perf_counter()
        sampled: dict[str, int] = {}
        logprobs: dict = {}
        if plan.chunks:
            # The signal spans the step's device time: choose() waits for the logits.
            with signalling(self.on_prefill if plan.num_batched_tokens > len(plan.chunks) else None):
                started = time.monotonic()
                for chunk in plan.chunks:
                    self.live[chunk.request_id].phases.on_scheduled(started)
                requests = {c.request_id: self.scheduler.get_request(c.request_id) for c in plan.chunks}
                wanting = {rid: self.live[rid].prompt_logprobs for rid in requests
                           if self.live[rid].prompt_logprobs is not None}
                due, logits = self.runner.execute(plan, requests, {c.request_id: self.live[c.request_id].geometry
                                                                   for c in plan.chunks},
                                                  self.scheduler.encoder_cache.get, prompt_logprobs=wanting)
                # On a GPU the forward is only queued so far. The grammar masks need
                # only the tokens consumed already: the host fills them now, before
                # the first read that waits for the logits (in choose()).
                masks = self._grammars.fill([self.live[c.request_id].matcher for c in due]) if self._grammars else None
                rows = [self.sampling_row(c.request_id) for c in due]
                if self._decode_ahead and self.runner.is_fast_decode(plan, requests):
                    self.ahead.launch(self, plan, due, logits, rows, masks)   # read by the next step (engine/ahead.py)
                    self._record(plan, t0, t1, t2, time.perf_counter())
                    return []
                chosen = choose(logits, rows, self.penalties, masks, self._grammars)
            sampled = dict(zip((c.request_id for c in due), chosen.tokens))
            logprobs = {due[i].request_id: lp for i, lp in chosen.logprobs.items()}
        t3 = time.perf_counter()
        finished = {f.request_id: f for f in self.scheduler.update(plan, sampled)}
        outputs = [self.token_output(rid, token, finished.get(rid), logprobs.get(rid))
                   for rid, token in sampled.items()]
        self.scheduler.encoder_cache.drain_freed()
        if outputs:
            self.pacer.on_tokens(time.monotonic(), mixed=plan.num_batched_tokens > len(plan.chunks))
        self._record(plan, t0, t1, t2, t3)
        return outputs

    def _record(self, plan, t0: float, t1: float, t2: float, t3: float) -> None:
        tokens = sum(c.num_tokens for c in plan.chunks)
        phases = {"schedule": t1 - t0, "forward": t3 - t2, "update": time.perf_counter() - t3}
        if plan.encode_keys:
            phases["encode"] = t2 - t1
        self.profile.record(step_kind(tokens, len(plan.chunks), len(plan.encode_keys)), phases, tokens,
                            len(plan.chunks))

    def _admit_pending(self) -> None:
        now = time.monotonic()
        cache = self.scheduler.encoder_cache
        for key, (embedding, since) in list(self.pending_embeddings.items()):
            if self._admit(key, embedding):
                del self.pending_embeddings[key]
            elif not cache.is_needed(key) and now - since >= self.config.orphan_embedding_ttl:
                del self.pending_embeddings[key]

    def _encode_locally(self, keys: list[str]) -> None:
        inputs = {}
        for live in self.live.values():
            inputs.update({k: v for k, v in live.image_inputs.items() if k in keys})
        embeddings = self.runner.encode_images([inputs[k] for k in keys])
        for key, embedding in zip(keys, embeddings):
            self.scheduler.encoder_cache.set_payload(key, embedding)

    def sampling_row(self, request_id: str) -> SamplingRow:
        request = self.scheduler.get_request(request_id)
        params = request.sampling_params
        banned: tuple[int, ...] = ()
        if request.num_output_tokens < params.min_tokens:
            banned = tuple(set(params.stop_token_ids) | (set() if params.ignore_eos else set(request.eos_token_ids)))
        if params.bad_words_token_ids:
            banned = tuple(set(banned) | bad_word_bans(params.bad_words_token_ids, request.output_token_ids))
        live = self.live[request_id]
        if live.pool_row is None and uses_penalties(params):
            live.pool_row = self.penalties.take(request.prompt_token_ids, live.earlier_output)
        return SamplingRow(params, live.generator, banned, live.pool_row, live.matcher)

    def grammars(self) -> Grammars:
        if self._grammars is None:
            self._grammars = Grammars(self.tokenizer.to_json(), self.model.spec.language.vocab_size,
                                      tuple(self.tokenizer.eos_token_ids))
        return self._grammars

    def _forget(self, request_id: str) -> None:
        live = self.live.pop(request_id, None)
        if live is not None and live.pool_row is not None:
            self.penalties.give_back(live.pool_row)

    def token_output(self, request_id: str, token: int, finished: FinishedRequest | None,
                     logprobs=None) -> RequestOutput:
        live = self.live[request_id]
        live.phases.on_token(time.monotonic())
        chosen = (logprobs,) if logprobs is not None else ()
        request = self.scheduler.get_request(request_id)
        # As vLLM: a stop token (or EOS) that ends the request stays in the
        # token ids, and in the text only with include_stop_str_in_output.
        stop_token = finished is not None and finished.status is RequestStatus.FINISHED_STOPPED
        keep = not stop_token or live.text.include_stop
        delta = live.text.push(token) if keep else ""
        if finished is None and (live.text.stopped or (live.matcher is not None and live.matcher.is_stopped())):
            finished = self.scheduler.finish(request_id, RequestStatus.FINISHED_STOPPED)
        prompt_logprobs = ()
        if live.prompt_logprobs is not None:   # the first token: the prompt is all computed
            prompt_logprobs, live.prompt_logprobs = tuple(v for _, v in sorted(live.prompt_logprobs.items())), None
        if finished is None:
            return RequestOutput(request_id, (token,), delta, num_prompt_tokens=request.num_prompt_tokens,
                                 num_output_tokens=request.num_output_tokens, logprobs=chosen,
                                 prompt_logprobs=prompt_logprobs)
        delta += live.text.finish()
        self._forget(request_id)
        # A stop string the last allowed token completed ends it as "stop", not "length".
        reason = "stop" if live.text.stopped else finished.finish_reason
        # vLLM's stop_reason: the stop token id asked for, or the stop string, that ended it.
        stop_reason = (token if token in live.stop_token_ids else None) if stop_token else live.text.stop_string
        return RequestOutput(request_id, (token,), delta, True, reason,
                             finished.num_prompt_tokens, len(finished.output_token_ids), logprobs=chosen,
                             phases=live.phases.durations(time.monotonic()), stop_reason=stop_reason,
                             num_cached_tokens=finished.num_cached_tokens, prompt_logprobs=prompt_logprobs)
