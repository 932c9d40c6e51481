"""The soak (scripts/soak.py, docs/reliability.md) for one minute: the
launcher's 2 encoders + 2 generators on the tiny model on the CPU under a
mixed load, with one fault of each kind; each acceptance condition of its
report is its own test. First, its request classification and RSS verdicts
on made-up records."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import REPO

sys.path.insert(0, str(REPO / "scripts"))

from soak_faults import KINDS, Fault  # noqa: E402
from soak_load import ABORTED, FAILED, SUCCEEDED, Result  # noqa: E402
from soak_report import classify, rss_verdicts, unexpected_restarts  # noqa: E402
from soak_stack import Incarnation  # noqa: E402

LOST_GENERATOR = "the request lost its generator 2 times; it is not sent again"


def failed(index: int, sent: float, ended: float, error: str, cause: str = "http_503") -> Result:
    return Result(index, 1, True, sent, ended, FAILED, cause, error, 503)


def test_only_a_generator_faults_own_error_in_its_window_is_excused():
    faults = [Fault("kill_generator", "generator-0", 10, at_s=20.0, recovered_s=26.0),
              Fault("kill_encoder", "encoder-0", 11, at_s=50.0, recovered_s=54.0)]
    results = [Result(0, 0, False, 1.0, 2.0, SUCCEEDED), Result(1, 2, True, 1.0, 2.0, ABORTED),
               failed(2, 18.0, 22.0, LOST_GENERATOR),              # in flight at the kill
               failed(3, 30.5, 31.0, "no generator is available"),  # within the grace after the recovery
               failed(4, 40.0, 41.0, LOST_GENERATOR),               # long after it: a loss
               failed(5, 51.0, 52.0, LOST_GENERATOR),               # an encoder's fault excuses nothing
               failed(6, 21.0, 22.0, "the server stopped before this request finished"),
               failed(7, 21.0, 200.0, "no answer within the client's timeout", cause="timeout")]
    assert classify(results, faults, end_s=100.0) == {
        0: SUCCEEDED, 1: ABORTED, 2: "generator_fault", 3: "generator_fault", 4: "lost:http_503",
        5: "lost:http_503", 6: "lost:http_503", 7: "lost:timeout"}


def test_a_fault_never_recovered_from_excuses_until_the_end():
    faults = [Fault("stop_generator", "generator-1", 12, at_s=20.0)]
    assert classify([failed(0, 80.0, 81.0, LOST_GENERATOR)], faults, end_s=90.0) == {0: "generator_fault"}
    assert classify([failed(0, 96.0, 97.0, LOST_GENERATOR)], faults, end_s=90.0) == {0: "lost:http_503"}


def test_rss_is_judged_from_each_process_own_warm_up_to_its_end():
    first = Incarnation("generator-0", 100, -5.0, [(t, kib, 0, 0) for t, kib in
                                                   ((0, 500), (10, 1000), (20, 1050), (60, 1080))])
    killed = Incarnation("generator-1", 101, -5.0, [(10, 1000), (20, 1000)])
    late = Incarnation("generator-1", 102, 30.0, [(33, 400), (43, 800), (45, 900), (60, 1000)])
    young = Incarnation("encoder-0", 103, 55.0, [(57, 300), (60, 900)])
    verdicts = rss_verdicts([first, killed, late, young], warmup_end_s=10.0, warmup_s=10.0,
                            ready={100: 0.0, 101: 0.0, 102: 35.0}, live={100, 102, 103}, tolerance=0.10)
    assert [(v["pid"], v["judged"], v["to_the_end"], v["baseline_kib"], v["ratio"], v["within"])
            for v in verdicts] == [
        (100, True, True, 1000, 1.08, True), (101, True, False, 1000, 1.0, True),
        (102, True, True, 900, 1.1111, False), (103, False, True, None, None, None)]
    faults = [Fault("kill_generator", "generator-1", 101, at_s=25.0, recovered_s=35.0, new_pid=102)]
    assert unexpected_restarts([first, killed, late, young], {100, 101}, faults) == ["encoder-0 pid 103 at 55 s"]


@pytest.fixture(scope="module")
def soak(tmp_path_factory):
    folder = tmp_path_factory.mktemp("soak")
    report = folder / "soak.json"
    argv = [sys.executable, str(REPO / "scripts" / "soak.py"), "--minutes", "1", "--rate", "3", "--seed", "7",
            "--warmup-s", "6", "--fault-gap-s", "0.5", "1", "--rss-interval-s", "2", "--log-dir", str(folder / "logs"),
            "--json", str(report)]
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=400)
    if not report.exists():
        pytest.fail(f"the soak wrote no report (exit {done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return json.loads(report.read_text()), done


CONDITIONS = ("load_served", "no_request_lost", "faults_recovered", "no_unexpected_restart", "rss_within_tolerance",
              "idle_leases_zero", "idle_kv_blocks_zero", "idle_no_requests", "clean_stop", "no_shm_left",
              "no_stray_process", "no_socket_left")


@pytest.mark.parametrize("name", CONDITIONS)
def test_soak_condition(soak, name):
    report, _ = soak
    condition = report["conditions"][name]
    assert condition["ok"], f"{name}: {condition['seen']} (logs: {report['log_dir']})"


def test_soak_reports_exactly_these_conditions(soak):
    assert sorted(soak[0]["conditions"]) == sorted(CONDITIONS)


def test_soak_injected_every_kind_of_fault(soak):
    report, _ = soak
    kinds = {f["kind"] for f in report["faults"]}
    assert kinds == set(KINDS), f"missing: {sorted(set(KINDS) - kinds)}; faults: {report['faults']}"


def test_soak_sent_the_whole_mix(soak):
    req = soak[0]["requests"]
    assert req["text_only"] > 0 and req["with_images"] > 0 and 0 < req["streamed"] < req["sent"]
    assert req["aborted_by_client"] > 0, "no stream was hung up on"
    assert req["connection_retries"] > 0, "the proxy's restart refused no connection"


def test_soak_exit_code_is_its_verdict(soak):
    report, done = soak
    assert done.returncode == (0 if report["ok"] else 1), done.stdout[-3000:]
    assert ("soak: PASS" in done.stdout) == report["ok"]
