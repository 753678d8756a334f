"""CriticModel: an independent copy of the policy trunk plus a zero-initialised value head."""

from __future__ import annotations

import pytest
import torch

from model.critic import CriticModel, trunk_of
from model.loader import build_minimind


@pytest.fixture()
def policy():
    torch.manual_seed(0)
    return build_minimind(64, 2, vocab_size=256)


def _ids(b: int = 2, t: int = 7) -> torch.Tensor:
    return torch.randint(3, 256, (b, t), generator=torch.Generator().manual_seed(1))


def test_trunk_is_a_copy_sharing_nothing(policy):
    critic = CriticModel.from_policy(policy)
    policy_sd = policy.model.state_dict()
    critic_sd = critic.trunk.state_dict()
    assert critic_sd.keys() == policy_sd.keys()
    assert all(torch.equal(v, policy_sd[k]) for k, v in critic_sd.items())  # same values
    policy_ptrs = {p.data_ptr() for p in policy.parameters()}
    assert not any(p.data_ptr() in policy_ptrs for p in critic.parameters())  # no shared storage

    before = {k: v.clone() for k, v in policy.state_dict().items()}
    with torch.no_grad():
        for p in critic.parameters():
            p.add_(1.0)
    assert all(torch.equal(v, before[k]) for k, v in policy.state_dict().items())


def test_trunk_hidden_states_equal_policy(policy):
    critic = CriticModel.from_policy(policy).eval()
    policy.eval()
    ids = _ids()
    with torch.no_grad():
        want = policy.model(input_ids=ids).last_hidden_state
        got = critic.trunk(input_ids=ids).last_hidden_state
    assert torch.equal(got, want)


def test_initial_values_are_exactly_zero_fp32(policy):
    critic = CriticModel.from_policy(policy)
    ids = _ids(3, 5)
    values = critic(ids, attention_mask=torch.ones_like(ids))
    assert values.shape == (3, 5) and values.dtype == torch.float32
    assert torch.equal(values, torch.zeros(3, 5))


def test_values_fp32_from_bf16_trunk(policy):
    critic = CriticModel.from_policy(policy.to(torch.bfloat16))
    assert next(critic.trunk.parameters()).dtype == torch.bfloat16
    with torch.no_grad():
        critic.value_head.weight.normal_()
    values = critic(_ids())
    assert values.shape == (2, 7) and values.dtype == torch.float32


def test_values_to_keep_slices_last_positions(policy):
    critic = CriticModel.from_policy(policy).eval()
    with torch.no_grad():
        critic.value_head.weight.normal_(generator=torch.Generator().manual_seed(2))
        critic.value_head.bias.fill_(0.5)
    ids = _ids(2, 9)
    with torch.no_grad():
        full = critic(ids)
        last4 = critic(ids, values_to_keep=4)
    assert last4.shape == (2, 4)
    assert torch.allclose(last4, full[:, -4:], atol=1e-6)
    assert not torch.allclose(full, torch.full_like(full, 0.5))  # the head now depends on the tokens


def test_values_follow_position_ids_for_left_padding(policy):
    critic = CriticModel.from_policy(policy).eval()
    with torch.no_grad():
        critic.value_head.weight.normal_(generator=torch.Generator().manual_seed(3))
    seq = _ids(1, 5)
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), seq], 1)
    mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1]])
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        alone = critic(seq)
        got = critic(padded, attention_mask=mask, position_ids=pos)[:, 3:]
    assert torch.allclose(got, alone, atol=1e-5)


def test_gradients_reach_value_head(policy):
    critic = CriticModel.from_policy(policy)
    ids = _ids()
    returns = torch.randn(2, 7, generator=torch.Generator().manual_seed(4))
    loss = ((critic(ids) - returns) ** 2).mean()
    loss.backward()
    assert critic.value_head.weight.grad is not None and critic.value_head.weight.grad.abs().sum() > 0
    # d loss / d bias = mean(2 * (0 - returns)) at the zero init.
    assert torch.allclose(critic.value_head.bias.grad, (-2 * returns).mean().reshape(1), atol=1e-6)
    assert all(p.grad is None for p in policy.parameters())  # the policy is not in the graph

    # After one optimiser step on the head, the trunk gets gradient too.
    torch.optim.SGD(critic.parameters(), lr=0.1).step()
    critic.zero_grad()
    ((critic(ids) - returns) ** 2).mean().backward()
    assert critic.trunk.layers[0].self_attn.q_proj.weight.grad.abs().sum() > 0


def test_trunk_of_rejects_a_model_without_trunk():
    with pytest.raises(ValueError, match="cannot find the trunk"):
        trunk_of(torch.nn.Linear(2, 2))


def test_trunk_of_unwraps_module_attribute(policy):
    class Wrapper(torch.nn.Module):  # the shape of DDP: the real model under `.module`
        def __init__(self, m):
            super().__init__()
            self.module = m

    assert trunk_of(Wrapper(policy)) is policy.model
