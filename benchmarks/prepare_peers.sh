#!/usr/bin/env bash
# What `python benchmarks/gpu_check.py --peers` needs from outside this repository, in peers/ (ignored by git),
# made here, where the network is, for a GPU machine that has none (docs/distributed.md, "Against MiniMind and TRL"):
#
#   bash benchmarks/prepare_peers.sh /path/to/minimind   # a clone of github.com/jingyaogong/minimind (bare or not)
#
#   peers/minimind/   `git archive HEAD` of MiniMind's model/ dataset/ trainer/ (~0.7 MB; its commit in MINIMIND_COMMIT)
#   peers/wheels/     trl 1.16.0, datasets 4.8.5, dill 0.4.1, multiprocess 0.70.19 (~1.7 MB): TRL's GRPOTrainer and
#                     what it needs beyond the GPU image (which has torch, transformers, accelerate, pandas, pyarrow,
#                     xxhash, psutil, ...), for CPython 3.12 on x86-64 Linux, no dependencies pulled in.
# There: python3 -m pip install -q --no-index --no-deps --target /tmp/site peers/wheels/*.whl && export PYTHONPATH=/tmp/site
set -euo pipefail
src=${1:?usage: bash benchmarks/prepare_peers.sh /path/to/minimind-clone}
root=$(cd "$(dirname "$0")/.." && pwd)
dest="$root/peers"
python=${PYTHON:-python3}
rm -rf "$dest/minimind" "$dest/wheels"
mkdir -p "$dest/minimind" "$dest/wheels"
git -C "$src" archive HEAD model dataset trainer | tar -x -C "$dest/minimind"
git -C "$src" rev-parse HEAD > "$dest/minimind/MINIMIND_COMMIT"
"$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any \
    -d "$dest/wheels" trl==1.16.0 datasets==4.8.5 dill==0.4.1 multiprocess==0.70.19
du -sh "$dest/minimind" "$dest/wheels"
ls "$dest/wheels"
