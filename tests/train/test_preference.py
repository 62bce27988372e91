"""Offline Diffusion-DPO: the preference-pair file (schema, errors naming the line) and the
supervised run on it (loss log 2 against its own reference at the start, the DPO gradient,
resume keeps the initial reference), and the recipe through `unirl.train_sft`."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from PIL import Image

from tests.conftest import run_module, tiny_model_config
from unirl.algorithms.diffusion_dpo import diffusion_dpo_loss
from unirl.data.preference_pairs import PreferencePairsFile, load_preference_pairs
from unirl.train.preference import OfflineDiffusionDPO, OfflineDiffusionDPOConfig


def write_pairs(root, n: int = 4, size: int = 16) -> str:
    """n pairs of random RGB PNGs (size x size), as `pairs.jsonl` under `root`."""
    rng = np.random.default_rng(0)
    (root / "img").mkdir(exist_ok=True)
    lines = []
    for i in range(n):
        for key in ("w", "l"):
            Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(
                root / "img" / f"{i}{key}.png"
            )
        lines.append(
            json.dumps(
                {"prompt": f"a red square {i}", "chosen": f"img/{i}w.png", "rejected": f"img/{i}l.png"}
            )
        )
    path = root / "pairs.jsonl"
    path.write_text("\n".join(lines) + "\n\n")
    return str(path)


def test_pairs_load_images_in_model_range_and_latents(tmp_path):
    path = write_pairs(tmp_path, n=2)
    pairs = load_preference_pairs(path)
    assert [p.prompt for p in pairs] == ["a red square 0", "a red square 1"]
    img = np.asarray(Image.open(tmp_path / "img" / "0w.png").convert("RGB"), dtype=np.float32)
    torch.testing.assert_close(pairs[0].chosen, torch.from_numpy(img).permute(2, 0, 1) / 127.5 - 1)
    latent = torch.randn(3, 16, 16)
    torch.save(latent, tmp_path / "z.pt")
    with open(path, "a") as f:
        f.write(json.dumps({"prompt": "p", "chosen": "z.pt", "rejected": "img/1l.png"}) + "\n")
    assert torch.equal(load_preference_pairs(path)[2].chosen, latent)
    source = PreferencePairsFile(path)
    prompts, w, lo = source.sample_batch(5, np.random.default_rng(0))
    assert len(prompts) == 5 and w.shape == lo.shape == (5, 3, 16, 16)


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("{not json", r":3: not valid JSON"),
        ('["a"]', r":3: expected an object"),
        ('{"prompt": "p", "chosen": "img/0w.png"}', r":3: missing \['rejected'\]"),
        (
            '{"prompt": "", "chosen": "img/0w.png", "rejected": "img/0l.png"}',
            r":3: prompt must be a non-empty string",
        ),
        (
            '{"prompt": "p", "chosen": "img/nope.png", "rejected": "img/0l.png"}',
            r":3 \(chosen\): .*nope.png does not exist",
        ),
        (
            '{"prompt": "p", "chosen": "img/0w.png", "rejected": "pairs.jsonl"}',
            r":3 \(rejected\): .*unsupported suffix",
        ),
        (
            '{"prompt": "p", "chosen": "big.png", "rejected": "img/0l.png"}',
            r":3 \(chosen\): shape \[3, 8, 8\] differs",
        ),
    ],
)
def test_bad_lines_are_named(tmp_path, line, expected):
    path = write_pairs(tmp_path, n=1)
    Image.fromarray(np.zeros((8, 8, 3), dtype=np.uint8)).save(tmp_path / "big.png")
    with open(path, "a") as f:
        f.write(line + "\n")
    with pytest.raises(ValueError, match=r"pairs.jsonl" + expected):
        load_preference_pairs(path)


def test_empty_or_missing_file_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_preference_pairs(str(tmp_path / "none.jsonl"))
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="holds no pairs"):
        load_preference_pairs(str(tmp_path / "empty.jsonl"))


def config(**kw) -> OfflineDiffusionDPOConfig:
    base = dict(
        num_steps=3, batch_size=2, lr=1e-3, beta=100.0, log_every=1, checkpoint_every=1, max_sequence_length=8
    )
    return OfflineDiffusionDPOConfig(**{**base, **kw})


def test_first_step_is_log_two_and_the_gradient_is_the_dpo_gradient(tmp_path):
    bundle = tiny_model_config().build()
    run = OfflineDiffusionDPO(
        bundle, PreferencePairsFile(write_pairs(tmp_path)), config(), str(tmp_path / "out")
    )
    state = (run.rng.bit_generator.state, run.gen.get_state())
    loss, extra = run.batch_loss()
    assert float(loss.detach()) == pytest.approx(math.log(2.0), abs=1e-7) and extra["margin"] == 0.0
    loss.backward()
    got = [p.grad.clone() for p in bundle.transformer.parameters()]

    # the same draws, assembled from the formula with a perturbed copy as the reference
    run.rng.bit_generator.state, _ = state
    run.gen.set_state(state[1])
    bundle.transformer.zero_grad()
    prompts, w, lo = run.data.sample_batch(2, run.rng)
    eps = torch.randn(w.shape, generator=run.gen)
    sigma = torch.sigmoid(torch.randn(2, generator=run.gen))  # logit-normal, shift 1
    pe, _, pp, _ = bundle.pipeline.encode_prompt(
        prompt=prompts,
        prompt_2=None,
        prompt_3=None,
        device="cpu",
        do_classifier_free_guidance=False,
        max_sequence_length=8,
    )

    def err(x0):
        x_t = (1 - sigma.view(-1, 1, 1, 1)) * x0 + sigma.view(-1, 1, 1, 1) * eps
        v = bundle.transformer(
            hidden_states=x_t,
            timestep=sigma * 1000,
            encoder_hidden_states=pe,
            pooled_projections=pp,
            return_dict=False,
        )[0]
        return ((v - (eps - x0)) ** 2).mean(dim=(1, 2, 3))

    ew, el = err(w), err(lo)
    loss2 = -torch.nn.functional.logsigmoid(-50.0 * ((ew - ew.detach()) - (el - el.detach()))).mean()
    loss2.backward()
    for g, want in zip(got, [p.grad for p in bundle.transformer.parameters()], strict=True):
        # the run forwards chosen and rejected as one batch, this as two: float rounding of the GEMMs
        # (4.6e-8 on 3 of 32768 entries of a 4e-2 gradient on an AVX2 machine)
        torch.testing.assert_close(g, want, rtol=1e-4, atol=1e-5 * float(want.abs().max()) + 1e-12)
    # and the loss function itself is the shared one
    torch.testing.assert_close(diffusion_dpo_loss(ew, el, ew, el, 100.0)[0], torch.full((2,), math.log(2.0)))


def test_resume_keeps_the_initial_reference(tmp_path):
    pairs = PreferencePairsFile(write_pairs(tmp_path))
    out = str(tmp_path / "out")
    first = OfflineDiffusionDPO(tiny_model_config().build(), pairs, config(num_steps=2), out)
    first.run()
    rows = [json.loads(x) for x in open(first.log_path)]
    assert rows[0]["loss"] == pytest.approx(math.log(2.0), abs=1e-7) and rows[1]["loss"] != rows[0]["loss"]
    resumed = OfflineDiffusionDPO(tiny_model_config().build(), pairs, config(num_steps=3), out)
    resumed.load_state()
    trained = dict(first.bundle.transformer.named_parameters())
    assert all(torch.equal(p, trained[n]) for n, p in resumed.bundle.transformer.named_parameters())
    initial = dict(first.reference.named_parameters())
    assert all(torch.equal(p, initial[n]) for n, p in resumed.reference.named_parameters())


def test_recipe_runs_through_train_sft(tmp_path):
    res = run_module(
        "unirl.train_sft",
        "--config-name=sft/shapes_diffusiondpo_offline",
        "sft.num_steps=1",
        "sft.batch_size=2",
        "sft.log_every=1",
        f"output_dir={tmp_path}",
        f"export_dir={tmp_path / 'export'}",
    )
    assert res.returncode == 0, res.stderr[-3000:]
    row = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    assert row["step"] == 1 and row["loss"] == pytest.approx(math.log(2.0), abs=1e-6)
    assert (tmp_path / "export" / "transformer").is_dir()
    bad = run_module(
        "unirl.train_sft", "--config-name=sft/shapes_diffusiondpo_offline", f"data.path={tmp_path}/x.jsonl"
    )
    assert bad.returncode == 2 and "x.jsonl does not exist" in bad.stderr


def test_an_embedded_guidance_family_trains_offline_dpo_at_its_scale(tmp_path):
    """A guidance-distilled FLUX.1 (the scale is a network input) trains on pairs at
    `guidance_scale`: the first step is still log 2 (policy = reference), and the scale reaches
    the network (another scale, another error on the same draws)."""
    from unirl.models.flux import FluxModelConfig, TinyFluxConfig

    def flux_run(scale: float, out: str) -> OfflineDiffusionDPO:
        bundle = FluxModelConfig(tiny=TinyFluxConfig(resolution=16, clip_max_length=8)).build()
        pairs = PreferencePairsFile(write_pairs(tmp_path))
        return OfflineDiffusionDPO(bundle, pairs, config(guidance_scale=scale), str(tmp_path / out))

    run = flux_run(3.5, "a")
    loss, _ = run.batch_loss()
    assert float(loss.detach()) == pytest.approx(math.log(2.0), abs=1e-7)
    x, sigma = torch.rand(1, 3, 16, 16) * 2 - 1, torch.tensor([0.5])
    cond = run.bundle.encode_text(["a"], False, 8)
    errs = [
        float(r._errors(r.bundle.denoiser, x, sigma, cond, x, x))
        for r in (run, flux_run(1.0, "b"))  # the same seeded weights, two scales
    ]
    assert abs(errs[0] - errs[1]) > 1e-6


def test_a_family_that_trains_unguided_refuses_a_dpo_guidance_scale(tmp_path):
    with pytest.raises(ValueError, match=r"sft.guidance_scale=2.0: SD3Bundle guides by 'cfg'"):
        OfflineDiffusionDPO(
            tiny_model_config().build(),
            PreferencePairsFile(write_pairs(tmp_path)),
            config(guidance_scale=2.0),
            str(tmp_path),
        )
