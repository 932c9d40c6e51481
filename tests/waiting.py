"""Waiting on a condition with a deadline instead of sleeping a guess; and,
for the end-to-end tests, on the proxy's stats poll catching up with now."""

from __future__ import annotations

import time
import uuid

import zmq

from pipeline import protocol, transport


def until(condition, what: str, deadline_s: float = 30.0, interval_s: float = 0.05):
    """condition()'s first truthy value, polled every interval_s; an
    AssertionError naming `what` once deadline_s has passed."""
    deadline = time.monotonic() + deadline_s
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {deadline_s}s waiting for {what}")
        time.sleep(interval_s)
    return value


def stage_address(stack, name: str) -> str:
    """The inbox of the Stack's stage `name` (what the proxy's /health names when it is down)."""
    argv = stack.argv[name]
    return argv[argv.index("--address") + 1]


def asked(stack, name: str, deadline_s: float = 10.0) -> protocol.StageStats:
    """Stage `name`'s stats as it reports them now, asked directly, as the
    proxy asks it (with an address of our own for the reply). A generator
    answers from a snapshot its engine loop takes every 50 ms."""
    ctx = zmq.Context()
    me = f"ipc://{stack.run_dir}/ask-{uuid.uuid4().hex[:8]}.sock"
    inbox = transport.make_socket(ctx, zmq.PULL, me, bind=True)
    out = transport.Outbox(ctx)
    try:
        out.send(stage_address(stack, name), protocol.StatsRequest(me))
        until(lambda: inbox.poll(0), f"{name} to answer a stats request", deadline_s)
        return protocol.decode(inbox.recv())
    finally:
        inbox.close(linger=0)
        out.close()
        ctx.term()


# Counters a stage reports as "PREFIX.LABEL" and the labelled /metrics series
# the proxy makes of them (pipeline/proxy/metrics.py): (stage, prefix, series, label).
_LABELLED = (("encoder", "images.", "epd_encoder_images_total", "phase"),
             ("encoder", "handoffs.", "epd_encoder_handoffs_total", "lane"),
             ("generator", "steps.", "epd_generator_steps_total", "kind"))
_JOB_OUTCOMES = ("encoded", "dedup", "failed")   # an encoder's, as epd_encoder_jobs_total{outcome}


def _exported(stats: protocol.StageStats) -> list[tuple[str, tuple[str, str], int]]:
    """(series, its labels as /metrics writes them, value) for the counters of `stats` named above."""
    instance = f'instance="{stats.instance}"'
    out = []
    if stats.stage == "encoder":
        out += [("epd_encoder_jobs_total", (instance, f'outcome="{key}"'), stats.counters[key])
                for key in _JOB_OUTCOMES if key in stats.counters]
    for stage, prefix, series, label in _LABELLED:
        if stats.stage == stage:
            out += [(series, (instance, f'{label}="{key[len(prefix):]}"'), value)
                    for key, value in stats.counters.items() if key.startswith(prefix)]
    return out


def caught_up(stack, deadline_s: float = 10.0) -> None:
    """Wait until the proxy's /metrics is no older than this call: for every
    live stage, the counters there reach what the stage itself reports now.
    (The proxy polls the stages' stats, every 0.5 s.) A stage whose counters
    did not move since the proxy's last poll passes at once: that poll shows
    its counters as they are now."""
    wanted = [entry for name, proc in stack.procs.items() if name != "proxy" and proc.poll() is None
              for entry in _exported(asked(stack, name))]

    def shown() -> bool:
        metrics = stack.metrics()

        def total(series: str, labels: tuple[str, str]) -> float:
            return sum(v for k, v in metrics.items() if k.split("{")[0] == series and all(s in k for s in labels))

        return all(total(series, labels) >= value for series, labels, value in wanted)

    until(shown, "the proxy's stats poll to catch up with the stages", deadline_s)
