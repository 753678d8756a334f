#!/usr/bin/env bash
# Serve a reward model for `train_ppo.py --reward_model_url` (trainer/reward_server.py): vLLM's pooling runner on
# MODEL_DIR (an HF *ForSequenceClassification directory, e.g. out/demo_rm), from the engine's own virtualenv
# (scripts/setup_engine.sh); wait until it answers /health, then print its URL and the trainer's flags.
#
#   scripts/serve_reward_model.sh [--no-wait | --foreground] MODEL_DIR [PORT]     PORT: 8001 by default
#
# The trainer sends token IDs to POST /classify with use_activation false (the raw score, not vLLM's default sigmoid
# of a one-label head) and keeps --reward_model_path MODEL_DIR for its tokenizer and chat template
# (docs/reward_servers.md). What this script sets, and why:
#   --runner pooling                    a classifier, not a generator (vLLM would also infer it from the config)
#   --max-model-len 512                 the trainer scores the last 512 tokens of a conversation; at least that
#   on a CPU (no nvidia-smi): --dtype float32 and --enforce-eager, OpenMP threads bound to every core this shell
#                                       may use (the in-process scorer's fp32: scores agree to float rounding)
#
# Environment (all optional):
#   ENGINE_VENV      the engine's virtualenv (default: $MINIPPO_ENGINE_VENV, else .venv-engine in the repository)
#   DTYPE            --dtype; default float32 on a CPU, bfloat16 on a GPU (the trainer's frozen reward model there)
#   MAX_MODEL_LEN    --max-model-len (default 512)
#   RM_HOST          the address to listen on (default 127.0.0.1; a private interface, or 0.0.0.0 on a trusted
#                    network, for trainers on other nodes)
#   MINIPPO_REWARD_API_KEY  a key the server wants (vLLM's VLLM_API_KEY, its --api-key kept off the command line);
#                    the trainer sends it from the same variable. vLLM checks it on /v1 routes only: /classify and
#                    /tokenize answer anyone who reaches the port (docs/reward_servers.md)
#   KV_CACHE_GB      CPU: VLLM_CPU_KVCACHE_SPACE in GiB (default 1)
#   GPU_MEM          GPU: --gpu-memory-utilization (default 0.3: the trainer and a rollout engine may share the GPU)
#   RM_LOG           the server's log (default /tmp/minippo-rm-PORT.log; --foreground: the terminal)
#   RM_START_TIMEOUT seconds to wait for /health (default 600)
#   ENGINE_ARGS      more arguments for the server, word-split
#
# --no-wait: start it and return at once. --foreground: run the server in this process (exec), as
# tests/test_engine_vllm.py does.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=scripts/serve_common.sh
. "$ROOT/scripts/serve_common.sh"
die() { echo "serve_reward_model: error: $*" >&2; exit 1; }

MODE=background
while [[ $# -gt 0 && "$1" == --* ]]; do
    case "$1" in
        --no-wait) MODE=nowait ;;
        --foreground) MODE=foreground ;;
        -h|--help) sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        *) die "unknown option $1 (--no-wait, --foreground, --help)" ;;
    esac
    shift
done
[[ $# -ge 1 && $# -le 2 ]] || die "usage: scripts/serve_reward_model.sh [--no-wait|--foreground] MODEL_DIR [PORT]"
MODEL="$1"; PORT="${2:-8001}"
[[ "$PORT" =~ ^[0-9]+$ ]] || die "PORT must be a number, not '$PORT'"
[[ -f "$MODEL/config.json" ]] || die "$MODEL is not an HF model directory (no config.json)"
grep -q 'ForSequenceClassification"' "$MODEL/config.json" \
    || die "$MODEL is not a sequence-classification model (its config.json names no *ForSequenceClassification architecture)"
MODEL="$(cd "$MODEL" && pwd)"
HOST="${RM_HOST:-127.0.0.1}"
SHOWN_HOST="$HOST"; [[ "$HOST" == "0.0.0.0" ]] && SHOWN_HOST="$(hostname)"
URL="http://$SHOWN_HOST:$PORT"
CHECK="http://$([[ "$HOST" == "0.0.0.0" ]] && echo 127.0.0.1 || echo "$HOST"):$PORT/health"

VENV="${ENGINE_VENV:-${MINIPPO_ENGINE_VENV:-$ROOT/.venv-engine}}"
PY="$VENV/bin/python"
[[ -x "$PY" ]] || die "no engine virtualenv at $VENV: build it with scripts/setup_engine.sh (or set ENGINE_VENV)"
"$PY" -c "import vllm" 2>/dev/null || die "$VENV has no importable vllm: rebuild it with scripts/setup_engine.sh $VENV"
if curl -s -m 2 -o /dev/null "$CHECK" 2>/dev/null; then
    die "something already answers on port $PORT: stop it or give another PORT"
fi

export HF_HUB_OFFLINE="${HF_HUB_OFFLINE:-1}"
# The key through vLLM's own variable (it reads --api-key or VLLM_API_KEY): off the command line and the echo below.
if [[ -n "${MINIPPO_REWARD_API_KEY:-}" ]]; then export VLLM_API_KEY="$MINIPPO_REWARD_API_KEY"; fi
ARGS=(--model "$MODEL" --runner pooling --host "$HOST" --port "$PORT" --max-model-len "${MAX_MODEL_LEN:-512}" --seed 0)
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    ARGS+=(--dtype "${DTYPE:-bfloat16}" --gpu-memory-utilization "${GPU_MEM:-0.3}")
    WHERE="GPU"
else
    CORES="$("$PY" -c 'import os; print(",".join(map(str, sorted(os.sched_getaffinity(0)))))')"
    export VLLM_CPU_OMP_THREADS_BIND="${VLLM_CPU_OMP_THREADS_BIND:-$CORES}" VLLM_CPU_NUM_OF_RESERVED_CPU="${VLLM_CPU_NUM_OF_RESERVED_CPU:-0}"
    export VLLM_CPU_KVCACHE_SPACE="${KV_CACHE_GB:-${VLLM_CPU_KVCACHE_SPACE:-1}}"
    ARGS+=(--dtype "${DTYPE:-float32}" --enforce-eager)
    WHERE="CPU (cores $VLLM_CPU_OMP_THREADS_BIND)"
fi
# shellcheck disable=SC2206
ARGS+=(${ENGINE_ARGS:-})

CMD=("$PY" -m vllm.entrypoints.openai.api_server "${ARGS[@]}")
echo "serve_reward_model: vllm pooling on $WHERE: ${CMD[*]}"
launch_server serve_reward_model "${RM_LOG:-/tmp/minippo-rm-$PORT.log}" "${RM_START_TIMEOUT:-600}"
echo "train with:  python train_ppo.py --reward_model_url $URL --reward_model_path $MODEL ..."
echo "stop it with: kill -- -$PID"
