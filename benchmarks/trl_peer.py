"""The peer's figure: TRL's GRPOTrainer doing the SmolLM2 IFEval preset's work on this CPU, timed per step and per
phase, for an A/B against `benchmarks/bench_ppo.py --actor_path` (docs/speed-and-memory.md).

Runs in a scratch virtualenv of its own (TRL is not a dependency of minippo):

    python3 -m venv /tmp/venv-trl && /tmp/venv-trl/bin/pip install -r requirements.txt trl==1.16.0
    /tmp/venv-trl/bin/python benchmarks/trl_peer.py --num_threads 1 --steps 3

The work, as the preset's step (configs/smollm2_ifeval.yaml): 4 prompts of dataset/ifeval_train.jsonl x 4 samples
= 16 rows, T=0.7, exactly 64 new tokens (min_new_tokens, so EOS does not shorten TRL's rows and the work stays
equal), the IFEval constraint reward (dataset/ifeval.py, the same function), beta 0.02 (so a reference forward),
one optimizer step per generation batch (num_iterations 1), bf16 mixed precision on fp32 weights (`bf16=True`,
`use_cpu=True`). Phases come from TRL's own profiling contexts ("profiling/Time taken: ..."), collected here.

`--work zero` is benchmarks/gpu_check.py --peers' row instead (on a GPU: `--device cuda`): --prompts prompts of
exactly --prompt_len tokens (random words, lengthened or shortened until TRL's own tokenization of them has that
many), --num_generations samples each, exactly --gen_len new tokens, a reward of 0 for every sample, --beta,
gradient checkpointing off (TRL defaults it on), optionally --cache_implementation static. The JSON then also holds
every step's time in transformers' generate() (TRL's "transformers.generate" context) and CUDA's peak memory.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def exact_prompts(tok, n: int, length: int, seed: int) -> list[str]:
    """`n` texts of random words that `tok(text)` (TRL's tokenization of a plain-text prompt) makes exactly
    `length` tokens."""
    rng = random.Random(seed)
    words = "the a of to and in is for on with as by at from that this be are or was it".split()
    out = []
    while len(out) < n:
        text = " ".join(rng.choice(words) for _ in range(length))
        for _ in range(4 * length):
            k = len(tok(text)["input_ids"])
            if k == length:
                out.append(text)
                break
            text = text.rsplit(" ", 1)[0] if k > length else f"{text} {rng.choice(words)}"
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(ROOT / "out" / "smollm2_135m_instruct"))
    p.add_argument("--num_threads", type=int, default=1)
    p.add_argument("--steps", type=int, default=3, help="timed steps, after --warmup untimed ones")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--json", default=None, help="write the figures here")
    p.add_argument("--work", default="ifeval", choices=["ifeval", "zero"],
                   help="ifeval: the SmolLM2 IFEval preset's step; zero: exact-length prompts, zero reward (gpu_check --peers)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--prompts", type=int, default=4, help="prompts per step")
    p.add_argument("--num_generations", type=int, default=4)
    p.add_argument("--prompt_len", type=int, default=64, help="--work zero: tokens per prompt")
    p.add_argument("--gen_len", type=int, default=64)
    p.add_argument("--beta", type=float, default=None, help="KL coefficient (default 0.02 for ifeval, 0.1 for zero)")
    p.add_argument("--cache_implementation", default=None, help="GRPOConfig.cache_implementation, e.g. static")
    o = p.parse_args(argv)

    import torch
    import transformers
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    from trl.extras import profiling

    torch.set_num_threads(o.num_threads)
    phases: dict[str, dict[int, float]] = defaultdict(lambda: defaultdict(float))  # name -> {step: seconds}
    step_s: list[float] = []

    def collect(self: profiling.ProfilingContext, duration: float) -> None:
        phases[self.name][len(step_s)] += duration  # the step under way: those finished so far

    profiling.ProfilingContext._log_metrics = collect  # TRL's own phase timers, kept instead of sent to a tracker

    tok = AutoTokenizer.from_pretrained(o.model)
    n = o.prompts * (o.warmup + o.steps)
    if o.work == "ifeval":
        from dataset.ifeval import reward as ifeval_reward

        rows = [json.loads(line) for line in (ROOT / "dataset" / "ifeval_train.jsonl").read_text().splitlines()]
        data = Dataset.from_list([{"prompt": [{"role": "user", "content": r["conversations"][0]["content"]}],
                                   "constraints": json.dumps(r["constraints"])} for r in rows[:n]])

        def reward(completions: list, constraints: list[str], **_: object) -> list[float]:
            return [ifeval_reward(json.loads(c), comp[-1]["content"]) for comp, c in zip(completions, constraints)]
    else:
        data = Dataset.from_list([{"prompt": t} for t in exact_prompts(tok, n, o.prompt_len, seed=0)])

        def reward(completions: list, **_: object) -> list[float]:
            return [0.0] * len(completions)

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            if o.device == "cuda":
                torch.cuda.synchronize()
            self.t = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            if o.device == "cuda":
                torch.cuda.synchronize()
            step_s.append(time.perf_counter() - self.t)

    model = AutoModelForCausalLM.from_pretrained(o.model, dtype=torch.float32)
    beta = o.beta if o.beta is not None else (0.02 if o.work == "ifeval" else 0.1)
    extra = {} if o.work == "ifeval" else {"gradient_checkpointing": False}
    if o.cache_implementation:
        extra["cache_implementation"] = o.cache_implementation
    cfg = GRPOConfig(
        output_dir=str(Path(os.environ.get("TMPDIR", "/tmp")) / "trl_peer"), use_cpu=o.device == "cpu", bf16=True,
        per_device_train_batch_size=o.prompts * o.num_generations, num_generations=o.num_generations,
        max_completion_length=o.gen_len, temperature=0.7 if o.work == "ifeval" else 0.8,
        beta=beta, learning_rate=2e-5, num_iterations=1, max_steps=o.warmup + o.steps, logging_steps=1,
        report_to=[], save_strategy="no", seed=42, shuffle_dataset=False, dataloader_num_workers=0,
        generation_kwargs={"min_new_tokens": o.gen_len}, **extra,
    )
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=cfg, train_dataset=data,
                          processing_class=tok, callbacks=[StepTimer()])
    trainer.train()
    timed = step_s[o.warmup:]
    per_step = {name: statistics.median(v.get(i, 0.0) for i in range(o.warmup, len(step_s))) for name, v in phases.items()}
    gen: dict[int, float] = defaultdict(float)  # TRL names it "<Trainer class>.transformers.generate"
    for name, per_step_s in phases.items():
        if name.endswith("transformers.generate"):
            for i, t in per_step_s.items():
                gen[i] += t
    out = {"trl_step_s_median": statistics.median(timed), "step_s": step_s, "phases_s_median_per_step": per_step,
           "generate_s": [gen.get(i, 0.0) for i in range(o.warmup, len(step_s))], "warmup": o.warmup,
           "threads": o.num_threads, "torch": torch.__version__, "trl": trl.__version__,
           "transformers": transformers.__version__, "rows": o.prompts * o.num_generations, "beta": beta,
           "cache_implementation": o.cache_implementation,
           "params": sum(p.numel() for p in model.parameters())}
    if o.device == "cuda":
        out.update(peak_allocated_mb=torch.cuda.max_memory_allocated() / 2**20,
                   peak_reserved_mb=torch.cuda.max_memory_reserved() / 2**20)
    print(json.dumps(out, indent=1))
    if o.json:
        Path(o.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
