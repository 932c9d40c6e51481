"""Prefill pacing: prefill chunks held back while they would stretch the
decoding requests' time between tokens past a target.

A mixed step (prefill chunks beside the decodes) takes several times a
decode step: on the H200 under the half text-only load of issue 14, 25 ms
against 4.5 (docs/benchmarks.md). The decoding requests wait for it, so a
burst of image requests, which the scheduler otherwise prefills step after
step, stretches every decoding request's time per output token (TPOT) for
as long as the burst lasts. Requests waiting for their first token have
slack (there the images' P99 TTFT was 340 ms against a 2 s SLO); those
decoding have none.

So with a target of T ms the engine plans a step with prefill only while
the mean time between the last steps' tokens, counting the next step as
long as the last mixed one, stays within T; otherwise it runs a decode-only
step. Over a window the mixed steps are then spaced so that decoding
requests average at most T (as long as decode steps alone are faster), and
the prefill a burst brings waits, in larger chunks, instead. Prefill is
never held for more than `max_hold_s` in a row, so it keeps a share of the
steps even where decode steps alone are slower than T, and never while no
request is decoding (no one's tokens to protect). Off unless a target is
given.
"""

from __future__ import annotations

from collections import deque


class PrefillPacer:
    def __init__(self, target_s: float | None, max_hold_s: float = 0.5, window: int = 32) -> None:
        if target_s is not None and not target_s > 0:
            raise ValueError(f"prefill pacing target must be > 0 s, got {target_s!r}")
        if not max_hold_s >= 0:
            raise ValueError(f"prefill pacing max hold must be >= 0 s, got {max_hold_s!r}")
        if window < 2:
            raise ValueError(f"prefill pacing window must be at least 2 steps, got {window}")
        self.target_s = target_s
        self.max_hold_s = max_hold_s
        self._token_times: deque[float] = deque(maxlen=window)   # when steps' tokens reached the host
        self._last_mixed_s = 0.0      # the last mixed step's time between tokens
        self._last_was_mixed = False
        self._held_since: float | None = None
        self.held_steps = 0           # decode-only steps planned while prefill was due (a counter)

    @property
    def enabled(self) -> bool:
        return self.target_s is not None

    def on_tokens(self, now: float, mixed: bool) -> None:
        """A step's tokens reached the host at `now`; `mixed`: it carried prefill."""
        if mixed and self._token_times:
            self._last_mixed_s = now - self._token_times[-1]
        self._token_times.append(now)
        self._last_was_mixed = mixed

    def on_no_decodes(self) -> None:
        """No request is decoding: the gaps so far were nobody's time between tokens."""
        self._token_times.clear()
        self._held_since = None

    def allows_prefill(self, now: float) -> bool:
        """Whether the next step may carry prefill chunks (asked only when
        some are due and some request decodes). A False counts as a held step."""
        if self.target_s is None or len(self._token_times) < 2:
            return self._release()
        times = self._token_times
        projected = (now - times[0] + self._last_mixed_s) / len(times)
        if projected <= self.target_s:
            return self._release()
        if self._held_since is None:
            self._held_since = now
        elif now - self._held_since >= self.max_hold_s:
            return self._release()
        self.held_steps += 1
        return False

    def _release(self) -> bool:
        self._held_since = None
        return True


def prefill_allowed(pacer: PrefillPacer, scheduler, now: float) -> bool:
    """The engine's question before each step: may it carry prefill?"""
    if not pacer.enabled:
        return True
    if not scheduler.any_decoding():
        pacer.on_no_decodes()
        return True
    return not scheduler.prefill_due() or pacer.allows_prefill(now)
