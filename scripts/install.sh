#!/usr/bin/env bash
# Install UniRL into ./.venv: the CPU torch wheel, the package with its dev, TransferQueue and Mooncake
# extras, and the one system library Mooncake's TCP transport links (libibverbs1, Debian/Ubuntu).
# On a GPU machine, install the CUDA torch you want into .venv first; torch==2.13.0 is then skipped
# only if you set TORCH_SPEC="" (the package itself asks for torch>=2.6).
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH_SPEC=${TORCH_SPEC-torch==2.13.0}
if ! /sbin/ldconfig -p 2>/dev/null | grep -q libibverbs.so.1; then
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
  $SUDO apt-get update -qq && $SUDO apt-get install -y -qq libibverbs1
fi
python3 -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
if [ -n "$TORCH_SPEC" ]; then pip install -q "$TORCH_SPEC"; fi
pip install -q -e ".[dev,transferqueue,mooncake]"
