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


# ---- ThreadGovernor ---------------------------------------------------------------------------
import math  # noqa: E402
import multiprocessing  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

from unirl.distributed.cores import (  # noqa: E402
    GovernorSettings,
    ThreadGovernor,
    apply_thread_count,
    govern_threads,
    governed_threads,
    thread_governor,
    thread_metrics,
)

HZ = os.sysconf("SC_CLK_TCK")


@pytest.fixture
def restore_threads():
    """The test starts without a governor on this thread (an in-process run of an earlier test
    in this process leaves its worker's) and ends with the thread count it found."""
    threads = torch.get_num_threads()
    govern_threads(threads)  # fixed: drops any governor on this thread
    assert thread_governor() is None
    yield
    govern_threads(threads)


class FakeMachine:
    """A /proc/stat over cpus 0-1 (plus a cpu7 outside the affinity), a clock and this process's
    CPU time, all moved by hand: `run(seconds, own=..., others=...)` adds `seconds` of wall time
    in which this process used `own` cores and other processes `others` cores."""

    def __init__(self, tmp_path):
        self.stat, self.now, self.own, self.busy = tmp_path / "stat", 100.0, 5.0, {0: 1000, 1: 1000}
        self.outside = 500
        self.write()

    def write(self):
        lines = ["cpu  0 0 0 0 0 0 0 0 0 0"]  # the machine-wide line: not read
        for i, ticks in sorted(self.busy.items()):
            # user nice system idle iowait irq softirq steal: busy = user+nice+system+irq+softirq+steal
            lines.append(f"cpu{i} {ticks - 3} 1 1 9999 5 0 1 0 0 0")
        lines.append(f"cpu7 {self.outside} 0 0 0 0 0 0 0 0 0")
        lines.append("intr 12345")
        self.stat.write_text("\n".join(lines) + "\n")

    def run(self, seconds, own, others):
        self.now += seconds
        self.own += own * seconds
        ticks = round((own + others) * seconds * HZ)
        self.busy[0] += ticks // 2
        self.busy[1] += ticks - ticks // 2
        self.outside += 10 * HZ  # a neighbour outside the affinity: never counted
        self.write()

    def governor(self, max_threads=2, **settings):
        return ThreadGovernor(
            max_threads,
            GovernorSettings(**settings),
            proc_stat=str(self.stat),
            cpu_max=str(self.stat.parent / "no-cpu.max"),
            clock=lambda: self.now,
            cpu_time=lambda: self.own,
        )


@pytest.fixture
def machine(tmp_path, monkeypatch, restore_threads):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    return FakeMachine(tmp_path)


def test_governor_gives_a_taken_core_back_and_takes_it_again(machine):
    g = machine.governor()
    assert g.threads == torch.get_num_threads() == 2 and g.capacity == 2 and not g.by_cgroup
    machine.run(1.0, own=2.0, others=0.05)  # Ray's services: under the tolerance
    assert g.poll() == 2 and g.others == pytest.approx(0.05, abs=0.02)
    machine.run(1.0, own=1.0, others=1.0)  # a busy loop on one core
    assert g.poll() == 1 and torch.get_num_threads() == 2  # asked for, not yet in force
    assert g.apply() == 1 == torch.get_num_threads()  # a step starts
    assert g.others == pytest.approx(1.0, abs=0.02) and g.changes == 1
    machine.run(1.0, own=1.0, others=1.0)
    assert g.poll() == 1 and g.apply() == 1 and g.changes == 1  # no flapping while the load stays
    machine.run(1.0, own=1.0, others=0.0)  # it left
    assert g.poll() == 2 and g.apply() == 2 == torch.get_num_threads() and g.changes == 2


@pytest.mark.parametrize("others, want", [(0.2, 2), (0.3, 1), (1.2, 1), (1.3, 1), (3.0, 1)])
def test_every_started_core_of_load_over_the_tolerance_takes_a_thread(machine, others, want):
    g = machine.governor(tolerance=0.25)
    machine.run(2.0, own=0.9, others=others)
    assert g.poll() == want
    assert g.others == pytest.approx(others, abs=0.02)


def test_four_threads_give_up_one_per_core_taken(tmp_path, monkeypatch, restore_threads):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    m = FakeMachine(tmp_path)
    m.busy = {0: 1000, 1: 1000, 2: 1000, 3: 1000}
    m.write()
    g = m.governor(max_threads=4)
    for others, want in [(1.0, 3), (2.0, 2), (0.0, 4)]:
        m.run(1.0, own=4.0 - others, others=others)
        assert g.poll() == want == 4 - math.ceil(others - 0.25)


def test_a_share_below_the_cores_never_goes_above_its_share(machine):
    """Two workers on two cores: each has one thread, and the other worker's core is not free."""
    g = machine.governor(max_threads=1)
    machine.run(1.0, own=1.0, others=1.0)
    assert g.poll() == 1
    machine.run(1.0, own=1.0, others=0.0)
    assert g.poll() == 1


def test_a_window_spent_waiting_is_dropped(machine):
    """The worker waited on the driver, which computed on both cores: that is not a load that
    competes with the worker's compute, and the thread count stays."""
    g = machine.governor()
    machine.run(1.0, own=0.1, others=2.0)
    assert g.poll() == 2 and g.apply() == 2 and g.others == 0.0 and g.changes == 0


def test_between_looks_nothing_is_read(machine):
    g = machine.governor(interval_s=0.5)
    machine.run(0.4, own=1.0, others=1.0)
    machine.stat.unlink()  # a read would fail and be noticed
    assert g.poll() == 2 and g.others == 0.0
    machine.write()
    machine.run(0.2, own=1.0, others=1.0)
    assert g.poll() == 1  # the window is the 0.6 s since the last look


def test_a_count_set_by_someone_else_is_theirs(machine):
    g = machine.governor()
    torch.set_num_threads(3)  # a judge that sets its own for a call
    machine.run(1.0, own=2.0, others=1.0)
    assert g.poll() == 1 and g.apply() == 3 == torch.get_num_threads()  # theirs
    torch.set_num_threads(2)  # restored: governed again
    machine.run(1.0, own=2.0, others=1.0)
    assert g.poll() == 1 and g.apply() == 1 == torch.get_num_threads()


def test_an_unreadable_stat_changes_nothing(machine):
    g = machine.governor()
    machine.run(1.0, own=1.0, others=1.0)
    machine.stat.write_text("cpu0 not numbers\n")
    assert g.poll() == 2 and g.apply() == 2 and g.changes == 0


def test_under_a_cgroup_quota_the_load_is_the_containers(tmp_path, monkeypatch, restore_threads):
    """A container given 2 CPUs of a 4-core affinity: the host's other cores' load is not ours;
    the cgroup's usage minus this process's is."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    (tmp_path / "cpu.max").write_text("200000 100000\n")
    stat = tmp_path / "cpu.stat"
    clock, own = [0.0], [0.0]

    def usage(usec):
        stat.write_text(f"usage_usec {usec}\nuser_usec 1\nsystem_usec 1\nnr_throttled 0\n")

    usage(1_000_000)
    g = ThreadGovernor(
        2,
        proc_stat=str(tmp_path / "absent"),
        cpu_max=str(tmp_path / "cpu.max"),
        cgroup_stat=str(stat),
        clock=lambda: clock[0],
        cpu_time=lambda: own[0],
    )
    assert g.by_cgroup and g.capacity == 2
    clock[0], own[0] = 1.0, 1.0
    usage(1_000_000 + 2_000_000)  # 2 CPU-seconds in the cgroup: 1 of them another process's
    assert g.poll() == 1 and g.others == pytest.approx(1.0)


def test_max_threads_below_one_is_refused(machine):
    with pytest.raises(ValueError, match="max_threads must be >= 1"):
        machine.governor(max_threads=0)


def test_fixed_threads_are_not_governed_and_a_scoped_governor_restores(restore_threads):
    assert govern_threads(1) == 1 and thread_governor() is None and torch.get_num_threads() == 1
    with governed_threads(share=1) as n:
        assert n == usable_cores() and thread_governor() is not None
        assert thread_metrics()["cpu/threads"] == n and "cpu/others_load" in thread_metrics()
    assert thread_governor() is None and torch.get_num_threads() == 1
    assert thread_metrics() == {"cpu/threads": 1.0}


def _spin(core):
    os.sched_setaffinity(0, {core})
    while True:
        pass


def _others_now(seconds: float = 1.0) -> float:
    """Cores other processes use on this process's CPUs over `seconds` (this process sleeps)."""
    g = ThreadGovernor(1)
    t0, own0, busy0 = g._sample()
    time.sleep(seconds)
    t1, own1, busy1 = g._sample()
    return (busy1 - busy0 - (own1 - own0)) / (t1 - t0)


def test_the_real_proc_stat_counts_this_processs_own_work():
    """The real files: half a second of this process's CPU time (spinning, however long a shared
    machine takes to give it) shows in the busy time of its CPUs (whatever else runs there only
    adds to it), in seconds, not clock ticks."""
    g = ThreadGovernor(1)
    t0, own0, busy0 = g._sample()
    while time.process_time() - own0 < 0.5 and time.monotonic() - t0 < 20:
        pass
    t1, own1, busy1 = g._sample()
    own, busy, wall = own1 - own0, busy1 - busy0, t1 - t0
    assert own >= 0.5 and busy >= 0.8 * own, (own, busy)
    assert busy <= wall * len(g.cpus) * 1.05 + 0.05  # no more than the CPUs could do


@pytest.mark.skipif(usable_cores() < 2, reason="needs two cores: one to load, one to keep")
def test_a_real_busy_core_takes_a_thread_and_gives_it_back(restore_threads):
    """The real /proc/stat and process CPU time: one process spinning on the last core takes
    one of this thread's torch threads within seconds of compute, and it comes back once the
    process is gone. It needs the other cores quiet (run alone, not beside another test worker)."""
    quiet = _others_now()
    if quiet > 0.25:
        pytest.skip(f"other processes use {quiet:.2f} cores here: this needs a quiet machine (run it alone)")
    cores = usable_cores()
    govern_threads(share=1)
    g = thread_governor()
    layer, x = torch.nn.Linear(256, 256), torch.randn(64, 256)

    def compute_until(want, seconds=8.0):
        end = time.monotonic() + seconds
        while time.monotonic() < end and g.threads != want:
            apply_thread_count()  # a "step" starts
            with torch.no_grad():
                layer(x)  # the process-wide forward pre-hook polls the governor
        return g.threads

    ctx = multiprocessing.get_context("spawn")
    spinner = ctx.Process(target=_spin, args=(max(os.sched_getaffinity(0)),), daemon=True)
    spinner.start()
    try:
        assert compute_until(cores - 1) == cores - 1, f"others' load seen: {g.others:.2f} cores"
        assert g.others > 0.5
    finally:
        spinner.kill()
        spinner.join()
    assert compute_until(cores) == cores, f"others' load seen: {g.others:.2f} cores"


def test_workers_above_niceness_zero_are_named_on_stderr(capsys):
    from unirl.trainer.trainer import warn_if_niced

    warn_if_niced([{"rank": 0, "niceness": 0}, {"engine": 0, "niceness": 0}])
    assert capsys.readouterr().err == ""
    warn_if_niced([{"rank": 0, "niceness": 15}, {"rank": 1, "niceness": 15}, {"engine": 0, "niceness": 0}])
    err = capsys.readouterr().err
    assert "2 of the run's 3 worker/engine processes run at niceness 15" in err
    assert "RAY_worker_niceness=0" in err
