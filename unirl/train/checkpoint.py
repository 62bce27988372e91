"""Per-rank train state on disk: `torch.distributed.checkpoint` for tensors, a small file per rank for the rest.

Layout of one checkpoint directory (the driver adds `driver_state.json`,
`weights/` and the `COMPLETE` marker):
    train/          DCP shards: trainable params, optimizer, EMA, the loss's snapshots, reference
    rank{r}.pt      LR scheduler, counters, RNG states and the algorithm's state (e.g. an
                    adaptive KL coefficient) of rank r (`torch.save`: RNG states are per
                    process, so each rank keeps its own file)
"""

from __future__ import annotations

import os
import random
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp

from unirl.algorithms.base import StageAlgorithm
from unirl.train.backend import TrainBackend

_TENSOR_KEYS = ("model", "optim", "ema", "snapshots", "reference")


def _rng_state() -> dict[str, Any]:
    """This process's torch (CPU), Python and NumPy generator states, in types that
    `torch.load(weights_only=True)` reads back: NumPy's key array travels as a tensor."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    numpy_state = (kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached)
    return {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": numpy_state}


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))


def save_train_state(
    path: str, backend: TrainBackend, rank: int, algorithm: StageAlgorithm | None = None
) -> None:
    """Write this rank's part of the train state (and `algorithm.state_dict()`) under `path`.
    Collective when sharded."""
    state = backend.state_dict()
    dcp.save({k: state[k] for k in _TENSOR_KEYS if k in state}, checkpoint_id=os.path.join(path, "train"))
    extra = {"scheduler": state["scheduler"], "counters": state["counters"], "rng": _rng_state()}
    if algorithm is not None:
        extra["algorithm"] = algorithm.state_dict()
    torch.save(extra, os.path.join(path, f"rank{rank}.pt"))


def _keep_saved_optimizer_state(tensors: dict[str, Any], checkpoint_id: str) -> None:
    """Drop from the load template the optimizer state of parameters the checkpoint holds none
    for. A trainable parameter that never had a gradient (Qwen-Image's last block's text-stream
    output, whose result no later layer reads) has no optimizer state when the run saves, but a
    fresh optimizer's template has one for every parameter (`get_state_dict` initialises them).
    Left out, such a parameter ends the load without state, as in the run that saved; its
    other keys, and every model key, must still be in the checkpoint."""
    state = tensors.get("optim", {}).get("state")
    if not state:
        return
    saved = dcp.FileSystemReader(checkpoint_id).read_metadata().state_dict_metadata
    for name in [n for n, fields in state.items() if not any(f"optim.state.{n}.{f}" in saved for f in fields)]:
        del state[name]


def load_train_state(
    path: str, backend: TrainBackend, rank: int, algorithm: StageAlgorithm | None = None
) -> None:
    """Restore what `save_train_state` wrote, in place (the algorithm's state too when
    `algorithm` is given). Collective when sharded.

    Raises FileNotFoundError naming the missing file when the checkpoint was
    written by a run with fewer ranks or is incomplete.
    """
    extra_path = os.path.join(path, f"rank{rank}.pt")
    if not os.path.isfile(extra_path):
        raise FileNotFoundError(
            f"checkpoint {path} has no {os.path.basename(extra_path)}: it was written with a different "
            "num_devices or is incomplete"
        )
    state = backend.state_dict()
    tensors = {k: state[k] for k in _TENSOR_KEYS if k in state}
    _keep_saved_optimizer_state(tensors, os.path.join(path, "train"))
    dcp.load(tensors, checkpoint_id=os.path.join(path, "train"))
    # CPU: torch.set_rng_state takes a CPU ByteTensor; weights_only: the file holds only
    # tensors and plain containers, so loading it runs no pickled code
    extra = torch.load(extra_path, map_location="cpu", weights_only=True)
    state.update(tensors)
    state["scheduler"] = extra["scheduler"]
    state["counters"] = extra["counters"]
    backend.load_state_dict(state)
    if algorithm is not None:
        algorithm.load_state_dict(extra.get("algorithm", {}))
    _set_rng_state(extra["rng"])
