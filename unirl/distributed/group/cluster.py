"""Connecting the driver to Ray: join a running cluster or start a local one.

`init_ray` is the one place the driver decides where Ray runs:

- Ray already initialised in this process: leave it alone.
- ``RAY_ADDRESS`` set (e.g. by ``examples/run_experiment_multinode.sh``): join
  that cluster. Somebody else started it, so the driver must never shut it down
  (``ray.shutdown()`` only disconnects; the cluster itself is stopped by
  whoever ran ``ray start``).
- Otherwise (or ``RAY_ADDRESS=local``): start a private single-node instance bound to
  loopback, its workers at niceness 0 (`WORKER_NICENESS`).

Worker niceness: Ray starts every worker process at niceness 15 (its `worker_niceness`), the
driver at 0. A worker computes the run, and at niceness 15 beside any process of niceness 0 (a
reward model, a data loader, another job) it gets 36/1060 of a shared core (the kernel's weights
of nice 15 and 0): with torch's threads waiting for the one on that core, a step slowed 16x beside
one busy core (issue 47, `docs/results/contention.md`). A local instance started here runs them
at 0; a cluster started with ``ray start`` sets it from ``RAY_worker_niceness`` in that command's
environment (`examples/run_experiment_multinode.sh` sets 0), and the driver warns when workers run
above 0 (`Trainer`).

Its return value says whether THIS call started Ray, i.e. whether the caller
owns it and should call ``ray.shutdown()`` when done::

    started = init_ray(num_cpus=4)
    try:
        ...
    finally:
        if started:
            ray.shutdown()
"""

from __future__ import annotations

import os

import ray

RAY_ADDRESS_ENV = "RAY_ADDRESS"
WORKER_NICENESS = 0  # the workers of a local instance: as the driver (Ray's default: 15)


def init_ray(num_cpus: int | None = None) -> bool:
    """Make sure this process is connected to Ray; return True only if this call started it.

    Args:
        num_cpus: logical CPUs of the local instance when one is started here
            (None: Ray's default, the machine's core count). Ignored when Ray
            is already initialised or ``RAY_ADDRESS`` names a cluster: that
            cluster's nodes declared their resources when they were started.

    Returns:
        False if Ray was already initialised (nothing is done) or if the driver
        joined the cluster named by the ``RAY_ADDRESS`` environment variable
        (``ray.init(address=..., log_to_driver=True)``); True if a new local
        instance was started (``RAY_ADDRESS`` unset or ``local``; ``include_dashboard=False``,
        bound to 127.0.0.1, ``log_to_driver=True``, workers at `WORKER_NICENESS`).

    Contract: the caller calls ``ray.shutdown()`` when done ONLY if this
    returned True. A cluster joined through ``RAY_ADDRESS`` belongs to its
    launcher; never stop it from here (and never run ``ray stop``, which kills
    every Ray instance on the machine).

    Raises:
        ConnectionError: (from Ray) if ``RAY_ADDRESS`` names a cluster that
            cannot be reached.
    """
    if ray.is_initialized():
        return False
    address = os.environ.get(RAY_ADDRESS_ENV, "").strip()
    if address and address != "local":
        ray.init(address=address, log_to_driver=True)
        return False
    # address="local": always a new instance; a bare ray.init() would silently join any
    # other Ray instance already running on this machine.
    ray.init(
        address="local",
        num_cpus=num_cpus,
        include_dashboard=False,
        log_to_driver=True,
        _node_ip_address="127.0.0.1",
        _system_config={"worker_niceness": WORKER_NICENESS},
    )
    return True
