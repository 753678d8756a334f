"""Benchmark PPO steps of the real trainer code (`train_ppo.make_experience` + `train_ppo.ppo_update`).

    python scripts/bench_ppo.py                          # demo 128x4 and 512x8, fp32 vs bf16, old-actor 0 vs 1
    python scripts/bench_ppo.py --quick                  # 128x4, bf16, 2 steps: a smoke run (~30 s)
    python scripts/bench_ppo.py --sizes 512x8 --dtypes bfloat16 --num_threads 1,2 --use_compile 0,1 \
        --frozen_low_precision 0,1 --json bench.json     # levers: every comma list expands the matrix

What is measured. Every configuration runs in a fresh subprocess (so peak RSS is per config), builds
the run with `trainer.run.setup.setup`, as `train_ppo.main()` does, from a namespace made by
`train_ppo.parse_args` (random init: `--from_weight none`), then runs `--warmup` untimed steps and
`--steps` timed steps of `make_experience` + `ppo_update`, refreshing the old actor like main()'s
loop. The work per step is fixed: `--batch_size` prompts of exactly `--prompt_len` tokens,
`--gen_len` new tokens with EOS suppressed (train_ppo's hidden `--suppress_eos 1`), one update epoch
of one minibatch. Prompts: `random` = uniform token ids in [3, vocab) (no special tokens, no padding);
`demo` = real prompts from dataset/demo_train.jsonl rendered by RLAIFDataset and left-padded to
exactly `--prompt_len` columns (same FLOPs, exercises the padding-mask path). The reward model is a
negligible 1-layer, hidden-32 sequence classifier (`--reward_model tiny`) or none.

Phase timers are the trainer's own: make_experience and ppo_update take a timer (trainer/run/timing.py)
and time their phases with it; the bench passes one that also sums CPU seconds and counts FLOPs.
Reported per step (medians over the timed steps):
  generate           sampling with KV cache (generate_rollout)
  score_old          old log-probs + entropy (actor itself, or the frozen old-actor copy)
  score_ref          reference log-probs
  score_critic       critic values
  score_reward       decode + rule rewards + reward model (compute_rewards)
  score_other        the rest of make_experience (KL, GAE, whitening, metrics)
  update_actor_fwd / update_critic_fwd / update_optimizer (grad clipping + AdamW steps) / update_backward
                     (the rest: losses, backward)
  sync_old           old_actor.load_state_dict(actor.state_dict()) when --update_old_actor_freq > 0
With --parallel_update on (train_ppo's default for CPU bf16), the actor's and the critic's forward
overlap in time: each is its own thread's wall time, so the remainder update_backward is understated;
`update` itself is exact.
The same split is kept in process CPU seconds (`cpu_s`); the table's cpu/wall column is the noise
check: on a quiet machine it is close to the thread count, far below it the process waited for a core.

Update-phase FLOPs are analytic (documented in `forward_flops`): a forward costs 2 FLOP per
multiply-accumulate of every linear layer at every position, plus 4*T^2*head_dim*heads per layer per
row for attention (QK^T and AV, full square as the counters count it), plus the LM head only at the
R+1 kept positions; training = 3x forward (backward ~ 2x) for actor and critic. The warm-up step is
also counted with torch.utils.flop_counter.FlopCounterMode (without --use_compile) as a check; it
counts matmuls only (it has no formula for CPU's flash-attention kernel), so it sits ~4% below.
Achieved FLOP/s = update FLOPs / update time, as a share of this machine's torch.mm peak measured
in the same run (1024 and 2048 squares, before and after the configs, the better of the two) at the
same thread count and for the matching dtype (fp32 configs against the fp32 peak, bf16 against bf16).

Memory: peak RSS (ru_maxrss of the child) is split into the process baseline after imports, the
parameter bytes of each model, gradients (actor + critic, fp32), AdamW state (2 fp32 tensors per
trained parameter) and the remainder (activations, allocator slack, temporaries). The budget line is
baseline + 4 fp32 model copies + 2 AdamW states (= 8 x fp32 actor bytes).

On a shared machine prefer `--num_threads 1` (two threads that must meet at every parallel region
stall whenever another process holds a core) and read `cpu_s` alongside the wall times.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import itertools
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402

from trainer.run.timing import PhaseTimer  # noqa: E402

MB = 1024 * 1024
# shared/notes/cpu-speed.md: MiniMind train_ppo.py, 512x8, same work, fp32, on another machine (an AMD EPYC).
# Scaling it by the fp32 matmul peak does not carry over: on this machine's Intel Xeon the estimate was
# ~5.4 s and MiniMind measured 9.6 s (README), so compare against a same-machine figure (--minimind_s).
MINIMIND_REFERENCE_S = 5.9
TIME_KEYS = ("step", "generate", "score", "score_old", "score_ref", "score_critic", "score_reward", "score_other",
             "update", "update_actor_fwd", "update_critic_fwd", "update_optimizer", "update_backward", "sync_old")
RESULT_KEYS = ("config", "ok", "error", "params", "time_s", "time_s_all", "cpu_s", "first_step_s", "build_s",
               "tokens_per_s_generate", "tokens_per_s_step", "flops", "update_tflops_per_s", "update_peak_share",
               "memory_mb")
TOP_KEYS = ("machine", "date", "matmul_peak_gflops", "settings", "results", "minimind_reference_s", "minimind_here_s")


# ------------------------------------------------------------------------------------ helpers
def parse_size(text: str) -> tuple[int, int]:
    """'512x8' -> (hidden 512, layers 8)."""
    try:
        h, l = text.lower().split("x")
        return int(h), int(l)
    except ValueError:
        raise SystemExit(f"error: --sizes entry {text!r} must look like HIDDENxLAYERS, e.g. 512x8") from None


def rss_now_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def matmul_peak(dtype: torch.dtype, sizes: tuple[int, ...] = (1024, 2048), reps: int = 8) -> dict[str, float]:
    """GFLOP/s of torch.mm on square matrices: median of `reps` timed calls per size; peak = best size."""
    out = {}
    for n in sizes:
        a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
        for _ in range(2):
            torch.mm(a, b)
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            torch.mm(a, b)
            times.append(time.perf_counter() - t)
        out[str(n)] = 2 * n**3 / statistics.median(times) / 1e9
    out["peak"] = max(out.values())
    return out


def forward_flops(cfg: Any, rows: int, seq: int, head_positions: int) -> float:
    """Analytic FLOPs of one forward: 2 x MACs of every linear at every position, attention
    QK^T + AV over the full T x T square, and the LM head on `head_positions` positions per row."""
    H, L, I, V = cfg.hidden_size, cfg.num_hidden_layers, cfg.intermediate_size, cfg.vocab_size
    heads, kv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
    if getattr(cfg, "use_moe", False):
        I = I * getattr(cfg, "num_experts_per_tok", 1)  # active experts only (router ignored)
    linear_macs = H * heads * hd + 2 * H * kv * hd + heads * hd * H + 3 * H * I
    attn = 4 * heads * hd * seq * seq
    return rows * seq * L * 2 * linear_macs + rows * L * attn + 2 * H * V * rows * head_positions


# ------------------------------------------------------------------------------------ child
def now() -> tuple[float, float]:
    """(wall, process CPU) seconds. CPU time is the noise check on a shared machine: with N threads
    on a quiet machine cpu ~ N x wall; much less means the process waited for a core."""
    return time.perf_counter(), time.process_time()


class BenchTimer(PhaseTimer):
    """The trainer's phase timer (wall seconds per phase), plus process CPU seconds and, on the
    warm-up step, FLOPs of the phases that do not nest another counted one."""

    FLOP_PHASES = ("generate", "score_old", "score_ref", "score_critic", "score_reward", "update")

    def __init__(self, count_flops: bool = False) -> None:
        super().__init__()
        self.cpu: dict[str, float] = {}
        self.flops: dict[str, float] = {}
        self.count_flops = count_flops

    @contextlib.contextmanager
    def __call__(self, name: str):
        counter = None
        if self.count_flops and name in self.FLOP_PHASES:
            from torch.utils.flop_counter import FlopCounterMode

            counter = FlopCounterMode(display=False)
        start = now()
        try:
            with counter or contextlib.nullcontext():
                yield
        finally:
            end = now()
            self.add(name, end[0] - start[0])
            with self._lock:
                self.cpu[name] = self.cpu.get(name, 0.0) + end[1] - start[1]
            if counter is not None:
                self.flops[name] = self.flops.get(name, 0.0) + counter.get_total_flops()


def split_step(acc: dict[str, float]) -> dict[str, float]:
    """One step's TIME_KEYS from a timer's per-phase sums (wall or CPU seconds)."""
    rec = {k: acc.get(k, 0.0) for k in TIME_KEYS}
    rec["score"] = rec["step"] - rec["sync_old"] - rec["generate"] - rec["update"]  # the rest of make_experience
    rec["score_other"] = rec["score"] - rec["score_old"] - rec["score_ref"] - rec["score_critic"] - rec["score_reward"]
    rec["update_backward"] = rec["update"] - rec["update_actor_fwd"] - rec["update_critic_fwd"] - rec["update_optimizer"]
    return rec


def make_batch(tok: Any, batch_size: int, prompt_len: int, kind: str, seed: int) -> dict:
    """A prompt batch of exactly `prompt_len` columns in collate_left_pad's format."""
    from dataset.rlaif import RLAIFDataset, collate_left_pad, read_rlaif_jsonl

    if kind == "random":
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(3, len(tok), (batch_size, prompt_len), generator=g)
        texts = [tok.decode(r.tolist()) for r in ids]
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "prompt": texts,
                "messages": [[{"role": "user", "content": t}] for t in texts], "reference": [None] * batch_size,
                "assistant_prefix": [""] * batch_size, "index": list(range(batch_size)), "num_truncated": [0] * batch_size}
    records, _ = read_rlaif_jsonl(ROOT / "dataset" / "demo_train.jsonl")
    ds = RLAIFDataset(records, tok, max_prompt_len=prompt_len, seed=seed)
    batch = collate_left_pad([ds[i] for i in range(batch_size)], pad_id=tok.pad_token_id)
    extra = prompt_len - batch["input_ids"].shape[1]
    if extra > 0:  # pad every row further on the left: exactly prompt_len columns
        batch["input_ids"] = torch.cat([torch.full((batch_size, extra), tok.pad_token_id), batch["input_ids"]], 1)
        batch["attention_mask"] = torch.cat([torch.zeros(batch_size, extra, dtype=torch.long), batch["attention_mask"]], 1)
    return batch


def make_tiny_rm(path: Path, vocab: int, pad_id: int) -> None:
    """A 1-layer hidden-32 sequence classifier: stands in for a negligible reward model."""
    from transformers import Qwen3Config, Qwen3ForSequenceClassification

    from model.loader import load_tokenizer

    torch.manual_seed(0)
    rm = Qwen3ForSequenceClassification(Qwen3Config(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, num_labels=1, pad_token_id=pad_id, tie_word_embeddings=True))
    rm.save_pretrained(path)
    load_tokenizer().save_pretrained(path)


def run_config(cfg: dict) -> dict:
    """One configuration, in this (fresh) process. Returns the result dict (RESULT_KEYS)."""

    import train_ppo as T
    from model.loader import load_tokenizer
    from trainer.run.distributed import DistInfo
    from trainer.run.setup import setup

    load_tokenizer()
    rss_base = rss_now_mb()  # torch + transformers + project imported, tokenizer loaded, no model yet

    hidden, layers = cfg["hidden"], cfg["layers"]
    argv = ["--hidden_size", str(hidden), "--num_hidden_layers", str(layers), "--from_weight", "none",
            "--batch_size", str(cfg["batch_size"]), "--mini_batch_size", str(cfg["batch_size"]),
            "--ppo_update_iters", "1", "--max_gen_len", str(cfg["gen_len"]), "--max_seq_len", str(cfg["prompt_len"]),
            "--dtype", cfg["dtype"], "--update_old_actor_freq", str(cfg["update_old_actor_freq"]),
            "--frozen_low_precision", str(cfg["frozen_low_precision"]), "--use_compile", str(cfg["use_compile"]),
            "--num_threads", str(cfg["num_threads"]), "--parallel_update", str(cfg.get("parallel_update", -1)),
            "--suppress_eos", "1", "--seed", str(cfg["seed"]),
            "--warmup_steps", "0", "--max_steps", str(cfg["warmup"] + cfg["steps"] + 1),
            "--rm_weight", "0.5" if cfg["reward_model"] else "0", "--lora_r", str(cfg.get("lora_r", 0)),
            "--reward_model_path", cfg["reward_model"] or "none", *cfg.get("extra_args", [])]
    args = T.parse_args(argv)

    # ---- the run, built by the trainer's own set-up (models, optimizers, precision, compile)
    t_build = time.perf_counter()
    built = setup(args, DistInfo())
    s, m, opt, kl_ctl = built.settings, built.models, built.optim, built.kl_ctl
    actor, critic, ref, old_actor, rm_scorer, optims = m.actor, m.critic, m.ref, m.old_actor, m.rm_scorer, opt.optims
    total = cfg["warmup"] + cfg["steps"]
    build_s = time.perf_counter() - t_build
    rss_models = rss_now_mb()
    batch = make_batch(m.tok, args.batch_size, cfg["prompt_len"], cfg["prompts"], args.seed)

    per_step: list[dict[str, float]] = []
    per_step_cpu: list[dict[str, float]] = []
    first_step_s = float("nan")
    flops_counted: dict[str, float] = {}
    error = None
    try:
        for step in range(total):  # train_ppo.main's loop body, with a timer that also counts CPU time and FLOPs
            counting = step == 0 < cfg["warmup"] and cfg["count_flops"] and not args.use_compile
            timer = BenchTimer(count_flops=counting)
            with timer("step"):
                with timer("sync_old"):
                    if old_actor is not None and step % args.update_old_actor_freq == 0:
                        old_actor.load_state_dict(actor.state_dict())
                exp = T.make_experience(args, batch, m, s, kl_ctl.value, {}, timer)
                with timer("update"):
                    T.ppo_update(args, exp.rollout, m, opt, step, s, kl_ctl.value, timer)
            ro = exp.rollout
            if counting:
                flops_counted = dict(timer.flops)
            if ro.sequences.shape[1] != cfg["prompt_len"] + cfg["gen_len"]:
                raise RuntimeError(f"response length {ro.response_len} != --gen_len {cfg['gen_len']} (EOS not suppressed?)")
            recs = split_step(timer.wall), split_step(timer.cpu)
            if step == 0:
                first_step_s = recs[0]["step"]
            if step >= cfg["warmup"]:
                per_step.append(recs[0])
                per_step_cpu.append(recs[1])
    except Exception as e:  # noqa: BLE001 - reported in the table, the other configs still run
        error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"

    # ---- figures
    nparams = lambda m: sum(p.numel() for p in m.parameters()) if m is not None else 0
    pbytes = lambda m: sum(p.numel() * p.element_size() for p in m.parameters()) if m is not None else 0
    params = {"actor": nparams(actor), "critic": nparams(critic), "ref": nparams(ref), "old_actor": nparams(old_actor),
              "reward_model": nparams(rm_scorer.model) if rm_scorer is not None and hasattr(rm_scorer, "model") else 0}
    adam_bytes = sum(t.numel() * t.element_size() for o in optims.values() for s in o.state.values()
                     for t in s.values() if isinstance(t, torch.Tensor))
    grad_bytes = sum(p.numel() * 4 for m in (actor, critic) if m is not None for p in m.parameters() if p.requires_grad)
    param_mb = {"actor": pbytes(actor) / MB, "critic": pbytes(critic) / MB, "ref": pbytes(ref) / MB,
                "old_actor": pbytes(old_actor) / MB,
                "reward_model": pbytes(rm_scorer.model) / MB if rm_scorer is not None and hasattr(rm_scorer, "model") else 0.0}
    peak = peak_rss_mb()
    fp32_copy_mb = params["actor"] * 4 / MB
    accounted = rss_base + sum(param_mb.values()) + grad_bytes / MB + adam_bytes / MB
    memory = {
        "peak_rss": peak, "baseline_imports": rss_base, "after_models": rss_models, "params": param_mb,
        "grads": grad_bytes / MB, "adamw": adam_bytes / MB, "activations_other": peak - accounted,
        "fp32_model_copy": fp32_copy_mb, "budget_4_copies_2_adamw": rss_base + 8 * fp32_copy_mb,
    }
    memory["within_budget"] = bool(peak <= memory["budget_4_copies_2_adamw"])

    med = {k: statistics.median(r[k] for r in per_step) for k in TIME_KEYS} if per_step else {}
    B, P, R = args.batch_size * args.num_generations, cfg["prompt_len"], cfg["gen_len"]  # rows
    seq = P + R
    mcfg = actor.config
    actor_fwd = forward_flops(mcfg, B, seq, R + 1)
    critic_fwd = forward_flops(mcfg, B, seq, 0) if critic is not None else 0.0  # critic-free estimators build none
    gen = forward_flops(mcfg, B, P, 1) + sum(forward_flops(mcfg, B, 1, 1) + B * mcfg.num_hidden_layers * 4 * mcfg.hidden_size * (P + t)
                                           for t in range(1, R))
    flops = {
        "update_analytic": 3 * (actor_fwd + critic_fwd) * args.ppo_update_iters,
        "score_analytic": 2 * actor_fwd + critic_fwd,  # old log-probs + reference + critic
        "generate_analytic": gen,
        "counted": flops_counted,  # FlopCounterMode on the warm-up step (matmuls + SDPA); {} when compiled
    }
    flops["step_analytic"] = flops["update_analytic"] + flops["score_analytic"] + gen
    upd_rate = flops["update_analytic"] / med["update"] / 1e12 if med else float("nan")
    return {
        "config": cfg, "ok": error is None and bool(per_step), "error": error, "params": params,
        "time_s": med, "time_s_all": {k: [r[k] for r in per_step] for k in TIME_KEYS},
        "cpu_s": ({k: statistics.median(r[k] for r in per_step_cpu) for k in TIME_KEYS} if per_step_cpu else {}),
        "first_step_s": first_step_s, "build_s": build_s,
        "tokens_per_s_generate": B * R / med["generate"] if med else float("nan"),
        "tokens_per_s_step": B * R / med["step"] if med else float("nan"),
        "flops": flops, "update_tflops_per_s": upd_rate, "update_peak_share": None,  # filled by the parent
        "memory_mb": memory,
    }


# ------------------------------------------------------------------------------------ parent
def _die_with_parent() -> None:
    """Linux: a config's process ends with the bench (no orphan hogging a shared machine)."""
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Benchmark minippo PPO steps (the real trainer code path)",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    a = p.add_argument
    a("--sizes", default=None, help="comma list of HIDDENxLAYERS (default 128x4,512x8; --quick: 128x4)")
    a("--dtypes", default=None, help="comma list of float32,bfloat16 (default both; --quick: bfloat16)")
    a("--update_old_actor_freq", default=None, help="comma list of old-actor modes: 0 = no copy, N = frozen copy refreshed every N steps (default 0,1; --quick: 0)")
    a("--frozen_low_precision", default="1", help="comma list of 0/1: reference/old actor/RM held in --dtype")
    a("--use_compile", default="0", help="comma list of 0/1: torch.compile the training forward (actor_train, critic_train)")
    a("--num_threads", default="0", help="comma list of torch thread counts (0 = torch default)")
    a("--parallel_update", default="-1", help="comma list of -1/0/1: actor and critic update side by side on one core each (-1 = train_ppo's auto)")
    a("--lora_r", default="0", help="comma list of LoRA ranks of the actor (0 = full fine-tuning; --extra sets --lora_alpha etc.)")
    a("--batch_size", type=int, default=8)
    a("--prompt_len", type=int, default=64)
    a("--gen_len", type=int, default=64)
    a("--prompts", default="random", choices=["random", "demo"], help="random ids, or demo prompts left-padded to --prompt_len")
    a("--reward_model", default="tiny", choices=["tiny", "none"], help="a negligible 1-layer RM, or no RM (rm_weight 0)")
    a("--steps", type=int, default=None, help="timed steps per config (default 5; --quick: 2)")
    a("--warmup", type=int, default=1, help="untimed steps first (the first also counts FLOPs)")
    a("--count_flops", type=int, default=1, choices=[0, 1], help="FlopCounterMode on the warm-up step")
    a("--seed", type=int, default=42)
    a("--timeout", type=int, default=900, help="seconds per config")
    a("--quick", action="store_true", help="smoke run: one small config, 2 steps")
    a("--json", default=None, help="write all results to this file")
    a("--minimind_s", type=float, default=None,
      help="MiniMind's train_ppo.py median s/step for the same work measured on this machine (README: how); "
           "the summary prints our speed-up against it")
    a("--extra", default="", help="extra train_ppo flags for every config, e.g. \"--temperature 1.0\"")
    a("--_child", default=None, help=argparse.SUPPRESS)
    return p


def expand_configs(o: argparse.Namespace) -> list[dict]:
    sizes = [parse_size(s) for s in (o.sizes or ("128x4" if o.quick else "128x4,512x8")).split(",")]
    ints = lambda s: [int(x) for x in str(s).split(",")]
    dtypes = (o.dtypes or ("bfloat16" if o.quick else "float32,bfloat16")).split(",")
    for d in dtypes:
        if d not in ("float32", "bfloat16", "float16"):
            raise SystemExit(f"error: --dtypes entry {d!r}: use float32, bfloat16 or float16")
    old_modes = ints(o.update_old_actor_freq or ("0" if o.quick else "0,1"))
    steps = o.steps if o.steps is not None else (2 if o.quick else 5)
    if steps < 1 or o.warmup < 0:
        raise SystemExit("error: --steps must be >= 1 and --warmup >= 0")
    # Every comma list expands the matrix (the last list varies fastest).
    matrix = itertools.product(sizes, ints(o.num_threads), ints(o.use_compile), ints(o.frozen_low_precision),
                               dtypes, old_modes, ints(o.parallel_update), ints(o.lora_r))
    return [{
        "name": f"{h}x{l}", "hidden": h, "layers": l, "dtype": d, "update_old_actor_freq": old,
        "frozen_low_precision": flp, "use_compile": comp, "num_threads": threads, "parallel_update": par,
        "batch_size": o.batch_size, "prompt_len": o.prompt_len, "gen_len": o.gen_len,
        "prompts": o.prompts, "steps": steps, "warmup": o.warmup, "count_flops": o.count_flops,
        "seed": o.seed, "reward_model": None, "extra_args": o.extra.split() if o.extra else [], "lora_r": lora,
    } for (h, l), threads, comp, flp, d, old, par, lora in matrix]


def run_child(cfg: dict, timeout: int) -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONPATH=str(ROOT))
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "result.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--_child", json.dumps({**cfg, "out": str(out)})]
        try:
            r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"config": cfg, "ok": False, "error": f"timeout after {timeout} s"}
        if r.returncode != 0 or not out.exists():
            tail = (r.stderr.strip().splitlines() or ["(no output)"])[-1]
            return {"config": cfg, "ok": False, "error": f"exit {r.returncode}: {tail}"}
        return json.loads(out.read_text())


def fmt_row(r: dict) -> str:
    c = r["config"]
    label = (f"{c['name']:>6} {c['dtype'][:4]:>4} old={c['update_old_actor_freq']} flp={c['frozen_low_precision']} "
             f"cmp={c['use_compile']} thr={c['num_threads'] or 'def'} par={c.get('parallel_update', -1)} lora={c.get('lora_r', 0)}")
    if not r.get("ok"):
        return f"{label} | FAILED: {r.get('error')}"
    t, m = r["time_s"], r["memory_mb"]
    score_parts = f"{t['score_old']:.2f}/{t['score_ref']:.2f}/{t['score_critic']:.2f}/{t['score_reward']:.2f}"
    share = r.get("update_peak_share")
    return (f"{label} | {t['step']:6.2f} {t['generate']:6.2f} {t['score']:6.2f} ({score_parts}) {t['update']:6.2f} "
            f"{t['sync_old']:5.2f} | {r['tokens_per_s_generate']:6.0f} | {r['update_tflops_per_s'] * 1000:6.1f} "
            f"{(share or float('nan')) * 100:5.1f}% | {m['peak_rss']:6.0f} {m['budget_4_copies_2_adamw']:6.0f} | "
            f"{r['cpu_s']['step'] / t['step']:4.2f}")


HEADER = ("config                                   |   step    gen  score (old/ref/critic/reward)      update  sync  "
          "| gen t/s | upd GF/s %peak | peakMB budgetMB | cpu/wall")


def main(argv: list[str] | None = None) -> None:
    o = build_parser().parse_args(argv)
    if o._child:
        _die_with_parent()
        cfg = json.loads(o._child)
        res = run_config(cfg)
        Path(cfg["out"]).write_text(json.dumps(res))
        return
    cfgs = expand_configs(o)
    default_threads = torch.get_num_threads()
    thread_counts = sorted({c["num_threads"] for c in cfgs})
    peak_dtypes = sorted({"float32", "bfloat16"} | {c["dtype"] for c in cfgs})
    peak_kw = {"sizes": (1024,), "reps": 3} if o.quick else {}

    def measure_peaks() -> dict[str, dict[str, dict[str, float]]]:
        """{threads: {dtype: {size: GFLOP/s, "peak": best}}} at every thread count the configs use."""
        out = {}
        for t in thread_counts:
            torch.set_num_threads(t if t > 0 else default_threads)
            out[str(t)] = {d: matmul_peak(getattr(torch, d), **peak_kw) for d in peak_dtypes}
        torch.set_num_threads(default_threads)
        return out

    t_all = time.perf_counter()
    peaks_before = measure_peaks()
    for t, pk in peaks_before.items():
        print(f"matmul peak ({t if t != '0' else default_threads} threads): "
              + ", ".join(f"{d} {v['peak']:.0f}" for d, v in pk.items()) + " GFLOP/s", flush=True)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        rm_path = None
        if o.reward_model == "tiny":
            from model.loader import load_tokenizer

            tok = load_tokenizer()
            rm_path = str(Path(tmp) / "tiny_rm")
            make_tiny_rm(Path(rm_path), len(tok), tok.pad_token_id)
        print(HEADER, flush=True)
        for cfg in cfgs:
            cfg["reward_model"] = rm_path
            r = run_child(cfg, o.timeout)
            results.append(r)
            print(fmt_row(r) if r.get("ok") else fmt_row({**r, "ok": False}), flush=True)
    peaks_after = measure_peaks()
    # The better of before/after: on a shared machine the lower one is the noise, not the hardware.
    peaks = {t: {d: max(peaks_before[t][d]["peak"], peaks_after[t][d]["peak"]) for d in peak_dtypes} for t in peaks_before}
    for r in results:
        if r.get("ok"):
            c = r["config"]
            r["update_peak_share"] = r["update_tflops_per_s"] * 1000 / peaks[str(c["num_threads"])][c["dtype"]]
            r["matmul_peak_gflops"] = peaks[str(c["num_threads"])][c["dtype"]]
            c["reward_model"] = o.reward_model
    for t, pk in peaks_after.items():
        print(f"matmul peak after ({t if t != '0' else default_threads} threads): "
              + ", ".join(f"{d} {v['peak']:.0f}" for d, v in pk.items()) + " GFLOP/s (shares use the better of before/after)")
    print("\nshares of the update phase against the dtype-matched peak:")
    print(HEADER)
    for r in results:
        print(fmt_row(r))
    for r in results:
        if r.get("ok") and r["config"]["name"] == "512x8":
            step = r["time_s"]["step"]
            print(f"{r['config']['name']} {r['config']['dtype']} old={r['config']['update_old_actor_freq']} "
                  f"threads={r['config']['num_threads']}: {step:.2f} s/step"
                  + (f" = {o.minimind_s / step:.2f}x MiniMind's {o.minimind_s} s/step here (--minimind_s)" if o.minimind_s else "")
                  + f"; {MINIMIND_REFERENCE_S / step:.2f}x its {MINIMIND_REFERENCE_S} s/step on another machine")
    print(f"total bench time {time.perf_counter() - t_all:.0f} s")
    report = {
        "machine": {"cpu": cpu_name(), "logical_cpus": os.cpu_count(), "torch": torch.__version__,
                    "python": platform.python_version(), "torch_default_threads": default_threads,
                    "loadavg_end": os.getloadavg()},
        "date": _dt.datetime.now().isoformat(timespec="seconds"),
        "matmul_peak_gflops": {**peaks[str(thread_counts[0])], "by_threads": peaks,
                               "before": peaks_before, "after": peaks_after},
        "settings": {k: v for k, v in vars(o).items() if k != "_child"},
        "results": results,
        "minimind_reference_s": MINIMIND_REFERENCE_S,
        "minimind_here_s": o.minimind_s,
    }
    if o.json:
        Path(o.json).parent.mkdir(parents=True, exist_ok=True)
        Path(o.json).write_text(json.dumps(report, indent=1))
        print(f"wrote {o.json}")


if __name__ == "__main__":
    main()
