"""Time MiniMind's own trainers (its trainer/train_ppo.py or trainer/train_grpo.py, unmodified) on this machine,
at the work benchmarks/bench_ppo.py measures, so the two can be compared in one run (docs/speed-and-memory.md;
benchmarks/gpu_check.py --peers runs both on a GPU).

    git clone https://github.com/jingyaogong/minimind /path/to/minimind   # not shipped here
    python benchmarks/time_minimind.py --minimind_dir /path/to/minimind --size 512x8 --json mm.json
    python benchmarks/time_minimind.py --minimind_dir /path/to/minimind --script grpo --size 768x8 --device cuda:0
    python benchmarks/bench_ppo.py --sizes 512x8 --minimind_s <the median it printed>

What it sets up (MiniMind's trainer loads fixed paths): random-init HIDDENxLAYERS weights (seeded)
saved as <minimind_dir>/out/full_sft_<hidden>.pth if that file is absent, and 200 prompts of ~64
chat-template tokens in <minimind_dir>/minippo_bench_prompts.jsonl. Its reward model is replaced by
one that scores 0 (its rule rewards still run), the `datasets` package by a json-lines reader (same
records). PPO (--script ppo): batch 8, prompt 64, 64 new tokens (a random model rarely stops), one PPO
epoch of one minibatch. GRPO (--script grpo): --batch_size prompts (default 2) x --num_generations
(default 4), --beta (default 0.1, MiniMind's own default), its default loss. Both: no data-loader workers,
--dtype (MiniMind's autocast dtype on a GPU; on a CPU MiniMind runs fp32), 2 threads unless --num_threads.
A step is the wall time between two of its end-of-step log lines; the first --warmup steps are not
timed. `generate` is the time inside MiniMind's own MiniMindForCausalLM.generate (a CUDA sync on each
side of it on a GPU), per step. Prints the median s/step and exits as soon as the last timed step is logged.

MiniMind runs with this repository's root off its import path: MiniMind's `trainer/` has no
__init__.py (a namespace package), so our `trainer` package anywhere on sys.path would win the import
of `trainer.trainer_utils` and break it. The root is taken off sys.path here (entries that resolve to
it, and '' when started from it); every other entry (e.g. where carried wheels were installed) stays.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import runpy
import statistics
import sys
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # this repository: kept off MiniMind's import path
SCRIPTS = {"ppo": "train_ppo.py", "grpo": "train_grpo.py"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minimind_dir", required=True, help="a checkout of github.com/jingyaogong/minimind")
    p.add_argument("--script", default="ppo", choices=sorted(SCRIPTS), help="MiniMind's trainer/train_<script>.py")
    p.add_argument("--size", default="512x8", help="HIDDENxLAYERS")
    p.add_argument("--steps", type=int, default=5, help="timed steps (after --warmup untimed ones)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    p.add_argument("--batch_size", type=int, default=None, help="prompts per step (default: 8 for ppo, 2 for grpo)")
    p.add_argument("--num_generations", type=int, default=4, help="grpo: samples per prompt")
    p.add_argument("--beta", type=float, default=0.1, help="grpo: MiniMind's KL coefficient")
    p.add_argument("--device", default="cpu", help="MiniMind's --device (cpu, cuda:0, ...)")
    p.add_argument("--dtype", default="bfloat16", help="MiniMind's --dtype (its autocast dtype on a GPU)")
    p.add_argument("--num_threads", type=int, default=2)
    p.add_argument("--json", default="", help="write the step times here")
    return p.parse_args(argv)


def off_our_root(path: list[str], root: Path = ROOT, cwd: str | None = None) -> list[str]:
    """`path` (a sys.path) without the entries that resolve to `root` ('' and '.' stand for the current
    directory); every other entry stays, in its order."""
    cwd = cwd if cwd is not None else os.getcwd()
    root = root.resolve()
    keep = []
    for entry in path:
        try:
            same = (Path(cwd) / entry).resolve() == root  # '' and relative entries: from `cwd`
        except (OSError, RuntimeError):
            same = False
        if not same:
            keep.append(entry)
    return keep


def main(argv: list[str] | None = None) -> None:
    o = parse_args(argv)
    root = Path(o.minimind_dir).resolve()
    script = root / "trainer" / SCRIPTS[o.script]
    if not script.is_file():
        raise SystemExit(f"error: --minimind_dir {root}: no trainer/{SCRIPTS[o.script]} there (clone jingyaogong/minimind)")
    try:
        hidden, layers = (int(x) for x in o.size.lower().split("x"))
    except ValueError:
        raise SystemExit(f"error: --size {o.size!r}: use HIDDENxLAYERS, e.g. 512x8")
    if o.steps < 1 or o.warmup < 1:
        raise SystemExit("error: --steps and --warmup must be >= 1")
    batch = o.batch_size or (8 if o.script == "ppo" else 2)
    json_out = Path(o.json).resolve() if o.json else None  # before the chdir into MiniMind's trainer/ below
    sys.path[:] = off_our_root(sys.path)  # MiniMind's namespace `trainer/` must not meet ours (module docstring)
    for name in [m for m in sys.modules if m in ("trainer", "model", "dataset") or m.startswith(("trainer.", "model.", "dataset."))]:
        del sys.modules[name]  # nothing of ours imported under MiniMind's package names
    import torch

    torch.set_num_threads(o.num_threads)
    datasets = types.ModuleType("datasets")  # MiniMind reads its jsonl through `datasets`; same records
    datasets.load_dataset = lambda kind, data_files, split: [json.loads(line) for line in open(data_files)]
    datasets.Features = datasets.Sequence = datasets.Value = object
    sys.modules["datasets"] = datasets  # also where the real one is installed (TRL's wheels): same reader
    sys.path.insert(0, str(root))
    os.chdir(root / "trainer")  # MiniMind's paths are relative to trainer/
    import trainer.trainer_utils as tu  # MiniMind's module
    from model.model_minimind import MiniMindConfig, MiniMindForCausalLM  # MiniMind's module

    weights = root / "out" / f"full_sft_{hidden}.pth"
    if not weights.exists():
        weights.parent.mkdir(exist_ok=True)
        torch.manual_seed(0)
        torch.save(MiniMindForCausalLM(MiniMindConfig(hidden_size=hidden, num_hidden_layers=layers)).state_dict(), weights)
    data = root / "minippo_bench_prompts.jsonl"
    rng = random.Random(0)
    words = "the a of to and in is for on with as by at from that this be are or was it".split()
    with open(data, "w") as f:  # 44-56 words: 57-70 tokens with MiniMind's chat template
        for _ in range(200):
            q = " ".join(rng.choice(words) for _ in range(rng.randint(44, 56)))
            f.write(json.dumps({"conversations": [{"role": "user", "content": q}, {"role": "assistant", "content": ""}]}) + "\n")

    class ZeroRewardModel:
        def __init__(self, *args, **kwargs):
            pass

        def get_score(self, messages, response):
            return 0.0

    tu.LMForRewardModel = ZeroRewardModel
    cuda = o.device.startswith("cuda") and torch.cuda.is_available()  # (a stand-in test passes cuda:0 on a CPU)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    stamps: list[float] = []
    generate_s: dict[int, float] = {}  # step index (ends with stamps[i]) -> seconds inside generate()
    real_generate = MiniMindForCausalLM.generate

    def timed_generate(self, *args, **kwargs):
        sync()
        t0 = time.perf_counter()
        out = real_generate(self, *args, **kwargs)
        sync()
        generate_s[len(stamps)] = generate_s.get(len(stamps), 0.0) + time.perf_counter() - t0
        return out

    MiniMindForCausalLM.generate = timed_generate
    log = tu.Logger

    def timed_logger(msg, *args, **kwargs):
        if str(msg).startswith("Epoch:["):  # MiniMind's end-of-step line
            stamps.append(time.perf_counter())
            if len(stamps) == o.steps + o.warmup:
                first = o.warmup - 1  # stamps[first] ends the last warm-up step
                steps = [b - a for a, b in zip(stamps[first:], stamps[first + 1:])]
                gens = [generate_s.get(i, 0.0) for i in range(first + 1, len(stamps))]
                med = statistics.median(steps)
                print(f"MiniMind {o.script} {o.size}: median {med:.2f} s/step over {len(steps)} steps "
                      f"{[round(s, 2) for s in steps]}", flush=True)
                if json_out is not None:
                    mem = ({"peak_allocated_mb": torch.cuda.max_memory_allocated() / 2**20,
                            "peak_reserved_mb": torch.cuda.max_memory_reserved() / 2**20} if cuda else {})
                    json_out.write_text(json.dumps({
                        "script": o.script, "size": o.size, "device": o.device, "dtype": o.dtype, "batch_size": batch,
                        "num_generations": o.num_generations if o.script == "grpo" else 1, "steps_s": steps,
                        "median_s": med, "generate_s": gens, "torch": torch.__version__, **mem}))
                os._exit(0)  # the measurement is complete; MiniMind would go on for the whole epoch
        log(msg, *args, **kwargs)

    tu.Logger = timed_logger
    sys.argv = [str(script), "--hidden_size", str(hidden), "--num_hidden_layers", str(layers), "--batch_size", str(batch),
                "--max_seq_len", "64", "--max_gen_len", "64", "--num_workers", "0", "--data_path", str(data),
                "--save_interval", "100000", "--device", o.device, "--dtype", o.dtype]
    if o.script == "ppo":
        sys.argv += ["--ppo_update_iters", "1", "--mini_batch_size", str(batch)]
    else:
        sys.argv += ["--num_generations", str(o.num_generations), "--beta", str(o.beta)]
    runpy.run_path(str(script), run_name="__main__")


if __name__ == "__main__":
    main()
