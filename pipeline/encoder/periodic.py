"""The encoder's periodic chores, each a task beside its decode and compute
loops: the busy profile logged, silent consumers' leases expired, and the
hang watchdog kept armed while the event loop turns."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter

from pipeline.encoder.profile import profile_line
from pipeline.logs import STATS_LOGGER

log = logging.getLogger("epd.encoder")
stats_log = logging.getLogger(STATS_LOGGER)   # --disable-log-stats quiets it
PROFILE_LOG_S = 10.0   # how often the busy profile is logged while there is work

# Each takes the EncoderService (not imported: it imports this).


async def profile_loop(service) -> None:
    """Every PROFILE_LOG_S with work in it: one line of where the time went
    (decode and forward seconds are summed wall times of each batch, so busy
    shares show which of the two saturates first)."""
    while True:
        started = time.monotonic()
        await asyncio.sleep(PROFILE_LOG_S)
        busy, service.busy = service.busy, Counter()
        service.busy_totals.update(busy)
        if busy:
            line = profile_line(busy, time.monotonic() - started, len(service.decoded), len(service.to_decode))
            stats_log.info("encoder profile %s", line)


async def expiry_loop(service) -> None:
    while True:
        await asyncio.sleep(service.settings.expiry_interval)
        for lease in service.store.index.expire():
            log.warning("lease %s of silent consumer %s expired", lease.lease_id, lease.owner)
            service.space.freed()


async def watchdog_loop(service) -> None:
    """The event loop turns: progress, unless a vision forward is running
    (its start armed the watchdog, and it must end within the timeout)."""
    while True:
        if not service.forwarding:
            service.watchdog.progress()
        await asyncio.sleep(service.watchdog.rearm_s)
