"""The critic: the policy's trunk plus a per-token scalar value head.

Value head initialisation: weight and bias start at ZERO, so the first values are exactly 0
and the first advantages are the plain rewards-to-go rather than rewards minus random noise
from an untrained head. The trunk starts as a copy of the policy's trunk, so its features
already understand the text; the zero head still receives gradients on the first step (the
gradient w.r.t. the head is the trunk's features, which are non-zero), after which the trunk
starts to adapt too. `--critic_warmup_steps` lets the critic fit before the actor moves.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn


def trunk_of(policy: nn.Module) -> nn.Module:
    """The decoder stack (embeddings + layers + final norm) of a causal LM, without its LM head."""
    policy = getattr(policy, "module", policy)
    trunk = getattr(policy, getattr(policy, "base_model_prefix", "model"), None)
    if trunk is None or trunk is policy:
        prefix = getattr(policy, "base_model_prefix", "model")
        raise ValueError(f"cannot find the trunk of {type(policy).__name__} (no `{prefix}` attribute)")
    return trunk


class CriticModel(nn.Module):
    """values[b, t] = value_head(trunk(input_ids)[b, t]); one scalar per token, in fp32."""

    def __init__(self, trunk: nn.Module, hidden_size: int) -> None:
        super().__init__()
        self.trunk = trunk
        self.value_head = nn.Linear(hidden_size, 1)
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)

    @classmethod
    def from_policy(cls, policy: nn.Module) -> "CriticModel":
        """A critic whose trunk is a deep copy of the policy's (shares no tensor with it)."""
        trunk = copy.deepcopy(trunk_of(policy))
        hidden = getattr(trunk.config, "hidden_size")
        critic = cls(trunk, hidden)
        return critic.to(next(trunk.parameters()).device)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        values_to_keep: int = 0,
        **kwargs: Any,
    ) -> torch.Tensor:
        # kwargs reach the trunk's attention (a packed batch's shared_layout: model/shared_attention.py)
        hidden = self.trunk(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False, **kwargs
        ).last_hidden_state  # [B, T, H]
        if values_to_keep > 0:
            hidden = hidden[:, -values_to_keep:, :]
        # The head runs in fp32: values feed GAE, where bf16 rounding would bias advantages.
        with torch.autocast(device_type=hidden.device.type, enabled=False):
            return self.value_head(hidden.float()).squeeze(-1)  # [B, T']
