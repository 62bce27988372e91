"""How many CPU cores this process may use: the default of every torch thread count."""

from __future__ import annotations

import math
import os

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
