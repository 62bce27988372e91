#!/usr/bin/env bash
# Launch a recipe on this machine. Env vars become Hydra overrides; extra args pass through.
#   bash examples/run_experiment_single_node.sh diffusion/tiny_sd3_flowgrpo [key=value ...]
#   NUM_DEVICES=2 NUM_STEPS=10 OUTPUT_DIR=outputs/run10 DRY_RUN=1 bash examples/run_experiment_single_node.sh diffusion/tiny_sd3_flowgrpo
# ENTRY selects the entry point (default train_diffusion). DRY_RUN=1 prints the resolved recipe and exits.
# PRETRAINED_MODEL, DATA_PATH and OUTPUT_DIR are read by recipes through ${oc.env:...}.
set -euo pipefail
recipe="${1:?usage: $0 <domain>/<recipe> [key=value ...]}"
shift
entry="${ENTRY:-train_diffusion}"
python_bin="${PYTHON:-python}"
overrides=()
[[ -n "${NUM_DEVICES:-}" ]] && overrides+=("num_devices=${NUM_DEVICES}")
[[ -n "${NUM_STEPS:-}" ]] && overrides+=("num_steps=${NUM_STEPS}")
[[ -n "${SEED:-}" ]] && overrides+=("seed=${SEED}")
export RAY_DEDUP_LOGS="${RAY_DEDUP_LOGS:-1}"
export HF_HUB_OFFLINE="${HF_HUB_OFFLINE:-1}"
cmd=("${python_bin}" -m "unirl.${entry}" "--config-name=${recipe}" "${overrides[@]}" "$@")
if [[ "${DRY_RUN:-0}" == "1" ]]; then
  echo "+ ${cmd[*]}" >&2
  exec "${cmd[@]}" --cfg job --resolve
fi
exec "${cmd[@]}"
