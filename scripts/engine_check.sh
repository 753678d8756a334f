#!/usr/bin/env bash
# The rollout engine's check in one command: build the engine's virtualenv if it is missing
# (scripts/setup_engine.sh), then run tests/test_engine_vllm.py against a real vLLM server with it.
#
#   bash scripts/engine_check.sh            MINIPPO_ENGINE_VENV: the engine's virtualenv (default .venv-engine)
#
# The tests run with the trainer's python: $PYTHON, else .venv/bin/python, else python3 on the PATH. Extra arguments go
# to pytest (e.g. -k greedy). Exit status: pytest's.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export MINIPPO_ENGINE_VENV="${MINIPPO_ENGINE_VENV:-$ROOT/.venv-engine}"
PY="${PYTHON:-}"  # the trainer's interpreter: $PYTHON, else .venv's (the README's), else python3 on the PATH
[[ -n "$PY" ]] || { [[ -x "$ROOT/.venv/bin/python" ]] && PY="$ROOT/.venv/bin/python"; } || PY=python3
cd "$ROOT"

START=$SECONDS
bash scripts/setup_engine.sh "$MINIPPO_ENGINE_VENV"
BUILT=$((SECONDS - START))

echo "engine_check: $PY -m pytest -q -m slow tests/test_engine_vllm.py (engine: $MINIPPO_ENGINE_VENV)"
LOG="$(mktemp "${TMPDIR:-/tmp}/engine_check.XXXXXX")"
set +e
"$PY" -m pytest -q -m slow -rs -s tests/test_engine_vllm.py "$@" 2>&1 | tee "$LOG"
RC=${PIPESTATUS[0]}
set -e
echo
echo "engine_check: summary"
grep -E "vLLM server ready|engine greedy|log-prob gap|GRPO steps|killed engine|reward-model server ready|reward model served|as --reward_model_url|mean weight|adapter-only push|LoRA adapters pushed" "$LOG" | sed 's/^/  /' || true
echo "  $(tail -n 1 "$LOG")"
echo "  engine venv: $BUILT s (setup_engine.sh); tests: $((SECONDS - START - BUILT)) s; exit status $RC"
rm -f "$LOG"
exit "$RC"
