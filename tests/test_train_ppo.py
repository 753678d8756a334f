"""train_ppo.py: end-to-end runs on tiny local models (CPU, seconds each), and its update loop in-process
through the adapters in tests/helpers.py (values pinned by hand computations or against the plain path)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from model.weights import WeightsError
from tests.helpers import (
    ROOT,
    build_update_world,
    critic_values,
    lr_schedule,
    make_tiny_world,
    param_snapshot,
    phase_for,
    policy_logprobs,
    read_metrics,
    run_experience,
    run_main,
    run_train,
    run_update,
    tiny_flags,
)
from trainer.ppo import compute_gae, compute_token_rewards

FIXTURE = str(ROOT / "tests" / "fixtures" / "toy_rewards.py")


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("world")
    return make_tiny_world(tmp)


def test_smoke_three_steps_writes_weights_and_logs(world, tmp_path):
    flags = tiny_flags(world, tmp_path, save_dir=world["save_dir"], save_weight="smoke", swanlab_mode="offline",
                       sample_interval=1)
    run_train(flags, cwd=tmp_path)
    out = Path(world["save_dir"]) / f"smoke_{world['hidden']}.pth"
    state = torch.load(out, weights_only=True)
    assert state["model.embed_tokens.weight"].dtype == torch.float16  # MiniMind's format
    rows = read_metrics(tmp_path / "run")
    assert [row["step"] for row in rows] == [1, 2, 3]
    for key in ("reward/total", "reward/format", "reward/tags", "reward/rm", "reward/eos", "kl_ref", "ppo/approx_kl",
                "ppo/clipfrac", "ppo/entropy", "loss/policy", "loss/value", "value/explained_var", "response/length",
                "response/eos_rate", "lr/actor", "lr/critic", "tokens_per_s", "time/generate", "time/score", "time/update"):
        assert key in rows[-1], key
    run = json.loads((tmp_path / "run" / "run.json").read_text())
    assert run["args"]["max_steps"] == 3
    assert any((tmp_path / "swanlog").rglob("*")), "swanlab offline logs were not written"
    assert list((tmp_path / "ckpt").glob("smoke_*_resume_step*.pth"))


@pytest.mark.slow
def test_bad_flags_fail_with_one_line(world, tmp_path):
    r = run_train(tiny_flags(world, tmp_path, mini_batch_size=3), cwd=tmp_path, check=False)
    assert r.returncode != 0 and "--mini_batch_size 3 must divide" in r.stderr and "Traceback" not in r.stderr
    # A weights file named for --hidden_size 96 that holds the 64-wide model: a real shape mismatch.
    save96 = tmp_path / "out96"
    save96.mkdir()
    shutil.copy(Path(world["save_dir"]) / f"full_sft_{world['hidden']}.pth", save96 / "full_sft_96.pth")
    r = run_train(tiny_flags(world, tmp_path, hidden_size=96, save_dir=str(save96)), cwd=tmp_path, check=False)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith(f"error: {save96 / 'full_sft_96.pth'} does not fit the model"), lines[0]
    assert "wrongly shaped [lm_head.weight: file (6400, 64) vs model (6400, 96), " in lines[0]
    assert lines[0].endswith("check --hidden_size (or the vocabulary: --tokenizer_path must match the weights)")
    r = run_train(tiny_flags(world, tmp_path, data_path=str(tmp_path / "nope.jsonl")), cwd=tmp_path, check=False)
    assert "--data_path" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.slow
def test_nonfinite_reward_skips_steps_and_stops(world, tmp_path):
    flags = tiny_flags(world, tmp_path, reward_fn=[f"{FIXTURE}:always_nan"], max_steps=10, max_nonfinite=2,
                       save_weight="nan")
    before = torch.load(Path(world["save_dir"]) / f"full_sft_{world['hidden']}.pth", weights_only=True)
    r = run_train(flags, cwd=tmp_path, check=False)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "non-finite steps in a row" in r.stdout + r.stderr
    rows = read_metrics(tmp_path / "run")
    assert [row["nonfinite"] for row in rows] == [1.0, 1.0]
    # No optimizer step was taken: the saved resume (step 1) holds the starting weights.
    resume = sorted((tmp_path / "ckpt").glob("nan_*_resume_step*.pth"))[-1]
    actor = torch.load(resume, weights_only=True)["actor"]
    assert torch.equal(actor["model.layers.0.mlp.up_proj.weight"], before["model.layers.0.mlp.up_proj.weight"])


@pytest.mark.slow
def test_toy_reward_rises(world, tmp_path):
    """A reward a tiny random model can raise (share of low token ids) rises well beyond noise."""
    flags = tiny_flags(world, tmp_path, reward_fn=[f"{FIXTURE}:low_id_share"], rm_weight=0, format_weight=0,
                       tag_weight=0, accuracy_weight=0, eos_penalty=0, kl_coef=0.0, max_steps=40, batch_size=16,
                       mini_batch_size=8, learning_rate=1e-2, critic_learning_rate=3e-3, temperature=1.0,
                       max_gen_len=8, save_interval=100, sample_interval=0, epochs=20)
    run_train(flags, cwd=tmp_path, timeout=600)
    r = [row["reward/total"] for row in read_metrics(tmp_path / "run")]
    first, last = sum(r[:5]) / 5, sum(r[-5:]) / 5
    noise = torch.tensor(r[:5]).std().item()
    assert last > first + max(0.15, 4 * noise), (first, last, noise)


@pytest.mark.slow
def test_several_generations_per_prompt(world, tmp_path):
    """--num_generations N: each prompt is sampled N times in one batch and the spread is logged.
    2 prompts x 2 samples = 4 rows, all in samples.jsonl: group_std is recomputed from their rewards."""
    flags = tiny_flags(world, tmp_path, num_generations=2, batch_size=2, mini_batch_size=2, max_steps=2,
                       save_weight="grp", sample_interval=1, temperature=1.0, save_interval=100)
    run_train(flags, cwd=tmp_path)
    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2]
    samples = [json.loads(l) for l in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    for row in rows:
        step = [s for s in samples if s["step"] == row["step"]]
        assert len(step) == 4
        # Rows 2i and 2i+1 answer prompt i.
        assert step[0]["prompt"] == step[1]["prompt"] and step[2]["prompt"] == step[3]["prompt"]
        assert step[0]["prompt"] != step[2]["prompt"]
        rewards = torch.tensor([s["reward"] for s in step], dtype=torch.float32).view(2, 2)
        want = rewards.std(dim=1).mean().item()  # unbiased std within each prompt's group, mean over prompts
        assert want > 0  # temperature 1: the two samples of a prompt differ, and so do their RM scores
        assert row["reward/group_std"] == pytest.approx(want, rel=1e-5, abs=1e-7)


# =========================================================================================
# The update loop, in-process (through the adapters in tests/helpers.py): each flag's effect pinned
# by value, against a hand computation or against the plain path. A random 64x2 policy, 4 prompts,
# 8 new tokens, fp32, temperature 1 and a custom reward that differs between rows (low_id_share).

TOY = f"{FIXTURE}:low_id_share"
LR = 5e-5  # train_ppo's default actor LR


def _world(*flags: str, **kw):
    return build_update_world(["--reward_fn", TOY, "--temperature", "1.0", *flags], **kw)


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    m = mask.bool()
    return torch.where(m, x, torch.zeros((), dtype=x.dtype)).sum() / m.sum()


def _hand_actor_loss(world, ro, clip_eps: float = 0.2, kl_coef: float = 0.0, entropy_coef: float = 0.0) -> torch.Tensor:
    """The whole batch as one minibatch: token mean of max(-A r, -A clip(r, 1-eps, 1+eps)), r = pi / pi_old,
    + kl_coef x token mean of (log pi - log pi_ref) (k1), - entropy_coef x token mean of the entropy."""
    m = ro.response_mask.bool()
    logprobs, entropy = policy_logprobs(world, ro, with_entropy=entropy_coef > 0)
    ratio = torch.exp(torch.where(m, logprobs - ro.old_logprobs, 0.0))
    adv = ro.advantages
    loss = _masked_mean(torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - clip_eps, 1 + clip_eps)), m)
    if kl_coef:
        loss = loss + kl_coef * _masked_mean(logprobs - ro.ref_logprobs, m)
    if entropy_coef:
        loss = loss - entropy_coef * _masked_mean(entropy, m)
    return loss


def _hand_value_loss(world, ro, clip_range: float = 0.0) -> torch.Tensor:
    """0.5 x token mean of (V - R)^2 from a fresh critic forward, or of max((V - R)^2, (V_clip - R)^2)."""
    m = ro.response_mask.bool()
    v = critic_values(world, ro)
    err = (v - ro.returns) ** 2
    if clip_range:
        v_clip = ro.values + (v - ro.values).clamp(-clip_range, clip_range)
        err = torch.maximum(err, (v_clip - ro.returns) ** 2)
    return 0.5 * _masked_mean(err, m)


def _grad_norm(loss: torch.Tensor, module: torch.nn.Module) -> float:
    """Total L2 norm of d loss / d parameters, in fp32 as torch's clip_grad_norm_ computes it
    (autograd.grad: the module's .grad fields are left alone)."""
    params = [p for p in module.parameters() if p.requires_grad]
    grads = [g for g in torch.autograd.grad(loss, params, allow_unused=True) if g is not None]
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])).item()


def _max_change(before: dict, module: torch.nn.Module) -> float:
    return max((p.detach() - before[n]).abs().max().item() for n, p in module.named_parameters())


def _same(before: dict, module: torch.nn.Module) -> bool:
    return all(torch.equal(p.detach(), before[n]) for n, p in module.named_parameters())


def _one_step(*flags: str, step: int = 0, two_pass: bool = False):
    """A fresh world, its rollout, and one update at `step`: (world, rollout, stats, actor before, critic before).
    two_pass: score the critic's values in their own forward even with one epoch of one minibatch."""
    world = _world(*flags, *(("--reuse_values", "0") if two_pass else ()))
    ro, _ = run_experience(world)
    actor0, critic0 = param_snapshot(world.actor), param_snapshot(world.critic)
    stats = run_update(world, ro, step=step)
    return world, ro, stats, actor0, critic0


def _assert_same_params(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), name


def _differs(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return any(not torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def test_lr_schedule_warms_up_linearly_then_cosine_to_ten_percent():
    f = lr_schedule(4, 14)
    assert [f(s) for s in range(4)] == pytest.approx([1 / 5, 2 / 5, 3 / 5, 4 / 5], rel=1e-12)  # (s + 1) / (w + 1)
    assert f(4) == pytest.approx(1.0, rel=1e-12)  # the cosine starts at the peak
    assert f(9) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)), rel=1e-12)  # halfway: 0.55
    assert f(6) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * 0.2)), rel=1e-12)
    assert f(14) == pytest.approx(0.1, rel=1e-12) and f(30) == pytest.approx(0.1, rel=1e-12)  # floor: 10%
    g = lr_schedule(0, 10)
    assert g(0) == pytest.approx(1.0, rel=1e-12) and g(5) == pytest.approx(0.55, rel=1e-12)


def test_advantages_raw_gae_without_whitening_and_whitened_with_it():
    w0 = _world("--whiten_advantages", "0", "--kl_coef", "0.1")
    ro0, _ = run_experience(w0)
    m = ro0.response_mask
    kl = torch.where(m.bool(), ro0.old_logprobs - ro0.ref_logprobs, 0.0)  # k1, in the reward
    token_rewards = compute_token_rewards(ro0.rewards, kl, m, 0.1)
    adv, ret = compute_gae(token_rewards, ro0.values, m, gamma=1.0, lam=0.95)
    torch.testing.assert_close(ro0.advantages, adv, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(ro0.returns, ret, rtol=1e-6, atol=1e-7)
    raw_mean = _masked_mean(adv, m)
    raw_std = torch.sqrt(_masked_mean((adv - raw_mean) ** 2, m) * m.sum() / (m.sum() - 1))
    assert abs(raw_mean.item()) > 0.05 or abs(raw_std.item() - 1) > 0.05  # whitening has something to change

    w1 = _world("--whiten_advantages", "1", "--kl_coef", "0.1")
    ro1, _ = run_experience(w1)
    assert torch.equal(ro1.sequences, ro0.sequences)  # the same rollout: only the whitening differs
    torch.testing.assert_close(ro1.returns, ret, rtol=1e-6, atol=1e-7)  # returns are never whitened
    a1 = ro1.advantages
    mean1 = _masked_mean(a1, m)
    std1 = torch.sqrt(_masked_mean((a1 - mean1) ** 2, m) * m.sum() / (m.sum() - 1))  # unbiased
    assert abs(mean1.item()) < 1e-6 and std1.item() == pytest.approx(1.0, abs=1e-5)
    torch.testing.assert_close(a1, torch.where(m.bool(), (adv - raw_mean) / raw_std, 0.0), rtol=1e-5, atol=1e-6)


def test_kl_ref_metric_is_the_mean_over_rows_of_the_summed_token_kl():
    world = _world("--learning_rate", "3e-3")
    ro, _ = run_experience(world)
    run_update(world, ro, step=0)  # the actor leaves the reference, so the KL is far from 0
    ro, metrics = run_experience(world)
    per_row = ((ro.old_logprobs - ro.ref_logprobs) * ro.response_mask).sum(dim=1)
    assert abs(per_row.mean().item()) > 1e-3
    assert metrics["kl_ref"] == pytest.approx(per_row.mean().item(), rel=1e-5)
    # Not a per-token mean: responses here are longer than one token.
    assert ro.response_mask.sum(1).min() > 1


def test_grad_clip_reports_the_pre_clip_norm_computed_by_hand():
    """One minibatch: grad_norm/* is the total norm before clipping, whatever --grad_clip is; a tiny clip
    bounds the step (first AdamW step: |dtheta| = lr |g| / (|g| + 1e-8) <= lr x 1e-4 for |g| <= 1e-12)."""
    reported = {}
    for clip in ("1e9", "1e-12"):
        world = _world("--mini_batch_size", "4", "--grad_clip", clip)
        ro, _ = run_experience(world)
        hand_actor = _grad_norm(_hand_actor_loss(world, ro), world.actor)
        hand_critic = _grad_norm(0.5 * _hand_value_loss(world, ro, clip_range=0.2), world.critic)  # vf_coef 0.5
        actor0, critic0 = param_snapshot(world.actor), param_snapshot(world.critic)
        stats = run_update(world, ro, step=0)
        assert stats["grad_norm/actor"] == pytest.approx(hand_actor, rel=1e-5)
        assert stats["grad_norm/critic"] == pytest.approx(hand_critic, rel=1e-5)
        assert hand_actor > 1e-3 and hand_critic > 1e-3
        reported[clip] = (stats["grad_norm/actor"], stats["grad_norm/critic"])
        if clip == "1e-12":
            assert 0 < _max_change(actor0, world.actor) <= LR * 1e-4 * 1.01
            assert 0 < _max_change(critic0, world.critic) <= 1e-4 * 1e-4 * 1.01  # critic LR 1e-4
        else:
            assert _max_change(actor0, world.actor) > 0.5 * LR
    assert reported["1e9"] == reported["1e-12"]


@pytest.mark.slow
def test_kl_placement_loss_adds_the_kl_term_to_the_policy_loss():
    # In the loss, the KL is not in the reward: advantages are GAE of the bare scores.
    world = _world("--kl_placement", "loss", "--kl_coef", "0.5", "--whiten_advantages", "0", "--mini_batch_size", "4")
    ro, _ = run_experience(world)
    m = ro.response_mask
    adv, _ = compute_gae(compute_token_rewards(ro.rewards, None, m, 0.5), ro.values, m, 1.0, 0.95)
    torch.testing.assert_close(ro.advantages, adv, rtol=1e-6, atol=1e-7)
    with_kl = _grad_norm(_hand_actor_loss(world, ro, kl_coef=0.5), world.actor)
    without = _grad_norm(_hand_actor_loss(world, ro), world.actor)
    assert abs(with_kl - without) > 1e-2 * without  # the KL term matters for this check
    stats = run_update(world, ro, step=0)
    assert stats["grad_norm/actor"] == pytest.approx(with_kl, rel=1e-5)

    # kl_coef 0: both placements take exactly the same step; kl_coef 0.5: they do not.
    after = {}
    for coef in ("0", "0.5"):
        for place in ("reward", "loss"):
            w, _, _, _, _ = _one_step("--kl_placement", place, "--kl_coef", coef)
            after[coef, place] = w
    _assert_same_params(after["0", "reward"].actor, after["0", "loss"].actor)
    _assert_same_params(after["0", "reward"].critic, after["0", "loss"].critic)
    assert _differs(after["0.5", "reward"].actor, after["0.5", "loss"].actor)


@pytest.mark.slow
def test_entropy_bonus_is_in_the_actor_loss():
    """At random init the policy is near-uniform (entropy near its maximum, small entropy gradient), so a
    large coefficient makes the bonus visible; it then dominates the loss and raises the entropy."""
    world = _world("--entropy_coef", "100", "--mini_batch_size", "4")
    ro, _ = run_experience(world)
    hand = _grad_norm(_hand_actor_loss(world, ro, entropy_coef=100), world.actor)
    assert abs(hand - _grad_norm(_hand_actor_loss(world, ro), world.actor)) > 1e-2 * hand
    with torch.no_grad():
        ent_before = _masked_mean(policy_logprobs(world, ro, with_entropy=True)[1], ro.response_mask).item()
    stats = run_update(world, ro, step=0)
    assert stats["grad_norm/actor"] == pytest.approx(hand, rel=1e-5)
    with torch.no_grad():
        ent_after = _masked_mean(policy_logprobs(world, ro, with_entropy=True)[1], ro.response_mask).item()
    assert ent_after > ent_before

    w0, *_ = _one_step("--entropy_coef", "0")
    wa, *_ = _one_step("--entropy_coef", "0.3")
    wb, *_ = _one_step("--entropy_coef", "0.3")
    assert _differs(w0.actor, wa.actor)
    _assert_same_params(wa.actor, wb.actor)


def test_accumulation_steps_take_the_same_step_as_one_micro_batch():
    # Padded rows: each row's forward is the same in either split, so only the sums round differently (this and
    # the other tests that compare splits of one batch: micro-batches, ranks). Packed
    # (--padding_free 1), each split packs its rows otherwise, and Adam turns that rounding of a ~0 gradient into
    # +-LR; tests/test_padding_free.py holds packed and padded equal.
    w1, _, s1, actor0, critic0 = _one_step("--accumulation_steps", "1", "--padding_free", "0")
    w2, _, s2, _, _ = _one_step("--accumulation_steps", "2", "--padding_free", "0")
    assert _max_change(actor0, w1.actor) > 0.5 * LR and _max_change(critic0, w1.critic) > 0
    for (name, p), q in zip([*w1.actor.named_parameters(), *w1.critic.named_parameters()],
                            [*w2.actor.parameters(), *w2.critic.parameters()]):
        # Two AdamW steps of ~LR each; rounding differs only where a gradient is ~0 (Adam amplifies it there).
        torch.testing.assert_close(q, p, rtol=0, atol=LR * 1e-2, msg=name)
    assert s2["grad_norm/actor"] == pytest.approx(s1["grad_norm/actor"], rel=1e-6)
    assert s2["grad_norm/critic"] == pytest.approx(s1["grad_norm/critic"], rel=1e-6)
    # The logged losses are the minibatch's, whose gradient was taken, not a mean of the micro-batches' means.
    assert s2["loss/policy"] == pytest.approx(s1["loss/policy"], rel=1e-5, abs=1e-7)
    assert s2["loss/value"] == pytest.approx(s1["loss/value"], rel=1e-5, abs=1e-7)


def test_critic_warmup_freezes_the_actor_until_step_n(recwarn):
    world = _world("--critic_warmup_steps", "2")
    ro, _ = run_experience(world)
    for step in (0, 1):
        actor0, critic0 = param_snapshot(world.actor), param_snapshot(world.critic)
        stats = run_update(world, ro, step=step)
        # the actor's schedule counts the frozen steps too, without torch's warning about its unstepped optimizer
        assert not [w for w in recwarn if "lr_scheduler.step()" in str(w.message)]
        assert _same(actor0, world.actor), f"the actor moved at step {step} < --critic_warmup_steps"
        assert not _same(critic0, world.critic)
        assert "grad_norm/actor" not in stats and stats["grad_norm/critic"] > 0
    actor0 = param_snapshot(world.actor)
    stats = run_update(world, ro, step=2)
    assert not _same(actor0, world.actor) and stats["grad_norm/actor"] > 0


def test_vf_coef_scales_the_critic_gradient_and_zero_freezes_the_critic():
    w0, _, s0, actor0, critic0 = _one_step("--vf_coef", "0", "--mini_batch_size", "4")
    assert _same(critic0, w0.critic) and s0["grad_norm/critic"] == 0.0
    assert _max_change(actor0, w0.actor) > 0.5 * LR
    _, _, s_half, _, _ = _one_step("--vf_coef", "0.5", "--mini_batch_size", "4")
    w1, _, s_one, _, c1 = _one_step("--vf_coef", "1.0", "--mini_batch_size", "4")
    assert not _same(c1, w1.critic)
    assert s_one["loss/value"] == s_half["loss/value"] == s0["loss/value"]  # the loss is reported unscaled
    assert s_one["grad_norm/critic"] == pytest.approx(2 * s_half["grad_norm/critic"], rel=1e-6)
    assert s_half["grad_norm/critic"] > 0


@pytest.mark.parametrize("clip", ["0", "0.2"])
def test_value_loss_by_hand_unclipped_and_clipped(clip):
    """One minibatch, one epoch: loss/value is 0.5 x token mean of (V - R)^2 (clip 0) or of the max with
    the clipped error (clip 0.2), V from a fresh critic forward before the step. The first update starts
    at V = V_old (no clipping can happen), the second after a large critic step (it must)."""
    world = _world("--cliprange_value", clip, "--mini_batch_size", "4", "--critic_learning_rate", "0.01")
    ro, _ = run_experience(world)
    with torch.no_grad():
        first = _hand_value_loss(world, ro, clip_range=float(clip)).item()
    assert run_update(world, ro, step=0)["loss/value"] == pytest.approx(first, rel=1e-5)
    with torch.no_grad():
        unclipped = _hand_value_loss(world, ro).item()
        clipped = _hand_value_loss(world, ro, clip_range=0.2).item()
    assert clipped > unclipped * 1.1  # the critic moved beyond the clip range (1.8x with these flags)
    stats = run_update(world, dataclasses.replace(ro, values_with_grad=None), step=1)  # that graph is spent
    assert stats["loss/value"] == pytest.approx(unclipped if clip == "0" else clipped, rel=1e-5)
    assert (stats["value/clipfrac"] > 0) == (clip == "0.2")


def test_early_stop_kl_crossing_minibatch_does_not_step():
    """One minibatch per epoch: epoch 1 starts at the rollout policy (approx-KL ~0) and steps; epoch 2's
    approx-KL crosses the tiny limit, so it must not step: the weights are those after epoch 1 alone."""
    stopped, _, s_stop, _, _ = _one_step("--ppo_update_iters", "2", "--early_stop_kl", "1e-9", "--mini_batch_size", "4")
    # Two passes as the 2-epoch runs do (the reused values agree to rounding, not bit for bit: another row order).
    one, _, s_one, actor0, _ = _one_step("--ppo_update_iters", "1", "--mini_batch_size", "4", two_pass=True)
    two, *_ = _one_step("--ppo_update_iters", "2", "--mini_batch_size", "4")
    assert s_stop["ppo/early_stopped"] == 1.0 and s_one["ppo/early_stopped"] == 0.0
    _assert_same_params(stopped.actor, one.actor)
    _assert_same_params(stopped.critic, one.critic)
    assert not _same(actor0, one.actor)
    assert _differs(two.actor, one.actor)  # without the stop, epoch 2 would have stepped


def _huge_head_rm(out: Path) -> Path:
    """A tiny sequence-classifier RM (make_tiny_world's shape) whose score head is scaled by 1e4: its raw
    scores are in the hundreds or thousands, of either sign."""
    from transformers import Qwen3Config, Qwen3ForSequenceClassification

    from model.loader import load_tokenizer

    tok = load_tokenizer()
    torch.manual_seed(1)
    rm = Qwen3ForSequenceClassification(Qwen3Config(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, num_labels=1, pad_token_id=tok.pad_token_id, tie_word_embeddings=True))
    with torch.no_grad():
        rm.score.weight.mul_(1e4)
    rm.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def test_reward_model_scores_are_clipped_to_three(tmp_path):
    from model.loader import load_reward_model
    from trainer.reward_model import RewardModelScorer
    from trainer.rewards import compute_rewards

    path = _huge_head_rm(tmp_path / "rm")
    model, tok = load_reward_model(path)
    user = [{"role": "user", "content": "What is 2 + 3?"}]
    replies = ["<think>\nadd\n</think>\n<answer>\n5\n</answer>", "<think>\nhmm\n</think>\n<answer>\nseven\n</answer>",
               "no format at all", "<answer>\n12\n</answer>"]
    full = [user + [{"role": "assistant", "content": r}] for r in replies]
    answers = [user + [{"role": "assistant", "content": a}] for a in ("5", "seven", "no format at all", "12")]
    for sign in (-1, 1):  # the head as saved scores every conversation far below -3; negated, far above 3
        if sign == 1:
            with torch.no_grad():
                model.score.weight.neg_()
        raw = RewardModelScorer(model, tok, clip=float("inf")).score(full + answers)
        assert (sign * raw).min() > 3
        clipped = raw.clamp(-3, 3)
        torch.testing.assert_close(RewardModelScorer(model, tok).score(full + answers), clipped, rtol=0, atol=0)
        _, comps = compute_rewards(prompts=["q"] * 4, messages=[user] * 4, replies=replies, references=[None] * 4,
                                   has_eos=[True] * 4, weights={"rm": 1.0}, rm=RewardModelScorer(model, tok),
                                   reasoning=True, custom_fns={})
        torch.testing.assert_close(comps["rm"], 0.4 * clipped[:4] + 0.6 * clipped[4:])
        torch.testing.assert_close(comps["rm"], torch.full((4,), 3.0 * sign), rtol=0, atol=1e-6)

    # train_ppo's scorer clips too: with only the RM weighted, every reward is 0.4 x (+-3) + 0.6 x (+-3)
    # (the saved head scores in the negative hundreds; unclipped, the rewards would be too).
    world = build_update_world(["--reward_model_path", str(path), "--rm_weight", "1", "--format_weight", "0",
                                "--tag_weight", "0", "--accuracy_weight", "0", "--eos_penalty", "0", "--temperature", "1.0"])
    ro, metrics = run_experience(world)
    for r in ro.rewards.tolist():
        assert min(abs(r + 3.0), abs(r - 0.6), abs(r + 0.6), abs(r - 3.0)) < 1e-5, ro.rewards
    assert metrics["reward/rm"] == pytest.approx(ro.rewards.mean().item(), rel=1e-6)


@pytest.mark.slow  # 3 steps in a subprocess: ~11 s on 2 shared cores
def test_nonfinite_counter_resets_after_a_finite_step(world, tmp_path):
    """Steps 1 and 3 are non-finite, step 2 is finite: with --max_nonfinite 2 the run completes (a counter
    that did not reset at step 2 would stop it at step 3, as test_nonfinite_reward_skips_steps_and_stops
    shows for two in a row)."""
    flags = tiny_flags(world, tmp_path, reward_fn=[f"{FIXTURE}:nan_on_odd_steps"], max_steps=3, max_nonfinite=2,
                       save_weight="alt", rm_weight=0, sample_interval=0, save_interval=100)
    r = run_train(flags, cwd=tmp_path, check=False)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    rows = read_metrics(tmp_path / "run")
    assert [row["step"] for row in rows] == [1, 2, 3]
    assert [row["nonfinite"] for row in rows] == [1.0, 0.0, 1.0]
    assert json.loads((tmp_path / "run" / "run.json").read_text())["status"] == "finished"


@pytest.mark.slow  # 2 steps + plots in a subprocess: ~11 s on 2 shared cores
def test_finished_run_marks_run_json_and_writes_plots(world, tmp_path):
    flags = tiny_flags(world, tmp_path, max_steps=2, warmup_steps=2, save_weight="fin", sample_interval=0,
                       learning_rate=1e-3, critic_learning_rate=2e-3, save_interval=100)
    run_train(flags, cwd=tmp_path)
    run = json.loads((tmp_path / "run" / "run.json").read_text())
    assert run["status"] == "finished" and run["end_time"] >= run["start_time"]
    plots = tmp_path / "run" / "plots"
    names = {p.name for p in plots.glob("*.png")}
    assert {"overview.png", "reward.png", "kl.png", "value.png", "response.png", "lr.png"} <= names, names
    for name in names:
        assert (plots / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    # The LR logged at step s is the one the NEXT update uses: warm-up (s+1)/(w+1), then cosine to 10%.
    f = lr_schedule(2, 2)
    rows = read_metrics(tmp_path / "run")
    assert [row["lr/actor"] for row in rows] == pytest.approx([1e-3 * f(1), 1e-3 * f(2)], rel=1e-9)
    assert [row["lr/critic"] for row in rows] == pytest.approx([2e-3 * f(1), 2e-3 * f(2)], rel=1e-9)
    assert [f(1), f(2)] == pytest.approx([2 / 3, 1.0])


def _with_remote_code(src: Path, dst: Path, marker: Path, model_type: str | None = None) -> Path:
    """A copy of the HF directory `src` whose config.json maps the Auto classes to a local remote.py that,
    when imported, writes `marker`; `model_type` replaces the config's (an unknown one leaves transformers
    no stock class to fall back on)."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["auto_map"] = {"AutoConfig": "remote.RemoteConfig", "AutoModel": "remote.RemoteModel",
                       "AutoModelForCausalLM": "remote.RemoteModel",
                       "AutoModelForSequenceClassification": "remote.RemoteModel"}
    if model_type:
        cfg["model_type"] = model_type
    (dst / "config.json").write_text(json.dumps(cfg))
    (dst / "remote.py").write_text(f"from pathlib import Path\n\nPath({str(marker)!r}).write_text('remote code ran')\n")
    return dst


@pytest.fixture
def remote_marker(tmp_path, monkeypatch) -> Path:
    """The file remote.py writes when imported; transformers' module cache of any subprocess goes to tmp."""
    monkeypatch.setenv("HF_MODULES_CACHE", str(tmp_path / "hf_modules"))
    return tmp_path / "REMOTE_CODE_RAN"


@pytest.mark.slow
def test_remote_code_runs_only_with_trust_remote_code(world, tmp_path, remote_marker):
    from model.loader import load_policy, load_reward_model
    from tests.tiny_hf import save_tiny_causal_lm

    marker = remote_marker
    evil_rm = _with_remote_code(Path(world["rm"]), tmp_path / "evil_rm", marker, model_type="minippo_evil")
    # The marker works: with trust, transformers imports remote.py (and then fails to find the class).
    probe = subprocess.run([sys.executable, "-c", "import sys; from model.loader import load_reward_model\n"
                            "try: load_reward_model(sys.argv[1], trust_remote_code=True)\nexcept Exception: pass",
                            str(evil_rm)], cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1"),
                           capture_output=True, text=True, timeout=120)
    assert marker.exists(), probe.stderr[-2000:]
    marker.unlink()
    # Without it: no stock class for the model type is a one-line error naming the flag ...
    with pytest.raises(WeightsError, match="not a sequence-classification model.*add --trust_remote_code 1"):
        load_reward_model(evil_rm)
    # ... and a stock model type with an auto_map loads the stock class.
    rm, _ = load_reward_model(_with_remote_code(Path(world["rm"]), tmp_path / "rm_map", marker))
    assert type(rm).__name__ == "Qwen3ForSequenceClassification"
    save_tiny_causal_lm(tmp_path / "llama", "llama")
    actor, _ = load_policy(hf_path=_with_remote_code(tmp_path / "llama", tmp_path / "llama_map", marker))
    assert type(actor).__name__ == "LlamaForCausalLM"
    assert not marker.exists()


@pytest.mark.slow
def test_train_ppo_refuses_a_remote_code_reward_model_in_one_line(world, tmp_path, remote_marker):
    """The same remote-code RM as above (whose remote.py demonstrably runs when trusted) through train_ppo
    without --trust_remote_code: one line, exit != 0, remote.py never imported."""
    evil_rm = _with_remote_code(Path(world["rm"]), tmp_path / "evil_rm", remote_marker, model_type="minippo_evil")
    r = run_train(tiny_flags(world, tmp_path, reward_model_path=str(evil_rm)), cwd=tmp_path, check=False)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    last = r.stderr.strip()
    assert last.startswith(f"error: --reward_model_path {evil_rm}: not a sequence-classification model"), r.stderr
    assert last.endswith("add --trust_remote_code 1")
    assert not remote_marker.exists()


# ------------------------------------------------------------------ bad input: one line, at start-up

def _validate(world, tmp_path, **over) -> str | None:
    """validate_flags on flags parsed as train_ppo.py parses them: the SystemExit message, or None."""
    from train_ppo import parse_args
    from trainer.run.cli import validate as validate_flags

    try:
        validate_flags(parse_args(tiny_flags(world, tmp_path, **over)))
    except SystemExit as e:
        return str(e)
    return None


@pytest.mark.parametrize("flag, value, message", [
    ("learning_rate", "nan", "error: --learning_rate nan must be a finite number > 0"),
    ("learning_rate", "inf", "error: --learning_rate inf must be a finite number > 0"),
    ("learning_rate", "0", "error: --learning_rate 0.0 must be a finite number > 0"),
    ("critic_learning_rate", "-0.0001", "error: --critic_learning_rate -0.0001 must be a finite number > 0"),
    ("critic_learning_rate", "nan", "error: --critic_learning_rate nan must be a finite number > 0"),
    ("grad_clip", "inf", "error: --grad_clip inf must be a finite number > 0"),
    ("grad_clip", "nan", "error: --grad_clip nan must be a finite number > 0"),
    ("clip_epsilon", "0", "error: --clip_epsilon 0.0 must be a finite number > 0"),
    ("clip_epsilon", "nan", "error: --clip_epsilon nan must be a finite number > 0"),
    ("kl_coef", "nan", "error: --kl_coef nan must be a finite number >= 0"),
    ("kl_coef", "inf", "error: --kl_coef inf must be a finite number >= 0"),
    ("kl_coef", "-0.1", "error: --kl_coef -0.1 must be a finite number >= 0"),
    ("device", "tpu", "error: --device tpu: expected one of auto, cpu, cuda, cuda:N"),
    ("device", "cuda:x", "error: --device cuda:x: expected one of auto, cpu, cuda, cuda:N"),
    ("device", "CPU", "error: --device CPU: expected one of auto, cpu, cuda, cuda:N"),
])
def test_bad_numbers_and_device_are_one_line_at_start_up(world, tmp_path, flag, value, message):
    assert _validate(world, tmp_path, **{flag: value}) == message


@pytest.mark.parametrize("over", [dict(kl_coef=0), dict(device="cuda:1"), dict(device="cuda"), dict(device="auto"),
                                  dict(learning_rate=1e-6, critic_learning_rate=3, grad_clip=0.5, clip_epsilon=0.1)])
def test_good_numbers_and_devices_pass_validation(world, tmp_path, over):
    assert _validate(world, tmp_path, **over) is None


@pytest.mark.parametrize("flag", ["checkpoint_dir", "save_dir", "run_dir"])
def test_output_dir_that_is_a_file_is_one_line_at_start_up(world, tmp_path, flag):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    over = {flag: str(blocker)}
    if flag == "save_dir":  # --from_weight none: nothing is read from --save_dir, only written there
        over["from_weight"] = "none"
    assert _validate(world, tmp_path, **over) == (
        f"error: --{flag} {blocker}: is a file, not a directory; give a directory path (created if missing)")
    # A file in the way further up the path.
    assert _validate(world, tmp_path, **{**over, flag: str(blocker / "sub")}) == (
        f"error: --{flag} {blocker / 'sub'}: {blocker} is a file, not a directory; give a directory path (created if missing)")


def test_default_run_dir_under_a_file_named_runs(world, tmp_path, monkeypatch):
    """No --run_dir means runs/<save_weight>_<hidden>: a file called runs in the working directory blocks it."""
    from train_ppo import parse_args
    from trainer.run.cli import validate as validate_flags

    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").write_text("x")
    flags = tiny_flags(world, tmp_path)
    i = flags.index("--run_dir")
    del flags[i:i + 2]
    with pytest.raises(SystemExit, match=r"^error: --run_dir \(default runs/\.\.\.\): is a file"):
        validate_flags(parse_args(flags))


@pytest.mark.slow
def test_checkpoint_dir_file_fails_before_any_work(world, tmp_path):
    """Found at start-up: before, the run trained a step and then crashed at its first save."""
    (tmp_path / "ckpt").write_text("not a directory")
    r = run_train(tiny_flags(world, tmp_path), cwd=tmp_path, check=False)
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert f"error: --checkpoint_dir {tmp_path / 'ckpt'}: is a file, not a directory" in r.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.slow
def test_unknown_device_end_to_end_is_one_line(world, tmp_path):
    r = run_train(tiny_flags(world, tmp_path, device="tpu"), cwd=tmp_path, check=False)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "--device tpu: expected one of auto, cpu, cuda, cuda:N" in r.stderr


@pytest.mark.slow
def test_reward_model_bin_with_pickled_code_end_to_end(world, tmp_path):
    """A reward model whose pytorch_model.bin would run code: one line naming the file; the code never runs."""
    import shutil

    from safetensors.torch import load_file

    rm = tmp_path / "rm"
    shutil.copytree(world["rm"], rm)
    state = load_file(rm / "model.safetensors")
    (rm / "model.safetensors").unlink()
    marker = tmp_path / "payload_ran"

    class RunsCode:
        def __reduce__(self):
            return (exec, (f"open({str(marker)!r}, 'w').close()",))

    torch.save({**state, "payload": RunsCode()}, rm / "pytorch_model.bin")
    r = run_train(tiny_flags(world, tmp_path, reward_model_path=str(rm)), cwd=tmp_path, check=False)
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr[-3000:]
    lines = [line for line in r.stderr.splitlines() if "pickled code" in line]
    assert len(lines) == 1 and lines[0].startswith(f"error: --reward_model_path {rm}: refused {rm / 'pytorch_model.bin'}")
    assert not marker.exists()


# ------------------------------------------------------------------ a custom reward function that fails

BAD_REWARDS = '''
def boom(prompt, reply, reference):
    return 1 / 0


def quits(prompt, reply, reference):
    raise SystemExit(0)
'''


@pytest.fixture(scope="module")
def boom_run(world, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("boom")
    (tmp / "bad_rewards.py").write_text(BAD_REWARDS)
    return run_train(tiny_flags(world, tmp, reward_fn=[f"{tmp / 'bad_rewards.py'}:boom"], max_steps=1), cwd=tmp,
                     check=False)


@pytest.mark.slow
def test_raising_reward_fn_names_function_exception_and_prompt(boom_run):
    r = boom_run
    assert r.returncode != 0
    line = next(line for line in r.stderr.splitlines() if "--reward_fn boom raised" in line)
    assert "ZeroDivisionError: division by zero on row 0 (prompt: '<|im_start|>" in line


def test_raising_reward_fn_is_one_line_without_traceback(boom_run):
    assert "Traceback" not in boom_run.stderr
    assert [line for line in boom_run.stderr.splitlines() if "--reward_fn boom" in line][0].startswith("error: ")


@pytest.mark.slow
def test_reward_fn_calling_exit_zero_fails_the_run(world, tmp_path):
    """SystemExit(0) inside a reward function must not end training looking like a success."""
    (tmp_path / "bad_rewards.py").write_text(BAD_REWARDS)
    r = run_train(tiny_flags(world, tmp_path, reward_fn=[f"{tmp_path / 'bad_rewards.py'}:quits"], max_steps=1),
                  cwd=tmp_path, check=False)
    assert r.returncode != 0
    assert "--reward_fn quits raised SystemExit: 0 on row 0" in r.stderr


# ------------------------------------------------------------------ critic-free estimators and the DAPO knobs
CRITIC_FREE = ("grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline")


@pytest.mark.slow
@pytest.mark.parametrize("est", CRITIC_FREE)
def test_critic_free_estimator_builds_no_critic_and_updates_the_actor(est):
    world, ro, stats, actor0, _ = _critic_free_step(est)
    assert world.models.critic is None and world.models.critic_train is None
    assert list(world.optim.optims) == ["actor"] and list(world.optim.scheds) == ["actor"]
    assert _max_change(actor0, world.actor) > 0.5 * LR
    assert ro.values is None and not any(k.startswith(("loss/value", "value/", "grad_norm/critic")) for k in stats)


def _critic_free_step(est: str, *flags: str):
    world = _world("--advantage_estimator", est, "--num_generations", "4", "--batch_size", "2", "--mini_batch_size", "4", *flags)
    ro, _ = run_experience(world)
    actor0 = param_snapshot(world.actor)
    stats = run_update(world, ro)
    return world, ro, stats, actor0, None


@pytest.mark.parametrize("est", ["grpo", "dr_grpo", "rloo"])
def test_group_estimators_give_every_token_its_responses_baselined_score(est):
    """KL in the loss (grpo/dr_grpo's default) or no KL: each response's advantage is its score minus
    the group's baseline, equal on every one of its tokens (trainer/estimators.py, tested by hand)."""
    import trainer.estimators as E

    world, ro, _, _, _ = _critic_free_step(est, "--kl_coef", "0")
    baseline = {"grpo": E.group_normalised, "dr_grpo": E.group_centred, "rloo": E.leave_one_out}[est]
    want = baseline(ro.rewards, 4)
    m = ro.response_mask.bool()
    for i in range(ro.rewards.shape[0]):
        assert torch.allclose(ro.advantages[i][m[i]], want[i].expand(int(m[i].sum())), atol=1e-6), i
    assert ro.rewards.view(-1, 4).std(1).gt(0).any(), "every group equal: the check would prove nothing"


def test_reinforce_pp_returns_are_whitened_over_the_batch():
    world, ro, _, _, _ = _critic_free_step("reinforce_pp")
    m = ro.response_mask.bool()
    assert ro.advantages[m].mean().item() == pytest.approx(0.0, abs=1e-5)
    assert ro.advantages[m].std().item() == pytest.approx(1.0, rel=1e-4)


def test_kl_auto_rules_follow_each_papers_choice():
    for est, place, kl in (("gae", "reward", "k1"), ("grpo", "loss", "k3"), ("dr_grpo", "loss", "k3"),
                           ("rloo", "reward", "k1"), ("reinforce_pp", "reward", "k1")):
        cfg = _world("--advantage_estimator", est, "--num_generations", "2", "--mini_batch_size", "4").cfg
        assert (cfg.kl_placement, cfg.kl_estimator) == (place, kl), est
        assert (cfg.flat()["kl_placement"], cfg.flat()["kl_estimator"]) == (place, kl)  # what resume files record


def _ragged(ro, lengths=(3, 5, 8, 2)):
    """Cut the responses to different lengths (masked after), as EOS would: per-sequence and per-token
    aggregation then differ (a random policy never samples EOS in 8 tokens)."""
    P = ro.prompt_len
    for i, n in enumerate(lengths):
        ro.response_mask[i, n:] = 0
        ro.attention_mask[i, P + n:] = 0
    return ro


def _ragged_step(*flags: str):
    world = _world(*flags)
    ro = _ragged(run_experience(world)[0])
    actor0 = param_snapshot(world.actor)
    return world, ro, run_update(world, ro), actor0


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"])
def test_per_sequence_loss_modes_take_the_same_step_in_micro_batches(mode):
    """Row-normalised losses are scaled by each micro-batch's share of rows, so --accumulation_steps 2
    gives the step of one micro-batch (as token_mean's token shares do), and the mode changes the step."""
    flags = ("--loss_agg_mode", mode, "--mini_batch_size", "4", "--padding_free", "0")  # why: the test above
    w1, _, s1, actor0 = _ragged_step(*flags, "--accumulation_steps", "1")
    w2, _, s2, _ = _ragged_step(*flags, "--accumulation_steps", "2")
    assert s2["grad_norm/actor"] == pytest.approx(s1["grad_norm/actor"], rel=1e-5)
    for (name, p), q in zip(w1.actor.named_parameters(), w2.actor.parameters()):
        torch.testing.assert_close(q, p, rtol=0, atol=LR * 1e-2, msg=name)
    _, _, s3, _ = _ragged_step("--mini_batch_size", "4")
    assert s3["grad_norm/actor"] != pytest.approx(s1["grad_norm/actor"], rel=1e-3)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_a_row_masked_whole_is_no_response_of_the_per_sequence_step(mode):
    """--mask_truncated 1 masks a response whole: it is no row of the per-response mean (verl's agg_loss) nor of
    the update's row count, so loss/policy is the mean over the 3 rows with a token, and --accumulation_steps 2
    (the masked row in one micro-batch, whose share is then 1 of 3 rows, not 2 of 4) takes the same step."""
    def step(accumulation: str):
        world = _world("--loss_agg_mode", mode, "--mini_batch_size", "4", "--accumulation_steps", accumulation,
                       "--padding_free", "0")  # padded rows: as test_accumulation_steps_take_the_same_step_as_one_micro_batch
        ro = _ragged(run_experience(world)[0])
        ro.response_mask[1] = 0  # what --mask_truncated 1 does to a response cut without EOS
        logprobs, _ = policy_logprobs(world, ro)
        return world, ro, logprobs, run_update(world, ro)

    w1, ro, logprobs, s1 = step("1")
    m = ro.response_mask.bool()
    ratio = torch.exp(torch.where(m, logprobs - ro.old_logprobs, 0.0))
    tok = torch.maximum(-ro.advantages * ratio, -ro.advantages * ratio.clamp(0.8, 1.2))
    rows = [tok[i][m[i]] for i in (0, 2, 3)]  # row 1 has no token
    hand = {"seq_mean_token_mean": sum(r.mean() for r in rows) / 3, "seq_mean_token_sum_norm": sum(r.sum() for r in rows) / 3 / 8}[mode]
    assert s1["loss/policy"] == pytest.approx(hand.item(), rel=1e-5, abs=1e-7)
    w2, _, _, s2 = step("2")
    assert s2["grad_norm/actor"] == pytest.approx(s1["grad_norm/actor"], rel=1e-5)
    assert s2["loss/policy"] == pytest.approx(hand.item(), rel=1e-5, abs=1e-7)  # the minibatch's loss, not a micro-batch's
    for (name, p), q in zip(w1.actor.named_parameters(), w2.actor.parameters()):
        torch.testing.assert_close(q, p, rtol=0, atol=LR * 1e-2, msg=name)


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"])
def test_policy_loss_aggregation_by_hand(mode):
    """token_mean (PPO, DAPO): over all tokens; seq_mean_token_mean (GRPO): each response's token mean, then
    the mean over responses; seq_mean_token_sum: token sums' mean; _norm (Dr. GRPO): that / --max_gen_len."""
    world = _world("--loss_agg_mode", mode, "--mini_batch_size", "4")
    ro = _ragged(run_experience(world)[0])
    m = ro.response_mask.bool()
    logprobs, _ = policy_logprobs(world, ro)
    ratio = torch.exp(torch.where(m, logprobs - ro.old_logprobs, 0.0))
    tok = torch.maximum(-ro.advantages * ratio, -ro.advantages * ratio.clamp(0.8, 1.2))
    rows = [tok[i][m[i]] for i in range(len(m))]
    hand = {"token_mean": torch.cat(rows).mean(), "seq_mean_token_mean": torch.stack([r.mean() for r in rows]).mean(),
            "seq_mean_token_sum": torch.stack([r.sum() for r in rows]).mean(),
            "seq_mean_token_sum_norm": torch.stack([r.sum() for r in rows]).mean() / 8}[mode]
    assert run_update(world, ro)["loss/policy"] == pytest.approx(hand.item(), rel=1e-5, abs=1e-7)


def test_one_minibatch_reuses_the_scoring_values_and_equals_two_passes():
    """One epoch of one minibatch (MiniMind's shape): the critic's scoring forward is kept with its graph and
    the update does not run a second one; values, losses and the updated weights equal the two-pass path."""
    flags = ("--mini_batch_size", "4", "--ppo_update_iters", "1")
    one = _world(*flags)
    assert one.cfg.reuse_values
    _random_value_head(one)
    ro1, _ = run_experience(one)
    assert ro1.values_with_grad is not None and ro1.values_with_grad.requires_grad
    s1 = run_update(one, ro1)
    two = _world(*flags, "--reuse_values", "0")
    _random_value_head(two)
    ro2, _ = run_experience(two)
    assert ro2.values_with_grad is None
    s2 = run_update(two, ro2)
    torch.testing.assert_close(ro1.values, ro2.values, rtol=0, atol=1e-6)
    assert s1["loss/value"] == pytest.approx(s2["loss/value"], rel=1e-5)
    assert s1["grad_norm/critic"] == pytest.approx(s2["grad_norm/critic"], rel=1e-5)
    _assert_close_params(one.critic, two.critic)
    _assert_close_params(one.actor, two.actor)
    assert not _world("--mini_batch_size", "2").cfg.reuse_values  # two minibatches: two passes
    assert not _world(*flags, "--ppo_update_iters", "2").cfg.reuse_values


def _random_value_head(world) -> None:
    with torch.no_grad():  # the zero init would make every value 0 and the comparison trivial
        world.critic.value_head.weight.normal_(generator=torch.Generator().manual_seed(5))


def _assert_close_params(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(q, p, rtol=0, atol=LR * 1e-2, msg=name)


@pytest.mark.parametrize("over, message", [
    (dict(advantage_estimator="grpo"), "error: --advantage_estimator grpo compares the --num_generations responses to each prompt"),
    (dict(advantage_estimator="rloo", num_generations=1), "--num_generations >= 2"),
    (dict(filter_groups=1), "error: --filter_groups 1 drops groups"),
    (dict(advantage_estimator="reinforce_pp", critic_warmup_steps=2),
     "error: --critic_warmup_steps trains the critic, but --advantage_estimator reinforce_pp has none"),
    (dict(overlong_buffer_len=8), "error: --overlong_buffer_len 8 must be in [0, --max_gen_len 8)"),
    (dict(clip_epsilon_high="nan"), "error: --clip_epsilon_high nan must be a finite number > 0"),
    (dict(eval_data_path="nope.jsonl"), "error: --eval_data_path nope.jsonl: file not found"),
])
def test_bad_estimator_combinations_are_one_line(world, tmp_path, over, message):
    assert message in (_validate(world, tmp_path, **over) or "")


def test_reinforce_pp_alone_needs_no_groups(world, tmp_path):
    assert _validate(world, tmp_path, advantage_estimator="reinforce_pp") is None


def test_critic_flags_with_a_critic_free_estimator_warn_once(capsys):
    from train_ppo import parse_args

    parse_args(["--advantage_estimator", "grpo", "--vf_coef", "0.3", "--lam", "0.9"])
    err = capsys.readouterr().err
    assert err.strip() == "warning: --advantage_estimator grpo builds no critic: --vf_coef, --lam are ignored"
    parse_args(["--advantage_estimator", "grpo"])
    parse_args(["--vf_coef", "0.3"])
    assert capsys.readouterr().err == ""


@pytest.fixture(scope="module")
def grpo_run(world, tmp_path_factory):
    """3 steps of grpo with every DAPO knob on: dynamic sampling, clip-higher, overlong penalty, token sums,
    and evaluation every 2 steps on a held-out file."""
    tmp = tmp_path_factory.mktemp("grpo")
    held_out = tmp / "held_out.jsonl"
    held_out.write_text("".join((ROOT / "dataset" / "demo_eval.jsonl").read_text(encoding="utf-8").splitlines(True)[:6]))
    flags = tiny_flags(world, tmp, advantage_estimator="grpo", num_generations=2, batch_size=2, mini_batch_size=2,
                       filter_groups=1, clip_epsilon_high=0.28, overlong_buffer_len=4, loss_agg_mode="seq_mean_token_sum",
                       eval_data_path=str(held_out), eval_interval=2, eval_samples=4, temperature=1.2, save_weight="grpo")
    r = run_train(flags, cwd=tmp)
    return {"tmp": tmp, "r": r}


@pytest.mark.slow
def test_critic_free_run_saves_no_critic_and_logs_no_critic_metrics(grpo_run):
    tmp = grpo_run["tmp"]
    rows = read_metrics(tmp / "run")
    steps = [r for r in rows if "reward/total" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert not any(k.startswith(("loss/value", "value/", "lr/critic", "grad_norm/critic")) for r in steps for k in r)
    state = torch.load(sorted((tmp / "ckpt").glob("grpo_*_resume_step*.pth"))[-1], weights_only=True)
    assert state["critic"] is None and list(state["optim"]) == ["actor"]
    assert state["args"]["advantage_estimator"] == "grpo" and state["args"]["clip_epsilon_high"] == 0.28


def test_overlong_penalty_is_its_own_reward_component(grpo_run):
    steps = [r for r in read_metrics(grpo_run["tmp"] / "run") if "reward/total" in r]
    assert all(-1.0 <= r["reward/overlong"] <= 0.0 for r in steps)


def test_filter_groups_logs_its_work_and_the_position_counts_every_batch_drawn(grpo_run):
    tmp = grpo_run["tmp"]
    steps = [r for r in read_metrics(tmp / "run") if "reward/total" in r]
    extra = [r["filter/extra_rollouts"] for r in steps]
    assert all(0 <= e <= 4 for e in extra) and all("filter/groups_dropped" in r for r in steps)
    state = torch.load(sorted((tmp / "ckpt").glob("grpo_*_resume_step*.pth"))[-1], weights_only=True)
    assert state["consumed"] == 2 * (3 + sum(extra))  # 2 prompts per batch drawn, extra ones included


@pytest.mark.slow
def test_filter_groups_ending_where_the_data_runs_out_saves_evaluates_and_says_so(world, tmp_path):
    """Every reward 0 (no group has signal), so each step draws 1 + --filter_max_rounds batches of a
    16-prompt file: the data runs out at step 3 of the planned 8, before --save_interval and
    --eval_interval. The run still saves its last step, evaluates it and logs its true step count."""
    lines = Path(world["data"]).read_text(encoding="utf-8").splitlines(True)
    data, held_out = tmp_path / "short.jsonl", tmp_path / "held_out.jsonl"
    data.write_text("".join(lines[:16]))
    held_out.write_text("".join((ROOT / "dataset" / "demo_eval.jsonl").read_text(encoding="utf-8").splitlines(True)[:2]))
    flags = tiny_flags(world, tmp_path, advantage_estimator="grpo", num_generations=2, batch_size=2, mini_batch_size=2,
                       filter_groups=1, filter_max_rounds=2, data_path=str(data), max_steps=0, save_interval=100,
                       eval_data_path=str(held_out), eval_interval=100, eval_samples=2, save_weight="short",
                       format_weight=0, tag_weight=0, rm_weight=0, accuracy_weight=0, eos_penalty=0, ifeval_weight=0)
    r = run_train(flags, cwd=tmp_path)
    done = next(l for l in r.stdout.splitlines() + r.stderr.splitlines() if "done: " in l)
    assert "done: 3 steps (the prompt data ran out before the planned 8" in done, done
    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows if "reward/total" in r] == [1, 2, 3]
    assert [r["step"] for r in rows if "eval/accuracy" in r] == [0, 3]  # the start, and where it ended
    state = torch.load(tmp_path / "ckpt" / "short_64_resume_step00000003.pth", weights_only=True)
    assert (state["step"], state["epoch"], state["consumed"]) == (3, 1, 0)  # every prompt drawn
    assert (tmp_path / "out" / "short_64.pth").is_file()


def test_evaluation_runs_before_the_first_step_every_interval_and_at_the_end(grpo_run):
    rows = read_metrics(grpo_run["tmp"] / "run")
    evals = [r for r in rows if "eval/accuracy" in r]
    assert [r["step"] for r in evals] == [0, 2, 3]
    for r in evals:
        assert 0 <= r["eval/format_rate"] <= 1 and r["eval/response_length"] >= 1 and "eval/reward/rm" in r
    from trainer.run.plots import collect_series, figure_specs

    specs = {stem: [k for k, _ in panels] for stem, _, panels in figure_specs(collect_series(rows).keys())}
    assert "eval/accuracy" in specs["eval"] and not any(k.startswith("eval/") for k in specs["reward"])


# ------------------------------------------------------------------ the policy losses, ReMax, --mask_truncated
@pytest.mark.slow
@pytest.mark.parametrize("loss", ["dual_clip", "cispo", "gspo", "gmpo", "clip_cov", "kl_cov", "sapo"])
def test_every_policy_loss_trains_the_actor_through_the_update(loss):
    world, ro, stats, actor0, _ = _critic_free_step("grpo", "--policy_loss", loss, "--clip_cov_lb", "-1", "--ppo_update_iters", "2")
    assert _max_change(actor0, world.actor) > 0.1 * LR
    assert math.isfinite(stats["loss/policy"]) and "ppo/clipfrac" in stats and "ppo/ratio" in stats
    extra = {"dual_clip": "ppo/clipfrac_lower", "gspo": "ppo/seq_ratio", "gmpo": "ppo/seq_ratio", "clip_cov": "ppo/cov_frac",
             "kl_cov": "ppo/cov_frac", "sapo": "ppo/gate"}
    if loss in extra:
        assert math.isfinite(stats[extra[loss]])


def test_cispo_pairs_with_gae_too():
    world = _world("--policy_loss", "cispo")
    ro, metrics = run_experience(world)
    actor0 = param_snapshot(world.actor)
    stats = run_update(world, ro)
    assert _max_change(actor0, world.actor) > 0.1 * LR and "loss/value" in stats and "ppo/entropy" in metrics


def test_remax_baselines_each_response_by_the_greedy_replys_reward():
    world = _world("--advantage_estimator", "remax", "--num_generations", "2", "--batch_size", "2", "--mini_batch_size", "4",
                   "--kl_coef", "0")
    import train_ppo as T

    exp = T.make_experience(world.cfg, world.batch, world.models, world.runtime, 0.0, world.built.custom_fns, phase_for(world))
    ro = exp.rollout
    # The greedy replies, sampled and rewarded on their own: A = r - r(greedy) on every real token.
    greedy = T.greedy_baseline(world.cfg, T.Sampled(ro, world.batch, [], {}), world.models, world.runtime,
                               world.built.custom_fns, phase_for(world))
    assert greedy.shape == ro.rewards.shape and torch.equal(greedy[0::2], greedy[1::2])
    assert exp.metrics["reward/greedy_baseline"] == pytest.approx(greedy.mean().item())
    m = ro.response_mask.bool()
    for i in range(4):
        assert torch.allclose(ro.advantages[i][m[i]], (ro.rewards[i] - greedy[i]).expand(int(m[i].sum())))


def test_mask_truncated_leaves_responses_without_eos_out_of_the_update():
    """A random policy never emits EOS within 8 tokens: with --mask_truncated 1 every response is cut, so nothing
    trains; without it the same step moves the actor."""
    moved = {}
    for flag in ("0", "1"):
        world = _world("--advantage_estimator", "grpo", "--num_generations", "2", "--batch_size", "2", "--mini_batch_size", "4",
                       "--mask_truncated", flag)
        ro, _ = run_experience(world)
        assert not ro.has_eos.any(), "a response ended: the test would prove little"
        assert ro.response_mask.sum().item() == (0 if flag == "1" else ro.response_mask.numel())
        actor0 = param_snapshot(world.actor)
        run_update(world, ro)
        moved[flag] = _max_change(actor0, world.actor)
    assert moved["1"] == 0 and moved["0"] > 0.1 * LR


def test_eos_placement_advantage_takes_the_penalty_out_of_what_grpo_normalises():
    """--eos_placement advantage: the rewards leave the EOS penalty out, and each advantage gains the penalty x its
    group-centred cut indicator, unscaled: a group whose replies differ only in where they stop gets +-0.075, where
    the penalty inside GRPO's normalised reward makes the same 0.15 difference +-0.87."""
    import train_ppo as T
    from trainer.estimators import group_normalised

    flags = ("--advantage_estimator", "grpo", "--num_generations", "4", "--batch_size", "4", "--mini_batch_size", "16",
             "--eos_penalty", "0.15", "--kl_coef", "0")
    in_reward = _world(*flags)
    ro_r, _ = run_experience(in_reward)
    beside = _world(*flags, "--eos_placement", "advantage")
    ro_a, metrics = run_experience(beside)
    assert torch.equal(ro_a.sequences, ro_r.sequences) and not ro_a.has_eos.any(), "the test needs the same cut rollout"
    torch.testing.assert_close(ro_a.rewards, ro_r.rewards + 0.15)  # every reply was cut: the reward no longer pays -0.15
    assert metrics["reward/eos"] == -1.0  # still logged

    task = torch.tensor([0.5, 0.5, 0.5, 0.5, 0.0, 1.0, 0.0, 1.0] * 2)  # groups 1 and 3 differ only in where replies stop
    has_eos = torch.tensor([True, False, True, False, True, True, False, False] * 2)
    m = ro_a.response_mask
    adv, _ = T.compute_advantages(beside.cfg, dataclasses.replace(ro_a, rewards=task, has_eos=has_eos), 0.0, beside.runtime)
    guard = torch.tensor([0.075, -0.075, 0.075, -0.075, 0.075, 0.075, -0.075, -0.075] * 2)
    want = group_normalised(task, 4, beside.cfg.adv_eps, bool(beside.cfg.adv_std_unbiased)) + guard
    torch.testing.assert_close(adv, want[:, None] * m)
    penalised = task - 0.15 * (~has_eos).float()  # the default placement: the penalty is in the reward GRPO normalises
    adv_r, _ = T.compute_advantages(in_reward.cfg, dataclasses.replace(ro_r, rewards=penalised, has_eos=has_eos), 0.0,
                                    in_reward.runtime)
    assert adv_r[0, 0].item() == pytest.approx(0.866, abs=1e-3) and adv[0, 0].item() == pytest.approx(0.075)


def test_reward_norm_and_clip_shape_the_scores_the_estimator_sees():
    world = _world("--advantage_estimator", "reinforce_pp", "--reward_norm", "batch", "--reward_clip", "0.5", "--kl_coef", "0")
    import train_ppo as T
    from trainer.ppo import RewardNormalizer

    exp = T.make_experience(world.cfg, world.batch, world.models, world.runtime, 0.0, world.built.custom_fns, phase_for(world),
                            reward_norm=RewardNormalizer("batch", 0.5))
    r = exp.rollout.rewards
    want = ((r - r.mean()) / math.sqrt(r.var().item() + 1e-8)).clamp(-0.5, 0.5)
    scores, _, stats = T.shape_scores(world.cfg, r, None, RewardNormalizer("batch", 0.5), world.runtime)
    assert torch.allclose(scores, want, atol=1e-6) and r.std() > 0
    assert stats["reward_norm/mean"] == pytest.approx(r.mean().item()) and "reward_norm/std" in exp.metrics


def test_a_huge_finite_reward_is_clipped_counted_and_cannot_fix_the_running_std():
    """A reward function that answers 1e30 once: the total is clipped to --reward_max_abs before any normalisation and
    counted (reward/out_of_range); the running moments stay those of the ordinary rewards, so later steps still learn."""
    world = _world("--reward_fn", f"{FIXTURE}:huge_on_first_row", "--reward_norm", "running", "--reward_max_abs", "100")
    import train_ppo as T
    from trainer.ppo import RewardNormalizer

    norm = RewardNormalizer("running")
    for _ in range(2):  # the first batch sets the moments; the second must not be swamped
        exp = T.make_experience(world.cfg, world.batch, world.models, world.runtime, 0.0, world.built.custom_fns,
                                phase_for(world), reward_norm=norm)
        if _ == 0:
            assert exp.rollout.rewards.abs().max().item() == 100  # 1e30 clipped
            assert exp.metrics["reward/out_of_range"] == pytest.approx(1 / exp.rollout.rewards.numel())
    assert exp.metrics["reward/out_of_range"] == 0
    # The clipped row entered the moments winsorised near the others (median + 10): the std is not the clip's (~35).
    assert math.sqrt(norm.m2 / (norm.count - 1)) < 5
    scores, _, _ = T.shape_scores(world.cfg, exp.rollout.rewards, None, norm, world.runtime)
    assert scores.unique().numel() == scores.numel()  # later rewards still tell rows apart (1e30 made them equal in fp32)


def test_a_minimind_grpo_command_line_runs_end_to_end(world, tmp_path):
    """MiniMind's train_grpo.py flags, as its users type them (bare --use_wandb included), train and save under
    MiniMind's GRPO name."""
    flags = tiny_flags(world, tmp_path, max_steps=2, batch_size=2, num_generations=2, mini_batch_size=4, loss_type="cispo",
                       beta=0.05, epsilon_high=4.0, reward_fn=[TOY], rm_weight=0)
    code, out = run_main([*flags, "--use_wandb", "--swanlab_mode", "disabled"])
    assert code is None, out[-3000:]
    assert (tmp_path / "out" / "grpo_64.pth").is_file()
    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2] and all(math.isfinite(r["loss/policy"]) for r in rows)
    run = json.loads((tmp_path / "run" / "run.json").read_text())
    got = {k: run["args"][k] for k in ("policy_loss", "advantage_estimator", "kl_coef", "kl_placement", "cispo_max_weight")}
    assert got == {"policy_loss": "cispo", "advantage_estimator": "grpo", "kl_coef": 0.05, "kl_placement": "loss",
                   "cispo_max_weight": 4.0}


@pytest.mark.parametrize("flag", ["0", "1"])
def test_cuda_graphs_flag_reaches_the_sampler(flag, monkeypatch):
    """--cuda_graphs is read once into the config and handed to model.generation.sample with the other decode
    settings (on a CPU it changes nothing: tests/test_generation.py::test_cpu_sampling_keeps_its_decode_loop)."""
    import trainer.rollout as R
    from trainer.run.rollout_source import TakingTurns

    world = _world("--cuda_graphs", flag)
    seen = {}
    real = R.sample

    def spy(*args, **kwargs):
        seen.update(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(R, "sample", spy)
    TakingTurns(world.cfg, world.models, world.runtime).sample(world.batch)
    assert seen["cuda_graphs"] is (flag == "1") and seen["fast_decode"] is True
