"""A stage started by epd-launch stops on its own when the launcher is gone
(killed, so that it could not stop them): nothing is left running without
a supervisor, holding the HTTP port, the GPUs' memory and /dev/shm, where a
restarted launcher would find them in its way.

The launcher names itself in EPD_LAUNCHER_PID; a stage whose parent is no
longer that process has outlived it. A stage started by hand has no such
variable and never stops this way.

Nothing in flight is lost to it. The proxy stops as on SIGTERM: it stops
listening and lets the requests it holds finish, for --drain-timeout.
Encoders and generators go on serving it meanwhile, and stop once no proxy
has asked them for stats for QUIET_S (a proxy asks every 0.5 s): by then
the proxy has finished, or gone.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from collections.abc import Mapping
from pathlib import Path

LAUNCHER_PID_ENV = "EPD_LAUNCHER_PID"
QUIET_S = 5.0     # no stats asked for this long: no proxy is left to serve
CHECK_S = 0.5

log = logging.getLogger("epd.launcher_watch")


class LauncherWatch:
    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        text = (os.environ if env is None else env).get(LAUNCHER_PID_ENV, "")
        self.launcher = int(text) if text.isdigit() else None
        self.last_asked = time.monotonic()

    def launcher_gone(self) -> bool:
        return self.launcher is not None and os.getppid() != self.launcher

    def asked(self) -> None:
        """A proxy asked for this stage's stats: it is still being served."""
        self.last_asked = time.monotonic()

    def nobody_left(self) -> bool:
        """For encoders and generators: the launcher is gone, and so is
        every proxy (none has asked for QUIET_S). The clock first: while a
        proxy asks, as it does every 0.5 s, this costs no system call (a
        generator's receiver asks it per message)."""
        return (self.launcher is not None and time.monotonic() - self.last_asked > QUIET_S
                and self.launcher_gone())

    def log_stopping(self, stage: str) -> None:
        log.warning("the launcher (pid %d) is gone and no proxy has asked for %g s: this %s stops",
                    self.launcher, QUIET_S, stage)


def remove_own_files(watch: LauncherWatch, address: str, *paths: str | None) -> None:
    """At a stage's exit: the file of its ipc:// inbox and the other files
    of its own in the run folder (a generator's prefill signal), which the
    launcher removes when it stops the stage, but a launcher that is gone
    cannot. Only then: a stage the launcher restarts uses the same paths."""
    if not watch.launcher_gone():
        return
    own = [address.removeprefix("ipc://")] if address.startswith("ipc://") else []
    for path in own + [p for p in paths if p]:
        Path(path).unlink(missing_ok=True)


async def until_nobody_left(watch: LauncherWatch, stage: str) -> None:
    """Return (an encoder's serving then stops) once nobody is left to serve."""
    while not watch.nobody_left():
        await asyncio.sleep(CHECK_S)
    watch.log_stopping(stage)


async def drain_when_launcher_gone(watch: LauncherWatch) -> None:
    """The proxy's: once the launcher is gone, stop as SIGTERM stops it
    (stop listening, drain what is in flight, exit)."""
    if watch.launcher is None:
        return
    while not watch.launcher_gone():
        await asyncio.sleep(CHECK_S)
    log.warning("the launcher (pid %d) is gone: the proxy stops listening, lets its requests finish and exits",
                watch.launcher)
    os.kill(os.getpid(), signal.SIGTERM)
