"""How far the sampler's log-probs (--rollout_logprobs 1) are from a second forward, and what that
does to the PPO ratio on the first update minibatch, before any optimizer step.

    python benchmarks/measure_logprob_gap.py          # 512x8 random init + 128x4 demo policy, fp32 + bf16,
                                                   # without LoRA and with LoRA r16, seeds 0,1,2
    python benchmarks/measure_logprob_gap.py --sizes 128x4:full_sft --dtypes bfloat16 --lora_r 0 --seeds 0 --warmup_steps 5
    python benchmarks/measure_logprob_gap.py --device cuda --sizes 512x8:none --dtypes bfloat16 --seeds 0,1   # on a GPU

What is measured. Each (size, dtype, LoRA rank, seed) builds a run with the trainer's own set-up
(`train_ppo.parse_args` + `trainer.run.setup.setup`; `:none` = random init, `:full_sft` = the shipped
out/full_sft_<hidden>.pth), takes `--batch_size` demo prompts (dataset/demo_train.jsonl, picked by the
seed) and runs `train_ppo.make_experience` with --rollout_logprobs 1 (demo reward model), so
old_logprobs come from the KV-cached sampling pass (model/generation.py `sample`, model/fast_decode.py).
Then, under the run's autocast:
  2nd fwd  `policy_forward` of the finished sequences, no grad, the model's own attention: a second
           scoring pass (`cost` = its wall time, with entropy as score_old).
  upd fwd  `policy_forward` as `trainer.update.actor_backward` runs it on the first update minibatch (the
           trainer's permutation): grad on, inside `attention_implementation(settingargs.train_attn)`, i.e.
           eager attention under bf16 on CPU. The "new" log-probs of the first ratio.
  step     one real `train_ppo.ppo_update`, then the update forward again on the same rows.
Columns (token statistics over real response tokens, response_mask; log-probs in nats):
  tok                 response tokens in the batch
  gap_mean/p99/max    |sampler - 2nd fwd| per token
  A_*                 against the sampler's old log-probs (A_ratio / A_clipfrac are what the trainer logs as
                      ppo/ratio / ppo/clipfrac for that minibatch; checked when it is the whole batch):
                      ratio = token mean of exp(upd - old), clipfrac at --clip_epsilon, logr = mean
                      |upd - old|, max = largest |upd - old| (clipping starts at log 1.2 = 0.18), out = share
                      of tokens with the ratio outside [1-eps, 1+eps] whatever the advantage's sign
  B_*                 the same against the 2nd forward (the model's own attention kernel)
  C_logr              against a 2nd forward under the update's attention kernel, which is how the trainer
                      scores old log-probs with --rollout_logprobs 0 (= B except under bf16 on CPU, where
                      the model's own kernel is sdpa and the update's eager)
  move                mean |upd after the step - upd before|: what one update moves the log-probs (one
                      optimizer step when --mini_batch_size >= --batch_size). --warmup_steps 0 (default)
                      = the peak LR; the trainer's default 5 gives LR/6 on its first step.
  cost_s / step_s     the 2nd forward's wall seconds / generate + score + update with --rollout_logprobs 1
LoRA (`--lora_r R`, the `lora` label; 0 = full fine-tuning): the run is built with the trainer's own
--lora_r/--lora_alpha (peft adapters on every linear layer of the trunk) and --lora_learning_rate. peft starts
B = 0, where sampler and update both apply the plain base weights and the measurement would be the non-LoRA
one; so before the experience every adapter's B is replaced by seeded Gaussian noise (`perturb_adapters`,
generator seeded by the measurement seed), scaled per layer so that ||(alpha/r) B A||_F = --lora_delta x ||W||_F.
No training steps: the adapters' size is then a stated figure, not whatever a few PPO steps happen to give.
This is the case the issue asks about: the sampler's decode steps apply the folded weight W + (alpha/r) B A
cast once to the compute dtype (model/fast_decode.py via model/lora.py `effective_weight`), while the prefill,
the 2nd forward and the update run peft's layers, x W + (alpha/r) (x A) B, each product rounded on its own.
How to read it: before the first step the ratio should be exactly 1. If A_logr is small next to `move` and
A_clipfrac ~ 0, the sampler's log-probs serve as well as a second forward; if A_logr is comparable to
`move` or A_clipfrac is clearly > 0, the first minibatch clips on rounding noise and a second forward
earns its cost, provided it removes the gap (B_logr, or C_logr for one run under the update's kernel).
A, B and C share the experience's advantages (computed with the sampler's old log-probs; the KL-in-reward
term differs by ~kl_coef x gap).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch

import train_ppo as T
from dataset.rlaif import collate_left_pad
from model.forward import attention_implementation, policy_forward
from model.lora import base_of
from trainer.dist import DistInfo
from trainer.ppo import masked_mean, policy_loss
from trainer.rollout import Rollout
from trainer.run.distributed import resolve_device
from trainer.run.phases import phases
from trainer.run.setup import Setup, setup
from trainer.run.timing import PhaseTimer

COLUMNS = ("tok", "gap_mean", "gap_p99", "gap_max", "A_ratio", "A_clipfrac", "A_logr", "A_max", "A_out",
           "B_ratio", "B_clipfrac", "B_logr", "C_logr", "move", "cost_s", "step_s")


def ratio_stats(new: torch.Tensor, old: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, eps: float) -> dict[str, float]:
    """The trainer's own ratio / clipfrac (trainer.ppo.policy_loss), mean and max |log ratio|, out-of-range share."""
    _, st = policy_loss(new, old, adv, mask, eps)
    log_ratio = new - old
    out = (log_ratio.exp() - 1).abs() > eps
    return {"ratio": st["ratio"], "clipfrac": st["clipfrac"], "logr": masked_mean(log_ratio.abs(), mask).item(),
            "max": log_ratio.abs()[mask.bool()].max().item(), "out": masked_mean(out.float(), mask).item()}


@torch.no_grad()
def perturb_adapters(actor: torch.nn.Module, delta: float, seed: int) -> dict[str, float]:
    """Every LoRA layer's B (peft starts it at 0) replaced by seeded Gaussian noise scaled so that the
    adapter's weight, (alpha/r) B A, has Frobenius norm `delta` x its base weight's. A is peft's own init.
    Returns {"layers": how many, "rel_norm": mean ||(alpha/r) B A|| / ||W|| as applied}."""
    g = torch.Generator().manual_seed(10_000 + seed)  # CPU stream: the same adapters on any device
    rel = []
    for m in base_of(actor).modules():
        if not (hasattr(m, "lora_B") and hasattr(m, "base_layer")):
            continue
        w = m.base_layer.weight.float()
        for name in m.active_adapters:
            if name not in m.lora_B:
                continue
            a, b, scale = m.lora_A[name].weight, m.lora_B[name].weight, m.scaling[name]
            noise = torch.randn(b.shape, generator=g).to(b.device, torch.float32)
            delta_w = scale * noise @ a.float()
            b.copy_((noise * (delta * w.norm() / delta_w.norm())).to(b.dtype))
            rel.append((m.get_delta_weight(name).float().norm() / w.norm()).item())
    if not rel:
        raise ValueError("perturb_adapters: the actor has no LoRA layers")
    return {"layers": float(len(rel)), "rel_norm": statistics.fmean(rel)}


def update_forward(built: Setup, part: Rollout) -> torch.Tensor:
    """The new log-probs exactly as `trainer.update.actor_backward` computes them (grad on, update attention)."""
    m, s, cfg = built.models, built.runtime, built.cfg
    with attention_implementation(cfg.train_attn, m.actor_train, m.critic_train), torch.enable_grad(), s.autocast():
        lp, _ = policy_forward(m.actor_train, part.sequences, part.attention_mask, part.response_len, cfg.sample_temperature,
                               padding_free=bool(cfg.padding_free))
    return lp.detach()


def parse_size(size: str) -> tuple[int, int, str]:
    """'512x8:none' -> (512, 8, 'none'); a one-line error for anything else."""
    dims, _, weight = size.partition(":")
    try:
        hidden, layers = (int(x) for x in dims.lower().split("x"))
    except ValueError:
        raise SystemExit(f"error: --sizes entry {size!r} must look like HIDDENxLAYERS[:from_weight], e.g. 512x8:none") from None
    return hidden, layers, weight or "none"


def measure(size: str, dtype: str, seed: int, o: argparse.Namespace, lora_r: int = 0) -> dict[str, float]:
    """One (size, dtype, LoRA rank, seed): build the run, one experience, the three forwards, one update (COLUMNS)."""
    hidden, layers, weight = parse_size(size)
    lora = (["--lora_r", str(lora_r), "--lora_alpha", str(o.lora_alpha), "--learning_rate", str(o.lora_learning_rate)]
            if lora_r else [])
    argv = ["--hidden_size", str(hidden), "--num_hidden_layers", str(layers), "--from_weight", weight,
            "--dtype", dtype, "--seed", str(seed), "--batch_size", str(o.batch_size),
            "--mini_batch_size", str(min(o.mini_batch_size, o.batch_size)), "--max_gen_len", str(o.gen_len),
            "--temperature", str(o.temperature), "--clip_epsilon", str(o.clip_epsilon), "--rollout_logprobs", "1",
            "--num_threads", str(o.num_threads), "--warmup_steps", str(o.warmup_steps), "--swanlab_mode", "disabled",
            "--device", str(o.device), "--fast_decode", str(o.fast_decode), *lora]
    built = setup(T.parse_args(argv), DistInfo(device=o.device))
    m, s, args = built.models, built.runtime, built.cfg
    if lora_r:
        perturb_adapters(m.actor, o.lora_delta, seed)
    ds = built.dataset
    rows = torch.randperm(len(ds), generator=torch.Generator().manual_seed(seed))[: args.batch_size].tolist()
    batch = collate_left_pad([ds[i] for i in rows], pad_id=m.tok.pad_token_id)

    timer = PhaseTimer(s.cuda_devices)  # on a GPU each phase ends with its kernels done
    exp = T.make_experience(args, batch, m, s, built.kl_ctl.value, built.custom_fns, phases(timer, s))
    ro = exp.rollout
    mask = ro.response_mask.bool()

    # --rollout_logprobs 0: the second forward make_experience would run (score_old), timed.
    with torch.no_grad(), s.autocast():
        if s.device.type == "cuda":
            torch.cuda.synchronize(s.device)
        t0 = time.perf_counter()
        second, _ = policy_forward(m.actor, ro.sequences, ro.attention_mask, ro.response_len, args.sample_temperature,
                                   with_entropy=True)
        if s.device.type == "cuda":
            torch.cuda.synchronize(s.device)
        cost = time.perf_counter() - t0
        with attention_implementation(args.train_attn, m.actor):
            second_upd_attn, _ = policy_forward(m.actor, ro.sequences, ro.attention_mask, ro.response_len,
                                                args.sample_temperature)
    gap = (ro.old_logprobs - second).abs()[mask]

    # The first update minibatch, as ppo_update draws it at step 0 on rank 0.
    g = torch.Generator().manual_seed(args.seed * 7919)
    mb = torch.randperm(ro.sequences.shape[0], generator=g).split(args.mini_batch_size)[0]
    part, pmask = ro.index(mb), ro.response_mask[mb]
    new = update_forward(built, part)
    A = ratio_stats(new, part.old_logprobs, part.advantages, pmask, args.clip_epsilon)
    B = ratio_stats(new, second[mb], part.advantages, pmask, args.clip_epsilon)
    C = ratio_stats(new, second_upd_attn[mb], part.advantages, pmask, args.clip_epsilon)

    with timer("update"):
        stats = T.ppo_update(args, ro, m, built.optim, 0, s, built.kl_ctl.value, phases(timer, s))
    if len(mb) == ro.sequences.shape[0]:  # one minibatch: the trainer's own logged figures are A's
        tol = 1e-6 if s.device.type == "cpu" else 1e-4  # GPU kernels may pick another reduction order per call
        assert abs(stats["ppo/ratio"] - A["ratio"]) < tol and abs(stats["ppo/clipfrac"] - A["clipfrac"]) < tol, stats
    after = update_forward(built, part)
    step_s = sum(timer.wall[k] for k in ("generate", "score", "update"))
    return {"tok": float(mask.sum()), "gap_mean": gap.mean().item(), "gap_p99": torch.quantile(gap.double(), 0.99).item(),
            "gap_max": gap.max().item(), **{f"A_{k}": v for k, v in A.items()},
            "B_ratio": B["ratio"], "B_clipfrac": B["clipfrac"], "B_logr": B["logr"], "C_logr": C["logr"],
            "move": masked_mean((after - new).abs(), pmask).item(), "cost_s": cost, "step_s": step_s}


def width(key: str) -> int:
    return 6 if key == "tok" else 7 if key.endswith("_s") else 10 if key.endswith("ratio") else 9


def fmt(v: float, key: str) -> str:
    if key == "tok":
        return f"{v:6.0f}"
    if key.endswith("_s"):
        return f"{v:7.3f}"
    if key.endswith("ratio"):
        return f"{v:10.7f}"
    return f"{v:9.2e}" if v else f"{0:9d}"


def row(size: str, dtype: str, lora: str, seed: str, r: dict[str, float]) -> str:
    return f"{size:<15}{dtype:<9}{lora:>4}{seed:>5} " + " ".join(fmt(r[c], c) for c in COLUMNS)


HEADER = f"{'size':<15}{'dtype':<9}{'lora':>4}{'seed':>5} " + " ".join(f"{c:>{width(c)}}" for c in COLUMNS)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--sizes", default="512x8:none,128x4:full_sft",
                   help="HIDDENxLAYERS[:from_weight] list; none = random init, full_sft = out/full_sft_<hidden>.pth")
    p.add_argument("--dtypes", default="float32,bfloat16", help="comma list of autocast dtypes to measure (--dtype of the run)")
    p.add_argument("--lora_r", default="0,16",
                   help="comma list of LoRA ranks (the `lora` label); 0 = full fine-tuning. Give 0 alone to skip LoRA")
    p.add_argument("--lora_alpha", type=float, default=16.0, help="the trainer's --lora_alpha for the LoRA rows")
    p.add_argument("--lora_delta", type=float, default=0.05,
                   help="size of the perturbed adapters: ||(alpha/r) B A||_F / ||W||_F per layer (see the docstring); "
                        "raise it to mimic adapters trained longer")
    p.add_argument("--lora_learning_rate", type=float, default=1e-4,
                   help="--learning_rate of the LoRA rows' measured step (README's LoRA example); full rows keep the trainer's")
    p.add_argument("--seeds", default="0,1,2", help="comma list of seeds: each picks the prompts, the sampling and the adapters")
    p.add_argument("--batch_size", type=int, default=16, help="prompts per experience")
    p.add_argument("--mini_batch_size", type=int, default=16, help="the trainer's default; capped at --batch_size")
    p.add_argument("--gen_len", type=int, default=64, help="--max_gen_len of the experience")
    p.add_argument("--temperature", type=float, default=0.8, help="sampling temperature (log-probs are taken under it)")
    p.add_argument("--clip_epsilon", type=float, default=0.2, help="the PPO clip range the clipfrac columns count against")
    p.add_argument("--warmup_steps", type=int, default=0,
                   help="the trainer's LR warm-up for the measured step (0 = peak LR; the trainer's default 5 = LR/6 at step 0)")
    p.add_argument("--fast_decode", type=int, default=1, choices=[0, 1],
                   help="the trainer's --fast_decode for every row: 0 samples through transformers' (and peft's) layers, "
                        "to see how much of a LoRA gap the folded decode weights make")
    p.add_argument("--num_threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N: where the runs are built (auto = cuda when available)")
    return p


def main(argv: list[str] | None = None) -> None:
    o = build_parser().parse_args(argv)
    try:
        o.device = resolve_device(o.device)
        ranks = [int(x) for x in o.lora_r.split(",")]
        seeds = [int(x) for x in o.seeds.split(",")]
    except ValueError:
        raise SystemExit("error: --lora_r and --seeds take comma lists of integers, e.g. 0,16") from None
    except SystemExit as e:  # resolve_device's line, without the prefix
        raise SystemExit(f"error: {e.code}") from None
    if any(r < 0 for r in ranks) or not o.lora_delta > 0:
        raise SystemExit("error: --lora_r entries must be >= 0 and --lora_delta > 0")
    bad = [d for d in o.dtypes.split(",") if d not in ("float32", "bfloat16", "float16")]
    if bad:
        raise SystemExit(f"error: --dtypes entry {bad[0]!r}: use float32, bfloat16 or float16")
    sizes = o.sizes.split(",")
    for size in sizes:
        parse_size(size)  # every entry checked before the first (minutes-long) measurement
    os.chdir(ROOT)  # the trainer's default paths (dataset/, out/) are relative to the repo

    print(HEADER)
    for size in sizes:
        for dtype in o.dtypes.split(","):
            for lora_r in ranks:
                results = []
                for seed in seeds:
                    r = measure(size, dtype, seed, o, lora_r)
                    results.append(r)
                    print(row(size, dtype, str(lora_r), str(seed), r), flush=True)
                mean = {c: statistics.fmean(r[c] for r in results) for c in COLUMNS}
                for c in ("gap_max", "A_max"):  # over seeds: the max
                    mean[c] = max(r[c] for r in results)
                print(row(size, dtype, str(lora_r), "mean", mean), flush=True)


if __name__ == "__main__":
    main()
