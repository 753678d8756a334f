"""Policy losses, each registered by name with its metadata (trainer/registry.py). A loss maps the
update's log-probs, the sampling policy's old_logprobs, the advantages and the response mask (all
[B, R]) and the run's config to (loss, stats): stats are 0-d tensors (clipfrac, approx_kl, ratio).
"""

from __future__ import annotations

from torch import Tensor

from trainer.ppo import policy_loss
from trainer.registry import register_policy_loss


@register_policy_loss("vanilla", paper="Schulman et al. 2017, PPO, eq. (7); clip-higher: Yu et al. 2025, DAPO, sec. 3.1")
def vanilla(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, response_mask: Tensor, cfg) -> tuple[Tensor, dict]:
    """PPO's clipped surrogate, ratio clipped to [1 - --clip_epsilon, 1 + --clip_epsilon_high]."""
    return policy_loss(logprobs, old_logprobs, advantages, response_mask, cfg.clip_epsilon, cfg.clip_epsilon_high,
                       cfg.loss_agg_mode, cfg.max_gen_len)
