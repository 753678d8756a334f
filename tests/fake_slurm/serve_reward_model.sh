#!/usr/bin/env bash
# Stands in for scripts/serve_reward_model.sh on a node (--foreground MODEL_DIR PORT, RM_HOST): serves
# tests/reward_standin.py's subset of vLLM's pooling server on the node's own address.
set -euo pipefail
[[ "$1" == "--foreground" && $# == 3 ]] || { echo "fake serve_reward_model: unexpected arguments: $*" >&2; exit 2; }
echo "serve_reward_model on $SLURMD_NODENAME: RM_HOST=${RM_HOST:-} $*" >> "${FAKE_SLURM_LOG:-/dev/null}"
cd "$FAKE_REPO"
exec "$FAKE_PYTHON" -m tests.reward_standin --model "$2" --port "$3" --host "$SLURMD_NODENAME"
