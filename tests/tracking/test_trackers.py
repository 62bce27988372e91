"""Trackers (`unirl.tracking.trackers`): what each one records, read back with its own tools;
the fail-to-start rule both ways; the validator's check of a recipe's `tracking` list."""

from __future__ import annotations

import glob
import json
import struct
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.recipes import composed
from unirl.config.tree import ConfigError
from unirl.config.validate import validate_recipe
from unirl.tracking.metrics import JsonlWriter, save_image_grid
from unirl.tracking.trackers import ConsoleTracker, TrackerError, Tracking, tracker_problems

CONFIG = {"train": {"optim": {"lr": 0.003}}, "seed": 0, "tracking": ["tensorboard"]}
ROWS = [
    {"step": 0, "eval/accuracy": 0.25},
    {"step": 1, "reward/mean": 0.5, "loss": -0.125, "time/step_s": 0.2, "done": False},
    {"step": 2, "reward/mean": 0.75, "loss": float("nan"), "time/step_s": 0.25, "eval/accuracy": 0.5},
]


def save_grid(run: Path, step: int) -> str:
    """A 2x2-tile grid with prompts and rewards at `run/samples/step_XXXX`; returns the stem."""
    stem = run / "samples" / f"step_{step:04d}"
    images = torch.arange(4 * 3 * 8 * 8, dtype=torch.int64).reshape(4, 3, 8, 8).remainder(256).to(torch.uint8)
    save_image_grid(images, str(stem) + ".png", [f"prompt {i}" for i in range(4)], [0.1, 0.2, 0.3, 0.4])
    return str(stem)


def log_all(run: Path, spec) -> None:
    tracking = Tracking.start(str(run), spec, CONFIG)
    for row in ROWS:
        tracking.log(row)
    tracking.log_samples(2, save_grid(run, 2))
    tracking.close()


def test_tensorboard_events_hold_the_rows_samples_and_config(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log_all(tmp_path, ["tensorboard"])
    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"images": 0, "tensors": 0})
    events.Reload()
    scalars = {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
    # every number of every row at its step; NaN, bools and the step itself are not scalars
    assert scalars == {
        "eval/accuracy": [(0, 0.25), (2, 0.5)],
        "reward/mean": [(1, 0.5), (2, 0.75)],
        "loss": [(1, -0.125)],
        "time/step_s": [(1, pytest.approx(0.2)), (2, 0.25)],
    }
    (image,) = events.Images("samples")
    assert (image.step, image.width, image.height) == (2, 32, 8)  # 4 tiles of 8x8 in one row
    texts = {tag: events.Tensors(tag) for tag in events.Tags()["tensors"]}
    config = texts["config/text_summary"][0].tensor_proto.string_val[0].decode()
    assert '"lr": 0.003' in config
    assert "| 3 | 0.400 | prompt 3 |" in texts["samples/text_summary"][0].tensor_proto.string_val[0].decode()

    # metrics.jsonl is the JsonlWriter's, byte for byte
    plain = JsonlWriter(str(tmp_path / "plain.jsonl"))
    for row in ROWS:
        plain.write(row)
    plain.close()
    assert (tmp_path / "metrics.jsonl").read_bytes() == (tmp_path / "plain.jsonl").read_bytes()


def wandb_records(path: str) -> list:
    """The complete records of a W&B run file (`run-<id>.wandb`: a 7-byte header, then the LevelDB
    log format: 32 KiB blocks of records, each a 7-byte header (crc, length, type) and a chunk).
    wandb's service process may be writing the file while it is read: a tail whose chunk is cut
    short, or does not parse yet, ends the list (the caller reads again until the exit record)."""
    from google.protobuf.message import DecodeError
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    block, pos, chunk, records = 32768, 7, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if pos + 7 + length > len(data):  # the writer has not finished this chunk
            break
        chunk += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST: a record is complete
            record = pb.Record()
            try:
                record.ParseFromString(chunk)
            except DecodeError:  # bytes not yet flushed read as zeros
                break
            records.append(record)
            chunk = b""
    return records


def test_wandb_offline_run_under_the_run_dir_holds_the_keys_and_config(tmp_path: Path) -> None:
    log_all(tmp_path, [{"name": "wandb", "project": "unirl-test"}])
    (path,) = glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "run-*.wandb"))
    # wandb's service process may still be writing the file when `finish()` returns: read it once
    # it holds the run's exit record
    deadline = time.monotonic() + 30
    records = wandb_records(path)
    while not any(r.WhichOneof("record_type") == "exit" for r in records):
        assert time.monotonic() < deadline, f"{path} has no exit record after 30 s"
        time.sleep(0.1)
        records = wandb_records(path)
    history: dict[int, set[str]] = {}
    for r in records:
        if r.WhichOneof("record_type") == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
            history.setdefault(items["_step"], set()).update(k.split("/_")[0] for k in items)
    assert {"eval/accuracy"} <= history[0] and "reward/mean" not in history[0]
    assert {"reward/mean", "loss", "time/step_s"} <= history[1]
    assert {"reward/mean", "eval/accuracy", "samples", "samples_table"} <= history[
        2
    ] and "loss" not in history[2]
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    config = {u.key: json.loads(u.value_json) for u in run.config.update}
    assert config["train"] == {"optim": {"lr": 0.003}} and run.project == "unirl-test"
    assert run.display_name == tmp_path.name
    assert glob.glob(
        str(tmp_path / "wandb" / "offline-run-*" / "files" / "media" / "images" / "samples_*.png")
    )


def test_console_prints_the_chosen_keys_every_n_steps(tmp_path: Path, capsys) -> None:
    log_all(tmp_path, [{"name": "console", "every_n_steps": 2}])
    lines = capsys.readouterr().out.splitlines()
    assert lines == [
        f"run {tmp_path}",
        "step 0 eval/accuracy=0.25",  # eval rows print whatever the cadence
        "step 2 reward/mean=0.75 eval/accuracy=0.5 time/step_s=0.25",
        f"step 2 samples: {tmp_path}/samples/step_0002.png",
    ]


def block_tensorboard(monkeypatch) -> None:
    """Make `torch.utils.tensorboard` unimportable, as without the tensorboard package."""
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)


def test_a_required_tracker_that_fails_to_start_stops_the_run_naming_itself(tmp_path, monkeypatch, capsys):
    block_tensorboard(monkeypatch)
    closed = []
    monkeypatch.setattr(ConsoleTracker, "close", lambda self: closed.append(self))
    with pytest.raises(
        TrackerError, match=r"tracking\[1\]: tracker 'tensorboard' failed to start: ModuleNotFoundError"
    ) as err:
        Tracking.start(str(tmp_path), ["console", "tensorboard"], CONFIG)
    assert "optional: true" in str(err.value) and "pip install -e '.[tracking]'" in str(err.value)
    assert len(closed) == 1  # the tracker already started is closed
    assert not (tmp_path / "metrics.jsonl").exists()


def test_an_optional_tracker_that_fails_is_dropped_with_a_warning(tmp_path, monkeypatch, capsys):
    block_tensorboard(monkeypatch)
    tracking = Tracking.start(str(tmp_path), [{"name": "tensorboard", "optional": True}, "console"], CONFIG)
    assert (
        "warning: tracking[0]: tracker 'tensorboard' failed to start: ModuleNotFoundError"
        in capsys.readouterr().err
    )
    # an optional tracker failing later is dropped the same way; metrics.jsonl goes on
    monkeypatch.setattr(ConsoleTracker, "log_scalars", lambda *a: 1 / 0)
    tracking.trackers = [(k, t, True) for k, t, _ in tracking.trackers]
    for row in ROWS:
        tracking.log(row)
    tracking.close()
    err = capsys.readouterr().err
    assert err.count("tracker 'console' failed in log_scalars (ZeroDivisionError") == 1
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 3
    assert not (tmp_path / "tensorboard").exists()


@pytest.mark.parametrize(
    "spec, problem",
    [
        ("tensorboard", "tracking: expected a list of trackers"),
        ([{"optional": True}], "tracking[0]: expected a tracker name or {name: <name>"),
        ([{"name": "wandb", "optional": "yes"}], "tracking[0].optional: expected true or false, got 'yes'"),
        (["console", "console"], "tracking: 'console' is listed 2 times"),
        (
            [{"name": "wandb", "mode": "cloud"}],
            "tracking[0] (wandb): mode must be one of ('offline', 'online', 'disabled')",
        ),
    ],
)
def test_tracker_problems(spec, problem: str) -> None:
    (found,) = tracker_problems(spec)
    assert found.startswith(problem), found


def test_validator_rejects_unknown_tracker_names_and_options_before_ray(tmp_path: Path) -> None:
    bad = "++tracking=[tensorbord,{name:console,every_n_steps:0},{name:wandb,colour:red}]"
    with pytest.raises(ConfigError) as err:
        validate_recipe(composed("diffusion/tiny_sd3_flowgrpo", tmp_path, bad))
    assert [p for p in err.value.problems if p.startswith("tracking")] == [
        "tracking[0].name: unknown tracker 'tensorbord'; choose from ['console', 'tensorboard', 'wandb'] "
        "(metrics.jsonl is always written)",
        "tracking[1] (console): every_n_steps must be >= 1, got 0",
        "tracking[2] (wandb): WandbTracker.__init__() got an unexpected keyword argument 'colour'",
    ]
    # the names and options of the recipe docs pass (the same check, without composing again)
    assert (
        tracker_problems(["tensorboard", {"name": "wandb", "optional": True, "project": "p"}, "console"])
        == []
    )
