"""One typed config for a PPO run.

Every setting is a field of a frozen dataclass with the docstring under it (CleanRL's `Args`), grouped by
topic (ModelArgs, DataArgs, ...). `Config` inherits every group, so each setting is a real attribute of one
flat, frozen dataclass (`cfg.clip_epsilon`: a misspelt name is a type error), while the groups still title
the --help sections and the by-group presets. MiniMind's flag names are the fields' names.

Components take their own section, built from the flat fields (trainer/sections.py): `cfg.loss` for the policy
loss, `cfg.estimator` for the advantage estimator, `cfg.optim` for the optimizers, `cfg.sampling` for sampling,
`cfg.update` for the PPO update (nesting the loss and optimizer sections, as verl's ActorConfig does).

The command line, presets, MiniMind's aliases and validation are trainer/run/cli.py; the hardware rules
("auto" dtype, bf16 detection, the parallel update) are trainer/run/hardware.py. run.json and every resume
file record `cfg.flat()`, so a resume compares resolved values.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields
from typing import Any, Literal

import torch

from trainer.ppo import LOSS_AGG_MODES
from trainer.registry import estimator_names, estimator_spec, policy_loss_names
from trainer.runtime import DTYPES
from trainer.sections import EstimatorConfig, Flag, OptimConfig, PolicyLossConfig, SamplingConfig, UpdateConfig


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
    teacher_model_path: str | None = None
    """On-policy distillation (--distill_coef): the teacher, a local Hugging Face causal-LM directory or a native MiniMind
    .pth (its shape read off the file), loaded and held like the reference (frozen, --ref_device, sharded under
    --shard_frozen); its tokenizer must be the actor's (docs/distillation.md)."""
    teacher_url: str | None = None
    """Instead: a vLLM server of the teacher, asked for the prompt log-probs of each sampled sequence (/v1/completions,
    prompt_logprobs; raw log-softmax, so --temperature 1); key in MINIPPO_TEACHER_API_KEY; comma-separated for several."""


@dataclass(frozen=True)
class DataArgs:
    data_path: str = "dataset/demo_train.jsonl"
    """Prompts: a MiniMind RLAIF jsonl (not read with --reasoning_gym)."""
    reasoning_gym: str | None = None
    """Instead: prompts generated by reasoning-gym's tasks (pip install reasoning-gym), TASK[,TASK], each optionally with
    settings of its config (chain_sum:max_terms=3:max_digits=2): training rows from a seed derived from --seed, held-out
    rows (--eval_data_path auto) from a fixed seed; the accuracy reward is the task's own score_answer
    (docs/reasoning_gym.md). 'none' = off."""
    reasoning_gym_size: int = 2000
    """--reasoning_gym: training rows generated (its tasks in turn)."""
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
    cuda_graphs: Flag = 1
    """On a GPU, replay --fast_decode's decode step (sampling included) from a CUDA graph per shape bucket, kept across
    rollouts, instead of launching each of its kernels for every token (model/generation.py StaticDecode); 0 = launch them and
    hold no graph memory between rollouts. No effect on a CPU."""
    rollout_logprobs: Flag = 1
    """With no old-actor copy, old_logprobs come from the sampling pass itself instead of a second forward
    (the same numbers in fp32; under bf16 slightly apart, see docs/speed-and-memory.md). 0 = score the samples again
    (always, with a rollout engine: its log-probs only weigh the samples, --rollout_is)."""
    filter_groups: Flag = 0
    """DAPO dynamic sampling: drop groups whose --num_generations rewards are all equal (no signal) and sample
    the next prompts until the batch is full."""
    filter_max_rounds: int = 4
    """--filter_groups: at most this many extra prompt batches per step; then the batch is filled up with dropped groups."""
    tools: str | None = None
    """A Python module of tool functions (type hints + docstring each) the policy may call: rollouts become multi-turn
    episodes (sample a turn, run its <tool_call>s, append the replies, sample again). Only the policy's tokens train."""
    tools_system_prompt: str | None = None
    """--tools: list the tools in this system prompt instead of through the chat template's tools= (for a template
    without a tool section, e.g. SmolLM2-135M-Instruct's): "{tools}" in it becomes the tools' JSON schemas; it opens
    every tool prompt's system message (a row's own system text follows it)."""
    max_turns: int = 3
    """--tools: at most this many policy turns per episode."""
    max_total_len: int = 1024
    """--tools: at most this many tokens per episode, prompt and tool replies included; a turn that would pass it is cut."""
    tool_timeout: float = 5.0
    """--tools: seconds a tool call may run before it is stopped (the policy then reads a timeout error)."""
    max_tool_calls: int = 8
    """--tools: at most this many tool calls run per episode (all turns together); later calls are answered with an
    error, not run."""
    suppress_eos: Flag = opt(0, hidden=True)
    """Never stop at EOS (benchmarks: fixed lengths)."""


@dataclass(frozen=True)
class EngineArgs:
    rollout_engine: Literal["torch", "vllm", "sglang"] = "torch"
    """Who samples the rollouts: torch = the policy in this process; vllm / sglang = an inference server started
    beforehand in its own virtualenv (docs/engines.md), sent token IDs, synced with the policy's weights."""
    engine_url: str | None = None
    """The engine's URL; comma-separated for several: the ranks split into as many contiguous blocks (one engine per
    node, in node order); sglang: default --sglang_base_url."""
    engine_sync_interval: int = 1
    """Push the policy's weights to the engine every N updates (1: every rollout samples the current policy)."""
    async_rollouts: int = 0
    """The engine samples the next K batches while the trainer scores and updates (verl's one-step off-policy,
    prime-rl's async level): a batch is sampled by weights at most K updates (+ --engine_sync_interval - 1) older than
    the ones it trains (staler ones are refused), the lag corrected by --rollout_is (docs/engines.md). 0 = take turns."""
    engine_shared_path: str | None = None
    """Folder the pushed weights are written to; the engine must read the same path (default: a folder in /dev/shm
    named after the engine's URL, else under --checkpoint_dir, on one node with local engines only: needed for an
    engine on another host or a run over several nodes; sglang: --sglang_shared_path)."""
    engine_timeout: float = 600.0
    """Seconds an engine request (a batch of samples, a weight reload) may take before the run stops; under torchrun
    also no longer than the other ranks can wait (--ddp_timeout less a margin, for all of a step's requests)."""
    rollout_is: Literal["token", "sequence", "none"] = "token"
    """An engine's samples: truncated importance weights pi_old / pi_engine on the policy loss, per token or per
    response (none: measured and logged, not applied). Under --top_k / --top_p pi_old is renormalised over the tokens
    the trainer's logits keep, as vLLM's processed log-probs are; SGLang is then refused unless none (docs/engines.md)."""
    rollout_is_cap: float = 2.0
    """Upper truncation of --rollout_is weights."""
    sglang_base_url: str | None = None
    """MiniMind's name for --engine_url with --rollout_engine sglang (default http://localhost:8998)."""
    sglang_model_path: str | None = None
    """MiniMind's tokenizer path: its tokenizer files go with every weight push (default: the actor's tokenizer
    directory, model/ for native weights); must be the actor's tokenizer."""
    sglang_shared_path: str | None = None
    """MiniMind's name for --engine_shared_path with --rollout_engine sglang."""


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
    """Weight of the accuracy reward (1.0 when the answer matches the row's reference; on a --reasoning_gym row, the
    task's own score_answer of the <answer> content)."""
    eos_penalty: float = 0.5
    """Subtracted when a response never emits EOS."""
    eos_placement: Literal["reward", "advantage"] = "reward"
    """Where --eos_penalty acts: reward = a term of the reward the estimator normalises (with GRPO a group that differs
    only in which replies were cut learns to stop as hard as from a met constraint); advantage = added to each
    response's advantage after the estimator, centred in its group and not scaled (a group estimator only)."""
    ifeval_repairs: int = 0
    """Off-policy guidance (trainer/repair.py): in a group where no sample meets a constraint of a type a small model
    almost never meets by chance (lowercase, quotation, repeat_prompt, two_responses, paragraphs, bullets), up to this
    many samples are replaced by the group's best ended reply rewritten to meet it (dataset/ifeval.py REPAIRS), then
    rewarded like any other; their old log-probs are the policy's now (0 = off; logged as reward/repaired)."""
    ifeval_weight: float = 1.0
    """Weight of the instruction-following reward: the share of a prompt row's "constraints" (dataset/ifeval.py) the
    reply meets, logged per constraint type; rows without constraints get none."""
    ifeval_partial_weight: float = 0.0
    """Weight of a dense reward beside it: for each unmet constraint of a type a small model almost never meets by
    chance (uppercase, lowercase, repeat_prompt, start_phrase, two_responses), how close the reply comes (the share of
    letters in the case asked, of the request's words it opens with, the separator present), averaged like the
    ifeval reward (dataset/ifeval.py CLOSENESS; 0 = off). Below --ifeval_weight, a met constraint always earns more."""
    tool_error_penalty: float = 0.5
    """--tools: subtracted when an episode made a tool call that could not run (malformed JSON, unknown tool, bad
    arguments, or the tool raised or timed out)."""
    tool_ok_weight: float = 0.0
    """--tools: added when an episode called a tool and every call ran (reward/tool_ok: well-formed, a known tool, valid
    arguments), whatever the answer; a shaping reward for calling at all (0 = off)."""
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
    reward_max_abs: float = 1e4
    """A total reward outside [-this, this] is clipped to it before any normalisation and counted
    (reward/out_of_range): one huge finite value from a server or a function cannot swamp the run."""
    verifier_timeout: float = 10.0
    """Seconds a verifier that parses the policy's text (--reasoning_gym's score_answer) may take per reply, in a
    bounded worker process; a reply that runs over scores 0 and is counted (reward/verifier_timeouts)."""
    reward_model_url: str | None = None
    """Score the reward model on a server instead of in this process: vLLM's pooling runner started on
    --reward_model_path (scripts/serve_reward_model.sh; docs/reward_servers.md). The text is rendered and tokenized here
    with --reward_model_path's tokenizer and chat template, as in-process, and sent as token IDs; the weights load
    there only. Comma-separated for several: the ranks split into as many contiguous blocks (one server per node)."""
    reward_url: str | None = None
    """A reward function behind HTTP: each rank POSTs its rows as {"prompts", "replies", "references"} and reads
    {"rewards": [one number per reply]} (docs/reward_servers.md); the "url" component (reward/url)."""
    reward_url_weight: float = 1.0
    """Weight of the --reward_url reward."""
    distill_coef: float = 0.0
    """On-policy distillation (Agarwal et al. 2024, GKD with lambda = 1; Thinking Machines 2025): each sampled token's
    reward gets -this x (log pi(y_t) - log p_teacher(y_t)), the per-token reverse KL to --teacher_model_path /
    --teacher_url, beside the hybrid reward, under any estimator (0 = off; alone: every other reward weight 0)."""
    reward_timeout: float = 300.0
    """Seconds one request to --reward_model_url / --reward_url may take before the run stops (below --ddp_timeout)."""


@dataclass(frozen=True)
class PPOArgs:
    advantage_estimator: str = opt("gae", choices=estimator_names)
    """gae: a learned critic (PPO). Critic-free (no critic built): grpo (group mean/std), dr_grpo (group mean),
    rloo (leave-one-out mean), reinforce_pp (global whitening), reinforce_pp_baseline (group mean, then global).
    docs/estimators.md compares them."""
    policy_loss: str = opt("vanilla", choices=policy_loss_names)
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
    demo's data, reasoning-gym's held-out rows with --reasoning_gym, none otherwise; 'none' = off."""
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
    with loss scaling on V100/T4, fp32 on older GPUs; on a CPU bf16 only for models from 5M layer weights where a
    bf16 matmul measures >= 1.2x the fp32 rate at start (AMX, AMD's AVX512-BF16; not Intel's AVX512-BF16 alone),
    else fp32."""
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
    logprob_chunk_size: int = -1
    """Tokens per chunk of the log-prob path that never holds the [rows, tokens, vocab] logits (model/logprobs.py: the LM
    head projects, reduces and drops each chunk; the backward projects it again): -1 = auto (chunks of 16M logits; in
    scoring and with a frozen head always, for a trained head only past 1 GiB of fp32 logits), 0 = off, N = N tokens."""
    padding_free: Flag = 1
    """Score (old/ref log-probs, values) and update on rows packed without pad tokens (TRL's padding_free, verl's
    remove-padding): whole rows first-fit into packed rows of the width a cost model picks (attention over wider
    rows against fewer of them), positions restarting per row, attention kept within each row (transformers'
    packed-sequence masks); the same losses, log-probs and gradients to rounding, less work where prompts or
    responses are padded (docs/speed-and-memory.md). 0 = the padded rows."""
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
    save_timeout: int = 7200
    """Seconds the other ranks wait for rank 0 to write a resume file (a slow shared filesystem), outside
    --ddp_timeout's watchdog."""
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
    hsdp: Literal[-1, 0, 1] = -1
    """Under --strategy fsdp2: shard within a node and replicate across nodes (HSDP, a 2-D device mesh), so each
    layer's all-gather stays on the node's own links; -1 = on when the job spans nodes, 0 = shard over every rank."""


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
    "engine": (EngineArgs, "rollout engine: vLLM / SGLang servers (docs/engines.md)"),
    "reward": (RewardArgs, "reward"),
    "ppo": (PPOArgs, "ppo: estimator, loss, optimisation"),
    "eval": (EvalArgs, "evaluation during training (greedy, held-out prompts)"),
    "system": (SystemArgs, "system"),
    "output": (OutputArgs, "output"),
    "minimind": (MiniMindArgs, "MiniMind compatibility (accepted so MiniMind command lines run)"),
}
# Flags that only the critic uses: a critic-free estimator ignores them (a warning, not an error).
GAE_ONLY_FLAGS = ("critic_learning_rate", "vf_coef", "cliprange_value", "lam", "whiten_advantages", "critic_device")


# The bases in reverse: a dataclass lists its bases' fields from the last base to the first, so the flat field
# order is the groups' order (ModelArgs first), as --help, run.json and the resume files have it.
@dataclass(frozen=True)
class Config(MiniMindArgs, OutputArgs, SystemArgs, EvalArgs, PPOArgs, RewardArgs, EngineArgs, RolloutArgs, DataArgs,
             ModelArgs):
    """A run's settings: every group's fields as its own. `resolve()` returns one with every `auto` filled in."""

    config: str | None = None
    """The --config preset this was read over (recorded in run.json)."""
    resolved: bool = False
    """True once resolve() filled every auto."""

    def flat(self) -> dict[str, Any]:
        """Every setting by its flag name (tuples as lists): what run.json and resume files record."""
        return {f.name: (list(v) if isinstance(v, tuple) else v)
                for f in fields(self) if f.name != "resolved" for v in [getattr(self, f.name)]}

    def replace(self, **flat: Any) -> Config:
        """A copy with some settings changed, by flag name."""
        unknown = [name for name in flat if name not in SETTINGS]
        if unknown:
            raise AttributeError(f"Config has no setting {unknown[0]!r}")
        return dataclasses.replace(self, **flat)

    def _resolved(self) -> Config:
        return dataclasses.replace(self, resolved=True)

    # ---- values derived from settings (not flags of their own)
    @property
    def critic_free(self) -> bool:
        return not estimator_spec(self.advantage_estimator).needs_critic

    @property
    def sample_temperature(self) -> float:
        """The distribution log-probs are taken under (1.0 under --greedy)."""
        return self.sampling.sample_temperature

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

    # ---- each component's own section (trainer/sections.py), built from the flat settings
    @property
    def loss(self) -> PolicyLossConfig:
        """The registered --policy_loss's settings."""
        return PolicyLossConfig(
            name=self.policy_loss, clip_epsilon=self.clip_epsilon,
            clip_epsilon_high=self.clip_epsilon if self.clip_epsilon_high is None else self.clip_epsilon_high,
            clip_ratio_c=self.clip_ratio_c, cispo_max_weight=self.cispo_max_weight, gspo_clip_low=self.gspo_clip_low,
            gspo_clip_high=self.gspo_clip_high, gmpo_clip=self.gmpo_clip, clip_cov_ratio=self.clip_cov_ratio,
            clip_cov_lb=self.clip_cov_lb, clip_cov_ub=self.clip_cov_ub, kl_cov_ratio=self.kl_cov_ratio,
            kl_cov_coef=self.kl_cov_coef, sapo_tau_pos=self.sapo_tau_pos, sapo_tau_neg=self.sapo_tau_neg,
            loss_agg_mode=self.loss_agg_mode, max_gen_len=self.max_gen_len)

    @property
    def estimator(self) -> EstimatorConfig:
        """The registered --advantage_estimator's settings."""
        return EstimatorConfig(name=self.advantage_estimator, gamma=self.gamma, lam=self.lam,
                               num_generations=self.num_generations, adv_eps=self.adv_eps,
                               adv_std_unbiased=self.adv_std_unbiased, whiten_advantages=self.whiten_advantages)

    @property
    def optim(self) -> OptimConfig:
        """The actor's and critic's optimizers and their schedule."""
        return OptimConfig(learning_rate=self.learning_rate, critic_learning_rate=self.critic_learning_rate,
                           weight_decay=self.weight_decay, warmup_steps=self.warmup_steps, grad_clip=self.grad_clip)

    @property
    def sampling(self) -> SamplingConfig:
        """How a rollout is sampled."""
        return SamplingConfig(num_generations=self.num_generations, max_gen_len=self.max_gen_len,
                              temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, greedy=self.greedy,
                              suppress_eos=self.suppress_eos, fast_decode=self.fast_decode, cuda_graphs=self.cuda_graphs,
                              rollout_logprobs=self.rollout_logprobs, max_turns=self.max_turns,
                              max_total_len=self.max_total_len)

    @property
    def update(self) -> UpdateConfig:
        """The PPO update's settings, the loss and optimizer sections nested (resolved configs only)."""
        return UpdateConfig(
            loss=self.loss, optim=self.optim, ppo_update_iters=self.ppo_update_iters, mini_batch_size=self.mini_batch_size,
            accumulation_steps=self.accumulation_steps, critic_warmup_steps=self.critic_warmup_steps,
            early_stop_kl=self.early_stop_kl, entropy_coef=self.entropy_coef, kl_placement=self.kl_placement,
            kl_estimator=self.kl_estimator, vf_coef=self.vf_coef, cliprange_value=self.cliprange_value,
            sample_temperature=self.sample_temperature, padding_free=self.padding_free,
            parallel_update=self.parallel_update, train_attn=self.train_attn, seed=self.seed)


# Every setting's name ("resolved" is state, not a setting).
SETTINGS = frozenset(f.name for f in fields(Config)) - {"resolved"}
