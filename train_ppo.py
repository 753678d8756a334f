"""minippo: PPO (RLHF) for small causal language models, in one script.

    python train_ppo.py                                  # the embedded CPU demo (minutes)
    python train_ppo.py --from_resume 1                  # continue the last run exactly
    torchrun --nproc_per_node 8 train_ppo.py --hidden_size 768 --num_hidden_layers 8 \
        --from_weight full_sft --data_path dataset/rlaif.jsonl --reward_model_path <RM dir>

The loop reads like the algorithm: for each batch of prompts
  1. rollout    sample responses from the actor (temperature / top-k / top-p, stop at EOS)
  3. reward     hybrid reward: format regex + tags + reward model + accuracy + EOS + custom
                (--filter_groups: drop groups with equal rewards, sample more prompts; DAPO)
  2. score      old log-probs (the policy that sampled), reference log-probs, critic values
  4. advantages per-token KL penalty, reward on the EOS token, GAE and whitening, or a critic-free
                group baseline (--advantage_estimator grpo | dr_grpo | rloo | reinforce_pp[_baseline])
  5. update     epochs x minibatches of clipped policy loss + clipped value loss (+ KL, entropy)
  6. log, evaluate on held-out prompts, checkpoint
Models: actor (trained), critic (actor's trunk + value head, trained; gae only), reference (frozen
copy of the start), reward model (frozen, external), and optionally a frozen "old actor" copy.
Where things live: the math in trainer/ppo.py, sampling and scoring forwards in trainer/rollout.py,
reward components in trainer/rewards.py, one minibatch's forward/backward and optimizer step in
trainer/update.py; how a run is built, resumed, saved, logged and spread over
ranks in trainer/run/ (setup.py, lifecycle.py, checkpoint.py, distributed.py, ...).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))

from model.fast_decode import reuse_decoder  # noqa: E402
from trainer.ppo import ADVANTAGE_ESTIMATORS, LOSS_AGG_MODES, compute_gae, compute_token_rewards, discounted_returns  # noqa: E402
from trainer.ppo import explained_variance, group_advantages, kl_penalty, masked_whiten  # noqa: E402
from trainer.evaluate import evaluate_policy  # noqa: E402
from trainer.rewards import RewardFnError, compute_rewards, overlong_penalty  # noqa: E402
from trainer.rollout import Rollout, attention_implementation, critic_forward, forward_in_row_chunks, generate_rollout  # noqa: E402
from trainer.rollout import cat_rollouts, group_has_signal, policy_forward, rollout_metrics  # noqa: E402
from trainer.run import distributed as D  # noqa: E402
from trainer.run.lifecycle import Run  # noqa: E402
from trainer.run.setup import DTYPES, Models, Optim, Settings, on, setup  # noqa: E402
from trainer.run.timing import PhaseTimer  # noqa: E402
from trainer.update import minibatch_backward, optimizer_step  # noqa: E402


# --------------------------------------------------------------------------------------- flags
GAE_ONLY_FLAGS = ("critic_learning_rate", "vf_coef", "cliprange_value", "lam", "whiten_advantages", "critic_device")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="minippo: PPO for small causal LMs (MiniMind flag names)",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    a = p.add_argument_group("models").add_argument
    a("--from_weight", default="full_sft", help="native MiniMind weights <save_dir>/<from_weight>_<hidden>[_moe].pth")
    a("--actor_path", default=None, help="instead: a local Hugging Face causal-LM directory (own tokenizer/template)")
    a("--tokenizer_path", default=None, help="tokenizer dir (default: model/ for native weights, the HF dir otherwise)")
    a("--hidden_size", type=int, default=128)
    a("--num_hidden_layers", type=int, default=4)
    a("--num_attention_heads", type=int, default=0, help="0 = MiniMind's 8, or read off a qwen3-arch weights file")
    a("--num_key_value_heads", type=int, default=0, help="0 = MiniMind's 4 (qwen3) / 2 (llama), or read off the file")
    a("--use_moe", type=int, default=0, choices=[0, 1])
    a("--arch", default="auto", choices=["auto", "qwen3", "llama"], help="qwen3 = current MiniMind, llama = MiniMind2; auto reads the file")
    a("--reward_model_path", default="out/demo_rm", help="AutoModelForSequenceClassification dir, or 'none'")
    a("--trust_remote_code", type=int, default=0, choices=[0, 1], help="allow remote code (get_score() reward models)")
    a("--update_old_actor_freq", type=int, default=0,
      help="0: old log-probs recorded by the actor at rollout (no copy); N: MiniMind's frozen copy refreshed every N steps")
    a("--lora_r", type=int, default=0,
      help="LoRA rank of the actor's adapters (peft); 0 = full fine-tuning. With LoRA the reference is the actor with "
           "its adapters off (no copy) and the old actor (--update_old_actor_freq N) a copy of the adapters only")
    a("--lora_alpha", type=float, default=16.0, help="LoRA scale numerator: adapters add (alpha / r) B A x")
    a("--lora_dropout", type=float, default=0.0,
      help="dropout on the adapters' input while the actor is in train mode (TRL's PPO turns dropout off; the first ratio is then not 1)")
    a("--lora_target_modules", default="all-linear",
      help="'all-linear' (every linear layer of the trunk, never the LM head) or a comma list of layer names, e.g. q_proj,v_proj")
    a("--save_merged", type=int, default=-1, choices=[-1, 0, 1],
      help="with LoRA, also write the merged weights where a full run writes its policy (the .pth / <save_weight>_hf); "
           "-1 = on for native MiniMind weights, off for --actor_path. The adapter directory is always written")
    a("--rollout_logprobs", type=int, default=1, choices=[0, 1],
      help="with no old-actor copy, old_logprobs come from the sampling pass itself instead of a second forward "
           "(fp32: equal to ~1e-6; bf16: ~2e-3 nats apart, no clipping on it; the second forward costs ~9%% of a step: "
           "scripts/measure_logprob_gap.py, README)")
    a = p.add_argument_group("data").add_argument
    a("--data_path", default="dataset/demo_train.jsonl", help="MiniMind RLAIF jsonl")
    a("--skip_bad_lines", type=int, default=0, choices=[0, 1], help="skip and count malformed lines instead of failing")
    a("--max_seq_len", type=int, default=128, help="max prompt tokens (longer prompts lose their oldest tokens)")
    a("--max_gen_len", type=int, default=64, help="max new tokens per response")
    a("--thinking_ratio", type=float, default=1.0, help="share of prompts rendered with open thinking ('<think>\\n')")
    a("--system_prompt_ratio", type=float, default=0.0, help="share of prompts given a random system prompt")
    a("--num_workers", type=int, default=0, help="accepted for MiniMind compatibility (prompts are tokenised in-process)")
    a = p.add_argument_group("rollout").add_argument
    a("--batch_size", type=int, default=32, help="prompts per step per process")
    a("--num_generations", type=int, default=1, help="responses sampled per prompt")
    a("--temperature", type=float, default=0.8)
    a("--top_k", type=int, default=0, help="0 = off")
    a("--top_p", type=float, default=1.0, help="1.0 = off")
    a("--greedy", type=int, default=0, choices=[0, 1], help="argmax decoding (tests, debugging)")
    a("--fast_decode", type=int, default=1, choices=[0, 1],
      help="decode steps of dense Qwen3/Llama policies by model/fast_decode.py (same math, fewer ops); 0 = transformers' forward")
    a("--filter_groups", type=int, default=0, choices=[0, 1],
      help="DAPO dynamic sampling: drop groups whose --num_generations rewards are all equal (no signal) and sample "
           "the next prompts until the batch is full")
    a("--filter_max_rounds", type=int, default=4,
      help="--filter_groups: at most this many extra prompt batches per step; then the batch is filled up with "
           "dropped groups (zero advantage under group estimators)")
    a = p.add_argument_group("reward").add_argument
    a("--reasoning", type=int, default=1, choices=[0, 1], help="RM score = 0.4 x whole reply + 0.6 x <answer> content")
    a("--format_weight", type=float, default=1.0, help="x format regex reward (0.5 when matched)")
    a("--tag_weight", type=float, default=1.0, help="x tag reward (0.25 per tag present exactly once)")
    a("--rm_weight", type=float, default=0.5, help="x reward-model score (clipped to [-3, 3])")
    a("--accuracy_weight", type=float, default=1.0, help="x 1.0 when the answer matches the row's reference")
    a("--eos_penalty", type=float, default=0.5, help="subtracted when a response never emits EOS")
    a("--reward_fn", action="append", default=[], help="custom reward module:function (repeatable), fn(prompt, reply, reference) -> float")
    a("--overlong_buffer_len", type=int, default=0,
      help="DAPO soft overlong punishment: a penalty growing linearly over the last N tokens before --max_gen_len (0 = off)")
    a("--overlong_penalty", type=float, default=1.0, help="the penalty at --max_gen_len tokens (reward/overlong)")
    a = p.add_argument_group("ppo").add_argument
    a("--advantage_estimator", default="gae", choices=list(ADVANTAGE_ESTIMATORS),
      help="gae: learned critic (PPO); critic-free, no critic built: grpo (group mean/std), dr_grpo (group mean), "
           "rloo (leave-one-out mean), reinforce_pp (global whitening), reinforce_pp_baseline (group mean, then global)")
    a("--epochs", type=int, default=1, help="passes over the prompt data")
    a("--max_steps", type=int, default=250, help="stop after this many PPO steps (0 = no limit)")
    a("--ppo_update_iters", type=int, default=1,
      help="PPO epochs over each rollout batch (demo: 1 epoch x 250 steps matched 2 x 150 in accuracy at 2/3 the step time)")
    a("--mini_batch_size", type=int, default=16, help="rows per optimizer step (per process)")
    a("--accumulation_steps", type=int, default=1, help="micro-batches per minibatch (memory)")
    a("--learning_rate", type=float, default=5e-5, help="actor LR")
    a("--critic_learning_rate", type=float, default=1e-4)
    a("--weight_decay", type=float, default=0.0)
    a("--warmup_steps", type=int, default=5, help="linear LR warm-up (PPO steps), then cosine to 10%%")
    a("--critic_warmup_steps", type=int, default=0, help="steps that train only the critic")
    a("--grad_clip", type=float, default=1.0)
    a("--clip_epsilon", type=float, default=0.2)
    a("--clip_epsilon_high", type=float, default=None, help="upper clip 1 + this (DAPO's clip-higher, e.g. 0.28); default --clip_epsilon")
    a("--loss_agg_mode", default="token_mean", choices=list(LOSS_AGG_MODES),
      help="policy loss over tokens: token_mean (DAPO, PPO), seq_mean_token_mean (GRPO), seq_mean_token_sum, "
           "seq_mean_token_sum_norm (Dr. GRPO: token sums / --max_gen_len)")
    a("--vf_coef", type=float, default=0.5)
    a("--cliprange_value", type=float, default=0.2, help="0 = unclipped value loss")
    a("--gamma", type=float, default=1.0)
    a("--lam", type=float, default=0.95)
    a("--whiten_advantages", type=int, default=1, choices=[0, 1])
    a("--kl_coef", type=float, default=0.02)
    a("--kl_estimator", default="auto", choices=["auto", "k1", "k2", "k3"],
      help="Schulman's KL estimators; auto = k3 for grpo/dr_grpo (GRPO's, in the loss), k1 otherwise")
    a("--kl_placement", default="auto", choices=["auto", "reward", "loss"],
      help="KL as per-token reward penalty or as a loss term; auto = loss for grpo/dr_grpo (as their papers), reward otherwise")
    a("--adaptive_kl", type=int, default=0, choices=[0, 1], help="Ziegler et al. adaptive KL coefficient")
    a("--kl_target", type=float, default=1.0, help="adaptive KL: target KL per sequence (nats)")
    a("--kl_horizon", type=int, default=10000, help="adaptive KL: horizon in samples")
    a("--entropy_coef", type=float, default=0.0)
    a("--early_stop_kl", type=float, default=0.0, help="stop the update when approx-KL exceeds this (0 = off)")
    a("--max_nonfinite", type=int, default=5, help="stop after this many non-finite steps in a row")
    a = p.add_argument_group("evaluation during training (greedy, held-out prompts)").add_argument
    a("--eval_data_path", default="auto", help="RLAIF jsonl of held-out prompts; auto = dataset/demo_eval.jsonl for the "
                                                "demo's data, none otherwise; 'none' = off")
    a("--eval_interval", type=int, default=50, help="evaluate every N steps (and before the first, and after the last)")
    a("--eval_samples", type=int, default=100, help="prompts per evaluation (the first N of the file)")
    a = p.add_argument_group("system").add_argument
    a("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    a("--dtype", default="auto", choices=["auto", *DTYPES],
      help="autocast dtype (CPU and CUDA; log-probs stay fp32). auto = bfloat16 on GPUs with native bf16 (compute "
           "capability >= 8.0: A100, H100, RTX 30xx on), float16 with loss scaling on V100/T4, float32 on older GPUs; on a "
           "CPU bfloat16 only for models from 5M layer weights (e.g. 256x8, 512x8, 768x16) with native bf16 "
           "(AMX or AVX512-BF16), else float32")
    a("--ref_device", default="",
      help="device of the frozen reference: cpu, cuda:N, or cuda:+K = K GPUs after the rank's own (under torchrun with "
           "4 ranks per node on cuda:0-3, cuda:+4 puts each rank's reference on cuda:4-7); default: the actor's")
    a("--critic_device", default="",
      help="device of the critic (trained there; tensors move where they meet), as --ref_device; not cpu under "
           "torchrun on GPUs (NCCL); default: the actor's")
    a("--reward_device", default="", help="device of the reward model, as --ref_device; default: the actor's")
    a("--frozen_low_precision", type=int, default=-1, choices=[-1, 0, 1],
      help="hold reference/RM in --dtype; -1 = where --dtype auto picks a low precision (GPUs; large models on a "
           "CPU with native bf16)")
    a("--use_compile", type=int, default=0, choices=[0, 1])
    a("--train_attn_implementation", default="auto", choices=["auto", "eager", "sdpa"],
      help="attention kernel of the update's forward/backward (sampling and scoring keep the model's own); "
           "auto = eager under bf16 on CPU (update 1.85 vs 2.31 s at 512x8, scripts/bench_ppo.py; in fp32 sdpa "
           "was faster, 3.15 vs 3.55 s), else the model's own")
    a("--forward_batch_size", type=int, default=0,
      help="rows per scoring forward (old/ref log-probs, critic values); 0 = all batch_size x num_generations rows "
           "at once. Lower it when [rows, response_len, vocab] logits do not fit in memory")
    a("--num_threads", type=int, default=0, help="torch CPU threads (0 = torch default)")
    a("--parallel_update", type=int, default=-1, choices=[-1, 0, 1],
      help="actor and critic forward/backward side by side, one CPU core each, instead of one after the other "
           "on all cores (512x8 bf16 update ~2.0 -> ~1.7 s on 2 cores, peak RSS +~450 MB: both graphs are alive "
           "at once); -1 = on for single-process CPU runs under bf16 with >= 2 threads, unless one minibatch "
           "reuses the critic's scoring forward (then the critic's part is a backward alone)")
    a("--seed", type=int, default=42)
    a("--deterministic", type=int, default=0, choices=[0, 1],
      help="torch's deterministic algorithms and a fixed cuBLAS workspace: exact repeats on GPU too, slower "
           "(CPU runs repeat exactly without it)")
    a("--ddp_timeout", type=int, default=1800,
      help="seconds a collective waits for a missing rank before the run fails (NCCL waits this long for a dead peer)")
    a = p.add_argument_group("output").add_argument
    a("--save_dir", default="out", help="where weights are read (--from_weight) and written")
    a("--save_weight", default="ppo_actor", help="output name: <save_dir>/<save_weight>_<hidden>.pth")
    a("--save_interval", type=int, default=50, help="PPO steps between saves")
    a("--checkpoint_dir", default="checkpoints")
    a("--keep_checkpoints", type=int, default=2)
    a("--from_resume", type=int, default=0, choices=[0, 1, 2],
      help="1: continue from the newest resume file (an error if there is none); 2: continue if there is one, "
           "else start (preemptible jobs); 0: a new run (refused where another run left resume files)")
    a("--resume_check_inputs", type=int, default=1, choices=[0, 1],
      help="refuse to resume if the starting weights, reward model or prompts changed since the run began (sha256s in run.json)")
    a("--run_dir", default=None, help="metrics.jsonl, run.json, plots (default runs/<save_weight>_<hidden>)")
    a("--log_interval", type=int, default=1)
    a("--sample_interval", type=int, default=10, help="log a table of sample generations every N steps")
    a = p.add_argument_group("MiniMind compatibility (accepted so MiniMind command lines run)").add_argument
    a("--rollout_engine", default="torch", choices=["torch", "sglang"], help="torch: sampling in-process (sglang: not supported)")
    a("--sglang_base_url", default=None, help="accepted; used only with --rollout_engine sglang (not supported)")
    a("--sglang_model_path", default=None, help="accepted; as above")
    a("--sglang_shared_path", default=None, help="accepted; as above")
    a("--debug_mode", type=int, nargs="?", const=1, default=0, help="1: the sample table every --debug_interval steps")
    a("--debug_interval", type=int, default=20)
    a("--debug_log_ratio", type=int, nargs="?", const=1, default=0,
      help="accepted: the first-minibatch ratio and approx-KL MiniMind prints are logged every step (ppo/ratio, ppo/approx_kl)")
    a("--swanlab_mode", default="local", choices=["local", "offline", "cloud", "disabled"])
    a("--use_wandb", type=int, default=1, choices=[0, 1], help="MiniMind's name for 'log to SwanLab' (0 = disabled)")
    a("--wandb_project", default="minippo", help="swanlab project")
    a("--suppress_eos", type=int, default=0, choices=[0, 1], help=argparse.SUPPRESS)  # benchmarks: fixed lengths
    args = p.parse_args(argv)
    if args.advantage_estimator != "gae":  # one line, not an error: a command line may switch estimators
        unused = [f"--{k}" for k in GAE_ONLY_FLAGS if getattr(args, k) != p.get_default(k)]
        if unused and os.environ.get("RANK", "0") == "0":
            print(f"warning: --advantage_estimator {args.advantage_estimator} builds no critic: {', '.join(unused)} "
                  f"{'is' if len(unused) == 1 else 'are'} ignored", file=sys.stderr)
    return args


# --------------------------------------------------------------------------------------- steps 1-4
@dataclass
class Experience:
    """Steps 1-4 of one PPO step: the rollout with everything the update needs, and what to log."""

    rollout: Rollout
    metrics: dict[str, float]
    metric_weights: dict[str, float]  # what each per-rank metric is a mean over (for DDP's global mean)
    samples: list[dict]  # a few rows for the sample table


@dataclass
class Sampled:
    """Steps 1 and 3 for some prompts: the rollout (with rewards), its prompts' rows of the batch, the
    decoded responses and each reward component [B]."""

    rollout: Rollout
    batch: dict
    responses: list[str]
    comps: dict[str, torch.Tensor]

    def rows(self, groups: list[int], n: int) -> tuple[torch.Tensor, dict]:
        """The row indices of prompt groups `groups` (N rows each), and those prompts' fields of the batch."""
        idx = (torch.tensor(groups)[:, None] * n + torch.arange(n)).flatten()
        return idx, {k: [v[g] for g in groups] for k, v in self.batch.items() if isinstance(v, list)}


@torch.no_grad()
def make_experience(args: argparse.Namespace, batch: dict, m: Models, s: Settings, kl_coef: float, custom_fns: dict,
                    timer: PhaseTimer | None = None, more_prompts: Callable[[], dict | None] | None = None) -> Experience:
    """Rollout, reward, score, advantages for one batch of prompts (with --filter_groups, more prompts
    from `more_prompts` until every group of the batch carries signal)."""
    timer = timer or PhaseTimer()
    filter_stats = {}
    with reuse_decoder(m.actor) if args.filter_groups else contextlib.nullcontext():  # rounds share one weight copy
        sampled = sample_and_reward(args, batch, m, s, custom_fns, timer)  # steps 1 and 3
        if args.filter_groups:
            sampled, filter_stats = keep_groups_with_signal(args, sampled, m, s, custom_fns, timer, more_prompts)
    ro, batch, responses, comps = sampled.rollout, sampled.batch, sampled.responses, sampled.comps
    R, temp, rows = ro.response_len, s.sample_temperature, args.forward_batch_size  # rows per scoring forward (0 = all)
    with D.failing_together(s.info), timer("score"), s.autocast():  # 2. log-probs under the sampling distribution (fp32 softmax)
        entropy = ro.entropy
        if ro.old_logprobs is None:  # a frozen old actor, or --rollout_logprobs 0: score the samples again,
            scorer = m.old_actor or m.actor  # with the update's attention kernel: the first ratio is then exactly 1
            with timer("score_old"), attention_implementation(s.train_attn, scorer):
                ro.old_logprobs, entropy = forward_in_row_chunks(policy_forward, scorer, ro.sequences, ro.attention_mask,
                                                                 R, temp, with_entropy=True, rows=rows)
        with timer("score_ref"), s.autocast(s.ref_device):
            ref_logprobs, _ = forward_in_row_chunks(policy_forward, m.ref, *on(s.ref_device, ro.sequences, ro.attention_mask),
                                                    R, temp, rows=rows)
            ro.ref_logprobs = ref_logprobs.to(s.device)  # [B, R]
        if m.critic is not None and not s.reuse_values:
            with timer("score_critic"), s.autocast(s.critic_device):
                score_values(ro, m, s, rows)
    if s.reuse_values:  # the update's own (DDP) forward, which may talk to the other ranks: outside the rank-local block
        with timer("score"), timer("score_critic"), s.autocast(), s.autocast(s.critic_device):
            score_values(ro, m, s, rows)
    compute_advantages(args, ro, kl_coef, s)  # 4. advantages
    metrics, weights = rollout_metrics(ro, comps, entropy, kl_coef, args.num_generations)
    metrics.update(filter_stats)
    samples = [{"prompt": batch["prompt"][i // args.num_generations][-200:], "response": responses[i],
                "reward": ro.rewards[i].item(), **{k: v[i].item() for k, v in comps.items()}}
               for i in range(min(4, len(responses)))]
    return Experience(ro, metrics, weights, samples)


def sample_and_reward(args: argparse.Namespace, batch: dict, m: Models, s: Settings, custom_fns: dict,
                      timer: PhaseTimer) -> Sampled:
    """1. rollout: [B*N, P+R] sequences, N = --num_generations; 3. reward. Rank-local: a failure on some
    ranks only (reward function, reward model, OOM) stops every rank here with its line."""
    with D.failing_together(s.info):
        with timer("generate"), s.autocast():
            ro = generate_rollout(
                m.actor, batch["input_ids"].to(s.device), batch["attention_mask"].to(s.device), max_new_tokens=args.max_gen_len,
                eos_token_id=m.eos_ids or m.tok.eos_token_id, pad_token_id=m.tok.pad_token_id, temperature=args.temperature,
                top_k=args.top_k, top_p=args.top_p, greedy=bool(args.greedy), suppress_eos=bool(args.suppress_eos),
                num_generations=args.num_generations, return_logprobs=bool(args.rollout_logprobs) and m.old_actor is None,
                fast_decode=bool(args.fast_decode),
            )
        with timer("score"), timer("score_reward"):
            responses, comps = score_responses(args, batch, ro, m, custom_fns, timer)
    return Sampled(ro, batch, responses, comps)


def keep_groups_with_signal(args: argparse.Namespace, first: Sampled, m: Models, s: Settings, custom_fns: dict,
                            timer: PhaseTimer, more_prompts: Callable[[], dict | None] | None) -> tuple[Sampled, dict]:
    """DAPO's dynamic sampling (Yu et al. 2025, sec. 3.2): a group whose N rewards are all equal has zero
    advantage under a group baseline, so it only dilutes the batch. Keep the groups with signal and sample
    the next prompts (the same extra batches on every rank: the prompt stream is global) until each rank
    has --batch_size of them, at most --filter_max_rounds extra batches; then fill up with dropped groups."""
    n, want = args.num_generations, args.batch_size
    kept, dropped, rounds, cur = [], [], 0, first
    while True:
        signal = group_has_signal(cur.rollout.rewards, n).tolist()  # one host read per round
        kept += [(cur, g) for g, s_ in enumerate(signal) if s_]
        dropped += [(cur, g) for g, s_ in enumerate(signal) if not s_]
        if not D.any_rank(len(kept) < want, s.info) or rounds == args.filter_max_rounds:
            break
        batch = more_prompts() if more_prompts is not None else None
        if batch is None:  # the prompt data ran out (the same on every rank)
            break
        rounds += 1
        cur = sample_and_reward(args, batch, m, s, custom_fns, timer)
    chosen = (kept + dropped)[:want]
    stats = {"filter/groups_dropped": float(len(dropped)), "filter/extra_rollouts": float(rounds),
             "filter/groups_filled": float(max(0, want - len(kept)))}
    if rounds == 0 and len(kept) >= want:  # the first batch had signal everywhere: nothing to rebuild
        return first, stats
    by_source: dict[int, list] = {}
    for src, g in chosen:
        by_source.setdefault(id(src), [src, []])[1].append(g)
    parts, fields, responses, comps = [], {}, [], {}
    for src, groups in by_source.values():
        idx, prompt_fields = src.rows(groups, n)
        parts.append((src.rollout, idx))
        for k, v in prompt_fields.items():
            fields.setdefault(k, []).extend(v)
        responses += [src.responses[i] for i in idx.tolist()]
        for k, v in src.comps.items():
            comps.setdefault(k, []).append(v[idx])
    merged = cat_rollouts(parts, m.tok.pad_token_id)
    return Sampled(merged, fields, responses, {k: torch.cat(v) for k, v in comps.items()}), stats


def score_values(ro: Rollout, m: Models, s: Settings, rows: int) -> None:
    """Sets ro.values [B, R]: the critic's values of the sampled tokens. With one epoch of one minibatch
    (Settings.reuse_values) this is the update's own forward, with grad, so the update does not run it again."""
    seqs, mask = on(s.critic_device, ro.sequences, ro.attention_mask)
    if s.reuse_values:
        with torch.enable_grad(), attention_implementation(s.train_attn, m.critic_train):
            ro.values_with_grad = critic_forward(m.critic_train, seqs, mask, ro.response_len)
        ro.values = ro.values_with_grad.detach().float().to(s.device)
    else:
        ro.values = forward_in_row_chunks(critic_forward, m.critic, seqs, mask, ro.response_len, rows=rows).float().to(s.device)


def score_responses(args: argparse.Namespace, batch: dict, ro: Rollout, m: Models, custom_fns: dict,
                    timer: PhaseTimer) -> tuple[list[str], dict]:
    """Sets ro.rewards [B] (the weighted total); returns the decoded responses and each component [B].
    Rewards see the full assistant reply: the prefix the chat template forced + the decoded response."""
    rep = args.num_generations
    expand = lambda xs: [x for x in xs for _ in range(rep)]  # prompt i's samples are rows i*N .. i*N+N-1
    tokens, mask = ro.sequences[:, -ro.response_len:].tolist(), ro.response_mask.bool().tolist()  # one copy, not two per row
    responses = [m.tok.decode([t for t, keep in zip(row, k) if keep], skip_special_tokens=True) for row, k in zip(tokens, mask)]
    replies = [p + r for p, r in zip(expand(batch["assistant_prefix"]), responses)]
    weights = {"format": args.format_weight, "tags": args.tag_weight, "rm": args.rm_weight,
               "accuracy": args.accuracy_weight, "eos": args.eos_penalty}
    try:
        rewards, comps = compute_rewards(
            prompts=expand(batch["prompt"]), messages=expand(batch["messages"]), replies=replies,
            references=expand(batch["reference"]), has_eos=ro.has_eos.tolist(), weights=weights,
            rm=m.rm_scorer if args.rm_weight else None, reasoning=bool(args.reasoning), custom_fns=custom_fns, timer=timer,
        )
    except RewardFnError as e:  # the user's function, the user's to fix: one line, not a traceback
        raise SystemExit(f"error: {e}") from None
    if args.overlong_buffer_len:  # DAPO: warn long responses before the cut, in proportion
        comps["overlong"] = overlong_penalty(ro.response_mask.sum(1).cpu(), args.max_gen_len, args.overlong_buffer_len)
        rewards = rewards + args.overlong_penalty * comps["overlong"]
    ro.rewards = rewards.to(ro.sequences.device)
    return responses, comps


def compute_advantages(args: argparse.Namespace, ro: Rollout, kl_coef: float, s: Settings) -> None:
    """Sets ro.advantages and ro.returns [B, R] from the scores [B] (on each response's last token) and,
    with the KL in the reward, a per-token KL penalty:
      gae:               GAE over the critic's values, whitened over every rank's tokens;
      grpo/dr_grpo/rloo: each score minus its group's baseline (trainer/ppo.py group_advantages), then
                         the return-to-go (equal on every token when the KL is in the loss);
      reinforce_pp[_baseline]: the return-to-go of (group-centred) scores and KL, whitened over every rank."""
    kl = kl_penalty(ro.old_logprobs, ro.ref_logprobs, s.kl_estimator)  # [B, R]
    kl = kl if s.kl_placement == "reward" else None
    ro.rewards_finite = bool(torch.isfinite(ro.rewards).all())  # a non-finite step is skipped by the update
    scores = torch.nan_to_num(ro.rewards, nan=0.0, posinf=0.0, neginf=0.0)
    estimator, mask = args.advantage_estimator, ro.response_mask
    if estimator == "gae":
        token_rewards = compute_token_rewards(scores, kl, mask, kl_coef)
        ro.advantages, ro.returns = compute_gae(token_rewards, ro.values, mask, args.gamma, args.lam)
        whiten = args.whiten_advantages
    else:
        shaped = group_advantages(scores, args.num_generations, estimator)  # [B]: groups are this rank's rows
        ro.advantages = discounted_returns(compute_token_rewards(shaped, kl, mask, kl_coef), mask, args.gamma)
        ro.returns = ro.advantages  # no critic learns from them; logged only
        whiten = estimator.startswith("reinforce_pp")  # REINFORCE++'s baseline is the global batch
    if whiten:
        ro.advantages = masked_whiten(ro.advantages, mask, reduce=D.rank_sum(s.info))


# --------------------------------------------------------------------------------------- step 5
def ppo_update(args: argparse.Namespace, ro: Rollout, m: Models, opt: Optim, step: int, s: Settings, kl_coef: float,
               timer: PhaseTimer | None = None) -> dict[str, float]:
    """`--ppo_update_iters` epochs over shuffled minibatches; one optimizer step per minibatch."""
    timer = timer or PhaseTimer()
    train_actor = step >= args.critic_warmup_steps
    g = torch.Generator().manual_seed(args.seed * 7919 + step * 31 + s.info.rank)
    stats: dict[str, list] = {}  # per minibatch: floats, or 0-d tensors still on the device
    stopped_early = nonfinite = False
    with attention_implementation(s.train_attn, *[x for x in (m.actor_train, m.critic_train) if x is not None]):
        for _ in range(args.ppo_update_iters):
            for mb in torch.randperm(ro.sequences.shape[0], generator=g).split(args.mini_batch_size):
                bad, approx_kl = minibatch_backward(args, ro, mb, m, opt, s, train_actor, kl_coef, stats, timer)
                stats.setdefault("ppo/approx_kl", []).append(approx_kl)
                # Decisions taken together on every rank, before any optimizer moves.
                if D.any_rank(bad or not ro.rewards_finite, s.info):
                    nonfinite = True
                    opt.zero_grad()
                    break
                if train_actor and args.early_stop_kl > 0 and D.any_rank(approx_kl > args.early_stop_kl, s.info):
                    stopped_early = True
                    opt.zero_grad()  # the minibatch that crossed the limit does not step
                    break
                with timer("update_optimizer"):  # clip, then step unless a gradient norm is NaN/inf (skipped, counted)
                    trained = {"actor": m.actor_train} if train_actor else {}
                    if m.critic_train is not None:
                        trained["critic"] = m.critic_train
                    if not optimizer_step(opt, trained, args.grad_clip, stats, s.info):
                        nonfinite = True
                        break
            if stopped_early or nonfinite:
                break
    ro.values_with_grad = None  # its graph is spent: a second update of this rollout runs its own forward
    for sched in opt.scheds.values():
        sched.step()
    as_t = lambda x: torch.as_tensor(x, dtype=torch.float64, device=s.device)  # noqa: E731
    means = torch.stack([torch.stack([as_t(x) for x in v]).mean() for v in stats.values()])
    out = dict(zip(stats, means.tolist()))  # the step's stats, read from the device once
    out["ppo/early_stopped"] = float(stopped_early)
    out["nonfinite"] = float(nonfinite)
    if m.critic is not None:
        out["value/explained_var"] = explained_variance(ro.values, ro.returns, ro.response_mask, reduce=D.rank_sum(s.info))
    return out


# --------------------------------------------------------------------------------------- evaluation
def evaluate(args: argparse.Namespace, m: Models, s: Settings, records: list) -> dict[str, float]:
    """Greedy replies to held-out prompts, scored as in training (format, accuracy, reward model). Runs on
    rank 0 only, in its own random stream: training's samples are the same with or without it."""
    with s.autocast():
        ev = evaluate_policy(m.actor, m.tok, records, rm_scorer=m.rm_scorer, batch_size=64, max_prompt_len=args.max_seq_len,
                             max_new_tokens=args.max_gen_len, temperature=0.0, thinking_ratio=args.thinking_ratio, seed=args.seed)
    nan = float("nan")
    return {"eval/accuracy": nan if ev["accuracy"] is None else ev["accuracy"], "eval/format_rate": ev["format_rate"],
            "eval/reward/rm": nan if ev["rm_score_mean"] is None else ev["rm_score_mean"],
            "eval/response_length": ev["mean_response_len"], "eval/eos_rate": ev["eos_rate"]}


# --------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    built = setup(args)  # torchrun's ranks, threads, seeds, models, data, optimizers, DDP
    s, m, opt, kl_ctl = built.settings, built.models, built.optim, built.kl_ctl
    held_out = lambda: D.on_main(lambda: evaluate(args, m, s, built.eval_records), s.info)  # noqa: E731
    with Run(args, built) as run:  # resume, run.json, logger; marks the run's end however it ends
        if built.eval_records and run.step == 0:
            run.log_eval(held_out(), 0)  # where the policy starts
        for batch in run.batches():
            if m.old_actor is not None and run.step % args.update_old_actor_freq == 0:
                m.old_actor.load_state_dict(m.actor.state_dict())  # MiniMind's scheme: refresh the frozen copy
            timer = PhaseTimer(s.cuda_devices)
            with timer("step"):
                exp = make_experience(args, batch, m, s, kl_ctl.value, built.custom_fns, timer, run.next_batch)  # steps 1-4
                with timer("update"):
                    stats = ppo_update(args, exp.rollout, m, opt, run.step, s, kl_ctl.value, timer)  # step 5
            times = {f"time/{k}": v for k, v in timer.wall.items()
                     if k in ("generate", "score", "update", "step") or k.startswith("reward/")}
            metrics = {**exp.metrics, **stats, **times, **{f"lr/{k}": o.param_groups[0]["lr"] for k, o in opt.optims.items()}}
            # Reduce first: the adaptive KL controller must see the global kl_ref, or each rank
            # steers its own coefficient and the ranks (and the resume file) disagree.
            metrics = D.reduce_mean(metrics, s.info, weights=exp.metric_weights)
            if built.eval_records and ((run.step + 1) % args.eval_interval == 0 or run.step + 1 == s.total_steps):
                with timer("eval"):
                    metrics.update(held_out())
                metrics["time/eval"] = timer.wall["eval"]
            if not metrics["nonfinite"]:
                kl_ctl.update(metrics["kl_ref"], args.batch_size * args.num_generations * s.info.world_size)
            run.end_step(metrics, exp.samples)  # 6. log; checkpoint every --save_interval steps
        if built.eval_records and run.data_ran_out and run.evaluated_at != run.step:
            run.log_eval(held_out(), run.step)  # where the policy ended
        run.finish()  # saves the last step if it was not


if __name__ == "__main__":
    D.exit_after(main)
