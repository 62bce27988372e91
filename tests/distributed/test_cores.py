"""`usable_cores`: the CPU affinity capped by a cgroup v2 quota, read from a written cpu.max."""

from __future__ import annotations

import os

import pytest

from unirl.distributed.cores import usable_cores


@pytest.mark.parametrize(
    "cpu_max, want",
    [
        (None, 4),  # no cgroup v2 CPU controller: the affinity
        ("max 100000\n", 4),  # no quota
        ("250000 100000\n", 3),  # 2.5 CPUs: rounded up
        ("200000 100000\n", 2),
        ("50000 100000\n", 1),  # under one CPU: still one thread
        ("800000 100000\n", 4),  # a quota above the affinity: the affinity
        ("garbage\n", 4),  # a line we do not read: the affinity
    ],
)
def test_affinity_capped_by_the_cgroup_quota(tmp_path, monkeypatch, cpu_max, want):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 5})
    path = tmp_path / "cpu.max"
    if cpu_max is not None:
        path.write_text(cpu_max)
    assert usable_cores(str(path)) == want


def test_a_pinned_process_counts_its_cores_not_the_hosts():
    """This process's own affinity (the default cgroup file, wherever it exists) bounds the count."""
    assert 1 <= usable_cores() <= len(os.sched_getaffinity(0)) <= (os.cpu_count() or 1)
