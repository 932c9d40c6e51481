"""The Responses API's store: a bound in bytes, the oldest dropped first, a
response in use kept longer, one larger than the bound never kept; and the
bound as epd-launch passes it to the proxy (0: none kept)."""

from __future__ import annotations

import pytest

from pipeline.launch import cli
from pipeline.launch.plan import HostFacts, plan_stages
from pipeline.proxy.responses_store import ResponseStore
from stages.proxy import parse_args as proxy_args


def response(rid: str, text: str = "x" * 100) -> dict:
    return {"id": rid, "output": [{"text": text}]}


def test_the_oldest_go_first_and_a_used_one_stays():
    size = ResponseStore(1 << 20)
    assert size.put(response("p"), [], [])   # every response here has this size
    store = ResponseStore(size.used * 3)
    for rid in ("a", "b", "c"):
        assert store.put(response(rid), [], [])
    assert len(store) == 3 and store.used == size.used * 3
    assert store.get("a") is not None     # in use: now the newest
    assert store.put(response("d"), [], [])   # b, the oldest, goes
    assert store.get("b") is None and {r for r in "acd" if store.get(r)} == set("acd")
    assert store.pop("c").response["id"] == "c" and store.used == size.used * 2
    assert store.put(response("a"), [], [])   # again: replaced, not counted twice
    assert store.used == size.used * 2


def test_one_larger_than_the_bound_is_not_kept():
    store = ResponseStore(200)
    assert not store.put(response("big", "y" * 500), [], [])
    assert len(store) == 0 and store.used == 0
    assert not ResponseStore(0).enabled


@pytest.mark.parametrize("flag, expected", [([], 64.0), (["--responses-store-mb", "0"], 0.0),
                                            (["--responses-store-mb", "8"], 8.0)])
def test_epd_launch_passes_the_bound_to_the_proxy(tiny_dir, flag, expected):
    args = cli.parse_args([str(tiny_dir), "--device", "cpu", *flag])
    proxy = next(s for s in plan_stages(cli.build_options(args), HostFacts(gpu_count=0)) if s.role == "proxy")
    assert proxy_args(list(proxy.args)).responses_store_mb == expected


def test_a_negative_bound_is_refused_in_one_line(capsys):
    with pytest.raises(SystemExit) as stopped:
        proxy_args(["--generators", "ipc:///tmp/g", "--encoders", "ipc:///tmp/e", "--responses-store-mb", "-1"])
    assert stopped.value.code == 2 and "--responses-store-mb must be >= 0" in capsys.readouterr().err
