"""Each component's own config section (verl's `PolicyLossConfig`, `OptimConfig`, `RolloutConfig`, an `ActorConfig`
that nests the loss and optimizer sections): small frozen dataclasses that hold what one component reads, so a loss, an
estimator or an optimizer is handed its settings and not the whole run's.

The command line stays flat (MiniMind's flags, trainer/config.py's groups): `Config` builds each section from its flat
fields (`cfg.loss`, `cfg.estimator`, `cfg.optim`, `cfg.sampling`, `cfg.update`). A section's fields carry the flags'
own names and types, so `--clip_epsilon` is `cfg.loss.clip_epsilon` and a reader greps one name; the one exception is
the component's name (`--policy_loss`, `--advantage_estimator`), which is the section's `name`.

A leaf module: trainer/losses.py and trainer/estimators.py annotate with it while trainer/config.py imports their
registry, so it imports nothing from the project.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Flag = Literal[0, 1]


@dataclass(frozen=True)
class PolicyLossConfig:
    """What a registered policy loss reads (trainer/losses.py)."""

    name: str  # --policy_loss
    clip_epsilon: float
    clip_epsilon_high: float  # resolved: --clip_epsilon where the flag is not given (the symmetric clip)
    clip_ratio_c: float  # dual_clip
    cispo_max_weight: float  # cispo
    gspo_clip_low: float  # gspo
    gspo_clip_high: float
    gmpo_clip: float  # gmpo
    clip_cov_ratio: float  # clip_cov
    clip_cov_lb: float
    clip_cov_ub: float
    kl_cov_ratio: float  # kl_cov
    kl_cov_coef: float
    sapo_tau_pos: float  # sapo
    sapo_tau_neg: float
    loss_agg_mode: str  # resolved by trainer/run/cli.py resolve (auto = the loss's own)
    max_gen_len: int  # seq_mean_token_sum_norm's constant divisor (Dr. GRPO)


@dataclass(frozen=True)
class EstimatorConfig:
    """What a registered advantage estimator reads (trainer/estimators.py), and the whitening its caller applies."""

    name: str  # --advantage_estimator
    gamma: float
    lam: float  # gae
    num_generations: int  # the group size G of the group estimators
    adv_eps: float  # grpo, grpo_passk
    adv_std_unbiased: Flag  # grpo, grpo_passk
    whiten_advantages: Flag  # gae (the spec's whiten "flag")


@dataclass(frozen=True)
class OptimConfig:
    """What builds and steps the actor's and critic's optimizers (trainer/run/setup.py build_optim, trainer/update.py):
    AdamW (torch's betas and eps), linear warm-up then cosine to 10% of the peak, each model's gradient norm clipped."""

    learning_rate: float  # the actor's peak
    critic_learning_rate: float  # the critic's peak
    weight_decay: float
    warmup_steps: int
    grad_clip: float


@dataclass(frozen=True)
class SamplingConfig:
    """What sampling a rollout reads (the policy's own sampler or a rollout engine; --tools episodes)."""

    num_generations: int
    max_gen_len: int
    temperature: float
    top_k: int
    top_p: float
    greedy: Flag
    suppress_eos: Flag
    fast_decode: Flag
    cuda_graphs: Flag
    rollout_logprobs: Flag
    max_turns: int  # --tools episodes
    max_total_len: int

    @property
    def sample_temperature(self) -> float:
        """The distribution log-probs are taken under (1.0 under --greedy)."""
        return 1.0 if self.greedy else self.temperature


@dataclass(frozen=True)
class UpdateConfig:
    """What the PPO update reads (trainer/update.py; verl's ActorConfig and CriticConfig): the epochs and minibatches, the
    loss terms beside the policy loss, and the two sections it nests."""

    loss: PolicyLossConfig
    optim: OptimConfig
    ppo_update_iters: int
    mini_batch_size: int  # resolved: rows per optimizer step
    accumulation_steps: int
    critic_warmup_steps: int
    early_stop_kl: float
    entropy_coef: float
    kl_placement: str  # resolved: reward or loss
    kl_estimator: str  # resolved: k1, k2 or k3
    vf_coef: float
    cliprange_value: float
    sample_temperature: float  # the distribution the update's log-probs are taken under (the sampling's)
    padding_free: Flag
    parallel_update: int  # resolved: 0 or 1
    train_attn: str | None  # the update's attention kernel, None = the model's own
    seed: int  # with the step and rank, seeds the minibatch shuffle
