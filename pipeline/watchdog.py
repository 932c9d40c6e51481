"""A stage's hang watchdog. The loop it watches calls `progress()` as it
goes; once it has not for `timeout_s`, every thread's stack is written to
stderr (the stage's log) and the process exits with code 1. The launcher
then restarts it, and the proxy moves its requests, as after a crash: a
stage whose receiver still answers while its engine thread or vision
forward is stuck would otherwise look up forever, its requests hung.

Built on faulthandler's timer, which runs in C without the GIL, so a thread
stuck in native code while holding the GIL still trips it.
"""

from __future__ import annotations

import faulthandler
import math
import sys
import time

REARM_S = 1.0   # progress re-arms the timer at most this often (a decode loop turns every few ms)...
REARM_SHARE = 0.25   # ...and at most a quarter of the timeout: it trips after 3/4 to all of it idle
DEFAULT_TIMEOUT_S = 60.0   # vLLM's engine iteration timeout


class HangWatchdog:
    def __init__(self, timeout_s: float | None) -> None:
        """timeout_s: None or 0 turns it off."""
        if timeout_s is not None and timeout_s < 0:
            raise ValueError(f"a hang timeout must be >= 0 seconds (got {timeout_s})")
        self.timeout_s = timeout_s or None
        self.rearm_s = min(REARM_S, REARM_SHARE * (self.timeout_s or math.inf))
        self._armed_at = -math.inf

    def progress(self, force: bool = False) -> None:
        """The watched loop moved on: the timer starts again (within rearm_s,
        unless `force`: a long wait is about to begin)."""
        if self.timeout_s is None:
            return
        now = time.monotonic()
        if force or now - self._armed_at >= self.rearm_s:
            faulthandler.dump_traceback_later(self.timeout_s, exit=True, file=sys.stderr)
            self._armed_at = now

    def stop(self) -> None:
        """No more watching (the stage is stopping)."""
        if self.timeout_s is not None:
            faulthandler.cancel_dump_traceback_later()
            self._armed_at = -math.inf


def add_hang_timeout_flag(parser, watched: str) -> None:
    """--hang-timeout for a stage whose `watched` (e.g. "the engine loop") is watched."""
    parser.add_argument("--hang-timeout", type=float, default=DEFAULT_TIMEOUT_S,
                        help=f"seconds {watched} may go without progress before this process writes every "
                             f"thread's stack to its log and exits, to be restarted (0: never; "
                             f"default {DEFAULT_TIMEOUT_S:g})")
