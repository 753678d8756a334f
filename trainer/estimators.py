"""Advantage estimators, each registered by name with its metadata (trainer/registry.py).

Every estimator maps the rollout's outcome scores [B] (one per response, on its last token), the
per-token KL penalty [B, R] when the KL is in the reward (None when it is in the loss), the critic's
values [B, R] (GAE only) and the response mask to (advantages, returns) [B, R], before whitening: the
caller whitens over every rank's tokens as the spec's `whiten` says.

References
- GAE: Schulman et al. 2016, "High-Dimensional Continuous Control Using Generalized Advantage Estimation",
  eq. (16), on per-token rewards with the KL penalty of Ziegler et al. 2019, sec. 2.2.
- GRPO: Shao et al. 2024, "DeepSeekMath", sec. 4.1.2: A_i = (r_i - mean(r)) / std(r).
- Dr. GRPO: Liu et al. 2025, "Understanding R1-Zero-Like Training", sec. 3.1: A_i = r_i - mean(r).
- RLOO: Ahmadian et al. 2024, "Back to Basics", eq. (5): A_i = r_i - 1/(G-1) sum_{j != i} r_j.
- REINFORCE++: Hu 2025, sec. 3: per-token KL in the reward, the discounted return as the advantage,
  normalised over the whole global batch ("_baseline": the group mean subtracted from r_i first).
The group ones see the G = --num_generations responses to a prompt as rows i*G .. i*G+G-1 (never split
across ranks, so they need no collective).
"""

from __future__ import annotations

from torch import Tensor

from trainer.ppo import compute_gae, compute_token_rewards, discounted_returns
from trainer.registry import register_estimator


def _groups(scores: Tensor, group_size: int) -> Tensor:
    """[B] -> [B/G, G] fp32, refusing batches that are not whole groups of >= 2."""
    if group_size < 2 or scores.shape[0] % group_size:
        raise ValueError(f"group estimators need groups of >= 2 responses (got {scores.shape[0]} scores in groups of {group_size})")
    return scores.float().view(-1, group_size)


def group_centred(scores: Tensor, group_size: int) -> Tensor:
    """r_i - mean of its group (Dr. GRPO; REINFORCE++-baseline's first step)."""
    g = _groups(scores, group_size)
    return (g - g.mean(dim=1, keepdim=True)).reshape(-1)


def group_normalised(scores: Tensor, group_size: int, eps: float = 1e-6) -> Tensor:
    """(r_i - mean) / (std + eps), std unbiased as in the GRPO implementations (TRL, verl)."""
    g = _groups(scores, group_size)
    return ((g - g.mean(dim=1, keepdim=True)) / (g.std(dim=1, keepdim=True) + eps)).reshape(-1)


def leave_one_out(scores: Tensor, group_size: int) -> Tensor:
    """r_i - mean of the others = G/(G-1) (r_i - mean)."""
    g = _groups(scores, group_size)
    return ((g - g.mean(dim=1, keepdim=True)) * (group_size / (group_size - 1))).reshape(-1)


def outcome_returns(shaped: Tensor, kl: Tensor | None, response_mask: Tensor, kl_coef: float, gamma: float) -> tuple[Tensor, Tensor]:
    """The return-to-go of the per-token rewards (the baselined score on the last token, the KL penalty on
    every token when it is in the reward) as the advantage; equal on every token when the KL is in the loss.
    No critic learns from the returns (logged only): they are the same tensor."""
    advantages = discounted_returns(compute_token_rewards(shaped, kl, response_mask, kl_coef), response_mask, gamma)
    return advantages, advantages


@register_estimator("gae", needs_critic=True, needs_groups=False, whiten="flag", kl_placement="reward", kl_estimator="k1",
                    paper="Schulman et al. 2016 (GAE), with Ziegler et al. 2019's per-token KL reward")
def gae(scores: Tensor, kl: Tensor | None, values: Tensor, response_mask: Tensor, kl_coef: float, cfg) -> tuple[Tensor, Tensor]:
    token_rewards = compute_token_rewards(scores, kl, response_mask, kl_coef)
    return compute_gae(token_rewards, values, response_mask, cfg.gamma, cfg.lam)


@register_estimator("grpo", needs_critic=False, needs_groups=True, whiten="none", kl_placement="loss", kl_estimator="k3",
                    paper="Shao et al. 2024, DeepSeekMath, sec. 4.1.2")
def grpo(scores, kl, values, response_mask, kl_coef, cfg):
    return outcome_returns(group_normalised(scores, cfg.num_generations), kl, response_mask, kl_coef, cfg.gamma)


@register_estimator("dr_grpo", needs_critic=False, needs_groups=True, whiten="none", kl_placement="loss", kl_estimator="k3",
                    paper="Liu et al. 2025, Understanding R1-Zero-Like Training, sec. 3.1")
def dr_grpo(scores, kl, values, response_mask, kl_coef, cfg):
    return outcome_returns(group_centred(scores, cfg.num_generations), kl, response_mask, kl_coef, cfg.gamma)


@register_estimator("rloo", needs_critic=False, needs_groups=True, whiten="none", kl_placement="reward", kl_estimator="k1",
                    paper="Ahmadian et al. 2024, Back to Basics, eq. (5)")
def rloo(scores, kl, values, response_mask, kl_coef, cfg):
    return outcome_returns(leave_one_out(scores, cfg.num_generations), kl, response_mask, kl_coef, cfg.gamma)


@register_estimator("reinforce_pp", needs_critic=False, needs_groups=False, whiten="global", kl_placement="reward",
                    kl_estimator="k1", paper="Hu 2025, REINFORCE++, sec. 3")
def reinforce_pp(scores, kl, values, response_mask, kl_coef, cfg):
    return outcome_returns(scores.float(), kl, response_mask, kl_coef, cfg.gamma)


@register_estimator("reinforce_pp_baseline", needs_critic=False, needs_groups=True, whiten="global", kl_placement="reward",
                    kl_estimator="k1", paper="Hu 2025, REINFORCE++ (group-mean baseline variant)")
def reinforce_pp_baseline(scores, kl, values, response_mask, kl_coef, cfg):
    return outcome_returns(group_centred(scores, cfg.num_generations), kl, response_mask, kl_coef, cfg.gamma)
