"""DiffusionOPD's loss and gradient against the targets written out here (x_t, v, x0; plain and
self-normalised; ODE and SDE), student == teacher gives zero loss and zero gradient, teachers
chosen per data source, and the errors (a teacher whose LoRA layout differs, a source without a
teacher, an ODE rollout without its trajectory). A linear denoiser with a real peft LoRA; teacher
files written as `TrainBackend.save_weights` writes them (no Ray, milliseconds)."""

from __future__ import annotations

import json

import pytest
import torch
from peft import LoraConfig, inject_adapter_in_model
from safetensors.torch import save_file

from unirl.algorithms.diffusion_opd import (
    TEACHER_V_KEY,
    DiffusionOPD,
    DiffusionOPDConfig,
    LoRALayout,
    layout_problems,
    read_teacher,
    student_layout,
)
from unirl.sde.strategies import make_strategy
from unirl.types.rollout_resp import RolloutTrack
from unirl.types.segments import LatentSegment

SIGMAS = torch.tensor([1.0, 0.8, 0.55, 0.3, 0.1, 0.0])
C, R, ALPHA = 3, 2, 4.0


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(C, C)
        self.gate = torch.nn.Linear(C, C)


class LoRAStage:
    """v = (gate(proj(x)) over channels) * (1 + sigma) + c, with LoRA on proj and gate."""

    sde = "flow"

    def __init__(self, seed: int = 0, targets=("proj", "gate")) -> None:
        torch.manual_seed(seed)
        self.module = inject_adapter_in_model(
            LoraConfig(r=R, lora_alpha=ALPHA, target_modules=list(targets), init_lora_weights=False), Net()
        )
        for n, p in self.module.named_parameters():
            p.requires_grad_("lora_" in n)

    def velocity(self, x, sigma, cond, guidance_scale):
        h = self.module.gate(self.module.proj(x.permute(0, 2, 3, 1))).permute(0, 3, 1, 2)
        return h * (1 + sigma.view(-1, 1, 1, 1)) + cond["c"].view(-1, 1, 1, 1)


def lora_state(stage: LoRAStage) -> dict[str, torch.Tensor]:
    return {
        n.replace(".default.", "."): p.detach().clone()
        for n, p in stage.module.named_parameters()
        if "lora_" in n
    }


def write_teacher(path, state: dict[str, torch.Tensor], alpha: float = ALPHA) -> str:
    """A teacher directory as the train backend exports a LoRA (diffusers' key prefix and metadata)."""
    path.mkdir(parents=True, exist_ok=True)
    meta = {"lora_adapter_metadata": json.dumps({"transformer.lora_alpha": alpha, "transformer.r": R})}
    save_file(
        {f"transformer.{k}": v.contiguous() for k, v in state.items()},
        str(path / "pytorch_lora_weights.safetensors"),
        meta,
    )
    return str(path)


def random_teacher(seed: int) -> dict[str, torch.Tensor]:
    return lora_state(LoRAStage(seed=seed))


def rollout(stage: LoRAStage, eta: float, n: int = 4, sources=("red", "blue")) -> RolloutTrack:
    """n samples from the stage (eta 0: ODE; else SDE on steps 1-3), every position stored."""
    g = torch.Generator().manual_seed(1)
    strategy = make_strategy("flow", eta)
    cond = {"c": torch.randn(n, generator=g)}
    x = torch.randn(n, C, 3, 3, generator=g)
    sde_steps = [1, 2, 3] if eta > 0 else []
    latents = [x]
    with torch.no_grad():
        for i in range(len(SIGMAS) - 1):
            v = stage.velocity(x, SIGMAS[i].expand(n), cond, 1.0)
            sde = i in sde_steps
            out = strategy.step(
                x, v, SIGMAS, i, sde=sde, noise=torch.randn(x.shape, generator=g) if sde else None
            )
            x = out.next_sample
            latents.append(x)
    seg = LatentSegment(
        latents=torch.stack(latents, dim=1),
        positions=list(range(len(SIGMAS))),
        sigmas=SIGMAS.clone(),
        sde_indices=sde_steps,
        log_probs=torch.zeros(n, len(sde_steps)),
        eta=eta,
        guidance_scale=1.0,
    )
    return RolloutTrack(
        name="diffusion",
        sample_ids=[f"s{i}" for i in range(n)],
        group_ids=[f"g{i // 2}" for i in range(n)],
        prompts=["p"] * n,
        metadata=[{"source": sources[i % len(sources)]} for i in range(n)],
        segment=seg,
        conditions=cond,
    )


def hand_velocity(state: dict[str, torch.Tensor], base: Net, x, sigma, c):
    """The LoRA'd network written out: W' = W + (alpha / r) B A for proj and gate."""

    def lin(name, h):
        mod = getattr(base, name)
        w = mod.weight + (ALPHA / R) * state[f"{name}.lora_B.weight"] @ state[f"{name}.lora_A.weight"]
        return h @ w.T + mod.bias

    h = lin("gate", lin("proj", x.permute(0, 2, 3, 1))).permute(0, 3, 1, 2)
    return h * (1 + sigma.view(-1, 1, 1, 1)) + c.view(-1, 1, 1, 1)


def hand_target(target, eta, x, v, sigmas, i):
    """y(v) at state x before step i, written from its definition."""
    s = sigmas[i]
    if target == "v":
        return v
    if target == "x0":
        return x - s * v
    if eta == 0:
        return x + (sigmas[i + 1] - s) * v
    mean, std, _ = make_strategy("flow", eta).mean_and_std(x, v, sigmas, i)
    return mean / std


def base_net(stage: LoRAStage) -> Net:
    net = Net()
    net.proj.weight.data.copy_(stage.module.proj.base_layer.weight)
    net.proj.bias.data.copy_(stage.module.proj.base_layer.bias)
    net.gate.weight.data.copy_(stage.module.gate.base_layer.weight)
    net.gate.bias.data.copy_(stage.module.gate.base_layer.bias)
    return net


@pytest.mark.parametrize("target, eta", [("xt", 0.0), ("v", 0.0), ("x0", 0.0), ("xt", 0.7)])
@pytest.mark.parametrize("self_normalize", [False, True])
def test_loss_and_gradient_match_the_targets(tmp_path, target, eta, self_normalize):
    stage = LoRAStage(seed=0)
    teachers = {"red": random_teacher(5), "blue": random_teacher(6)}
    cfg = DiffusionOPDConfig(
        teachers={k: write_teacher(tmp_path / k, v) for k, v in teachers.items()},
        target=target,
        self_normalize=self_normalize,
        steps_per_sample=2,
    )
    track = rollout(stage, eta)
    algo = DiffusionOPD(cfg)
    before = lora_state(stage)
    prepared = algo.prepare_segment(stage, track)
    assert lora_state(stage).keys() == before.keys()
    assert all(torch.equal(lora_state(stage)[k], before[k]) for k in before)  # teachers swapped out again
    stage.module.zero_grad()
    out = algo.compute_loss_and_backward(stage, prepared, {"loss_scale": 1.0})
    got = {
        n.replace(".default.", "."): p.grad.clone()
        for n, p in stage.module.named_parameters()
        if "lora_" in n
    }

    # independently: every (sample, chosen step) row, the teacher of its source
    student = {k: v.clone().requires_grad_(True) for k, v in before.items()}
    net, seg = base_net(stage), track.segment
    steps = prepared.conditions["opd/steps"]
    rows = []
    for b in range(len(track)):
        for i in steps[b].tolist():
            assert i in ([1, 2, 3] if eta > 0 else range(5))
            x = seg.at(i)[b : b + 1]
            s, c = SIGMAS[i].view(1), track.conditions["c"][b : b + 1]
            v_t = hand_velocity(teachers[track.metadata[b]["source"]], net, x, s, c).detach()
            v_s = hand_velocity(student, net, x, s, c)
            d = hand_target(target, eta, x, v_s, SIGMAS, i) - hand_target(target, eta, x, v_t, SIGMAS, i)
            row = (d**2).mean()
            rows.append(row / d.detach().abs().mean() if self_normalize else row)
    loss = torch.stack(rows).mean()
    loss.backward()
    assert out["loss"] == pytest.approx(float(loss.detach()), rel=1e-5)
    for k, p in student.items():
        torch.testing.assert_close(got[k], p.grad, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("target, eta", [("xt", 0.0), ("v", 0.0), ("x0", 0.0), ("xt", 0.7)])
@pytest.mark.parametrize("self_normalize", [False, True])
def test_student_equal_to_teacher_gives_zero_loss_and_gradient(tmp_path, target, eta, self_normalize):
    stage = LoRAStage(seed=0)
    cfg = DiffusionOPDConfig(
        teachers={"red": write_teacher(tmp_path / "red", lora_state(stage))},
        target=target,
        self_normalize=self_normalize,
    )
    algo = DiffusionOPD(cfg)
    prepared = algo.prepare_segment(stage, rollout(stage, eta, sources=("red",)))
    stage.module.zero_grad()
    out = algo.compute_loss_and_backward(stage, prepared, {"loss_scale": 1.0})
    assert out["loss"] == 0.0 and out["opd/velocity_mse"] == 0.0
    for n, p in stage.module.named_parameters():
        if "lora_" in n:
            assert torch.count_nonzero(p.grad) == 0, n


def test_ode_identities_between_targets(tmp_path):
    """Under the ODE, mean d_xt^2 = dt^2 mean d_v^2 and mean d_x0^2 = s^2 mean d_v^2 row by row."""
    stage = LoRAStage(seed=0)
    path = write_teacher(tmp_path / "red", random_teacher(5))
    track = rollout(stage, 0.0, sources=("red",))
    losses = {}
    for target in ("v", "x0", "xt"):
        algo = DiffusionOPD(DiffusionOPDConfig(teachers={"red": path}, target=target, steps_per_sample=1))
        prepared = algo.prepare_segment(stage, track)
        i = prepared.conditions["opd/steps"][0, 0]
        losses[target] = algo.compute_loss_and_backward(stage, prepared.select([0]), {"loss_scale": 1.0})[
            "loss"
        ]
    s, dt = SIGMAS[i], SIGMAS[i + 1] - SIGMAS[i]
    assert losses["x0"] == pytest.approx(float(s**2) * losses["v"], rel=1e-5)
    assert losses["xt"] == pytest.approx(float(dt**2) * losses["v"], rel=1e-5)


def test_teacher_velocities_are_per_source_and_frozen(tmp_path):
    stage = LoRAStage(seed=0)
    teachers = {"red": random_teacher(5), "blue": random_teacher(6)}
    cfg = DiffusionOPDConfig(
        teachers={k: write_teacher(tmp_path / k, v) for k, v in teachers.items()}, target="v"
    )
    track = rollout(stage, 0.0)
    prepared = DiffusionOPD(cfg).prepare_segment(stage, track)
    v_t = prepared.conditions[TEACHER_V_KEY]
    net = base_net(stage)
    for b in range(len(track)):
        for j, i in enumerate(prepared.conditions["opd/steps"][b].tolist()):
            x, s, c = track.segment.at(i)[b : b + 1], SIGMAS[i].view(1), track.conditions["c"][b : b + 1]
            want = hand_velocity(teachers[track.metadata[b]["source"]], net, x, s, c)
            torch.testing.assert_close(v_t[b, j : j + 1], want, rtol=1e-5, atol=1e-6)


def test_read_teacher_and_layout_problems(tmp_path):
    stage = LoRAStage(seed=0)
    tensors, layout = read_teacher(write_teacher(tmp_path / "t", lora_state(stage), alpha=ALPHA))
    assert set(tensors) == set(lora_state(stage)) and layout.ranks == {"proj": R, "gate": R}
    assert layout.alpha == ALPHA
    student = student_layout(Net(), ["proj", "gate"], R, ALPHA)
    assert layout_problems("red", "t", layout, student) == []
    narrow = student_layout(Net(), ["proj"], R, ALPHA)
    (msg,) = layout_problems("red", "t", layout, narrow)
    assert "algorithm.config.teachers.red" in msg and "only by the teacher ['gate']" in msg
    msgs = layout_problems("red", "t", LoRALayout({"proj": 4, "gate": 4}, 8.0), student)
    assert any("rank" in m and "train.lora.rank=2" in m for m in msgs)
    assert any("alpha 8" in m for m in msgs)


def test_errors(tmp_path):
    stage = LoRAStage(seed=0)
    narrow = LoRAStage(seed=0, targets=("proj",))
    algo = DiffusionOPD(
        DiffusionOPDConfig(teachers={"red": write_teacher(tmp_path / "n", lora_state(narrow))})
    )
    with pytest.raises(ValueError, match=r"layout differs.*only in the student \['gate'\]"):
        algo.prepare_segment(stage, rollout(stage, 0.0, sources=("red",)))
    ok = DiffusionOPD(DiffusionOPDConfig(teachers={"red": write_teacher(tmp_path / "r", lora_state(stage))}))
    with pytest.raises(ValueError, match=r"data source 'blue'.*names \['red'\]"):
        ok.prepare_segment(stage, rollout(stage, 0.0))
    track = rollout(stage, 0.0, sources=("red",))
    bare = RolloutTrack(
        **{
            **track.__dict__,
            "segment": LatentSegment(
                latents=track.segment.latents[:, -1:],
                positions=[5],
                sigmas=SIGMAS,
                sde_indices=[],
                log_probs=torch.zeros(4, 0),
                eta=0.0,
                guidance_scale=1.0,
            ),
        }
    )
    with pytest.raises(ValueError, match="stage.store_trajectory: true"):
        ok.prepare_segment(stage, bare)
    with pytest.raises(ValueError, match="steps_per_sample=9 exceeds"):
        DiffusionOPD(DiffusionOPDConfig(teachers={"red": "x"}, steps_per_sample=9)).draw_steps(track)
    with pytest.raises(ValueError, match="algorithm.config.target must be one of"):
        DiffusionOPDConfig(teachers={"red": "x"}, target="eps")
    with pytest.raises(ValueError, match="algorithm.config.teachers"):
        DiffusionOPDConfig(teachers={})
    with pytest.raises(FileNotFoundError, match="pytorch_lora_weights.safetensors"):
        read_teacher(str(tmp_path))
