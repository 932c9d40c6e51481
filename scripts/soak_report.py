"""The soak's verdict: every request classified, each stage's RSS judged,
and one condition per acceptance line (docs/reliability.md states them).

A failed request is excused (`generator_fault`) only when a generator fault
could have caused it: its error is the proxy's "lost its generator" or "no
generator is available" 503, and it was in flight between a generator's
kill or stop and GRACE_S after the stack had recovered from it. Every other
failure is a loss.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

from soak_faults import KINDS, Fault
from soak_load import ABORTED, FAILED, SUCCEEDED, Result
from soak_stack import Incarnation

GRACE_S = 5.0     # the proxy's down timeout (3 s) and a stats round after the recovery
EXCUSED_ERRORS = ("lost its generator", "no generator is available")
FINISHED = re.compile(r"request (soak-\d+) finished: .*")


def classify(results: list[Result], faults: list[Fault], end_s: float) -> dict[int, str]:
    """Request index -> succeeded, aborted, generator_fault or lost:<cause>."""
    windows = [(f.at_s, (f.recovered_s if f.recovered_s is not None else end_s) + GRACE_S)
               for f in faults if f.touches_generator]
    out = {}
    for r in results:
        if r.outcome in (SUCCEEDED, ABORTED):
            out[r.index] = r.outcome
        elif (any(text in r.error for text in EXCUSED_ERRORS)
              and any(r.sent_s <= until and r.ended_s >= since for since, until in windows)):
            out[r.index] = "generator_fault"
        else:
            out[r.index] = f"lost:{r.cause}"
    return out


def request_figures(results: list[Result], classes: dict[int, str]) -> dict:
    counts = Counter(classes.values())
    lost = {c.partition(":")[2]: n for c, n in counts.items() if c.startswith("lost:")}
    return {"sent": len(results), "succeeded": counts[SUCCEEDED], "aborted_by_client": counts[ABORTED],
            "failed_generator_fault": counts["generator_fault"], "lost": sum(lost.values()), "lost_by_cause": lost,
            "connection_retries": sum(r.retries for r in results),
            "unsent_retries": sum(r.resets for r in results),
            "requests_retried": sum(1 for r in results if r.retries or r.resets),
            "text_only": sum(1 for r in results if not r.images),
            "with_images": sum(1 for r in results if r.images), "streamed": sum(1 for r in results if r.stream)}


def failures(results: list[Result], classes: dict[int, str], proxy_log: Path) -> list[dict]:
    """Each failed request with the proxy's log line about it (the evidence)."""
    lines = {}
    if proxy_log.exists():
        for line in proxy_log.read_text(errors="replace").splitlines():
            if match := FINISHED.search(line):
                lines[match[1]] = match[0][:400]
    return [{"index": r.index, "class": classes[r.index], "cause": r.cause, "error": r.error, "status": r.status,
             "sent_s": round(r.sent_s, 2), "ended_s": round(r.ended_s, 2), "retries": r.retries,
             "proxy_log": lines.get(f"soak-{r.index}")}
            for r in results if r.outcome == FAILED]


def rss_verdicts(incarnations: list[Incarnation], warmup_end_s: float, warmup_s: float, ready: dict[int, float],
                 live: set[int], tolerance: float) -> list[dict]:
    """Per process: RSS at its end (at idle after the load, or its last sample
    before a fault ended it) against the first sample after its warm-up: the
    run's, and for a process started later `warmup_s` after it was ready
    (`ready`: pid -> when the stack was whole with it; else from when its
    start was seen). Judged when it has a sample past that one."""
    out = []
    for inc in incarnations:
        after = max(warmup_end_s, ready.get(inc.pid, inc.seen_s) + warmup_s)
        baseline = next((s for s in inc.samples if s[0] >= after), None)
        end = inc.samples[-1] if inc.samples else None
        judged = baseline is not None and end[0] > baseline[0]
        ratio = round(end[1] / baseline[1], 4) if judged else None
        anon = round(end[2] / baseline[2], 4) if judged and len(end) > 2 and baseline[2] else None
        out.append({"instance": inc.instance, "pid": inc.pid, "seen_s": round(inc.seen_s, 2), "judged": judged,
                    "to_the_end": inc.pid in live,
                    "baseline_s": baseline[0] if baseline else None, "baseline_kib": baseline[1] if baseline else None,
                    "end_s": end[0] if end else None, "end_kib": end[1] if end else None, "ratio": ratio,
                    "anon_ratio": anon,   # RssAnon alone: VmRSS also counts arena pages as they are first touched
                    "within": None if ratio is None else abs(ratio - 1) <= tolerance,
                    "samples": inc.samples})
    return out


def unexpected_restarts(incarnations: list[Incarnation], first: set[int], faults: list[Fault]) -> list[str]:
    """Processes that are neither of the first start nor a fault's recovery:
    a stage that died by itself."""
    explained = first | {f.new_pid for f in faults if f.new_pid is not None}
    return [f"{inc.instance} pid {inc.pid} at {inc.seen_s:.0f} s" for inc in incarnations if inc.pid not in explained]


def conditions(report: dict, tolerance: float) -> dict[str, tuple[bool, str]]:
    """Acceptance line -> (holds, what was seen)."""
    req, stop, idle = report["requests"], report["stop"], report["idle"]
    rss = report["rss"]
    judged = [v for v in rss if v["judged"]]
    unjudged = sorted({v["instance"] for v in rss} - {v["instance"] for v in judged if v["to_the_end"]})
    outside = [f"{v['instance']} pid {v['pid']}: x{v['ratio']}" for v in judged if not v["within"]]
    faults = report["faults"]
    return {
        "load_served": (req["sent"] > 0 and req["succeeded"] > 0,
                        f"{req['succeeded']} of {req['sent']} requests succeeded"),
        "no_request_lost": (req["lost"] == 0, f"{req['lost']} lost: {req['lost_by_cause']}"),
        "faults_recovered": (all(f["recovered_s"] is not None for f in faults),
                             f"{sum(f['recovered_s'] is not None for f in faults)} of {len(faults)} recovered"),
        "no_unexpected_restart": (not report["unexpected_restarts"],
                                  f"restarted by no fault: {report['unexpected_restarts'] or 'none'}"),
        "rss_within_tolerance": (not outside and not unjudged and bool(judged),
                                 f"outside +-{tolerance:.0%}: {outside or 'none'}; never judged: {unjudged or 'none'}"),
        "idle_leases_zero": (idle.get("epd_arena_leases") == 0, f"arena leases {idle.get('epd_arena_leases')}"),
        "idle_kv_blocks_zero": (idle.get("epd_kv_blocks_used") == 0, f"KV blocks {idle.get('epd_kv_blocks_used')}"),
        "idle_no_requests": (idle.get("epd_running_requests") == 0 and idle.get("epd_waiting_requests") == 0,
                             f"running {idle.get('epd_running_requests')}, waiting {idle.get('epd_waiting_requests')}"),
        "clean_stop": (stop["exit_code"] == 0 and not stop["killed"],
                       f"launcher exit {stop['exit_code']} after {stop['stop_s']} s"
                       + (" (killed)" if stop["killed"] else "")),
        "no_shm_left": (not stop["shm_left"], f"left: {stop['shm_left'] or 'none'}"),
        "no_stray_process": (not stop["strays"] and not stop["stage_pids_alive"],
                             f"strays: {stop['strays'] or 'none'}"),
        "no_socket_left": (not stop["sockets_left"], f"left: {stop['sockets_left'] or 'none'}"),
    }


def summary(report: dict) -> str:
    req = report["requests"]
    faults = Counter(f["kind"] for f in report["faults"])
    lines = [f"soak: {report['minutes']:g} min, seed {report['seed']}, rate {report['rate']:g}/s, "
             f"{report['encoders']} encoders + {report['generators']} generators",
             f"requests: {req['sent']} sent, {req['succeeded']} succeeded, {req['aborted_by_client']} aborted by the "
             f"client, {req['failed_generator_fault']} failed with a generator fault, {req['lost']} lost "
             f"{req['lost_by_cause'] or ''}; retried: {req['connection_retries']} refused connections, "
             f"{req['unsent_retries']} cut before the request was written",
             "faults: " + ", ".join(f"{k} x{faults[k]}" for k in KINDS)]
    for v in report["rss"]:
        if v["judged"]:
            lines.append(f"rss {v['instance']:<12} pid {v['pid']:<7} {v['baseline_kib'] / 1024:7.1f} MiB at "
                         f"{v['baseline_s']:4.0f} s -> {v['end_kib'] / 1024:7.1f} MiB at {v['end_s']:4.0f} s "
                         f"(x{v['ratio']:.3f}; anon x{v['anon_ratio']})"
                         + ("" if v["to_the_end"] else ", then a fault ended it"))
    idle = report["idle"]
    lines.append(f"idle: leases {idle.get('epd_arena_leases')}, KV blocks {idle.get('epd_kv_blocks_used')}, "
                 f"running {idle.get('epd_running_requests')}, waiting {idle.get('epd_waiting_requests')}")
    for name, condition in report["conditions"].items():
        if not condition["ok"]:
            lines.append(f"VIOLATED {name}: {condition['seen']}")
    lines.append("soak: PASS" if report["ok"] else "soak: FAIL")
    return "\n".join(lines)
