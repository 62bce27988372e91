"""How many CPU cores this process may use, and how many of them other processes leave it:
the default of every torch thread count (`usable_cores`), and the governor that keeps a
computing thread's torch threads at the cores actually free (`ThreadGovernor`, `govern_threads`)."""

from __future__ import annotations

import contextlib
import math
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

CGROUP_CPU_MAX = "/sys/fs/cgroup/cpu.max"  # cgroup v2: "<quota> <period>" (microseconds) or "max <period>"


def usable_cores(cpu_max: str = CGROUP_CPU_MAX) -> int:
    """The cores this process may run on: its CPU affinity (`os.sched_getaffinity`; where the
    platform has none, `os.cpu_count()`), capped by a cgroup v2 CPU quota rounded up (a container
    given 2.5 CPUs of a 64-core host: 3). At least 1. `os.cpu_count()` counts the host's cores,
    which a pinned process or a container with a quota cannot all use."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    try:
        with open(cpu_max) as f:
            quota, period = f.read().split()[:2]
        if quota != "max":
            cores = min(cores, math.ceil(int(quota) / int(period)))
    except (OSError, ValueError):  # no cgroup v2 CPU controller here, or a line we do not read
        pass
    return max(1, cores)


# /proc/stat cpuN fields counted as busy: user nice system irq softirq steal (guest is inside user)
_BUSY_FIELDS = (0, 1, 2, 5, 6, 7)
PROC_STAT = "/proc/stat"
CGROUP_CPU_STAT = "/sys/fs/cgroup/cpu.stat"  # cgroup v2: "usage_usec <n>" among others


@dataclass
class GovernorSettings:
    """When `ThreadGovernor` looks and how it decides.

    interval_s: wall time between two looks (each look reads one or two small files).
    tolerance: other processes' load, in cores, that does not take a core away (Ray's own
        services, a logger); above it, every started core of load takes one thread.
    min_active: a window counts only when this process used at least this many cores of CPU
        time in it (a spinning team squeezed onto one core uses under 1); a window it spent
        mostly waiting (on the driver, a reward, a peer) says nothing about the cores free while
        it computes, and is dropped.
    """

    interval_s: float = 0.5
    tolerance: float = 0.25
    min_active: float = 0.5


class ThreadGovernor:
    """Keeps this thread's torch intra-op threads at the cores no other process is using.

    Torch's OpenMP threads split every op into equal shares and spin at the op's end waiting for
    each other; when another process takes one of the cores, the share on that core runs in its
    time slices, and the threads on the free cores spin through them (issue 47: a 16x slower step
    beside one busy core; `docs/results/contention.md`). The governor measures, over windows of
    `interval_s` in which this process was computing, the CPU time other processes took on the
    cores it may use, and asks for `max_threads - ceil(others - tolerance)` threads (at least 1):
    one thread fewer per core taken, back up when the cores free again. The count changes only at
    `apply()`, where a unit of work starts (`apply_thread_count`), so the forwards of one step
    all round alike.

    Where the load comes from: the per-CPU busy time of `/proc/stat` over this process's CPU
    affinity, minus this process's own CPU time; when a cgroup v2 quota caps the cores below the
    affinity (a container given 4 CPUs of a 64-core host), the cgroup's `usage_usec` instead,
    minus the same: then the other processes are the container's own.

    `poll()` is called from the thread that computes (a forward pre-hook, `govern_threads`), and
    `apply()` from the same thread: torch's thread count belongs to the calling thread.
    """

    def __init__(
        self,
        max_threads: int,
        settings: GovernorSettings | None = None,
        *,
        proc_stat: str = PROC_STAT,
        cpu_max: str = CGROUP_CPU_MAX,
        cgroup_stat: str = CGROUP_CPU_STAT,
        clock: Callable[[], float] = time.monotonic,
        cpu_time: Callable[[], float] = time.process_time,
    ) -> None:
        if max_threads < 1:
            raise ValueError(f"max_threads must be >= 1, got {max_threads}")
        self.max_threads = max_threads
        self.settings = settings or GovernorSettings()
        self.proc_stat, self.cgroup_stat = proc_stat, cgroup_stat
        self.clock, self.cpu_time = clock, cpu_time
        try:
            self.cpus = sorted(os.sched_getaffinity(0))
        except AttributeError:  # not on Linux
            self.cpus = list(range(os.cpu_count() or 1))
        self.capacity = usable_cores(cpu_max)
        self.by_cgroup = self.capacity < len(self.cpus)
        self.hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self.threads = max_threads  # the count in force
        self.target = max_threads  # the count the last counted window asks for
        self.others = 0.0  # other processes' load in the last counted window, in cores
        self.changes = 0
        torch.set_num_threads(self.threads)
        self._start = self._sample()

    def _machine_busy_s(self) -> float | None:
        """CPU seconds spent so far on the cores this process may use (or in its cgroup)."""
        try:
            if self.by_cgroup:
                with open(self.cgroup_stat) as f:
                    for line in f:
                        key, value = line.split()[:2]
                        if key == "usage_usec":
                            return int(value) / 1e6
                return None
            wanted = {f"cpu{i}" for i in self.cpus}
            busy = 0
            with open(self.proc_stat) as f:
                for line in f:
                    fields = line.split()
                    if fields and fields[0] in wanted:
                        busy += sum(int(fields[1 + i]) for i in _BUSY_FIELDS)
            return busy / self.hz
        except (OSError, ValueError, IndexError):
            return None

    def _sample(self) -> tuple[float, float, float | None]:
        return self.clock(), self.cpu_time(), self._machine_busy_s()

    def poll(self) -> int:
        """Look again when `interval_s` has passed since the last look; returns the count it asks
        for (`target`). Nothing changes until `apply()`."""
        now = self.clock()
        t0, own0, busy0 = self._start
        if now - t0 < self.settings.interval_s:
            return self.target
        sample = self._sample()
        self._start = sample
        _, own1, busy1 = sample
        wall = now - t0
        own = (own1 - own0) / wall  # cores this process used
        if busy0 is None or busy1 is None or own < self.settings.min_active:
            return self.target  # no reading, or a window spent mostly waiting
        self.others = max(0.0, (busy1 - busy0) / wall - own)
        taken = max(0, math.ceil(self.others - self.settings.tolerance))
        self.target = min(self.max_threads, max(1, self.capacity - taken))
        return self.target

    def apply(self) -> int:
        """Put `target` in force; returns the count in force. Called where a unit of work starts
        (a step, a scoring call), never inside one: a forward and its replay, or a policy and its
        reference, run at one thread count and round alike. A count someone else set since (a
        judge that sets its own) is left alone until they restore ours."""
        if torch.get_num_threads() != self.threads:
            return torch.get_num_threads()
        if self.target != self.threads:
            torch.set_num_threads(self.target)
            self.threads = self.target
            self.changes += 1
        return self.threads


_local = threading.local()  # .governor: the governor of this thread, if any
_hook: torch.utils.hooks.RemovableHandle | None = None


def _poll(module: torch.nn.Module, args: tuple) -> None:
    governor = getattr(_local, "governor", None)
    if governor is not None:
        governor.poll()


def govern_threads(fixed: int | None = None, share: int = 1) -> int:
    """Set the calling thread's torch threads and return the count: `fixed` when given (the
    recipe's `threads_per_worker`: that many, always); else `usable_cores() // share` (at least
    1; `share`: the processes of the run that compute at once on these cores), kept by a
    `ThreadGovernor` that every module forward of this thread polls (a process-wide forward
    pre-hook, installed once; a poll between its looks costs a clock read)."""
    global _hook
    if fixed:
        _local.governor = None
        torch.set_num_threads(int(fixed))
        return int(fixed)
    governor = ThreadGovernor(max(1, usable_cores() // max(1, share)))
    _local.governor = governor
    if _hook is None:
        _hook = torch.nn.modules.module.register_module_forward_pre_hook(_poll)
    return governor.threads


def apply_thread_count() -> int:
    """At the start of a unit of work (a step, a scoring call): the calling thread's governor puts
    the count its last look asked for in force; returns the torch thread count."""
    governor = thread_governor()
    return governor.apply() if governor is not None else torch.get_num_threads()


def thread_governor() -> ThreadGovernor | None:
    """The calling thread's governor (None when its threads are fixed or ungoverned)."""
    return getattr(_local, "governor", None)


@contextlib.contextmanager
def governed_threads(fixed: int | None = None, share: int = 1) -> Iterator[int]:
    """`govern_threads` for the `with` block only (a driver's run); the calling thread's previous
    governor and thread count come back after it. Yields the thread count set."""
    previous, threads = thread_governor(), torch.get_num_threads()
    try:
        yield govern_threads(fixed, share)
    finally:
        _local.governor = previous
        torch.set_num_threads(previous.threads if previous is not None else threads)


def thread_metrics() -> dict[str, float]:
    """`cpu/threads` (this thread's torch threads now) and, when governed, `cpu/others_load`
    (the cores other processes took in the last counted window): a step row that slowed down
    on a shared machine says so."""
    governor = thread_governor()
    metrics = {"cpu/threads": float(torch.get_num_threads())}
    if governor is not None:
        metrics["cpu/others_load"] = governor.others
    return metrics
