"""The cores a stage may use: cgroup quotas (systemd's CPUQuota=, a
container's --cpus) as well as the CPUs it may run on."""

from __future__ import annotations

from pathlib import Path

from pipeline.cpu_threads import cgroup_cpu_quota, threads_per_stage


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_a_v2_quota_on_a_parent_slice_counts(tmp_path):
    """systemd puts CPUQuota= on the unit; a slice above it may be tighter."""
    write(tmp_path / "proc", "0::/system.slice/epd.service\n")
    write(tmp_path / "cg/system.slice/epd.service/cpu.max", "max 100000\n")
    assert cgroup_cpu_quota(tmp_path / "cg", tmp_path / "proc") is None
    write(tmp_path / "cg/system.slice/cpu.max", "250000 100000\n")
    assert cgroup_cpu_quota(tmp_path / "cg", tmp_path / "proc") == 2.5
    write(tmp_path / "cg/system.slice/epd.service/cpu.max", "150000 100000\n")
    assert cgroup_cpu_quota(tmp_path / "cg", tmp_path / "proc") == 1.5


def test_a_v1_quota_and_a_container_root(tmp_path):
    """A container sees its own cgroup mounted as the root, whatever
    /proc/self/cgroup names; controllers other than cpu are ignored."""
    write(tmp_path / "proc", "9:name=systemd:/docker/abc\n4:cpu,cpuacct:/docker/abc\n2:memory:/docker/abc\n")
    write(tmp_path / "cg/cpu/cpu.cfs_quota_us", "200000\n")
    write(tmp_path / "cg/cpu/cpu.cfs_period_us", "100000\n")
    assert cgroup_cpu_quota(tmp_path / "cg", tmp_path / "proc") == 2.0
    write(tmp_path / "cg/cpu/cpu.cfs_quota_us", "-1\n")
    assert cgroup_cpu_quota(tmp_path / "cg", tmp_path / "proc") is None


def test_no_cgroup_information_means_no_quota(tmp_path):
    assert cgroup_cpu_quota(tmp_path / "cg", tmp_path / "missing") is None
    write(tmp_path / "proc", "0::/\n")
    write(tmp_path / "cg/cpu.max", "garbage\n")
    assert cgroup_cpu_quota(tmp_path / "cg", tmp_path / "proc") is None
    write(tmp_path / "proc", "not a cgroup line\n0::/\n")   # skipped, not a crash at start-up
    write(tmp_path / "cg/cpu.max", "200000 100000\n")
    assert cgroup_cpu_quota(tmp_path / "cg", tmp_path / "proc") == 2.0


def test_threads_per_stage_is_an_even_share_and_at_least_one():
    assert threads_per_stage(4, 16) == 4
    assert threads_per_stage(4, 2) == 1
    assert threads_per_stage(3, 16) == 5
    assert threads_per_stage(0, 8) == 8
