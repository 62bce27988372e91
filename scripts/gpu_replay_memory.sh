#!/usr/bin/env bash
# Issue 45 on one GPU (none of this runs in CI): batched-step replay against per-step replay on the
# SD3.5-Medium-sized random transformer (train-phase time and peak GPU memory, runs alternated), and
# the memory planner's prediction beside each run's measured peak (SD3.5-M both ways, Wan 2.1
# 1.3B-sized). In-process runs (no Ray needed).
# Usage: bash scripts/gpu_replay_memory.sh [output dir, default outputs/gpu_replay_memory] [steps, default 3]
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
OUT=${1:-outputs/gpu_replay_memory}
STEPS=${2:-3}
mkdir -p "$OUT"
python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'needs a CUDA build of torch and a GPU')"
echo "== $(python -c 'import torch; print(torch.cuda.get_device_name(0), torch.__version__)')"

summary() {  # $1: run dir, $2: label -> train-phase time per step (after the first) and peak GPU memory
  python - "$1" "$2" <<'PY'
import json, statistics, sys
rows = [json.loads(line) for line in open(sys.argv[1] + "/metrics.jsonl") if '"time/train_s"' in line]
train = [r["time/train_s"] for r in rows[1:]] or [rows[0]["time/train_s"]]
peak = max(r.get("memory/worker_peak_device_mb", 0.0) for r in rows) / 1024
print(json.dumps({"run": sys.argv[2], "steps": len(rows), "train_s": [round(r["time/train_s"], 3) for r in rows],
                  "train_s_median_after_first": round(statistics.median(train), 3),
                  "step_s": [round(r["time/step_s"], 3) for r in rows], "peak_gib": round(peak, 3),
                  "reward": [round(r["reward/mean"], 5) for r in rows],
                  "ratio_first_update": [r.get("ratio/first_update_mean") for r in rows]}))
PY
}

plan() {  # $1: recipe, then overrides -> the planner's peak
  python -m unirl.plan_memory --config-name="$@" 2>&1 | grep -E "memory plan|peak per device|phase"
}

SD35=(--config-name=diffusion/sd35m_random_flowgrpo num_steps="$STEPS" logging.progress=false)
BATCHED=stage.replay_steps_per_forward=10  # all 10 SDE steps of a sample in one forward
plan diffusion/sd35m_random_flowgrpo
plan diffusion/sd35m_random_flowgrpo "$BATCHED"
for rep in 0 1; do
  if [ "$rep" = 0 ]; then order="per_step batched"; else order="batched per_step"; fi
  for side in $order; do
    extra=(); [ "$side" = batched ] && extra=("$BATCHED")
    python -m unirl.train_diffusion "${SD35[@]}" "${extra[@]}" output_dir="$OUT/sd35m_${side}_$rep" > "$OUT.sd35m_${side}_$rep.log" 2>&1
    summary "$OUT/sd35m_${side}_$rep" "sd35m_${side}_$rep"
  done
done

plan diffusion/wan13b_random_flowgrpo
python -m unirl.train_diffusion --config-name=diffusion/wan13b_random_flowgrpo num_steps=2 logging.progress=false \
  output_dir="$OUT/wan13b" > "$OUT.wan13b.log" 2>&1
summary "$OUT/wan13b" wan13b
