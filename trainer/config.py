"""One typed config for a PPO run.

Every setting is a field of a grouped, frozen dataclass below with the docstring under it (CleanRL's
`Args`); the command line is generated from them, so a flag is defined once. MiniMind's flag names are
the fields' names.

    raw = parse_args(argv)        # flags, over an optional --config preset (YAML or Python, nanoGPT's idea)
    cfg = resolve(raw, info)      # validated, every `auto` filled in for this rank's device: frozen

Nothing downstream reads a raw flag: the run is built from `cfg`, and run.json and every resume file
record `cfg.flat()`, so a resume compares resolved values. Fields are read flat (`cfg.clip_epsilon`):
each name exists once across the groups.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import difflib
import functools
import inspect
import math
import os
import re
import runpy
import sys
import textwrap
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal, get_args, get_origin, get_type_hints

import torch

import trainer.estimators  # noqa: F401 - registers the advantage estimators
import trainer.losses  # noqa: F401 - registers the policy losses
from trainer.ppo import LOSS_AGG_MODES
from trainer.registry import ADVANTAGE_ESTIMATORS, POLICY_LOSSES, estimator_spec, policy_loss_spec
from trainer.runtime import DTYPES, DistInfo
Flag = Literal[0, 1]


def opt(default: Any = dataclasses.MISSING, **meta: Any) -> Any:
    """A field with parser metadata: choices (a callable: read when the parser is built, so a registry
    filled later is seen), const (a flag that may be given without a value), hidden."""
    if isinstance(default, (list, tuple)):
        return field(default=tuple(default), metadata=meta)
    return field(default=default, metadata=meta)


# --------------------------------------------------------------------------------------- the groups
@dataclass(frozen=True)
class ModelArgs:
    from_weight: str = "full_sft"
    """Native MiniMind weights to start from: <save_dir>/<from_weight>_<hidden>[_moe].pth ('none' = random init)."""
    actor_path: str | None = None
    """Instead: a local Hugging Face causal-LM directory (its own tokenizer and chat template)."""
    tokenizer_path: str | None = None
    """Tokenizer directory (default: model/ for native weights, the --actor_path directory otherwise)."""
    hidden_size: int = 128
    """Width of the native MiniMind model (names its files); read off the model for --actor_path."""
    num_hidden_layers: int = 4
    """Layers of the native MiniMind model."""
    num_attention_heads: int = 0
    """0 = MiniMind's 8, or read off a qwen3-arch weights file."""
    num_key_value_heads: int = 0
    """0 = MiniMind's 4 (qwen3) / 2 (llama), or read off the weights file."""
    use_moe: Flag = 0
    """MiniMind's mixture-of-experts variant (files named ..._moe.pth)."""
    arch: Literal["auto", "qwen3", "llama"] = "auto"
    """qwen3 = current MiniMind, llama = MiniMind2; auto reads the weights file."""
    reward_model_path: str = "out/demo_rm"
    """AutoModelForSequenceClassification directory of the reward model, or 'none'."""
    trust_remote_code: Flag = 0
    """Allow the model directories' own Python code (e.g. reward models with get_score()). Only for code you trust."""
    update_old_actor_freq: int = 0
    """0: old log-probs recorded by the actor at rollout (no copy); N: MiniMind's frozen old-actor copy, refreshed every N steps."""
    lora_r: int = 0
    """LoRA rank of the actor's adapters (peft); 0 = full fine-tuning. With LoRA the reference is the actor with its
    adapters off (no copy) and the old actor (--update_old_actor_freq N) a copy of the adapters only."""
    lora_alpha: float = 16.0
    """LoRA scale numerator: adapters add (alpha / r) B A x."""
    lora_dropout: float = 0.0
    """Dropout on the adapters' input in train mode (TRL's PPO turns dropout off; the first ratio is then not 1)."""
    lora_target_modules: str = "all-linear"
    """'all-linear' (every linear layer of the trunk, never the LM head) or a comma list of layer names, e.g. q_proj,v_proj."""
    save_merged: Literal[-1, 0, 1] = -1
    """With LoRA, also write the merged weights where a full run writes its policy; -1 = on for native MiniMind
    weights, off for --actor_path. The adapter directory is always written."""


@dataclass(frozen=True)
class DataArgs:
    data_path: str = "dataset/demo_train.jsonl"
    """Prompts: a MiniMind RLAIF jsonl."""
    skip_bad_lines: Flag = 0
    """Skip and count malformed lines instead of failing on the first."""
    max_seq_len: int = 128
    """Max prompt tokens (longer prompts lose their oldest tokens)."""
    thinking_ratio: float = 1.0
    """Share of prompts rendered with open thinking ('<think>\\n')."""
    system_prompt_ratio: float = 0.0
    """Share of prompts given a random system prompt."""
    epochs: int = 1
    """Passes over the prompt data."""
    num_workers: int = 0
    """Accepted for MiniMind compatibility (prompts are tokenised in-process)."""


@dataclass(frozen=True)
class RolloutArgs:
    batch_size: int = 32
    """Prompts per step per process."""
    num_generations: int = 1
    """Responses sampled per prompt (group estimators compare them: use 4-16)."""
    max_gen_len: int = 64
    """Max new tokens per response."""
    temperature: float = 0.8
    """Sampling temperature; log-probs are taken under the same distribution."""
    top_k: int = 0
    """Sample among the k most likely tokens (0 = off)."""
    top_p: float = 1.0
    """Nucleus sampling mass (1.0 = off)."""
    greedy: Flag = 0
    """Argmax decoding (tests, debugging)."""
    fast_decode: Flag = 1
    """Decode steps of dense Qwen3/Llama policies by model/fast_decode.py (same math, fewer ops); 0 = transformers' forward."""
    rollout_logprobs: Flag = 1
    """With no old-actor copy, old_logprobs come from the sampling pass itself instead of a second forward
    (the same numbers in fp32; under bf16 slightly apart, see docs/speed-and-memory.md). 0 = score the samples again."""
    filter_groups: Flag = 0
    """DAPO dynamic sampling: drop groups whose --num_generations rewards are all equal (no signal) and sample
    the next prompts until the batch is full."""
    filter_max_rounds: int = 4
    """--filter_groups: at most this many extra prompt batches per step; then the batch is filled up with dropped groups."""
    tools: str | None = None
    """A Python module of tool functions (type hints + docstring each) the policy may call: rollouts become multi-turn
    episodes (sample a turn, run its <tool_call>s, append the replies, sample again). Only the policy's tokens train."""
    max_turns: int = 3
    """--tools: at most this many policy turns per episode."""
    max_total_len: int = 1024
    """--tools: at most this many tokens per episode, prompt and tool replies included; a turn that would pass it is cut."""
    tool_timeout: float = 5.0
    """--tools: seconds a tool call may run before it is stopped (the policy then reads a timeout error)."""
    suppress_eos: Flag = opt(0, hidden=True)
    """Never stop at EOS (benchmarks: fixed lengths)."""


@dataclass(frozen=True)
class RewardArgs:
    reasoning: Flag = 1
    """Reward-model score = 0.4 x the whole reply + 0.6 x its <answer> content."""
    format_weight: float = 1.0
    """Weight of the format regex reward (0.5 when matched)."""
    tag_weight: float = 1.0
    """Weight of the tag reward (0.25 per tag present exactly once)."""
    rm_weight: float = 0.5
    """Weight of the reward-model score (clipped to [-3, 3]); 0 = no reward model."""
    accuracy_weight: float = 1.0
    """Weight of the accuracy reward (1.0 when the answer matches the row's reference)."""
    eos_penalty: float = 0.5
    """Subtracted when a response never emits EOS."""
    ifeval_weight: float = 1.0
    """Weight of the instruction-following reward: the share of a prompt row's "constraints" (dataset/ifeval.py) the
    reply meets, logged per constraint type; rows without constraints get none."""
    tool_error_penalty: float = 0.5
    """--tools: subtracted when an episode made a tool call that could not run (malformed JSON, unknown tool, bad
    arguments, or the tool raised or timed out)."""
    reward_fn: tuple[str, ...] = ()
    """A custom reward, module:function (repeatable): fn(prompt, reply, reference) -> float."""
    overlong_buffer_len: int = 0
    """DAPO soft overlong punishment: a penalty growing linearly over the last N tokens before --max_gen_len (0 = off)."""
    overlong_penalty: float = 1.0
    """The overlong penalty at --max_gen_len tokens (reward/overlong)."""
    reward_norm: Literal["none", "batch", "running"] = "none"
    """Normalise the total reward before the advantages: batch = (r - mean) / std over every rank's batch; running =
    by the mean and std of every reward so far (OpenRLHF; kept in the resume file). The logged rewards stay raw."""
    reward_clip: float = 0.0
    """Clip the (normalised) reward to [-this, this] before the advantages (0 = off)."""


@dataclass(frozen=True)
class PPOArgs:
    advantage_estimator: str = opt("gae", choices=lambda: list(ADVANTAGE_ESTIMATORS))
    """gae: a learned critic (PPO). Critic-free (no critic built): grpo (group mean/std), dr_grpo (group mean),
    rloo (leave-one-out mean), reinforce_pp (global whitening), reinforce_pp_baseline (group mean, then global).
    docs/estimators.md compares them."""
    policy_loss: str = opt("vanilla", choices=lambda: list(POLICY_LOSSES))
    """vanilla = PPO's clipped surrogate (clip-higher through --clip_epsilon_high); dual_clip (a bound for negative
    advantages); cispo (clipped, detached importance weight: MiniMind's GRPO default); gspo (sequence-level ratio);
    gmpo (geometric mean of the token ratios); clip_cov / kl_cov (against entropy collapse); sapo (a soft gate).
    docs/losses.md compares them."""
    max_steps: int = 250
    """Stop after this many PPO steps (0 = no limit: --epochs passes over the data)."""
    ppo_update_iters: int = 1
    """PPO epochs over each rollout batch."""
    mini_batch_size: int = 16
    """Rows per optimizer step (per process); must divide --batch_size x --num_generations; 0 = all of them (one
    optimizer step per rollout, as MiniMind's GRPO)."""
    accumulation_steps: int = 1
    """Micro-batches per minibatch: lowers memory, same gradients."""
    learning_rate: float = 5e-5
    """Actor learning rate (peak)."""
    critic_learning_rate: float = 1e-4
    """Critic learning rate (peak; gae only)."""
    weight_decay: float = 0.0
    """AdamW weight decay of actor and critic."""
    warmup_steps: int = 5
    """Linear LR warm-up (PPO steps), then cosine to 10% of the peak."""
    critic_warmup_steps: int = 0
    """Steps that train only the critic (gae only)."""
    grad_clip: float = 1.0
    """Clip each model's gradient norm to this."""
    clip_epsilon: float = 0.2
    """PPO's clip range: the ratio is clipped to [1 - eps, 1 + eps_high]."""
    clip_epsilon_high: float | None = None
    """Upper clip 1 + this (DAPO's clip-higher, e.g. 0.28); default --clip_epsilon."""
    clip_ratio_c: float = 3.0
    """dual_clip: the loss of a token with a negative advantage is at most -A x this (> 1)."""
    cispo_max_weight: float = 5.0
    """cispo: the importance weight is clipped to at most this (the paper bounds only the top; MiniMind's and TRL's
    --epsilon_high)."""
    gspo_clip_low: float = 3e-4
    """gspo: the sequence ratio is clipped to [1 - this, 1 + --gspo_clip_high] (the paper's ranges)."""
    gspo_clip_high: float = 4e-4
    """gspo: the upper clip of the sequence ratio."""
    gmpo_clip: float = 0.4
    """gmpo: each token's log-ratio is clipped to [-this, this] (the paper's (e^-0.4, e^0.4))."""
    clip_cov_ratio: float = 2e-4
    """clip_cov: the share of tokens taken out of the gradient (at least one per micro-batch)."""
    clip_cov_lb: float = 1.0
    """clip_cov: tokens are drawn among those with covariance above this..."""
    clip_cov_ub: float = 5.0
    """clip_cov: ...and below this."""
    kl_cov_ratio: float = 2e-3
    """kl_cov: the share of tokens (largest covariance first) given the |log-ratio| penalty (at least one)."""
    kl_cov_coef: float = 1.0
    """kl_cov: weight of that penalty."""
    sapo_tau_pos: float = 1.0
    """sapo: gate temperature for positive advantages."""
    sapo_tau_neg: float = 1.05
    """sapo: gate temperature for negative advantages."""
    loss_agg_mode: str = opt("auto", choices=lambda: ["auto", *LOSS_AGG_MODES])
    """Policy loss over tokens: token_mean (DAPO, PPO), seq_mean_token_mean (GRPO), seq_mean_token_sum,
    seq_mean_token_sum_norm (Dr. GRPO: token sums / --max_gen_len); auto = the loss's own (token_mean; gspo, gmpo, sapo:
    seq_mean_token_mean)."""
    mask_truncated: Flag = 0
    """Leave responses cut at --max_gen_len without EOS out of the loss (DAPO; TRL's mask_truncated_completions):
    their reward says nothing about how they would have ended."""
    vf_coef: float = 0.5
    """Weight of the value loss (gae only)."""
    cliprange_value: float = 0.2
    """Value clipping around the rollout's values (0 = unclipped value loss; gae only)."""
    gamma: float = 1.0
    """Discount of the per-token rewards."""
    lam: float = 0.95
    """GAE's lambda (gae only)."""
    whiten_advantages: Flag = 1
    """Whiten GAE's advantages over every rank's tokens (gae only; the other estimators fix their own scope)."""
    adv_std_unbiased: Flag = 1
    """grpo, grpo_passk: the group's std unbiased (TRL, verl) or, 0, the population std (MiniMind)."""
    adv_eps: float = 1e-6
    """grpo, grpo_passk: added to the group's std before dividing (MiniMind: 1e-4)."""
    kl_coef: float = 0.02
    """KL coefficient to the reference (the start coefficient with --adaptive_kl 1)."""
    kl_estimator: Literal["auto", "k1", "k2", "k3"] = "auto"
    """Schulman's KL estimators; auto = the estimator's own (k3 for grpo/dr_grpo, k1 otherwise)."""
    kl_placement: Literal["auto", "reward", "loss"] = "auto"
    """KL as a per-token reward penalty or as a loss term; auto = the estimator's own (loss for grpo/dr_grpo, as
    their papers; reward otherwise)."""
    adaptive_kl: Flag = 0
    """Ziegler et al.'s adaptive KL coefficient, steered towards --kl_target."""
    kl_target: float = 1.0
    """Adaptive KL: target KL per sequence (nats)."""
    kl_horizon: int = 10000
    """Adaptive KL: horizon in samples."""
    entropy_coef: float = 0.0
    """Entropy bonus weight (0 = off)."""
    early_stop_kl: float = 0.0
    """Stop a step's update when the approx-KL to the sampling policy exceeds this (0 = off)."""
    max_nonfinite: int = 5
    """Stop the run after this many non-finite steps in a row."""


@dataclass(frozen=True)
class EvalArgs:
    eval_data_path: str | None = "auto"
    """RLAIF jsonl of held-out prompts, evaluated greedily during training; auto = dataset/demo_eval.jsonl for the
    demo's data, none otherwise; 'none' = off."""
    eval_interval: int = 50
    """Evaluate every N steps (and before the first, and after the last)."""
    eval_samples: int = 100
    """Prompts per evaluation (the first N of the file)."""


@dataclass(frozen=True)
class SystemArgs:
    device: str = "auto"
    """auto | cpu | cuda | cuda:N (under torchrun each rank takes its own GPU)."""
    dtype: str = opt("auto", choices=lambda: ["auto", *DTYPES])
    """Autocast dtype (log-probs stay fp32). auto = bf16 on GPUs with native bf16 (A100, H100, RTX 30xx on), fp16
    with loss scaling on V100/T4, fp32 on older GPUs; on a CPU bf16 only for models from 5M layer weights with
    native bf16 (AMX or AVX512-BF16), else fp32."""
    ref_device: str = ""
    """Device of the frozen reference: cpu, cuda:N, or cuda:+K = K GPUs after the rank's own (4 ranks per node on
    cuda:0-3 with cuda:+4 put each reference on cuda:4-7); default: the actor's."""
    critic_device: str = ""
    """Device of the critic (trained there), as --ref_device; not cpu under torchrun on GPUs (NCCL); default: the actor's."""
    reward_device: str = ""
    """Device of the reward model, as --ref_device; default: the actor's."""
    frozen_low_precision: Literal[-1, 0, 1] = -1
    """Hold the reference and reward model in --dtype; -1 = where --dtype auto picks a low precision."""
    use_compile: Flag = 0
    """torch.compile the update's models."""
    train_attn_implementation: Literal["auto", "eager", "sdpa", "model"] = "auto"
    """Attention kernel of the update's forward/backward (sampling and scoring keep the model's own); auto = eager
    under bf16 on a CPU, where torch's fused backward is slow at PPO's short sequences; model = the model's own."""
    forward_batch_size: int = 0
    """Rows per scoring forward (old/ref log-probs, values); 0 = all rows at once. Lower it when the
    [rows, response_len, vocab] logits do not fit in memory."""
    num_threads: int = 0
    """torch CPU threads (0 = torch's default)."""
    reuse_values: Literal[-1, 0, 1] = -1
    """GAE with one PPO epoch of one minibatch in one micro-batch (MiniMind's shape): the critic's scoring forward,
    with grad, is also the update's, so the critic runs one forward per step; -1 = wherever that shape holds, 0 = off
    (a separate update forward)."""
    parallel_update: Literal[-1, 0, 1] = -1
    """Run the actor's and the critic's forward/backward side by side, one CPU core each, instead of one after the
    other (both graphs alive: more memory); -1 = on for single-process CPU runs under bf16 with >= 2 threads, unless
    one minibatch reuses the critic's scoring forward."""
    seed: int = 42
    """Seed of everything random: the same seed and flags give the same run on a CPU."""
    deterministic: Flag = 0
    """torch's deterministic algorithms and a fixed cuBLAS workspace: exact repeats on GPU too, slower (CPU runs
    repeat exactly without it)."""
    ddp_timeout: int = 1800
    """Seconds a collective waits for a missing rank before the run fails."""
    strategy: Literal["ddp", "fsdp2"] = "ddp"
    """How the trained models are spread over the ranks. ddp: every rank holds whole models and optimizer state.
    fsdp2: torch's fully_shard per decoder layer and at the root, so each rank holds 1/world of the actor's and
    critic's parameters, gradients and AdamW state (use it when four models do not fit one GPU; docs/distributed.md)."""
    shard_frozen: Flag = 1
    """Under --strategy fsdp2: shard the reference and reward model too (1), or hold a whole copy on every rank (0:
    no all-gather to score with them; for small frozen models)."""
    cpu_offload: Flag = 0
    """Under --strategy fsdp2 on GPUs: keep the sharded parameters, gradients and optimizer state in host memory
    (FSDP2's CPUOffloadPolicy; the optimizer steps on the CPU). Slower; for models that do not fit even sharded."""


@dataclass(frozen=True)
class OutputArgs:
    save_dir: str = "out"
    """Where weights are read (--from_weight) and written."""
    save_weight: str = "ppo_actor"
    """Output name: <save_dir>/<save_weight>_<hidden>.pth (or <save_weight>_hf for --actor_path)."""
    save_interval: int = 50
    """PPO steps between saves."""
    checkpoint_dir: str = "checkpoints"
    """Where resume files go."""
    keep_checkpoints: int = 2
    """Resume files kept (the newest)."""
    from_resume: Literal[0, 1, 2] = 0
    """1: continue from the newest resume file (an error if there is none); 2: continue if there is one, else start
    (preemptible jobs); 0: a new run (refused where another run left resume files)."""
    resume_check_inputs: Flag = 1
    """Refuse to resume if the starting weights, reward model or prompts changed since the run began (sha256s in run.json)."""
    run_dir: str | None = None
    """metrics.jsonl, run.json, plots (default runs/<save_weight>_<hidden>)."""
    log_interval: int = 1
    """Log metrics every N steps."""
    sample_interval: int = 10
    """Log a table of sample generations every N steps."""
    swanlab_mode: Literal["local", "offline", "cloud", "disabled"] = "local"
    """SwanLab dashboard mode (local: `swanlab watch swanlog`)."""
    use_wandb: Flag = opt(1, const=1)
    """MiniMind's name for 'log to SwanLab' (0 = disabled)."""
    wandb_project: str = "minippo"
    """SwanLab project."""


@dataclass(frozen=True)
class MiniMindArgs:
    """Accepted so MiniMind command lines run as they are."""

    rollout_engine: Literal["torch", "sglang"] = "torch"
    """torch: sampling in-process (sglang: not supported)."""
    sglang_base_url: str | None = None
    """Accepted; used only with --rollout_engine sglang (not supported)."""
    sglang_model_path: str | None = None
    """Accepted; as above."""
    sglang_shared_path: str | None = None
    """Accepted; as above."""
    debug_mode: int = opt(0, const=1)
    """1: the sample table every --debug_interval steps."""
    debug_interval: int = 20
    """Steps between sample tables under --debug_mode."""
    debug_log_ratio: int = opt(0, const=1)
    """Accepted: the ratio and approx-KL MiniMind prints are logged every step (ppo/ratio, ppo/approx_kl)."""
    loss_type: Literal["grpo", "cispo"] | None = None
    """MiniMind's train_grpo.py: any of --loss_type / --beta / --epsilon / --epsilon_high runs its GRPO (default cispo):
    --advantage_estimator grpo (population std + 1e-4), KL in the loss (k3), seq_mean_token_mean, one update over
    the whole batch, --num_generations 6, --save_weight grpo; grpo = --policy_loss vanilla, cispo = --policy_loss cispo."""
    beta: float | None = None
    """MiniMind's GRPO KL coefficient (--kl_coef; MiniMind's default 0.1)."""
    epsilon: float | None = None
    """MiniMind's GRPO clip (--clip_epsilon; default 0.2)."""
    epsilon_high: float | None = None
    """MiniMind's CISPO weight cap (--cispo_max_weight; default 5.0)."""


GROUPS: dict[str, tuple[type, str]] = {
    "model": (ModelArgs, "models"),
    "data": (DataArgs, "data"),
    "rollout": (RolloutArgs, "rollout"),
    "reward": (RewardArgs, "reward"),
    "ppo": (PPOArgs, "ppo: estimator, loss, optimisation"),
    "eval": (EvalArgs, "evaluation during training (greedy, held-out prompts)"),
    "system": (SystemArgs, "system"),
    "output": (OutputArgs, "output"),
    "minimind": (MiniMindArgs, "MiniMind compatibility (accepted so MiniMind command lines run)"),
}
# Flags that only the critic uses: a critic-free estimator ignores them (a warning, not an error).
GAE_ONLY_FLAGS = ("critic_learning_rate", "vf_coef", "cliprange_value", "lam", "whiten_advantages", "critic_device")


@dataclass(frozen=True)
class Config:
    """A run's settings, by group. `resolve()` returns one with every `auto` filled in."""

    model: ModelArgs = field(default_factory=ModelArgs)
    data: DataArgs = field(default_factory=DataArgs)
    rollout: RolloutArgs = field(default_factory=RolloutArgs)
    reward: RewardArgs = field(default_factory=RewardArgs)
    ppo: PPOArgs = field(default_factory=PPOArgs)
    eval: EvalArgs = field(default_factory=EvalArgs)
    system: SystemArgs = field(default_factory=SystemArgs)
    output: OutputArgs = field(default_factory=OutputArgs)
    minimind: MiniMindArgs = field(default_factory=MiniMindArgs)
    config: str | None = None  # the --config preset this was read over (recorded in run.json)
    resolved: bool = False  # True once resolve() filled every auto

    def __getattr__(self, name: str) -> Any:
        # Only reached when normal lookup fails: a field of one of the groups (each name is unique).
        group = _FIELD_GROUP.get(name)
        if group is None:
            raise AttributeError(f"Config has no setting {name!r}")
        return getattr(object.__getattribute__(self, group), name)

    def flat(self) -> dict[str, Any]:
        """Every setting by its flag name (tuples as lists): what run.json and resume files record."""
        out = {name: (list(v) if isinstance(v, tuple) else v)
               for g in GROUPS for name, v in dataclasses.asdict(getattr(self, g)).items()}
        out["config"] = self.config
        return out

    def replace(self, **flat: Any) -> Config:
        """A copy with some settings changed, by flag name."""
        by_group: dict[str, dict] = {}
        for name, v in flat.items():
            if name == "config":
                continue
            if name not in _FIELD_GROUP:
                raise AttributeError(f"Config has no setting {name!r}")
            by_group.setdefault(_FIELD_GROUP[name], {})[name] = v
        groups = {g: dataclasses.replace(getattr(self, g), **kw) for g, kw in by_group.items()}
        return dataclasses.replace(self, **groups, **({"config": flat["config"]} if "config" in flat else {}))

    def _resolved(self) -> Config:
        return dataclasses.replace(self, resolved=True)

    # ---- values derived from settings (not flags of their own)
    @property
    def critic_free(self) -> bool:
        return not estimator_spec(self.advantage_estimator).needs_critic

    @property
    def sample_temperature(self) -> float:
        """The distribution log-probs are taken under (1.0 under --greedy)."""
        return 1.0 if self.greedy else self.temperature

    @property
    def can_reuse_values(self) -> bool:
        """One PPO epoch of one minibatch in one micro-batch with a critic: the critic's scoring forward and the
        update's first forward see the same weights and rows, so one forward with grad can serve both."""
        return (not self.critic_free and self.ppo_update_iters == 1 and self.minibatch_rows == self.rows
                and self.accumulation_steps == 1)

    @property
    def rows(self) -> int:
        """Responses per step per process."""
        return self.batch_size * self.num_generations

    @property
    def minibatch_rows(self) -> int:
        """--mini_batch_size, 0 = every row of the step."""
        return self.mini_batch_size or self.rows

    @property
    def frozen_dtype(self) -> torch.dtype:
        """The reference's and reward model's dtype on the actor's device (resolved configs only)."""
        return DTYPES[self.dtype] if self.frozen_low_precision == 1 else torch.float32

    @property
    def train_attn(self) -> str | None:
        """The update's attention kernel, None = the model's own (resolved configs only)."""
        return None if self.train_attn_implementation in ("model", "auto") else self.train_attn_implementation


_FIELD_GROUP = {f.name: g for g, (cls, _) in GROUPS.items() for f in fields(cls)}


# --------------------------------------------------------------------------------------- the parser
@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of a dataclass (read from its source, as CleanRL's tyro does)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str)):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return get_type_hints(cls)


def _kind(hint: Any) -> tuple[type, list | None, bool]:
    """(value type, choices, is a list) of a field's type hint."""
    origin, targs = get_origin(hint), get_args(hint)
    if origin is Literal:
        return type(targs[0]), list(targs), False
    if origin is tuple:
        return targs[0], None, True
    if targs and type(None) in targs:  # X | None
        inner = next(a for a in targs if a is not type(None))
        return (type(get_args(inner)[0]), list(get_args(inner)), False) if get_origin(inner) is Literal else (inner, None, False)
    return hint, None, False


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="train_ppo.py", description="minippo: PPO for small causal LMs (MiniMind flag names)",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--config", default=None, metavar="FILE",
                   help="a preset (YAML or Python file, e.g. configs/grpo_demo.yaml) whose settings become the defaults; "
                        "flags on the command line override it")
    for _, (cls, title) in GROUPS.items():
        g = p.add_argument_group(title)
        docs, hints = field_docs(cls), _hints(cls)
        for f in fields(cls):
            typ, choices, is_list = _kind(hints[f.name])
            meta = f.metadata
            if "choices" in meta:
                choices = meta["choices"]()
            helptext = argparse.SUPPRESS if meta.get("hidden") else docs[f.name].replace("%", "%%")
            kw: dict[str, Any] = {"default": f.default, "help": helptext, "dest": f.name}
            if is_list:
                kw.update(action="append", default=[], type=typ, metavar="MODULE:FN")
            else:
                kw.update(type=typ, choices=choices)
                if "const" in meta:
                    kw.update(nargs="?", const=meta["const"])
            g.add_argument(f"--{f.name}", **kw)
    return p


def parse_args(argv: list[str] | None = None) -> Config:
    """The command line (over a --config preset) as a Config, not yet resolved. Bad flags exit with argparse's
    one-line usage error; a bad preset with one line naming the file and setting."""
    argv = list(sys.argv[1:] if argv is None else argv)
    p = build_parser()
    preset_path = p.parse_known_args(argv)[0].config
    preset = load_preset(preset_path, p) if preset_path else {}
    p.set_defaults(**preset)
    ns = vars(p.parse_args(argv))
    if any(ns[k] is not None for k in MINIMIND_GRPO_FLAGS):  # MiniMind's train_grpo.py command line: its defaults
        p.set_defaults(**{k: v for k, v in minimind_grpo(ns, given_flags(argv)).items() if k not in preset})
        ns = vars(p.parse_args(argv))
    cfg = Config(config=ns.pop("config")).replace(**{k: tuple(v) if isinstance(v, list) else v for k, v in ns.items()})
    warn_unused(cfg)
    return cfg


MINIMIND_GRPO_FLAGS = ("loss_type", "beta", "epsilon", "epsilon_high")
MINIMIND_LOSS_TYPES = {"grpo": "vanilla", "cispo": "cispo"}  # MiniMind's --loss_type -> our --policy_loss
_UNSET = object()


def given_flags(argv: list[str]) -> set[str]:
    """The settings given on the command line itself (not defaults, not a preset's)."""
    p = build_parser()
    p.set_defaults(**{a.dest: None if isinstance(a, argparse._AppendAction) else _UNSET
                      for a in p._actions if a.option_strings and a.dest != "help"})
    return {k for k, v in vars(p.parse_args(argv)).items() if v is not _UNSET and v is not None}


def minimind_grpo(ns: dict[str, Any], given: set[str]) -> dict[str, Any]:
    """MiniMind's trainer/train_grpo.py as settings: GRPO advantages with its population std + 1e-4, the k3 KL in
    the loss at --beta, each response's token mean then the batch mean, one update over the whole batch, 6
    responses per prompt, its output name (grpo); --loss_type cispo (its default) = --policy_loss cispo capped at
    --epsilon_high, grpo = the clipped surrogate at --epsilon (symmetric). A flag given beside its MiniMind name is
    refused."""
    for ours, theirs in (("kl_coef", "beta"), ("clip_epsilon", "epsilon"), ("cispo_max_weight", "epsilon_high")):
        if ours in given and theirs in given:
            raise SystemExit(f"error: --{theirs} is MiniMind's name for --{ours}: give one of them")
    eps = 0.2 if ns["epsilon"] is None else ns["epsilon"]
    return dict(advantage_estimator="grpo", policy_loss=MINIMIND_LOSS_TYPES[ns["loss_type"] or "cispo"],
                num_generations=6, kl_coef=0.1 if ns["beta"] is None else ns["beta"], kl_placement="loss", kl_estimator="k3",
                clip_epsilon=eps, clip_epsilon_high=eps, cispo_max_weight=5.0 if ns["epsilon_high"] is None else ns["epsilon_high"],
                loss_agg_mode="seq_mean_token_mean", adv_std_unbiased=0, adv_eps=1e-4, ppo_update_iters=1, mini_batch_size=0,
                save_weight="grpo")


def warn_unused(cfg: Config) -> None:
    """One line, not an error, for critic settings a critic-free estimator ignores (a command line may switch estimators)."""
    if not cfg.critic_free:
        return
    defaults = Config()
    unused = [f"--{k}" for k in GAE_ONLY_FLAGS if getattr(cfg, k) != getattr(defaults, k)]
    if unused and os.environ.get("RANK", "0") == "0":
        print(f"warning: --advantage_estimator {cfg.advantage_estimator} builds no critic: {', '.join(unused)} "
              f"{'is' if len(unused) == 1 else 'are'} ignored", file=sys.stderr)


def load_preset(path: str, parser: argparse.ArgumentParser) -> dict[str, Any]:
    """A preset's settings, checked as flags are: a YAML mapping (flat, or by group: `ppo: {clip_epsilon: 0.1}`)
    or a Python file whose top-level names are settings (nanoGPT's config/*.py)."""
    where = f"--config {path}"
    if not Path(path).is_file():
        raise SystemExit(f"error: {where}: file not found")
    try:
        if path.endswith((".yaml", ".yml")):
            import yaml

            raw = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
        elif path.endswith(".py"):
            raw = {k: v for k, v in runpy.run_path(path).items()
                   if not k.startswith("_") and not inspect.ismodule(v) and not callable(v)}
        else:
            raise SystemExit(f"error: {where}: expected a .yaml, .yml or .py file")
    except SystemExit:
        raise
    except Exception as e:  # noqa: BLE001 - a syntax error in the user's file: one line naming it
        raise SystemExit(f"error: {where}: cannot read it: {type(e).__name__}: {' '.join(str(e).split())}") from None
    if not isinstance(raw, dict):
        raise SystemExit(f"error: {where}: expected a mapping of settings (name: value)")
    flat: dict[str, Any] = {}
    for k, v in raw.items():
        if k in GROUPS and isinstance(v, dict):
            flat.update(v)
        else:
            flat[k] = v
    actions = {a.dest: a for a in parser._actions if a.option_strings}
    out = {}
    for k, v in flat.items():
        a = actions.get(k)
        if a is None or k in ("config", "help"):
            near = difflib.get_close_matches(str(k), list(actions), n=1)
            hint = f" (did you mean {near[0]}?)" if near else ""
            raise SystemExit(f"error: {where}: unknown setting {k!r}{hint}; settings are the flags of train_ppo.py --help")
        out[k] = _preset_value(where, k, v, a)
    return out


def _preset_value(where: str, name: str, v: Any, a: argparse.Action) -> Any:
    """A preset value as the flag's type (YAML booleans for 0/1 flags), in its choices; a list for a repeatable flag."""
    if isinstance(a, argparse._AppendAction):
        return [_coerce(where, name, x, a.type, None) for x in (v if isinstance(v, list) else [v])]
    return None if v is None else _coerce(where, name, v, a.type, a.choices)


def _coerce(where: str, name: str, v: Any, typ: type | None, choices: list | None) -> Any:
    if isinstance(v, bool):
        v = int(v)
    try:
        if typ is int and isinstance(v, float) and not v.is_integer():
            raise ValueError
        v = typ(v) if typ is not None else v
    except (TypeError, ValueError):
        raise SystemExit(f"error: {where}: {name}: {v!r} is not a valid {getattr(typ, '__name__', 'value')}") from None
    if choices is not None and v not in choices:
        raise SystemExit(f"error: {where}: {name}: {v!r} is not one of {', '.join(map(str, choices))}")
    return v


# --------------------------------------------------------------------------------------- resolve
# --dtype auto / --frozen_low_precision -1 on a CPU: bf16 from this many matmul weights in the transformer
# layers (embeddings and LM head not counted) on a CPU with native bf16 (crossover: docs/speed-and-memory.md).
BF16_CPU_MIN_LAYER_PARAMS = 5_000_000


def cpu_native_bf16(cpuinfo: str | os.PathLike = "/proc/cpuinfo") -> bool:
    """True when the CPU multiplies bf16 natively (AMX-BF16 or AVX512-BF16). Without either, oneDNN
    emulates bf16 by converting to fp32, which is slower than fp32 itself. Read from the kernel's CPU
    flags; where there are none (not Linux), torch's own capability checks."""
    try:
        flags = {f for line in Path(cpuinfo).read_text().splitlines() if line.startswith("flags")
                 for f in line.split(":", 1)[-1].split()}
    except OSError:
        flags = set()
    if flags:
        return bool(flags & {"amx_bf16", "avx512_bf16"})
    checks = (getattr(torch.cpu, "_is_avx512_bf16_supported", None), getattr(torch.cpu, "_is_amx_tile_supported", None))
    return any(bool(c()) for c in checks if c is not None)


def layer_matmul_params(cfg: object) -> int:
    """Matmul weights of the transformer layers (q/k/v/o and the MLP; active experts only for MoE):
    what sets a step's bf16 gain. Embeddings and the LM head are left out (the head runs only at
    response positions and the embedding is a lookup)."""
    cfg = getattr(cfg, "text_config", None) or cfg
    H, L = cfg.hidden_size, cfg.num_hidden_layers
    heads = cfg.num_attention_heads
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    hd = getattr(cfg, "head_dim", None) or H // heads
    inter = getattr(cfg, "moe_intermediate_size", None) if getattr(cfg, "num_experts", 0) else None
    inter = (inter or cfg.intermediate_size) * (getattr(cfg, "num_experts_per_tok", 1) if inter else 1)
    return L * (2 * H * heads * hd + 2 * H * kv * hd + 3 * H * inter)


def model_config(cfg: Config) -> object | None:
    """The actor's transformers config from the settings alone (nothing loaded): --actor_path's config.json,
    or a MiniMind config from the shape flags. None when it cannot be read (loading reports that later)."""
    try:
        if cfg.actor_path:
            from transformers import AutoConfig

            return AutoConfig.from_pretrained(cfg.actor_path, trust_remote_code=bool(cfg.trust_remote_code))
        from model.config import MiniMindConfig

        heads = {k: getattr(cfg, k) for k in ("num_attention_heads", "num_key_value_heads") if getattr(cfg, k, 0)}
        return MiniMindConfig(hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_hidden_layers,
                              use_moe=bool(cfg.use_moe), arch="qwen3" if cfg.arch == "auto" else cfg.arch,
                              **heads).to_hf_config()
    except Exception:  # noqa: BLE001 - any unreadable config: the size is unknown, auto stays fp32 on CPU
        return None


def policy_layer_params(cfg: Config) -> int | None:
    """layer_matmul_params of the actor the settings describe (None: unknown)."""
    mc = model_config(cfg)
    return None if mc is None else layer_matmul_params(mc)


def cuda_auto_dtype(device: torch.device) -> str:
    """--dtype auto on a GPU: bf16 where the GPU computes it natively (compute capability 8.0 on: Ampere,
    Hopper, ...); fp16 with loss scaling on Volta and Turing (V100, T4), whose tensor cores take fp16 but
    emulate bf16 more slowly than fp32; fp32 on older GPUs."""
    major, _ = torch.cuda.get_device_capability(device)
    if major >= 8 and torch.cuda.is_bf16_supported(including_emulation=False):
        return "bfloat16"
    return "float16" if major >= 7 else "float32"


def auto_dtype(device: torch.device, layer_params: int | None) -> str:
    """The auto rule. CUDA: `cuda_auto_dtype`. CPU: bf16 only with native bf16 and a model large enough
    that its matmuls gain more than the casts and elementwise work lose; else fp32."""
    if device.type == "cuda":
        return cuda_auto_dtype(device)
    big = layer_params is not None and layer_params >= BF16_CPU_MIN_LAYER_PARAMS
    return "bfloat16" if device.type == "cpu" and big and cpu_native_bf16() else "float32"


def resolve_precision(cfg: Config, device: torch.device, layer_params: int | None = None) -> tuple[str, torch.dtype]:
    """(--dtype resolved, dtype of the frozen models) on `device`. The one home of both rules.

    auto and --frozen_low_precision -1 follow `auto_dtype`. An explicit low-precision --dtype where auto
    would pick fp32 keeps the frozen models in fp32 unless --frozen_low_precision 1. On a CPU (a --ref_device
    cpu beside a GPU actor) fp16 becomes fp32: CPUs have no fast fp16 and no loss scaler runs there."""
    auto = auto_dtype(device, layer_params)
    name = cfg.dtype if cfg.dtype != "auto" else auto
    if device.type == "cpu" and name == "float16":
        name = "float32"
    low = cfg.frozen_low_precision if cfg.frozen_low_precision >= 0 else int(auto != "float32")
    return name, (DTYPES[name] if low else torch.float32)


def eval_data_path(cfg: Config) -> str | None:
    """--eval_data_path resolved: auto = the demo's held-out file beside the demo's training prompts."""
    if cfg.eval_data_path in (None, "none"):
        return None
    if cfg.eval_data_path != "auto":
        return cfg.eval_data_path
    held_out = Path(cfg.data_path).with_name("demo_eval.jsonl")
    return str(held_out) if Path(cfg.data_path).name == "demo_train.jsonl" and held_out.is_file() else None


def use_parallel_update(flag: int, device: torch.device, distributed: bool, cpu_bf16: bool,
                        reuse_values: bool = False, threads: int | None = None) -> bool:
    """`--parallel_update`: 1/0 as given; -1 (auto) = on for single-process CPU runs under bf16 autocast with
    >= 2 torch threads, where the benchmark shows it pays, unless the update reuses the critic's scoring
    forward (then the critic's share is a backward alone and the actor's core does most of the work).
    DDP stays sequential: its gradient hooks would issue collectives from two threads in an order no other
    rank shares, so 1 is refused there."""
    if flag == 1 and (distributed or device.type != "cpu"):
        raise SystemExit("error: --parallel_update 1 is for single-process CPU runs (use -1 or 0 under torchrun or on CUDA)")
    if flag >= 0:
        return bool(flag)
    return (not distributed and device.type == "cpu" and cpu_bf16 and not reuse_values
            and (threads or torch.get_num_threads()) >= 2)


_UNREAD = object()


def resolve(raw: Config, info: DistInfo, mc: object | None = _UNREAD) -> Config:
    """`raw` validated and every `auto` filled in for this rank's device: --device, --dtype, --frozen_low_precision,
    --kl_placement / --kl_estimator (the estimator's own), --clip_epsilon_high, --loss_agg_mode (the loss's own),
    --mini_batch_size 0 (every row), --eval_data_path,
    --train_attn_implementation, --parallel_update, --save_merged, --hidden_size (an --actor_path model's
    own), --sample_interval (MiniMind's --debug_mode uses --debug_interval), --swanlab_mode (--use_wandb 0)."""
    if raw.resolved:
        return raw
    validate(raw)
    device = info.device
    if mc is _UNREAD:  # the actor's transformers config (None: unreadable), if the caller has not read it
        mc = model_config(raw)
    dtype, frozen = resolve_precision(raw, device, None if mc is None else layer_matmul_params(mc))
    est = estimator_spec(raw.advantage_estimator)
    cpu_bf16 = device.type == "cpu" and dtype == "bfloat16" and not raw.use_compile
    attn = raw.train_attn_implementation
    if attn == "auto":  # torch's CPU flash-attention backward under bf16 is slow at PPO's short sequences
        attn = "eager" if cpu_bf16 else "model"
    hidden = getattr(mc, "hidden_size", None) if raw.actor_path else None
    reuse = raw.can_reuse_values if raw.reuse_values == -1 else raw.reuse_values
    return raw.replace(
        device=device.type if raw.device == "auto" else raw.device, reuse_values=int(reuse),
        dtype=dtype, frozen_low_precision=int(frozen != torch.float32),
        kl_placement=est.kl_placement if raw.kl_placement == "auto" else raw.kl_placement,
        kl_estimator=est.kl_estimator if raw.kl_estimator == "auto" else raw.kl_estimator,
        clip_epsilon_high=raw.clip_epsilon if raw.clip_epsilon_high is None else raw.clip_epsilon_high,
        loss_agg_mode=policy_loss_spec(raw.policy_loss).loss_agg if raw.loss_agg_mode == "auto" else raw.loss_agg_mode,
        mini_batch_size=raw.minibatch_rows,
        eval_data_path=eval_data_path(raw), train_attn_implementation=attn,
        parallel_update=int(use_parallel_update(raw.parallel_update, device, info.enabled or raw.strategy == "fsdp2", cpu_bf16, bool(reuse),
                                                    raw.num_threads or None)),
        save_merged=raw.save_merged if raw.save_merged >= 0 else int(not raw.actor_path),
        hidden_size=hidden or raw.hidden_size, sample_interval=raw.debug_interval if raw.debug_mode else raw.sample_interval,
        swanlab_mode=raw.swanlab_mode if raw.use_wandb else "disabled",
    )._resolved()


DEVICE_FLAG = re.compile(r"cpu|cuda(:\+?\d+)?|")  # --ref_device / --critic_device / --reward_device


def fsdp2_checks(cfg: Config) -> list[tuple[bool, str]]:
    """What --strategy fsdp2 does not combine with, as validate's (ok, message) pairs."""
    if cfg.strategy != "fsdp2":
        return [(not cfg.cpu_offload, "--cpu_offload 1 offloads FSDP2's shards: it needs --strategy fsdp2")]
    why = "under --strategy fsdp2"
    return [
        (cfg.lora_r == 0, f"--lora_r {cfg.lora_r} {why}: LoRA adapters are small enough for --strategy ddp; use that"),
        (not cfg.use_moe, f"--use_moe 1 {why} is not supported (experts a rank does not route to have no gradient "
                          f"there); use --strategy ddp"),
        (not cfg.use_compile, f"--use_compile 1 {why} is not supported yet; drop it"),
        (cfg.parallel_update != 1, f"--parallel_update 1 {why}: the sharded backward all-gathers and reduce-scatters "
                                   f"per layer, which two threads would issue in different orders on different ranks"),
        (not (cfg.ref_device or cfg.critic_device or cfg.reward_device),
         f"--ref_device / --critic_device / --reward_device {why}: every model is sharded over the ranks' own devices; "
         f"drop them (--shard_frozen 1 shards the frozen models instead of moving them)"),
        (not cfg.cpu_offload or cfg.device != "cpu",
         "--cpu_offload 1 moves a GPU run's shards to host memory; a CPU run has nothing to offload: drop it"),
    ]


def validate(cfg: Config) -> None:
    """One-line errors for settings that would otherwise fail deep inside the run."""
    rows = cfg.rows
    est = ADVANTAGE_ESTIMATORS.get(cfg.advantage_estimator)
    loss = POLICY_LOSSES.get(cfg.policy_loss)
    mb = cfg.minibatch_rows
    checks = [
        (est is not None, f"--advantage_estimator {cfg.advantage_estimator}: expected one of {', '.join(ADVANTAGE_ESTIMATORS)}"),
        (loss is not None, f"--policy_loss {cfg.policy_loss}: expected one of {', '.join(POLICY_LOSSES)}"),
        (cfg.batch_size >= 1, "--batch_size must be >= 1"),
        (cfg.num_generations >= 1, "--num_generations must be >= 1"),
        (mb >= 1 and rows % mb == 0,
         f"--mini_batch_size {cfg.mini_batch_size} must divide --batch_size x --num_generations = {rows} (or be 0: all)"),
        (cfg.accumulation_steps >= 1 and mb % cfg.accumulation_steps == 0,
         f"--accumulation_steps {cfg.accumulation_steps} must divide --mini_batch_size {mb}"),
        (cfg.max_gen_len >= 1, "--max_gen_len must be >= 1"),
        (cfg.max_seq_len >= 8, "--max_seq_len must be >= 8"),
        (cfg.temperature > 0 or cfg.greedy, "--temperature must be > 0 (or use --greedy 1)"),
        (0 < cfg.top_p <= 1, "--top_p must be in (0, 1]"),
        (cfg.ppo_update_iters >= 1, "--ppo_update_iters must be >= 1"),
        (0 <= cfg.thinking_ratio <= 1, "--thinking_ratio must be in [0, 1]"),
        (cfg.epochs >= 1, "--epochs must be >= 1"),
        (cfg.save_interval >= 1, "--save_interval must be >= 1"),
        (Path(cfg.data_path).is_file(), f"--data_path {cfg.data_path}: file not found"),
        (cfg.reward_model_path in (None, "none") or Path(cfg.reward_model_path).is_dir() or cfg.rm_weight == 0,
         f"--reward_model_path {cfg.reward_model_path}: not a directory (use 'none' or --rm_weight 0 to run without a reward model)"),
        (cfg.actor_path is None or Path(cfg.actor_path).is_dir(), f"--actor_path {cfg.actor_path}: not a directory"),
        (cfg.rollout_engine == "torch", "--rollout_engine sglang is not supported: minippo samples with the policy "
                                        "in-process (--rollout_engine torch, the default); drop the --sglang_* flags"),
        (cfg.ddp_timeout > 0, "--ddp_timeout must be > 0 seconds"),
        (cfg.num_generations >= 2 or est is None or not est.needs_groups,
         f"--advantage_estimator {cfg.advantage_estimator} compares the --num_generations responses to each prompt: "
         f"give --num_generations >= 2 (e.g. 4)"),
        (cfg.num_generations >= 2 or loss is None or not loss.needs_groups,
         f"--policy_loss {cfg.policy_loss} compares the --num_generations responses to each prompt: give --num_generations >= 2"),
        (loss is None or loss.estimators is None or cfg.advantage_estimator in loss.estimators,
         f"--policy_loss {cfg.policy_loss} pairs with --advantage_estimator {' / '.join(loss.estimators or ())} only "
         f"(it needs one advantage per response, compared within its group)"),
        (loss is None or not loss.agg_fixed or cfg.loss_agg_mode in ("auto", loss.loss_agg),
         f"--loss_agg_mode {cfg.loss_agg_mode}: --policy_loss {cfg.policy_loss} is defined per response "
         f"({loss.loss_agg if loss else ''}); drop --loss_agg_mode"),
        (cfg.clip_epsilon_high is None or not cfg.clip_epsilon_high < cfg.clip_epsilon,
         f"--clip_epsilon_high {cfg.clip_epsilon_high} is below --clip_epsilon {cfg.clip_epsilon}: the upper clip is "
         f"1 + --clip_epsilon_high (clip-higher raises it)"),
        (not cfg.gspo_clip_high < cfg.gspo_clip_low,
         f"--gspo_clip_high {cfg.gspo_clip_high} is below --gspo_clip_low {cfg.gspo_clip_low}"),
        (not cfg.clip_ratio_c <= 1, f"--clip_ratio_c {cfg.clip_ratio_c} must be > 1 (the dual clip bounds -A x c above PPO's clip)"),
        (not cfg.cispo_max_weight < 1, f"--cispo_max_weight {cfg.cispo_max_weight} must be >= 1 (an on-policy token's weight is 1)"),
        (cfg.clip_cov_lb < cfg.clip_cov_ub, f"--clip_cov_lb {cfg.clip_cov_lb} must be below --clip_cov_ub {cfg.clip_cov_ub}"),
        (0 < cfg.clip_cov_ratio <= 1 and 0 < cfg.kl_cov_ratio <= 1, "--clip_cov_ratio and --kl_cov_ratio must be in (0, 1]"),
        (cfg.num_generations >= 2 or not cfg.filter_groups,
         "--filter_groups 1 drops groups of --num_generations responses with equal rewards: give --num_generations >= 2"),
        (cfg.filter_max_rounds >= 1, "--filter_max_rounds must be >= 1"),
        (cfg.max_turns >= 1, "--max_turns must be >= 1"),
        (cfg.max_total_len > cfg.max_seq_len or not cfg.tools,
         f"--max_total_len {cfg.max_total_len} must exceed --max_seq_len {cfg.max_seq_len} (the prompt) to leave room for turns"),
        (math.isfinite(cfg.tool_timeout) and cfg.tool_timeout > 0, f"--tool_timeout {cfg.tool_timeout} must be a number of seconds > 0"),
        (not cfg.tools or Path(cfg.tools).is_file(), f"--tools {cfg.tools}: file not found; give a .py module of tool functions"),
        (cfg.reuse_values != 1 or cfg.can_reuse_values,
         "--reuse_values 1 needs --advantage_estimator gae with one PPO epoch (--ppo_update_iters 1) of one minibatch "
         "(--mini_batch_size = --batch_size x --num_generations, --accumulation_steps 1)"),
        (cfg.critic_warmup_steps == 0 or est is None or est.needs_critic,
         f"--critic_warmup_steps trains the critic, but --advantage_estimator {cfg.advantage_estimator} has none: drop it"),
        (0 <= cfg.overlong_buffer_len < cfg.max_gen_len,
         f"--overlong_buffer_len {cfg.overlong_buffer_len} must be in [0, --max_gen_len {cfg.max_gen_len})"),
        (cfg.eval_interval >= 1 and cfg.eval_samples >= 1, "--eval_interval and --eval_samples must be >= 1"),
        (cfg.eval_data_path in ("auto", "none", None) or Path(cfg.eval_data_path).is_file(),
         f"--eval_data_path {cfg.eval_data_path}: file not found (or 'none' to train without evaluation)"),
        (cfg.lora_r >= 0, f"--lora_r {cfg.lora_r} must be >= 0 (0 = no LoRA, full fine-tuning)"),
        (math.isfinite(cfg.lora_alpha) and cfg.lora_alpha > 0, f"--lora_alpha {cfg.lora_alpha} must be a finite number > 0"),
        (0 <= cfg.lora_dropout < 1, f"--lora_dropout {cfg.lora_dropout} must be in [0, 1)"),
        (cfg.lora_r == 0 or not cfg.ref_device,
         f"--ref_device {cfg.ref_device}: with --lora_r > 0 the reference is the actor with its adapters off, on the "
         f"actor's device; drop --ref_device"),
        # torch.device() would take "tpu"/"mps" and fail later with a traceback.
        (re.fullmatch(r"auto|cpu|cuda(:\d+)?", cfg.device) is not None,
         f"--device {cfg.device}: expected one of auto, cpu, cuda, cuda:N"),
        *[(DEVICE_FLAG.fullmatch(getattr(cfg, f)) is not None,
           f"--{f} {getattr(cfg, f)}: expected cpu, cuda, cuda:N or cuda:+K (K GPUs after the rank's own), "
           f"or nothing (the actor's device)")
          for f in ("ref_device", "critic_device", "reward_device")],
        *fsdp2_checks(cfg),
    ]
    # nan compares False with everything, so "x > 0" alone would let it through.
    for flag, lowest in (("beta", ">= 0"), ("epsilon", "> 0"), ("epsilon_high", "> 0"), ("learning_rate", "> 0"),
                         ("critic_learning_rate", "> 0"), ("grad_clip", "> 0"),
                         ("clip_epsilon", "> 0"), ("kl_coef", ">= 0"), ("clip_epsilon_high", "> 0"), ("overlong_penalty", ">= 0"),
                         ("gspo_clip_low", "> 0"), ("gspo_clip_high", "> 0"), ("gmpo_clip", "> 0"), ("kl_cov_coef", ">= 0"),
                         ("sapo_tau_pos", "> 0"), ("sapo_tau_neg", "> 0"), ("adv_eps", ">= 0"), ("reward_clip", ">= 0"),
                         ("tool_error_penalty", ">= 0")):
        v = getattr(cfg, flag)
        if v is None:  # --clip_epsilon_high or a MiniMind name not given
            continue
        checks.append((math.isfinite(v) and (v > 0 if lowest == "> 0" else v >= 0),
                       f"--{flag} {v} must be a finite number {lowest}"))

    def blocking_file(path: str) -> Path | None:
        """The file standing where `path` or one of its parents must be a directory (found here, not
        at the first save after a step of work)."""
        for p in (Path(path), *Path(path).parents):
            if p.exists():
                return None if p.is_dir() else p
        return None

    # No --run_dir means runs/<save_weight>_<hidden>: "runs" must then be a directory.
    for label, value in ((f"--checkpoint_dir {cfg.checkpoint_dir}", cfg.checkpoint_dir),
                         (f"--save_dir {cfg.save_dir}", cfg.save_dir),
                         (f"--run_dir {cfg.run_dir}" if cfg.run_dir else "--run_dir (default runs/...)",
                          cfg.run_dir or "runs")):
        f = blocking_file(value)
        where = "is a file" if f == Path(value) else f"{f} is a file"
        checks.append((f is None, f"{label}: {where}, not a directory; give a directory path (created if missing)"))
    for ok, msg in checks:
        if not ok:
            raise SystemExit(f"error: {msg}")


def reference_markdown() -> str:
    """Every setting by group, as docs/configuration.md lists it (tests/test_config.py keeps the two equal)."""
    out = []
    for _, (cls, title) in GROUPS.items():
        docs, hints = field_docs(cls), _hints(cls)
        out += [f"### {title}", "", "| flag | default | what it does |", "|---|---|---|"]
        for f in fields(cls):
            if f.metadata.get("hidden"):
                continue
            choices = f.metadata["choices"]() if "choices" in f.metadata else _kind(hints[f.name])[1]
            default = f"`{f.default!r}`" + (f" ({' / '.join(map(str, choices))})" if choices else "")
            out.append(f"| `--{f.name}` | {default} | {docs[f.name].replace('|', '/')} |")
        out.append("")
    return "\n".join(out)
