#!/usr/bin/env bash
# Stands in for scripts/serve_engine.sh on a node: takes its arguments (--foreground vllm MODEL_DIR PORT, ENGINE_HOST),
# logs them, and serves tests/engine_standin.py's vLLM protocol on the node's own address.
set -euo pipefail
[[ "$1 $2" == "--foreground vllm" && $# == 4 ]] || { echo "fake serve_engine: unexpected arguments: $*" >&2; exit 2; }
echo "serve_engine on $SLURMD_NODENAME: ENGINE_HOST=${ENGINE_HOST:-} $*" >> "${FAKE_SLURM_LOG:-/dev/null}"
cd "$FAKE_REPO"
exec "$FAKE_PYTHON" -m tests.engine_standin --protocol vllm --model "$3" --port "$4" --host "$SLURMD_NODENAME"
