"""TransferQueue backends: `tq_simple` (SimpleStorage units) and `tq_mooncake` (MooncakeStore over TCP).

Uses the real `TransferQueue` package (``pip install -e ".[transferqueue]"``;
Mooncake also needs ``.[mooncake]`` and the system library libibverbs1),
imported lazily. Samples are written with TQ's key-value API, keyed by our
sample ids inside the step's partition; a meta's handle is just those keys,
so metas split and concatenate like any per-sample field and a consumer
looks its keys up (`kv_retrieve_meta`, which does not mark consumption) and
fetches only the fields it asks for. Exactly-once per consumer task is the
driver's claim ledger (`Transport.claim`): the single controller decides
which rank consumes which samples, rather than TQ's ready-first `get_meta`.

Lifecycle: the driver's `start()` creates the controller and storage (or
attaches to a controller already running in the cluster, which it then never
stops); workers `attach` a private client; `close()` in a worker closes only
its client, and the driver stops the controller only if it created it. With
`tq_mooncake` and no `master_address`, the driver also starts a private
``mooncake_master`` on free loopback ports and stops it on close.

TQ 0.1.11 facts this relies on (see unirl/dataplane/README.md): the controller and
each storage unit are ``num_cpus=1`` Ray actors; fixed-shape fields come back
as per-sample nested tensors; 1-D fields come back dense (SimpleStorage) or
as nested (1,) (Mooncake); strings come back as a `NonTensorStack`. The codec
turns all of these into the canonical forms.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from abc import abstractmethod
from typing import Any

import torch

from unirl.dataplane.transport import BatchMeta, DataPlaneError, Transport
from unirl.distributed.group.remote import free_port

CONTROLLER_NAME, CONTROLLER_NAMESPACE = "TransferQueueController", "transfer_queue"


def _import_tq():
    try:
        import transfer_queue
    except ImportError as exc:
        raise ImportError(
            'the TransferQueue transports need the `transferqueue` extra: pip install -e ".[transferqueue]"'
        ) from exc
    return transfer_queue


def _existing_controller():
    import ray

    try:
        return ray.get_actor(CONTROLLER_NAME, namespace=CONTROLLER_NAMESPACE)
    except ValueError:
        return None


class _TQTransport(Transport):
    """Shared TransferQueue logic; subclasses give the storage backend config."""

    storage_backend = ""

    def __init__(self, polling_mode: bool = True) -> None:
        super().__init__()
        self.polling_mode = bool(polling_mode)
        self._client = None
        self._owns_controller = False

    @classmethod
    def check_available(cls) -> None:
        _import_tq()

    @abstractmethod
    def _storage_config(self) -> dict[str, Any]:
        """The `backend.<storage_backend>` section of TQ's config."""

    # -- lifecycle --------------------------------------------------------------
    def start(self) -> dict[str, Any]:
        tq = _import_tq()
        if _existing_controller() is not None:  # another run's controller: use it, never stop it
            self.attach({})
            return {}
        conf = {
            "controller": {"polling_mode": self.polling_mode},
            "backend": {
                "storage_backend": self.storage_backend,
                self.storage_backend: self._storage_config(),
            },
        }
        tq.init(conf)
        self._owns_controller = True
        self._client = tq.get_client()
        return {}

    def attach(self, info: dict[str, Any]) -> None:
        import ray

        tq = _import_tq()
        ctrl = _existing_controller()
        if ctrl is None:
            raise DataPlaneError(
                "no TransferQueue controller in this Ray cluster: the driver's transport.start() must run first"
            )
        conf = ray.get(ctrl.get_config.remote())
        backend = conf.backend.storage_backend
        if backend != self.storage_backend:
            raise DataPlaneError(
                f"the running TransferQueue controller uses storage {backend!r}, this transport wants "
                f"{self.storage_backend!r}; use one TQ backend per Ray cluster"
            )
        client = tq.TransferQueueClient(
            client_id=f"unirl_{os.getpid()}_{id(self)}", controller_info=conf.controller.zmq_info
        )
        client.initialize_storage_manager(manager_type=backend, config=conf.backend[backend])
        self._client = client

    def close(self) -> None:
        if self._client is None:
            return
        if self._owns_controller:
            _import_tq().close()  # stops storage, closes the client, kills the controller
            self._owns_controller = False
        else:
            self._client.close()
        self._client = None

    @property
    def client(self):
        if self._client is None:
            raise DataPlaneError(f"transport {self.name!r} is not started/attached in this process")
        return self._client

    # -- data -------------------------------------------------------------------
    def _put(self, partition: str, sample_ids: list[str], wire: dict[str, Any]) -> Any:
        from tensordict import NonTensorStack, TensorDict

        columns = {}
        for name, value in wire.items():
            if isinstance(value, torch.Tensor):
                columns[name] = value
            elif value and isinstance(value[0], torch.Tensor):
                # Mooncake stores no zero-byte values (its partition then cannot be cleared): an empty
                # row travels as one zero row and `_get` cuts it back to the length the meta records
                rows = [r if r.shape[0] else r.new_zeros((1, *r.shape[1:])) for r in value]
                columns[name] = torch.nested.nested_tensor(rows, layout=torch.jagged)
            else:
                columns[name] = NonTensorStack(*value)
        td = TensorDict(columns, batch_size=[len(sample_ids)])
        meta = self.client.kv_retrieve_meta(keys=sample_ids, partition_id=partition, create=True)
        if meta.size != len(sample_ids):
            raise DataPlaneError(
                f"TransferQueue gave {meta.size} slots for {len(sample_ids)} samples in partition {partition!r}"
            )
        self.client.put(td, metadata=meta)
        return None  # the keys are the meta's sample ids

    def _get(self, meta: BatchMeta, names: list[str]) -> dict[str, Any]:
        tq_meta = self.client.kv_retrieve_meta(keys=meta.sample_ids, partition_id=meta.partition)
        if tq_meta.size != len(meta):
            raise DataPlaneError(
                f"partition {meta.partition!r} holds {tq_meta.size} of the {len(meta)} samples asked for "
                "(cleared, or never written)"
            )
        data = self.client.get_data(tq_meta.select_fields(names))
        out = {}
        for n in names:
            v = data.get(n)
            if meta.fields[n].kind == "object":
                out[n] = v.tolist() if hasattr(v, "tolist") else list(v)
            elif isinstance(v, torch.Tensor) and v.is_nested and n in meta.lengths:  # jagged
                out[n] = [r[:k] for r, k in zip(v.unbind(), meta.lengths[n], strict=True)]
            elif isinstance(v, torch.Tensor) and v.is_nested:
                out[n] = list(v.unbind())
            else:
                out[n] = v
        return out

    def _clear(self, partition: str) -> None:
        if partition in self.client.get_partition_list():
            self.client.clear_partition(partition)

    def stored_partitions(self) -> list[str]:
        """Partitions the controller holds (lifecycle checks)."""
        return sorted(self.client.get_partition_list())


class TQSimpleTransport(_TQTransport):
    """TransferQueue with SimpleStorage units (Ray actors holding the data; single node).

    Args:
        num_storage_units: storage actors (each takes 1 Ray CPU; use 1 on 2-core machines).
        polling_mode: controller polling mode (a fetch of unready data returns
            empty instead of blocking every client ~5 s).
    """

    name = "tq_simple"
    storage_backend = "SimpleStorage"

    def __init__(self, num_storage_units: int = 1, polling_mode: bool = True) -> None:
        super().__init__(polling_mode)
        if int(num_storage_units) < 1:
            raise ValueError(f"transport.num_storage_units must be >= 1, got {num_storage_units}")
        self.num_storage_units = int(num_storage_units)

    def _storage_config(self) -> dict[str, Any]:
        return {"num_data_storage_units": self.num_storage_units}


class TQMooncakeTransport(_TQTransport):
    """TransferQueue on a Mooncake store over TCP (the production data path; here on loopback).

    Every client process mounts a `global_segment_size` segment that holds
    the data it puts (so a producer must outlive the step that reads its
    samples: our rollout workers do) and a `local_buffer_size` staging buffer.

    Args:
        master_address: "host:rpc_port" of a running ``mooncake_master`` and
            `metadata_server` "host:http_port" of its HTTP metadata server;
            both null: the driver starts a private master on free loopback
            ports (``mooncake_master`` from the wheel) and stops it on close.
        hostname: address this node's clients advertise (127.0.0.1 on one node).
        global_segment_size, local_buffer_size: bytes per client process.
    """

    name = "tq_mooncake"
    storage_backend = "MooncakeStore"

    def __init__(
        self,
        master_address: str | None = None,
        metadata_server: str | None = None,
        hostname: str = "127.0.0.1",
        global_segment_size: int = 1 << 30,
        local_buffer_size: int = 256 << 20,
        polling_mode: bool = True,
    ) -> None:
        super().__init__(polling_mode)
        if (master_address is None) != (metadata_server is None):
            raise ValueError(
                "transport.master_address and transport.metadata_server go together (or both null)"
            )
        self.master_address, self.metadata_server = master_address, metadata_server
        self.hostname = hostname
        self.global_segment_size, self.local_buffer_size = int(global_segment_size), int(local_buffer_size)
        self._master: subprocess.Popen | None = None

    @classmethod
    def check_available(cls) -> None:
        _import_tq()
        try:
            import mooncake.store  # noqa: F401
        except ImportError as exc:
            raise ImportError(
                'tq_mooncake needs the `mooncake` extra (pip install -e ".[mooncake]", the non-CUDA '
                f"Mooncake wheel) and the system library libibverbs1 (apt-get install -y libibverbs1): {exc}"
            ) from exc

    def _storage_config(self) -> dict[str, Any]:
        return {
            "auto_init": False,  # TQ's auto_init kills every mooncake_master on the machine
            "metadata_server": self.metadata_server,
            "master_server_address": self.master_address,
            "local_hostname": self.hostname,
            "protocol": "tcp",
            "device_name": "",
            "global_segment_size": self.global_segment_size,
            "local_buffer_size": self.local_buffer_size,
        }

    def start(self) -> dict[str, Any]:
        if self.master_address is None and _existing_controller() is None:
            self._start_master()
        try:
            return super().start()
        except BaseException:
            self._stop_master()
            raise

    def close(self) -> None:
        try:
            if self._client is not None:
                # TQ's close leaves the Mooncake store client (its mounted segment) to process exit,
                # where it retries a stopped master for ~20 s: unmount it now, while the master runs
                self._client.storage_manager.storage_client.close()
            super().close()
        finally:
            self._stop_master()

    def _start_master(self) -> None:
        exe = shutil.which("mooncake_master") or os.path.join(
            os.path.dirname(sys.executable), "mooncake_master"
        )
        rpc, http, metrics = free_port(), free_port(), free_port()
        cmd = [
            exe,
            "-rpc_address=127.0.0.1",
            f"-rpc_port={rpc}",
            "-enable_http_metadata_server=true",
            "-http_metadata_server_host=127.0.0.1",
            f"-http_metadata_server_port={http}",
            "-metrics_host=127.0.0.1",
            f"-metrics_port={metrics}",
            # samples live until their partition is cleared: no lease expiry, no eviction
            "-default_kv_lease_ttl=999999",
            "-default_kv_soft_pin_ttl=999999",
            "-allow_evict_soft_pinned_objects=false",
            "-eviction_high_watermark_ratio=1.0",
            "-eviction_ratio=0.0",
        ]
        self._master_log = tempfile.NamedTemporaryFile(prefix="mooncake_master_", suffix=".log", delete=False)
        self._master = subprocess.Popen(
            cmd, stdout=self._master_log, stderr=subprocess.STDOUT, start_new_session=True
        )
        deadline = time.monotonic() + 30
        while True:
            try:
                with socket.create_connection(("127.0.0.1", rpc), timeout=0.5):
                    break
            except OSError:
                if self._master.poll() is not None:
                    self._master = None
                    with open(self._master_log.name, errors="replace") as f:
                        err = f.read()[-2000:]
                    raise DataPlaneError(
                        f"mooncake_master ({exe}) exited at start; log {self._master_log.name}:\n{err}"
                    ) from None
                if time.monotonic() > deadline:
                    self._stop_master()
                    raise DataPlaneError(
                        f"mooncake_master did not listen on 127.0.0.1:{rpc} within 30 s"
                    ) from None
                time.sleep(0.2)
        self.master_address, self.metadata_server = f"127.0.0.1:{rpc}", f"127.0.0.1:{http}"

    def _stop_master(self) -> None:
        if self._master is None:
            return
        self._master.terminate()
        try:
            self._master.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._master.kill()
            self._master.wait()
        self._master = None
        self._master_log.close()
        os.unlink(self._master_log.name)
