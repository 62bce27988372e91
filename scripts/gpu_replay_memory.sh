#!/usr/bin/env bash
# Issue 45 on one GPU (none of this runs in CI), in-process runs (no Ray needed):
#   1. the GPU test of activation offload (tests/train/test_offload_activations.py);
#   2. batched-step replay against per-step replay on the SD3.5-Medium-sized random transformer
#      (train-phase time and peak GPU memory; the two sides alternated, twice);
#   3. activation offload on it without activation checkpointing, against no offload;
#   4. the Wan 2.1 1.3B-sized recipe's peak;
#   and the memory planner's prediction for each configuration (computed on the CPU meanwhile).
# Usage: bash scripts/gpu_replay_memory.sh [output dir, default outputs/gpu_replay_memory] [steps, default 3]
# Each step has its own time limit (STEP_S seconds, default 150) and its log under the output dir, so
# a hung step costs one limit and the rest still runs; the summary lines go to stdout as they come.
# On a device machine of this workplace, first run a call of seconds that only imports (torch,
# diffusers, hydra, unirl): the one call of 2026-11-28 that ran this to its limit returned nothing.
set -uo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
OUT=${1:-outputs/gpu_replay_memory}
STEPS=${2:-3}
STEP_S=${STEP_S:-150}
mkdir -p "$OUT"
step() {  # $1: label, then the command: run it under the step limit, its output in $OUT/<label>.log
  local label=$1; shift
  echo "== $label ($(date +%T))"
  timeout "$STEP_S" "$@" > "$OUT/$label.log" 2>&1 || { echo "== $label failed or timed out:"; tail -5 "$OUT/$label.log"; }
}
timeout 60 python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'needs a CUDA build of torch and a GPU')" || exit 1
echo "== $(timeout 60 python -c 'import torch; print(torch.cuda.get_device_name(0), torch.__version__)')"

summary() {  # $1: run dir, $2: label -> train-phase time per step and peak GPU memory, one JSON line
  python - "$1" "$2" <<'PY'
import json, statistics, sys
rows = [json.loads(line) for line in open(sys.argv[1] + "/metrics.jsonl") if '"time/train_s"' in line]
train = [r["time/train_s"] for r in rows[1:]] or [rows[0]["time/train_s"]]
peak = max(r.get("memory/worker_peak_device_mb", 0.0) for r in rows) / 1024
print(json.dumps({"run": sys.argv[2], "steps": len(rows), "train_s": [round(r["time/train_s"], 3) for r in rows],
                  "train_s_median_after_first": round(statistics.median(train), 3),
                  "step_s": [round(r["time/step_s"], 3) for r in rows], "peak_gib": round(peak, 3),
                  "reward": [round(r["reward/mean"], 5) for r in rows],
                  "ratio_first_update": [r.get("ratio/first_update_mean") for r in rows]}), flush=True)
PY
}

SD35=(--config-name=diffusion/sd35m_random_flowgrpo logging.progress=false)
BATCHED=stage.replay_steps_per_forward=10  # all 10 SDE steps of a sample in one forward
NOCKPT=train.fsdp.activation_checkpointing=false
OFFLOAD=+train.stack.offload_activations=true

# the planner's predictions, on the CPU while the GPU runs
(
  for args in "sd35m_random_flowgrpo" "sd35m_random_flowgrpo $BATCHED" "sd35m_random_flowgrpo $NOCKPT" \
    "sd35m_random_flowgrpo $NOCKPT $OFFLOAD" "wan13b_random_flowgrpo"; do
    set -- $args
    recipe=$1; shift
    echo "== plan: $recipe $*"
    python -m unirl.plan_memory --config-name="diffusion/$recipe" "$@" 2>&1 | grep -E "phase|peak per device"
  done
) > "$OUT/plans.txt" 2>&1 &
PLANS=$!

step offload_test python -m pytest -q -n 0 -m gpu -p no:cacheprovider tests/train/test_offload_activations.py
tail -3 "$OUT/offload_test.log"

for rep in 0 1; do
  if [ "$rep" = 0 ]; then order="per_step batched"; else order="batched per_step"; fi
  for side in $order; do
    extra=(); [ "$side" = batched ] && extra=("$BATCHED")
    step "sd35m_${side}_$rep" python -m unirl.train_diffusion "${SD35[@]}" num_steps="$STEPS" "${extra[@]}" \
      output_dir="$OUT/sd35m_${side}_$rep"
    summary "$OUT/sd35m_${side}_$rep" "sd35m_${side}_$rep" || true
  done
done

for side in no_ckpt no_ckpt_offload; do
  extra=("$NOCKPT"); [ "$side" = no_ckpt_offload ] && extra+=("$OFFLOAD")
  step "sd35m_$side" python -m unirl.train_diffusion "${SD35[@]}" num_steps=2 "${extra[@]}" output_dir="$OUT/sd35m_$side"
  summary "$OUT/sd35m_$side" "sd35m_$side" || true
done

step wan13b python -m unirl.train_diffusion --config-name=diffusion/wan13b_random_flowgrpo num_steps=2 \
  logging.progress=false output_dir="$OUT/wan13b"
summary "$OUT/wan13b" wan13b || true

wait $PLANS
cat "$OUT/plans.txt"
