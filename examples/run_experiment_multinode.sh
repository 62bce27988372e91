#!/usr/bin/env bash
# Launch a recipe on a Ray cluster of several machines. Run it once per machine.
#
#   head (node 0), then the driver:
#     ROLE=head NNODES=2 bash examples/run_experiment_multinode.sh diffusion/tiny_sd3_flowgrpo num_devices=2 [key=value ...]
#   every other machine:
#     ROLE=worker HEAD_ADDR=10.0.0.1 bash examples/run_experiment_multinode.sh
#
# Env vars:
#   ROLE       head | worker (required)
#   HEAD_ADDR  IP of the head machine; required for workers. On the head it is
#              the --node-ip-address (default: this machine's first IP from `hostname -I`).
#   RAY_PORT   GCS port of the head (default 6379)
#   NNODES     head only: number of alive Ray nodes (head included) to wait for
#              before starting the driver (default 1)
#   NNODES_TIMEOUT  head only: seconds to wait for them (default 600)
#   NUM_CPUS / NUM_GPUS  optional logical resources this node declares to Ray
#   RAY_START_ARGS  optional extra `ray start` flags for this node, split on spaces
#              (e.g. "--include-dashboard=false --ray-client-server-port=10002")
#   NODE_IP    worker only, optional: --node-ip-address of this node (default: Ray picks)
#   PYTHON     interpreter of the venv (default python); `ray` is taken from its bin dir
# Everything else (NUM_DEVICES, NUM_STEPS, SEED, ENTRY, DRY_RUN, OUTPUT_DIR, ...)
# is read by examples/run_experiment_single_node.sh, which the head execs with
# RAY_ADDRESS exported so the driver joins this cluster (unirl's init_ray) and
# leaves it running when it finishes.
#
# This script never stops Ray: the nodes outlive the driver. When the run is over,
# stop the nodes you started on each machine yourself, by process, and never with
# Ray's machine-wide stop command on a shared machine (it kills every Ray instance there).
# Ray's processes stay in the session of the script that started them: run it under `setsid` and
# `ps -s <sid>` lists exactly this node's processes (tests/e2e/test_launchers.py stops its head so).
# Exit status 2: a missing or bad ROLE, HEAD_ADDR or recipe.
set -euo pipefail

role="${ROLE:-}"
port="${RAY_PORT:-6379}"
nnodes="${NNODES:-1}"
python_bin="${PYTHON:-python}"
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

# The `ray` CLI of the same environment as PYTHON.
ray_bin="$(dirname "$(command -v "${python_bin}")")/ray"
[[ -x "${ray_bin}" ]] || ray_bin="ray"

# `ray start` (Ray >= 2.5x) turns token authentication on when RAY_AUTH_MODE is unset and it finds a
# token (RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token, which any local `ray.init()`
# writes), but `ray.init(address=...)` with the mode unset does not, and the driver could not join.
# Decide once here, for the node and the driver alike; every node then needs the same token.
if [[ -z "${RAY_AUTH_MODE:-}" ]] && [[ -n "${RAY_AUTH_TOKEN:-}" || -f "${RAY_AUTH_TOKEN_PATH:-${HOME}/.ray/auth_token}" ]]; then
  export RAY_AUTH_MODE=token
fi

# Ray starts its workers at niceness 15 unless told otherwise; our workers are the run, and at 15
# they get a sliver of any core they share with another process (docs/results/contention.md).
export RAY_worker_niceness="${RAY_worker_niceness:-0}"

start_args=()
[[ -n "${NUM_CPUS:-}" ]] && start_args+=("--num-cpus=${NUM_CPUS}")
[[ -n "${NUM_GPUS:-}" ]] && start_args+=("--num-gpus=${NUM_GPUS}")
# shellcheck disable=SC2206  # word-splitting is the point: one flag per word
[[ -n "${RAY_START_ARGS:-}" ]] && start_args+=(${RAY_START_ARGS})

case "${role}" in
  head)
    if [[ $# -lt 1 ]]; then
      echo "usage: ROLE=head NNODES=<n> $0 <domain>/<recipe> [key=value ...]" >&2
      exit 2
    fi
    recipe="$1"
    shift
    head_addr="${HEAD_ADDR:-}"
    if [[ -z "${head_addr}" ]]; then
      head_addr="$(hostname -I 2>/dev/null | awk '{print $1}' || true)"
    fi
    [[ -n "${head_addr}" ]] || { echo "set HEAD_ADDR to this machine's IP" >&2; exit 2; }
    "${ray_bin}" start --head --port="${port}" --node-ip-address="${head_addr}" "${start_args[@]}"
    export RAY_ADDRESS="${head_addr}:${port}"
    echo "waiting for ${nnodes} Ray node(s) at ${RAY_ADDRESS}" >&2
    NNODES="${nnodes}" NNODES_TIMEOUT="${NNODES_TIMEOUT:-600}" "${python_bin}" - <<'PY'
import os
import sys
import time

import ray

want = int(os.environ["NNODES"])
deadline = time.monotonic() + float(os.environ["NNODES_TIMEOUT"])
ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=False)
try:
    while True:
        alive = sum(1 for n in ray.nodes() if n.get("Alive"))
        if alive >= want:
            sys.stderr.write(f"{alive} Ray node(s) alive\n")
            break
        if time.monotonic() > deadline:
            sys.stderr.write(f"only {alive} of {want} Ray node(s) alive after the timeout\n")
            sys.exit(1)
        time.sleep(2)
finally:
    ray.shutdown()  # disconnects this helper only; the cluster keeps running
PY
    exec bash "${here}/run_experiment_single_node.sh" "${recipe}" "$@"
    ;;
  worker)
    head_addr="${HEAD_ADDR:-}"
    if [[ -z "${head_addr}" ]]; then
      echo "ROLE=worker needs HEAD_ADDR=<IP of the head machine>" >&2
      exit 2
    fi
    node_ip=()
    [[ -n "${NODE_IP:-}" ]] && node_ip+=("--node-ip-address=${NODE_IP}")
    exec "${ray_bin}" start --address="${head_addr}:${port}" "${node_ip[@]}" "${start_args[@]}" --block
    ;;
  *)
    echo "set ROLE=head (node 0, runs the driver) or ROLE=worker (every other node); got ROLE='${role}'" >&2
    exit 2
    ;;
esac
