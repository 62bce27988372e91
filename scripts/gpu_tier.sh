#!/usr/bin/env bash
# The GPU tier, on a machine with CUDA (none of this runs in CI):
#   1. the CUDA tests (pytest -m gpu: device placement of every worker tensor, bf16 autocast, ...);
#   2. the tiny recipe for a few steps on one GPU with the in-process worker (needs no Ray), then
#      through Ray on one GPU and on 2 ranks (FSDP2 over NCCL) where Ray is installed and 2 GPUs exist;
#   3. Flow-GRPO on an SD3.5-Medium-sized random transformer (diffusion/sd35m_random_flowgrpo), on
#      a FLUX.1-dev-sized one (diffusion/flux_dev_random_flowgrpo), on a Wan 2.1 1.3B-sized
#      text-to-video one (diffusion/wan13b_random_flowgrpo) and on a Qwen-Image-sized one
#      (diffusion/qwenimage_random_flowgrpo: its fp32 transformer is ~82 GB, skipped on a GPU under
#      120 GB), then on a Z-Image-Turbo-sized one (diffusion/zimage_random_flowgrpo, 6.3B) and a
#      FLUX.2-Klein-4B-sized one (diffusion/flux2_klein_random_flowgrpo), then the conditioned
#      families: a FLUX.1-Kontext-dev-sized editor on 512 px sources
#      (diffusion/kontext_random_flowgrpo), a HunyuanVideo-1.5-sized text-to-video model
#      (diffusion/hunyuanvideo15_random_flowgrpo) and Wan 2.2 I2V-A14B's two 14B experts
#      (diffusion/wan22_i2v_random_flowgrpo: 108 GiB of fp32 weights, skipped on a GPU under 120 GB),
#      and an LTX-2-sized audio-video model (diffusion/ltx2_random_flowgrpo: a 19B transformer, 72
#      GiB of fp32 weights, skipped on a GPU under 120 GB), printing step time and peak GPU memory.
# Usage: bash scripts/gpu_tier.sh [output dir, default outputs/gpu_tier]
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1
OUT=${1:-outputs/gpu_tier}
python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'the GPU tier needs a CUDA build of torch and a GPU')"
NGPU=$(python -c "import torch; print(torch.cuda.device_count())")
echo "== $NGPU GPU(s): $(python -c 'import torch; print(torch.cuda.get_device_name(0))')"

summary() {  # $1: run dir -> one line: steps, mean step time after the first, peak GPU memory, rewards
  python - "$1" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1] + "/metrics.jsonl") if '"reward/mean"' in line]
times = [r["time/step_s"] for r in rows[1:]] or [rows[0]["time/step_s"]]
peak = max(r.get("memory/worker_peak_device_mb", 0.0) for r in rows)
print(f"{sys.argv[1]}: {len(rows)} steps, step {sum(times) / len(times):.2f} s (mean after the first), "
      f"peak GPU memory {peak / 1024:.2f} GiB, reward {rows[0]['reward/mean']:.4f} -> {rows[-1]['reward/mean']:.4f}, "
      f"first ratio {rows[0]['ratio/first_update_mean']}")
PY
}

python -m pytest -q -n 0 -m gpu -rs tests  # one process: the GPU tests spawn their own

TINY=(--config-name=diffusion/tiny_sd3_flowgrpo num_steps=5 logging.progress=false)
python -m unirl.train_diffusion "${TINY[@]}" launcher=in_process transport=inband output_dir="$OUT/tiny_in_process"
summary "$OUT/tiny_in_process"
if python -c "import ray" 2>/dev/null; then
  python -m unirl.train_diffusion "${TINY[@]}" output_dir="$OUT/tiny_ray_1gpu"
  summary "$OUT/tiny_ray_1gpu"
  if [ "$NGPU" -ge 2 ]; then
    python -m unirl.train_diffusion "${TINY[@]}" num_devices=2 output_dir="$OUT/tiny_ray_2gpu"
    summary "$OUT/tiny_ray_2gpu"
  fi
else
  echo "== Ray is not installed: the Ray runs are skipped"
fi

python -m unirl.train_diffusion --config-name=diffusion/sd35m_random_flowgrpo output_dir="$OUT/sd35m"
summary "$OUT/sd35m"

python -m unirl.train_diffusion --config-name=diffusion/flux_dev_random_flowgrpo output_dir="$OUT/flux_dev"
summary "$OUT/flux_dev"

python -m unirl.train_diffusion --config-name=diffusion/wan13b_random_flowgrpo output_dir="$OUT/wan13b"
summary "$OUT/wan13b"

GPU_GB=$(python -c "import torch; print(torch.cuda.get_device_properties(0).total_memory // 2**30)")
if [ "$GPU_GB" -ge 120 ]; then
  python -m unirl.train_diffusion --config-name=diffusion/qwenimage_random_flowgrpo output_dir="$OUT/qwenimage"
  summary "$OUT/qwenimage"
else
  echo "== the Qwen-Image-sized check needs a GPU of 120 GB or more (its fp32 transformer is ~82 GB): skipped"
fi

python -m unirl.train_diffusion --config-name=diffusion/zimage_random_flowgrpo output_dir="$OUT/zimage"
summary "$OUT/zimage"

python -m unirl.train_diffusion --config-name=diffusion/flux2_klein_random_flowgrpo output_dir="$OUT/flux2_klein"
summary "$OUT/flux2_klein"

python -m unirl.train_diffusion --config-name=diffusion/kontext_random_flowgrpo output_dir="$OUT/kontext"
summary "$OUT/kontext"

python -m unirl.train_diffusion --config-name=diffusion/hunyuanvideo15_random_flowgrpo output_dir="$OUT/hunyuanvideo15"
summary "$OUT/hunyuanvideo15"

if [ "$GPU_GB" -ge 120 ]; then
  python -m unirl.train_diffusion --config-name=diffusion/wan22_i2v_random_flowgrpo output_dir="$OUT/wan22_i2v"
  summary "$OUT/wan22_i2v"
else
  echo "== the Wan 2.2 I2V-A14B-sized check needs a GPU of 120 GB or more (two 14B experts): skipped"
fi

if [ "$GPU_GB" -ge 120 ]; then
  python -m unirl.train_diffusion --config-name=diffusion/ltx2_random_flowgrpo output_dir="$OUT/ltx2"
  summary "$OUT/ltx2"
else
  echo "== the LTX-2-sized check needs a GPU of 120 GB or more (a 19B transformer, planned peak 107 GiB): skipped"
fi
