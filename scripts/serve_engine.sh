#!/usr/bin/env bash
# Start a rollout engine for `train_ppo.py --rollout_engine vllm` on MODEL_DIR (an HF directory of the actor, e.g.
# `python scripts/convert_model.py to_hf ...`), from the engine's own virtualenv (scripts/setup_engine.sh), with the
# settings the trainer needs; wait until it answers /health, then print its URL and the trainer's flags.
#
#   scripts/serve_engine.sh [--no-wait | --foreground] vllm MODEL_DIR [PORT]     PORT: 8000 by default
#   scripts/serve_engine.sh sglang MODEL_DIR [PORT]     prints MiniMind's SGLang command (no CPU build on PyPI)
#
# What it always sets, and why:
#   VLLM_SERVER_DEV_MODE=1              /collective_rpc (weight reloads), /update_weight_version, /weight_info
#   --logprobs-mode processed_logprobs  log-probs after temperature (and top-k / top-p): what the trainer scores
#   --seed 0                            seeded requests draw the same samples run after run
#   on a CPU (no nvidia-smi): --enforce-eager, OpenMP threads bound to every core this shell may use
#
# Environment (all optional):
#   ENGINE_VENV      the engine's virtualenv (default: $MINIPPO_ENGINE_VENV, else .venv-engine in the repository)
#   DTYPE            --dtype; default float32 on a CPU (the trainer's CPU dtype: engine and trainer log-probs then
#                    agree to ~1e-5, and the tiny demo gains nothing from bf16), bfloat16 on a GPU (the trainer's
#                    --dtype auto there; the engine/trainer gap is then ~0.04 nats per token, docs/engines.md, and
#                    --rollout_is corrects it)
#   MAX_MODEL_LEN    --max-model-len (default 1024): at least the run's --max_seq_len + --max_gen_len
#   ENGINE_HOST      the address to listen on (default 127.0.0.1: dev mode lets any client that reaches the port
#                    load weights; a private interface, or 0.0.0.0 on a trusted network, for trainers on other nodes)
#   MINIPPO_ENGINE_API_KEY  a key the server wants (vLLM's VLLM_API_KEY, its --api-key kept off the command line,
#                    where every user of the machine could read it); the trainer sends it from the same variable.
#                    vLLM checks it on /v1 routes only: /collective_rpc, /pause, /update_weight_version and the
#                    other dev-mode routes answer anyone who reaches the port (docs/engines.md)
#   KV_CACHE_GB      CPU: VLLM_CPU_KVCACHE_SPACE in GiB (default 2)
#   GPU_MEM          GPU: --gpu-memory-utilization (default 0.45: the trainer may share the GPU)
#   ENGINE_LOG       the server's log (default /tmp/minippo-engine-PORT.log; --foreground: the terminal)
#   ENGINE_START_TIMEOUT  seconds to wait for /health (default 600)
#   ENGINE_UNTIE     CPU: 1 (default) serves a model whose LM head is tied to its embeddings untied (see below), 0 as
#                    it is; the untied folder: ENGINE_UNTIED_DIR (default /tmp/minippo-engine-PORT-untied)
#   LORA_RANK        R > 0: serve runtime LoRA adapters for a --lora_r R run, which then pushes its adapters alone
#                    (docs/engines.md "Adapter-only pushes"): --enable-lora --max-lora-rank R (rounded up to a rank
#                    vLLM accepts) --max-loras 2 (the adapter requests use and the one before it) and
#                    VLLM_ALLOW_RUNTIME_LORA_UPDATING=True (/v1/load_lora_adapter, /v1/unload_lora_adapter: like the
#                    dev-mode routes, they load files from any path a client names: keep the port private)
#   ENGINE_ARGS      more arguments for the server, word-split (e.g. "--tensor-parallel-size 2")
#
# --no-wait: start it and return at once. --foreground: run the server in this process (exec; stop it with Ctrl-C
# or by signalling this process): what tests/test_engine_vllm.py does.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=scripts/serve_common.sh
. "$ROOT/scripts/serve_common.sh"
die() { echo "serve_engine: error: $*" >&2; exit 1; }

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
[[ $# -ge 2 && $# -le 3 ]] || die "usage: scripts/serve_engine.sh [--no-wait|--foreground] vllm|sglang MODEL_DIR [PORT]"
KIND="$1"; MODEL="$2"; PORT="${3:-8000}"
[[ "$PORT" =~ ^[0-9]+$ ]] || die "PORT must be a number, not '$PORT'"
[[ -f "$MODEL/config.json" ]] || die "$MODEL is not an HF model directory (no config.json): convert the actor first with python scripts/convert_model.py to_hf ... --out_dir $MODEL"
MODEL="$(cd "$MODEL" && pwd)"
HOST="${ENGINE_HOST:-127.0.0.1}"
SHOWN_HOST="$HOST"; [[ "$HOST" == "0.0.0.0" ]] && SHOWN_HOST="$(hostname)"
URL="http://$SHOWN_HOST:$PORT"
CHECK="http://$([[ "$HOST" == "0.0.0.0" ]] && echo 127.0.0.1 || echo "$HOST"):$PORT/health"

case "$KIND" in
    sglang)
        # SGLang's CPU build is not on PyPI; on a GPU machine `pip install "sglang[all]"` in its own virtualenv.
        # MiniMind's command binds 0.0.0.0; here the address ENGINE_HOST says (127.0.0.1 by default), and a key
        # where MINIPPO_ENGINE_API_KEY is set (SGLang checks it on every route but /health and /metrics). The key is
        # printed as the variable, never its value.
        KEY_ARG=""; [[ -n "${MINIPPO_ENGINE_API_KEY:-}" ]] && KEY_ARG=' --api-key "$MINIPPO_ENGINE_API_KEY"'
        echo "SGLang is not started by this script; in SGLang's own virtualenv run MiniMind's command:"
        echo "  python -m sglang.launch_server --model-path $MODEL --attention-backend triton --host $HOST --port $PORT$KEY_ARG"
        echo "(add --enable-deterministic-inference for runs that repeat with one --seed, --context-length N for longer"
        echo " prompts + responses than the model's max_position_embeddings); then train with:"
        echo "  python train_ppo.py --rollout_engine sglang --engine_url $URL ..."
        exit 0 ;;
    vllm) ;;
    *) die "unknown engine '$KIND' (vllm or sglang)" ;;
esac

VENV="${ENGINE_VENV:-${MINIPPO_ENGINE_VENV:-$ROOT/.venv-engine}}"
PY="$VENV/bin/python"
[[ -x "$PY" ]] || die "no engine virtualenv at $VENV: build it with scripts/setup_engine.sh (or set ENGINE_VENV)"
"$PY" -c "import vllm" 2>/dev/null || die "$VENV has no importable vllm: rebuild it with scripts/setup_engine.sh $VENV"

if curl -s -m 2 -o /dev/null "$CHECK" 2>/dev/null; then
    die "something already answers on port $PORT: stop it or give another PORT"
fi

export VLLM_SERVER_DEV_MODE=1 HF_HUB_OFFLINE="${HF_HUB_OFFLINE:-1}"
# The key through vLLM's own variable (it reads --api-key or VLLM_API_KEY): off the command line and the echo below.
if [[ -n "${MINIPPO_ENGINE_API_KEY:-}" ]]; then export VLLM_API_KEY="$MINIPPO_ENGINE_API_KEY"; fi
ARGS=(--model "$MODEL" --host "$HOST" --port "$PORT" --max-model-len "${MAX_MODEL_LEN:-1024}"
      --logprobs-mode processed_logprobs --seed 0)
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    ARGS+=(--dtype "${DTYPE:-bfloat16}" --gpu-memory-utilization "${GPU_MEM:-0.45}")
    WHERE="GPU"
else
    # Every core this shell may run on (its affinity, not the machine's count), none kept back.
    CORES="$("$PY" -c 'import os; print(",".join(map(str, sorted(os.sched_getaffinity(0)))))')"
    export VLLM_CPU_OMP_THREADS_BIND="${VLLM_CPU_OMP_THREADS_BIND:-$CORES}" VLLM_CPU_NUM_OF_RESERVED_CPU="${VLLM_CPU_NUM_OF_RESERVED_CPU:-0}"
    export VLLM_CPU_KVCACHE_SPACE="${KV_CACHE_GB:-${VLLM_CPU_KVCACHE_SPACE:-2}}"
    ARGS+=(--dtype "${DTYPE:-float32}" --enforce-eager)
    WHERE="CPU (cores $VLLM_CPU_OMP_THREADS_BIND)"
    # vLLM's CPU backend packs each linear layer's weights once per load, and a weight reload repacks only the
    # layers it loads: a tied LM head (no lm_head.weight in the checkpoint) keeps sampling with the first weights
    # (measured on vllm-cpu 0.32: mean log-prob gap 0.07 after a push instead of 1e-6). Serve a tied model untied:
    # a folder of links to MODEL_DIR with its own config.json (tie_word_embeddings false) and lm_head.safetensors
    # (a copy of the embeddings); the trainer's pushes carry lm_head.weight (trainer/engine.py write_weights).
    if [[ "${ENGINE_UNTIE:-1}" == 1 ]]; then
        UNTIED="${ENGINE_UNTIED_DIR:-${TMPDIR:-/tmp}/minippo-engine-$PORT-untied}"
        SERVED="$("$PY" - "$MODEL" "$UNTIED" <<'PYEOF'
import json, shutil, sys
from pathlib import Path
from safetensors import safe_open
from safetensors.torch import save_file
src, dst = Path(sys.argv[1]), Path(sys.argv[2])
cfg = json.loads((src / "config.json").read_text(encoding="utf-8"))
files = sorted(src.glob("*.safetensors"))
names = {}
for f in files:
    with safe_open(str(f), "pt") as g:
        names.update(dict.fromkeys(g.keys(), f))
embed = "model.embed_tokens.weight"
if cfg.get("tie_word_embeddings") is not True or "lm_head.weight" in names or embed not in names:
    print(src)  # untied already, or not a layout this knows: served as it is
    sys.exit(0)
shutil.rmtree(dst, ignore_errors=True)
dst.mkdir(parents=True)
for f in src.iterdir():
    if f.name not in ("config.json", "model.safetensors.index.json", "lm_head.safetensors"):
        (dst / f.name).symlink_to(f.resolve())
cfg["tie_word_embeddings"] = False
(dst / "config.json").write_text(json.dumps(cfg, indent=2), encoding="utf-8")
with safe_open(str(names[embed]), "pt") as g:
    save_file({"lm_head.weight": g.get_tensor(embed).contiguous()}, str(dst / "lm_head.safetensors"), metadata={"format": "pt"})
index = src / "model.safetensors.index.json"
if index.is_file():
    data = json.loads(index.read_text(encoding="utf-8"))
    data.setdefault("weight_map", {})["lm_head.weight"] = "lm_head.safetensors"
    (dst / index.name).write_text(json.dumps(data, indent=2), encoding="utf-8")
print(dst)
PYEOF
)" || die "could not write the untied copy of $MODEL to $UNTIED (ENGINE_UNTIE=0 serves it tied)"
        if [[ "$SERVED" != "$MODEL" ]]; then
            echo "serve_engine: $MODEL ties its LM head: serving it untied from $SERVED (ENGINE_UNTIE=0: as it is)"
            ARGS[1]="$SERVED"
            ARGS+=(--served-model-name "$MODEL")
        fi
    fi
fi
if [[ -n "${LORA_RANK:-}" && "${LORA_RANK}" != 0 ]]; then
    [[ "$LORA_RANK" =~ ^[0-9]+$ ]] || die "LORA_RANK must be a number (the run's --lora_r), not '$LORA_RANK'"
    RANK=""
    for r in 1 8 16 32 64 128 256 320 512; do  # vLLM's --max-lora-rank choices (vllm/config/lora.py MaxLoRARanks)
        if (( r >= LORA_RANK )); then RANK=$r; break; fi
    done
    [[ -n "$RANK" ]] || die "LORA_RANK $LORA_RANK is above vLLM's largest --max-lora-rank (512)"
    export VLLM_ALLOW_RUNTIME_LORA_UPDATING=True
    ARGS+=(--enable-lora --max-lora-rank "$RANK" --max-loras 2)
fi
# shellcheck disable=SC2206
ARGS+=(${ENGINE_ARGS:-})

CMD=("$PY" -m vllm.entrypoints.openai.api_server "${ARGS[@]}")  # `vllm serve` is missing in vllm-cpu (no "vllm" dist)
echo "serve_engine: vllm on $WHERE: ${CMD[*]}"
launch_server serve_engine "${ENGINE_LOG:-/tmp/minippo-engine-$PORT.log}" "${ENGINE_START_TIMEOUT:-600}"
echo "train with:  python train_ppo.py --rollout_engine vllm --engine_url $URL ...  (the actor of $MODEL)"
[[ -n "${MINIPPO_ENGINE_API_KEY:-}" ]] && echo "  (it wants the key: the trainer sends MINIPPO_ENGINE_API_KEY; keep the port off untrusted networks all the same)"
echo "stop it with: kill -- -$PID"
