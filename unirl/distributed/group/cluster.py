"""Connecting the driver to Ray: join a running cluster or start a local one.

`init_ray` is the one place the driver decides where Ray runs:

- Ray already initialised in this process: leave it alone.
- ``RAY_ADDRESS`` set (e.g. by ``examples/run_experiment_multinode.sh``): join
  that cluster. Somebody else started it, so the driver must never shut it down
  (``ray.shutdown()`` only disconnects; the cluster itself is stopped by
  whoever ran ``ray start``).
- Otherwise: start a private single-node instance bound to loopback.

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
        instance was started (``include_dashboard=False``, bound to
        127.0.0.1, ``log_to_driver=True``).

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
    if address:
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
    )
    return True
