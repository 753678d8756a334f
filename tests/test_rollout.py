"""model/forward.py and trainer/rollout.py: the optimised log-prob / value paths equal the plain ones, padding invariance,
num_generations layout; plus a smoke run of benchmarks/bench_ppo.py."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from model.critic import CriticModel
from model.forward import (
    attention_implementation,
    critic_forward,
    forward_in_row_chunks,
    policy_forward,
    position_ids_from_mask,
)
from model.generation import filter_logits, kept_logprobs, sample, sample_from_logits
from model.loader import build_minimind
from model.logprobs import logprobs_from_logits
from tests.helpers import scramble
from trainer.rollout import cat_rollouts, generate_rollout, group_has_signal

ROOT = Path(__file__).resolve().parents[1]
PAD, EOS, V = 0, 2, 256


@pytest.fixture(scope="module")
def lm():
    return scramble(build_minimind(64, 2, vocab_size=V), seed=0).eval()


@pytest.fixture(scope="module")
def critic(lm):
    c = CriticModel.from_policy(lm).eval()
    with torch.no_grad():  # a non-zero head: the zero init would make every comparison trivial
        c.value_head.weight.normal_(generator=torch.Generator().manual_seed(5))
        c.value_head.bias.fill_(0.3)
    return c


def _batch(prompts: list[list[int]], response: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Left-padded prompts + a full-length response block: sequences [B, P+R], mask, P."""
    P = max(map(len, prompts))
    ids = torch.full((len(prompts), P), PAD, dtype=torch.long)
    mask = torch.zeros((len(prompts), P), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, P - len(p):] = torch.tensor(p)
        mask[i, P - len(p):] = 1
    return torch.cat([ids, response], 1), torch.cat([mask, torch.ones_like(response)], 1), P


PROMPTS = [[17, 45, 99], [5, 6, 7, 8, 9, 10, 11], [200, 13, 13, 4, 180]]
RESPONSE = torch.tensor([[30, 31, 32, 33, 34], [40, 41, 42, 43, 44], [50, 51, 52, 53, 54]])


def _plain_logprobs(lm, seq, mask, R, T):
    """Reference: full [B, P+R, V] logits, fp32 log_softmax(logits / T), gather, then slice."""
    logits = lm(input_ids=seq, attention_mask=mask, position_ids=position_ids_from_mask(mask)).logits.float()
    logp = F.log_softmax(logits / T, dim=-1)[:, :-1]  # position t predicts token t+1
    lp = logp.gather(-1, seq[:, 1:].unsqueeze(-1)).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    return lp[:, -R:], ent[:, -R:]


# ------------------------------------------------------------------ logprobs_from_logits


def test_logprobs_from_logits_hand_computed():
    # softmax([0, ln 3]) = [1/4, 3/4]; at T=2 the logits halve: p1 = sqrt(3) / (1 + sqrt(3)).
    logits = torch.tensor([[[0.0, math.log(3.0)], [0.0, math.log(3.0)]]])  # [1, 2, 2]
    tokens = torch.tensor([[1, 0]])
    lp, ent = logprobs_from_logits(logits, tokens, temperature=1.0, with_entropy=True)
    assert torch.allclose(lp, torch.tensor([[math.log(0.75), math.log(0.25)]]), atol=1e-6)
    h = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    assert torch.allclose(ent, torch.tensor([[h, h]]), atol=1e-6)
    lp2, _ = logprobs_from_logits(logits, tokens, temperature=2.0)
    s = math.sqrt(3.0)
    assert torch.allclose(lp2, torch.tensor([[math.log(s / (1 + s)), math.log(1 / (1 + s))]]), atol=1e-6)


def test_logprobs_from_logits_chunking_invariant():
    g = torch.Generator().manual_seed(0)
    logits = 3 * torch.randn(7, 5, 50, generator=g)
    tokens = torch.randint(0, 50, (7, 5), generator=g)
    want_lp, want_ent = logprobs_from_logits(logits, tokens, 0.7, chunk_rows=7, with_entropy=True)
    for chunk in (1, 2, 3, 8, 100):
        lp, ent = logprobs_from_logits(logits, tokens, 0.7, chunk_rows=chunk, with_entropy=True)
        assert torch.equal(lp, want_lp) and torch.equal(ent, want_ent), chunk
    assert lp.dtype == torch.float32 and lp.shape == (7, 5)
    # bf16 logits are upcast before the softmax: same result as upcasting by hand.
    lp16, _ = logprobs_from_logits(logits.bfloat16(), tokens, 0.7, chunk_rows=3)
    ref16, _ = logprobs_from_logits(logits.bfloat16().float(), tokens, 0.7)
    assert lp16.dtype == torch.float32 and torch.equal(lp16, ref16)


def _reference_logprobs(logits, tokens, T, chunk_rows, with_entropy):
    """The no-grad path's formula under autograd (what the update ran before _TokenLogprobs)."""
    from model.generation import token_logprobs

    parts = [token_logprobs(logits[s : s + chunk_rows], tokens[s : s + chunk_rows], T, with_entropy)
             for s in range(0, logits.shape[0], chunk_rows)]
    return torch.cat([p[0] for p in parts]), (torch.cat([p[1] for p in parts]) if with_entropy else None)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [1.0, 0.7])
@pytest.mark.parametrize("loss_of", ["lp", "lp+ent", "ent"])
def test_logprobs_grad_path_equals_autograd_of_the_plain_formula(dtype, T, loss_of):
    """With grad, logprobs_from_logits recomputes the softmax in backward: forward values are the
    no-grad path's bit for bit; the log-prob gradient is autograd's bit for bit too (the CPU fp32 demo
    must train exactly as before), the entropy's equal to rounding."""
    g = torch.Generator().manual_seed(0)
    base = (3 * torch.randn(5, 7, 40, generator=g)).to(dtype)  # [B, R+1, V]: policy_forward's slice below
    tokens = torch.randint(0, 40, (5, 6), generator=g)
    w_lp, w_ent = torch.randn(5, 6, generator=g), torch.randn(5, 6, generator=g)
    with_ent = loss_of != "lp"
    grads, values = [], []
    for fn in (logprobs_from_logits, _reference_logprobs):
        leaf = base.clone().requires_grad_(True)
        lp, ent = fn(leaf[:, :-1], tokens, T, 2, with_ent)  # chunks of 2 rows, last one shorter
        loss = (lp * w_lp).sum() if "lp" in loss_of else 0
        loss = loss + ((ent * w_ent).sum() if with_ent else 0)
        loss.backward()
        grads.append(leaf.grad)
        values.append((lp.detach(), ent.detach() if with_ent else None))
    with torch.no_grad():
        nograd_lp, nograd_ent = logprobs_from_logits(base[:, :-1], tokens, T, 2, with_ent)
    assert torch.equal(values[0][0], nograd_lp) and torch.equal(values[0][0], values[1][0])
    if with_ent:
        assert torch.equal(values[0][1], nograd_ent) and torch.equal(values[0][1], values[1][1])
    got, want = grads
    assert got.dtype == dtype and got.shape == base.shape and got[:, -1].eq(0).all()
    assert want.abs().max() > 0.1
    if loss_of == "lp":
        assert torch.equal(got, want)
    elif dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    else:  # both round an fp32 gradient to bf16; an ulp apart at most
        torch.testing.assert_close(got.float(), want.float(), atol=1e-6, rtol=2 ** -7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logprobs_grad_path_exact_at_the_demo_vocabulary(dtype):
    """At MiniMind's vocabulary (6400) and the default 8-row chunks, as the update runs it: the
    grad path's per-row values equal the no-grad chunks' and its gradient autograd's, bit for bit."""
    g = torch.Generator().manual_seed(3)
    base = (4 * torch.randn(11, 34, 6400, generator=g)).to(dtype)
    tokens = torch.randint(0, 6400, (11, 33), generator=g)
    w = torch.randn(11, 33, generator=g)
    with torch.no_grad():
        want_lp, _ = logprobs_from_logits(base[:, :-1], tokens, 0.8)
    grads = []
    for fn in (logprobs_from_logits, _reference_logprobs):
        leaf = base.clone().requires_grad_(True)
        lp, _ = fn(leaf[:, :-1], tokens, 0.8, 8, False)
        assert torch.equal(lp.detach(), want_lp)
        (lp * w).sum().backward()
        grads.append(leaf.grad)
    assert torch.equal(grads[0], grads[1])


def test_logprobs_grad_path_saves_no_full_vocab_fp32_tensor():
    """What the update keeps alive for backward: the logits themselves (bf16 here), never an fp32
    [B, R, V] log-softmax per chunk as autograd through the plain formula does."""
    from torch.autograd.graph import saved_tensors_hooks

    B, R, V = 4, 5, 64
    logits = torch.randn(B, R, V).bfloat16().requires_grad_(True)
    tokens = torch.randint(0, V, (B, R))

    def saved_full_vocab_fp32(fn) -> int:
        found = []

        def pack(t):
            if t.dtype == torch.float32 and t.shape[-1] == V and t.numel() >= R * V:
                found.append(t.numel())
            return t

        with saved_tensors_hooks(pack, lambda t: t):
            lp, ent = fn(logits, tokens, 0.8, 2, True)
        (lp.sum() + ent.sum()).backward()
        return sum(found)

    assert saved_full_vocab_fp32(_reference_logprobs) >= B * R * V  # the plain formula does (the test can fail)
    assert saved_full_vocab_fp32(logprobs_from_logits) == 0


def test_policy_forward_gradients_equal_the_full_logits_path(lm):
    """The model's gradients through policy_forward (kept positions, _TokenLogprobs) equal autograd
    through the plain full-logits formula."""
    seq, mask, P = _batch(PROMPTS, RESPONSE)
    R = RESPONSE.shape[1]
    w = torch.randn(3, R, generator=torch.Generator().manual_seed(2))
    grads = []
    for fn in (lambda: policy_forward(lm, seq, mask, R, 0.8, with_entropy=True), lambda: _plain_logprobs(lm, seq, mask, R, 0.8)):
        lm.zero_grad(set_to_none=True)
        lp, ent = fn()
        ((lp * w).sum() + 0.1 * ent.sum()).backward()
        grads.append({n: p.grad.clone() for n, p in lm.named_parameters() if p.grad is not None})
    lm.zero_grad(set_to_none=True)
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 5
    for n in grads[0]:
        torch.testing.assert_close(grads[0][n], grads[1][n], atol=1e-5, rtol=1e-4, msg=n)


# ------------------------------------------------------------------ policy_forward


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_policy_forward_equals_plain_full_logits_fp32(lm, temperature):
    seq, mask, P = _batch(PROMPTS, RESPONSE)
    R = RESPONSE.shape[1]
    with torch.no_grad():
        lp, ent = policy_forward(lm, seq, mask, R, temperature, with_entropy=True)
        want_lp, want_ent = _plain_logprobs(lm, seq, mask, R, temperature)
    assert lp.shape == (3, R) and lp.dtype == torch.float32
    assert (lp < -0.01).any()  # non-trivial: far from log 1
    assert torch.allclose(lp, want_lp, atol=1e-5, rtol=0), (lp - want_lp).abs().max()
    assert torch.allclose(ent, want_ent, atol=1e-5, rtol=0), (ent - want_ent).abs().max()


def test_policy_forward_under_bf16_autocast(lm):
    """Under bf16 autocast the kept-positions path equals the plain path run under the same autocast
    to 2e-2 (bf16 rounding of the projected logits may differ with the matmul's shape), and both stay
    within 0.15 nats of the fp32 values."""
    seq, mask, P = _batch(PROMPTS, RESPONSE)
    R = RESPONSE.shape[1]
    with torch.no_grad():
        want32, _ = _plain_logprobs(lm, seq, mask, R, 0.8)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            lp, ent = policy_forward(lm, seq, mask, R, 0.8, with_entropy=True)
            want, want_ent = _plain_logprobs(lm, seq, mask, R, 0.8)
    assert lp.dtype == torch.float32
    assert (lp - want).abs().max() < 2e-2
    assert (ent - want_ent).abs().max() < 2e-2
    assert (lp - want32).abs().max() < 0.15


def test_policy_forward_left_padding_invariant(lm, critic):
    seq, mask, P = _batch(PROMPTS, RESPONSE)
    R = RESPONSE.shape[1]
    with torch.no_grad():
        lp, ent = policy_forward(lm, seq, mask, R, 0.9, with_entropy=True)
        vals = critic_forward(critic, seq, mask, R)
        for i, p in enumerate(PROMPTS):
            alone = torch.tensor([p + RESPONSE[i].tolist()])
            ones = torch.ones_like(alone)
            lp1, ent1 = policy_forward(lm, alone, ones, R, 0.9, with_entropy=True)
            v1 = critic_forward(critic, alone, ones, R)
            assert torch.allclose(lp[i], lp1[0], atol=1e-5), i
            assert torch.allclose(ent[i], ent1[0], atol=1e-5), i
            assert torch.allclose(vals[i], v1[0], atol=1e-5), i


@pytest.mark.parametrize("bf16", [False, True])
def test_training_forward_equals_scoring_forward(lm, critic, bf16):
    """The update's forward (grad enabled) must give the scoring forward's (no grad) log-probs and
    values, also under bf16 autocast, or PPO's first ratio would not be exactly 1. (A faster SDPA
    kernel for the backward only was rejected for this: under bf16 it moved the ratio by ~1%.)"""
    seq, mask, P = _batch(PROMPTS, RESPONSE)
    R = RESPONSE.shape[1]
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
    with ctx:
        with torch.no_grad():
            lp0, ent0 = policy_forward(lm, seq, mask, R, 0.8, with_entropy=True)
            v0 = critic_forward(critic, seq, mask, R)
        lp1, ent1 = policy_forward(lm, seq, mask, R, 0.8, with_entropy=True)
        v1 = critic_forward(critic, seq, mask, R)
    assert lp1.requires_grad and v1.requires_grad
    assert torch.equal(lp1.detach(), lp0) and torch.equal(ent1.detach(), ent0)
    assert torch.equal(v1.detach(), v0)


def test_policy_forward_gradients_flow(lm):
    seq, mask, _ = _batch(PROMPTS[:1], RESPONSE[:1])
    lm.zero_grad(set_to_none=True)
    lp, _ = policy_forward(lm, seq, mask, RESPONSE.shape[1], 1.0)
    lp.sum().backward()
    assert lm.lm_head.weight.grad is not None and lm.lm_head.weight.grad.abs().sum() > 0
    lm.zero_grad(set_to_none=True)


# ------------------------------------------------------------------ critic_forward


def test_critic_forward_alignment_equals_plain_values(critic):
    """values[:, t] = V(prefix ending at P+t-1): the full-sequence values at positions P-1 .. P+R-2."""
    seq, mask, P = _batch(PROMPTS, RESPONSE)
    R = RESPONSE.shape[1]
    with torch.no_grad():
        got = critic_forward(critic, seq, mask, R)
        full = critic(seq, attention_mask=mask, position_ids=position_ids_from_mask(mask))  # [B, P+R]
    assert got.shape == (3, R) and got.dtype == torch.float32
    assert got.abs().max() > 1e-3
    assert torch.allclose(got, full[:, P - 1 : P + R - 1], atol=1e-5)
    assert not torch.allclose(got, full[:, P : P + R], atol=1e-3)  # the off-by-one would be visible


# ------------------------------------------------------------------ keep: the sampler's top-k / top-p distribution


@pytest.mark.parametrize("padding_free", [False, True])
@pytest.mark.parametrize("chunk", [0, 4])
@pytest.mark.parametrize("keep", [(0, 0.9), (20, 1.0), (20, 0.9)])
def test_policy_forward_keep_scores_the_samplers_kept_distribution_on_every_path(lm, monkeypatch, keep, chunk, padding_free):
    """policy_forward(keep=(top_k, top_p)): a third output from the same forward, each response token's log-prob under
    the sampler's filtered distribution renormalised (kept_logprobs of the full logits), on the plain, the chunked
    (model/logprobs.py: no [B, R, vocab] logits) and the packed paths alike; the first two outputs are keep=None's bit
    for bit (the PPO ratio's pi_old does not move). The local sampler's own draws are all inside the kept set, and
    renormalised they are more likely than under the whole vocabulary (log p - log S >= log p)."""
    from model import logprobs as L

    monkeypatch.setattr(L, "CHUNK_SIZE", chunk)
    ids, mask, _ = _batch(PROMPTS, torch.empty(3, 0, dtype=torch.long))
    with torch.no_grad():
        s = sample(lm, ids, mask, max_new_tokens=6, eos_token_id=EOS, pad_token_id=PAD, temperature=0.8, top_k=keep[0],
                   top_p=keep[1], generator=torch.Generator().manual_seed(2))
        seq, full, R, P = s.sequences, torch.cat([mask, s.response_mask.long()], 1), s.response_mask.shape[1], ids.shape[1]
        lp, ent = policy_forward(lm, seq, full, R, 0.8, with_entropy=True, padding_free=padding_free)
        lp2, ent2, kept = policy_forward(lm, seq, full, R, 0.8, True, padding_free, keep=keep)
        logits = lm(input_ids=seq, attention_mask=full, position_ids=position_ids_from_mask(full)).logits[:, P - 1 : -1]
        want = kept_logprobs(logits, seq[:, P:], 0.8, *keep)
    assert torch.equal(lp, lp2) and ent is not None and ent2 is not None and torch.equal(ent, ent2)
    real = s.response_mask.bool()
    assert real.sum() > 6 and kept[real].isfinite().all()
    torch.testing.assert_close(kept[real], want[real], rtol=0, atol=2e-5)
    assert (kept[real] >= lp[real] - 1e-5).all() and (kept[real] - lp[real]).max() > 1e-3


# ------------------------------------------------------------------ --forward_batch_size


@pytest.mark.parametrize("rows", [1, 3, 4])
def test_scoring_in_row_chunks_equals_one_forward(lm, critic, rows):
    """--forward_batch_size: old/ref log-probs, entropy and values scored `rows` rows at a time (last
    chunk shorter) equal the all-rows forward up to fp32 rounding (a smaller matmul may round differently
    in the last bits, more so with several threads: up to 4e-6 seen); rows = 0 or >= B is that one forward."""
    g = torch.Generator().manual_seed(1)
    prompts = [PROMPTS[i % 3][: 3 + i % 4] for i in range(7)]
    seq, mask, P = _batch(prompts, torch.randint(3, V, (7, 6), generator=g))
    mask[2, -3:] = 0  # rows that stopped early: post-EOS pads are masked out of attention
    mask[5, -1:] = 0
    R = 6
    with torch.no_grad():
        want_lp, want_ent = policy_forward(lm, seq, mask, R, 0.8, with_entropy=True)
        want_ref, none = policy_forward(lm, seq, mask, R, 0.8)
        want_v = critic_forward(critic, seq, mask, R)
        lp, ent = forward_in_row_chunks(policy_forward, lm, seq, mask, R, 0.8, with_entropy=True, rows=rows)
        ref, no_ent = forward_in_row_chunks(policy_forward, lm, seq, mask, R, 0.8, rows=rows)
        v = forward_in_row_chunks(critic_forward, critic, seq, mask, R, rows=rows)
    assert none is None and no_ent is None
    assert lp.shape == ent.shape == v.shape == (7, R)
    torch.testing.assert_close(lp, want_lp, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(ent, want_ent, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(ref, want_ref, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(v, want_v, atol=2e-5, rtol=1e-4)
    # Rows are really split: the model sees chunks of `rows` rows (0 and >= B: one call, as before).
    seen = []

    def spy(model, s, m, *a, **k):
        seen.append(s.shape[0])
        return policy_forward(model, s, m, *a, **k)

    with torch.no_grad():
        for r, want in ((rows, [rows] * (7 // rows) + ([7 % rows] if 7 % rows else [])), (0, [7]), (9, [7])):
            seen.clear()
            forward_in_row_chunks(spy, lm, seq, mask, R, 0.8, rows=r)
            assert seen == want, (r, seen)


def test_forward_batch_size_flag_defaults_to_one_forward():
    import train_ppo

    assert train_ppo.parse_args([]).forward_batch_size == 0
    assert train_ppo.parse_args(["--forward_batch_size", "8"]).forward_batch_size == 8


# ------------------------------------------------------------------ generate_rollout


def test_generate_rollout_repeats_each_prompt_consecutively(lm):
    prompts = [[17, 45, 99], [5, 6, 7, 8, 9]]
    seq, mask, P = _batch(prompts, torch.empty(2, 0, dtype=torch.long))
    N, R = 3, 4
    torch.manual_seed(0)
    ro = generate_rollout(lm, seq, mask, max_new_tokens=R, eos_token_id=EOS, pad_token_id=PAD, temperature=1.0,
                          top_k=0, top_p=1.0, suppress_eos=True, num_generations=N)
    assert ro.sequences.shape == (len(prompts) * N, P + R) and ro.prompt_len == P
    for i in range(len(prompts)):
        for j in range(N):
            assert torch.equal(ro.sequences[i * N + j, :P], seq[i]), (i, j)
            assert torch.equal(ro.attention_mask[i * N + j, :P], mask[i]), (i, j)
    assert ro.response_mask.shape == (len(prompts) * N, R) and ro.response_mask.eq(1).all()
    assert ro.attention_mask[:, P:].eq(1).all()
    # The N samples of a prompt are independent draws, not copies (a high-entropy scrambled model).
    assert len({tuple(r) for r in ro.sequences[:N, P:].tolist()}) > 1


@pytest.mark.parametrize("temperature,top_k,greedy", [(1.0, 0, False), (0.7, 20, False), (1.0, 0, True)])
def test_rollout_logprobs_equal_a_second_forward(lm, temperature, top_k, greedy):
    """--rollout_logprobs: the sampling pass's log-probs and entropy stand in for the old-actor forward.
    Same distribution (softmax(logits / T), before top-k and EOS suppression), so in fp32 they agree
    with policy_forward on the finished sequences to float rounding, on every real response token."""
    seq, mask, P = _batch(PROMPTS, torch.empty(3, 0, dtype=torch.long))
    torch.manual_seed(1)
    ro = generate_rollout(lm, seq, mask, max_new_tokens=12, eos_token_id=[EOS, 7], pad_token_id=PAD,
                          temperature=temperature, top_k=top_k, top_p=1.0, greedy=greedy, return_logprobs=True)
    R, m = ro.response_len, ro.response_mask.bool()
    want, want_ent = policy_forward(lm, ro.sequences, ro.attention_mask, R, 1.0 if greedy else temperature, with_entropy=True)
    assert ro.old_logprobs.shape == want.shape == m.shape
    torch.testing.assert_close(ro.old_logprobs[m], want[m], atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(ro.entropy[m], want_ent[m], atol=2e-5, rtol=1e-5)
    assert ro.old_logprobs[m].lt(-0.01).any()  # not a degenerate near-deterministic model
    plain = generate_rollout(lm, seq, mask, max_new_tokens=4, eos_token_id=EOS, pad_token_id=PAD, temperature=1.0,
                             top_k=0, top_p=1.0)
    assert plain.old_logprobs is None and plain.entropy is None


# ------------------------------------------------------------------ the sampler behind generate_rollout


@pytest.mark.parametrize("temperature, top_k, top_p", [(0.7, 0, 1.0), (1.0, 5, 1.0), (1.3, 0, 0.9), (0.8, 7, 0.6), (1.0, 1, 1.0)])
def test_filter_logits_equals_transformers_warpers(temperature, top_k, top_p):
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    g = torch.Generator().manual_seed(0)
    logits = 2 * torch.randn(6, 40, generator=g)
    logits[0, :5] = logits[0, 5]  # ties at the top-k boundary are kept by both
    ids = torch.zeros(6, 1, dtype=torch.long)
    want = logits.clone()
    if temperature != 1.0:
        want = TemperatureLogitsWarper(temperature)(ids, want)
    if top_k > 0:
        want = TopKLogitsWarper(top_k)(ids, want)
    if top_p < 1.0:
        want = TopPLogitsWarper(top_p)(ids, want)
    got = filter_logits(logits, temperature, top_k, top_p)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    assert torch.allclose(got[~torch.isinf(got)], want[~torch.isinf(want)], atol=1e-6)


def test_sample_from_logits_draws_the_softmax_distribution():
    probs = torch.tensor([0.1, 0.0, 0.2, 0.7])
    logits = probs.log().expand(40000, 4)  # the zero entry is -inf
    torch.manual_seed(0)
    draws = sample_from_logits(logits)
    assert draws.shape == (40000,) and draws.dtype == torch.long
    freq = torch.bincount(draws, minlength=4).float() / draws.numel()
    assert freq[1] == 0  # probability 0 is never drawn
    # 4 standard errors at n=40000: sqrt(0.7*0.3/40000) ~ 0.0023
    assert torch.allclose(freq, probs, atol=0.01), freq
    torch.manual_seed(0)
    assert torch.equal(sample_from_logits(logits), draws)  # deterministic under the seed


def test_sample_from_logits_rejects_nonfinite():
    with pytest.raises(RuntimeError, match="non-finite"):
        sample_from_logits(torch.tensor([[0.0, float("nan")]]))


# ------------------------------------------------------------------ the benchmark script


@pytest.mark.slow
def test_bench_quick_smoke_writes_documented_json(tmp_path):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_ppo

    out = tmp_path / "bench.json"
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_ppo.py"), "--quick", "--sizes", "64x2", "--steps", "1",
           "--batch_size", "2", "--prompt_len", "8", "--gen_len", "4", "--num_threads", "1", "--json", str(out),
           "--parallel_update", "1", "--minimind_s_per_step", "8.8", "--minimind_size", "64x2"]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rep = json.loads(out.read_text())
    assert set(bench_ppo.TOP_KEYS) <= rep.keys()
    assert rep["matmul_peak_gflops"]["float32"] > 0 and rep["matmul_peak_gflops"]["bfloat16"] > 0
    (res,) = rep["results"]
    assert res["ok"], res.get("error")
    assert set(bench_ppo.RESULT_KEYS) <= res.keys()
    assert set(bench_ppo.TIME_KEYS) <= res["time_s"].keys()
    t = res["time_s"]
    assert t["step"] > 0 and t["generate"] > 0 and t["update"] > 0
    assert abs(t["generate"] + t["score"] + t["update"] + t["sync_old"] - t["step"]) < 1e-6
    assert res["params"]["actor"] > 0 and res["memory_mb"]["peak_rss"] > res["memory_mb"]["baseline_imports"]
    assert res["flops"]["update_analytic"] > 0 and 0 < res["update_peak_share"]
    assert res["config"]["dtype"] == "bfloat16" and res["config"]["update_old_actor_freq"] == 0
    assert res["config"]["parallel_update"] == 1 and rep["minimind_here_s"] == 8.8
    assert "gen t/s" in r.stdout and "64x2" in r.stdout  # the table was printed
    # Generation against the weight-streaming limit: 64x2 bf16 streams its layer matmuls + LM head (2 bytes each) per token.
    from trainer.config import Config
    from trainer.run.hardware import layer_matmul_params, policy_layer_params

    n = policy_layer_params(Config().replace(hidden_size=64, num_hidden_layers=2))
    assert n == layer_matmul_params(argparse.Namespace(hidden_size=64, num_hidden_layers=2, num_attention_heads=8,
                                                       num_key_value_heads=4, head_dim=8, intermediate_size=256))
    assert res["generate_weight_mb_per_token"] == pytest.approx((n + 6400 * 64) * 2 / 2**20)
    bw = rep["memory_bandwidth_gbs"]["copy"]
    assert bw > 0 and res["generate_bandwidth_limit_s"] == pytest.approx(res["generate_weight_mb_per_token"] * 2**20 * 4 / (bw * 1e9))
    assert res["generate_bandwidth_share"] == pytest.approx(res["generate_bandwidth_limit_s"] / t["generate"])
    assert sum(res["phase_share"].values()) == pytest.approx(1.0)
    assert res["minimind_ratio"] == pytest.approx(8.8 / t["step"])  # the same-run MiniMind figure, at its size
    assert "bandwidth-bound" in r.stdout and "of the bfloat16 matmul peak" in r.stdout
    assert f"{8.8 / t['step']:.2f}x MiniMind's 8.8 s/step (same run" in r.stdout
    # The floors: the run's own peak and bandwidth applied to the step's shape; the default estimator (gae) with one
    # minibatch scores the critic with grad (--reuse_values) and the sampler's log-probs serve as old ones.
    shape, f = res["step_shape"], res["floors"]
    assert (shape["rows"], shape["prompts"], shape["prompt_len"], shape["gen_len"]) == (2, 2, 8, 4)
    assert (shape["score_old"], shape["score_ref"], shape["score_critic"], shape["update_critic_passes"]) == (False, True, True, 2)
    assert f["peak_gflops"] == rep["matmul_peak_gflops"]["bfloat16"] and f["bandwidth_gbs"] == bw
    again = bench_ppo.phase_floors(bench_ppo.StepShape(**shape), f["peak_gflops"], bw)
    assert again["floor_s"] == pytest.approx(f["floor_s"]) and f["floor_s"]["step"] > 0
    assert res["flops"]["update_analytic"] == again["flops"]["update"]
    assert f["x_floor"]["update"] == pytest.approx(1 / res["update_peak_share"])  # the same FLOPs and peak
    assert f["x_floor"]["generate"] == pytest.approx(t["generate"] / f["floor_s"]["generate"])
    assert f["furthest"]["by_ratio"] in ("generate", "score", "update")
    assert "floors per phase" in r.stdout and bench_ppo.floor_line(res) in r.stdout


@pytest.mark.slow
def test_bench_takes_a_local_hf_model_with_its_own_tokenizer(tmp_path):
    """--actor_path: a pretrained HF model's levers (here LoRA on and off, interleaved), on its own weights and tokenizer."""
    from tests.tiny_hf import save_tiny_causal_lm

    hf = tmp_path / "tiny_llama"
    save_tiny_causal_lm(hf)
    out = tmp_path / "bench.json"
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_ppo.py"), "--actor_path", str(hf), "--dtypes", "float32",
           "--update_old_actor_freq", "0", "--lora_r", "0,4", "--steps", "1", "--batch_size", "2", "--prompt_len", "8",
           "--gen_len", "4", "--num_threads", "1", "--reward_model", "none", "--interleave", "1", "--count_flops", "0",
           "--extra", "--advantage_estimator grpo --num_generations 2 --mini_batch_size 4", "--json", str(out)]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    results = json.loads(out.read_text())["results"]
    assert [(x["ok"], x["config"]["name"], x["config"]["lora_r"]) for x in results] == [(True, "tiny_llama", 0), (True, "tiny_llama", 4)]
    full, lora = (x["params"]["actor"] for x in results)
    assert lora > full  # the adapters on top of the same base
    assert all(x["params"]["critic"] == 0 for x in results)  # grpo: no critic built
    bad = subprocess.run([*cmd[:2], "--actor_path", str(hf), "--sizes", "64x2"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1 and "not both" in bad.stderr and "Traceback" not in bad.stderr


def _bench():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_ppo

    return bench_ppo


# A tiny step for the floors, by hand: hidden 8, 2 layers, MLP 16, vocab 10, 2 query heads and 1 key/value head of
# width 4. One layer's linears per position: q 8*8 + k, v 2*8*4 + o 8*8 + MLP 3*8*16 = 576 MACs; a decode step
# streams 2 * (2*64 + 2*32 + 3*128) = 1152 layer weights + 10*8 head = 1232 weights, 2 bytes each = 2464 bytes.
TINY_SHAPE = dict(hidden_size=8, num_hidden_layers=2, intermediate_size=16, vocab_size=10, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=4, rows=4, prompts=2, prompt_len=3, gen_len=3, itemsize=2,
                  decode_weight_params=1232)


def test_bench_phase_floors_against_hand_computed_figures():
    """Each phase's floor: FLOPs at the peak, decode steps at the larger of compute and weight + KV streaming. Peak
    1000 FLOP/s and 258 B/s make the first decode step compute-bound and the second bandwidth-bound."""
    b = _bench()
    from trainer.run.hardware import layer_matmul_params

    assert layer_matmul_params(argparse.Namespace(**TINY_SHAPE)) + 10 * 8 == 1232
    shape = b.StepShape(**TINY_SHAPE, score_old=True, score_ref=True, score_critic=True, update_actor_passes=3,
                        update_critic_passes=2)
    f = b.phase_floors(shape, peak_gflops=1e-6, bandwidth_gbs=0.258e-6)
    # prefill: the 2 distinct prompts, not the 4 rows: 2 rows x 3 positions x 2 layers x 2 x 576 = 13824,
    # attention 2 rows x 2 layers x 4*2*4*3^2 = 1152, head 2*8*10 x 2 rows x 1 position = 320 -> 15296 FLOP,
    # above its 2464 bytes / 258 B/s = 9.55 s.
    assert f["flops"]["generate_prefill"] == 15296
    # decode step t (KV length 3 + t): 2 x 4 rows x 1232 = 9856 + attention 4 rows x 2 layers x 4*2*4 x (3 + t);
    # bytes 2464 + 2 layers x 2 (K, V) x 1 head x 4 wide x (2 prompts x 3 + 4 rows x t) x 2 bytes: each distinct
    # prompt's K/V once (its group shares it), every row's decoded ones.
    # t=1: 9856 + 1024 = 10880 FLOP = 10.88 s against 2464 + 320 = 2784 B = 10.79 s: compute.
    # t=2: 9856 + 1280 = 11136 FLOP = 11.136 s against 2464 + 448 = 2912 B = 11.287 s: bandwidth.
    assert f["decode_steps"] == 2 and f["decode_compute_bound_steps"] == 1
    assert f["flops"]["generate_decode"] == 10880 + 11136 and f["decode_bytes"] == 2784 + 2912
    fl = f["floor_s"]
    assert fl["generate_prefill"] == pytest.approx(15.296)
    assert fl["generate_decode"] == pytest.approx(10.88 + 2912 / 258)
    assert fl["generate"] == pytest.approx(15.296 + 10.88 + 2912 / 258)
    # scoring, 4 rows x 6 positions: linears 4*6*2*2*576 = 55296, attention 4*2*4*2*4*36 = 9216;
    # the policy's head at R + 1 = 4 positions: 2*8*10*4*4 = 2560 -> 67072; the critic's, no head: 64512.
    assert (fl["score_old"], fl["score_ref"], fl["score_critic"]) == pytest.approx((67.072, 67.072, 64.512))
    assert fl["score"] == pytest.approx(198.656)
    # update: actor 3 x 67072 + critic 2 x 64512 (its forward ran in scoring) = 330240.
    assert fl["update"] == pytest.approx(330.24)
    assert fl["step"] == pytest.approx(15.296 + 10.88 + 2912 / 258 + 198.656 + 330.24)
    # No old-actor forward, no critic (GRPO), LoRA's 2x, two epochs; one prompt per row prefills all 4 rows.
    g = b.phase_floors(b.StepShape(**{**TINY_SHAPE, "prompts": 4}, score_old=False, score_critic=False,
                                   update_actor_passes=2, update_critic_passes=0, update_iters=2), 1e-6, 0.258e-6)["floor_s"]
    assert (g["score_old"], g["score_critic"], g["score"]) == (0.0, 0.0, pytest.approx(67.072))
    assert g["update"] == pytest.approx(2 * 2 * 67.072)
    assert g["generate_prefill"] == pytest.approx(2 * 15.296)  # linears, attention and head all scale with the rows
    # Shared prompts (padding-free groups): each of the 2 prompts' 3 positions once + 4 rows x 3 response positions =
    # 18 positions: linears 18*2*2*576 = 41472; attention 2 layers x 4*2*4 x (2 x 3^2 + 4 x 3 x 6) = 5760; the same
    # head 2560 -> 49792 for the policy, 47232 for the critic. Decode is unchanged.
    h = b.phase_floors(dataclasses.replace(shape, shared_prompts=True), 1e-6, 0.258e-6)["floor_s"]
    assert (h["score_ref"], h["score_critic"]) == pytest.approx((49.792, 47.232))
    assert h["update"] == pytest.approx(3 * 49.792 + 2 * 47.232)
    assert h["generate"] == pytest.approx(fl["generate"])


def test_bench_floor_summary_names_the_phase_furthest_from_its_floor():
    """The printed floors: measured / floor per phase, and the furthest phase by ratio and, where another loses more
    seconds, by seconds."""
    b = _bench()
    shape = b.StepShape(**TINY_SHAPE, score_ref=True, update_critic_passes=0)
    floors = b.phase_floors(shape, 1e-6, 0.258e-6)
    fl = floors["floor_s"]  # generate 37.46, score 67.07 (reference only), update 201.22
    t = {"step": 0.0, "generate": 3 * fl["generate"], "score_old": 0.0, "score_ref": 1.5 * fl["score_ref"],
         "score_critic": 0.0, "score": 1.5 * fl["score_ref"] + 1.0, "update": 2 * fl["update"]}
    t["step"] = t["generate"] + t["score"] + t["update"]
    rep = b.floors_against(floors, t)
    assert rep["x_floor"]["generate"] == pytest.approx(3.0) and rep["x_floor"]["update"] == pytest.approx(2.0)
    assert "score_old" not in rep["x_floor"] and "score_critic" not in rep["x_floor"]  # no forward: no floor
    assert rep["furthest"] == {"by_ratio": "generate", "by_seconds": "update"}  # 3x but 74.9 s; 2x but 201.2 s above
    r = {"config": {"name": "tiny", "dtype": "bfloat16", "update_old_actor_freq": 0, "num_threads": 1},
         "floors": rep, "step_shape": dataclasses.asdict(shape)}
    line = b.floor_line(r)
    assert "generate 112 / 37.5 s = 3.0x (prefill of 2 prompts x 3 15.3 s + 2 decode steps of 4 rows 22.2 s, " \
           "1 of them compute-bound)" in line
    assert "score 102 / 67.1 s = 1.5x (ref 101 / 67.1 s = 1.5x, reward + rest 1 s)" in line
    assert "update 402 / 201 s = 2.0x" in line
    assert "furthest from its floor: generate (3.0x its floor, 74.9 s above it); most seconds above its floor: update (201 s)" in line


def test_bench_groups_configs_of_one_size_for_interleaving():
    """--interleave 1: every dtype of one size (and thread count) in one process, so an A/B pair sees the same load."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_ppo

    o = bench_ppo.build_parser().parse_args(["--sizes", "64x2,128x4", "--dtypes", "float32,bfloat16",
                                             "--update_old_actor_freq", "0", "--num_threads", "1,2"])
    cfgs = bench_ppo.expand_configs(o)
    assert [[c["dtype"] for c in g] for g in bench_ppo.child_groups(cfgs, False)] == [[c["dtype"]] for c in cfgs]
    groups = bench_ppo.child_groups(cfgs, True)
    assert [(g[0]["name"], g[0]["num_threads"], [c["dtype"] for c in g]) for g in groups] == [
        (n, t, ["float32", "bfloat16"]) for n in ("64x2", "128x4") for t in (1, 2)]


def test_eager_training_attention_equals_sdpa_and_is_restored(lm, critic):
    """--train_attn_implementation: the update may switch kernels; log-probs, values and gradients stay the same."""
    seq, mask, P = _batch(PROMPTS, RESPONSE)
    R = RESPONSE.shape[1]
    assert lm.config._attn_implementation == "sdpa"

    def run():
        lm.zero_grad(set_to_none=True)
        lp, _ = policy_forward(lm, seq, mask, R, 0.9)
        lp.sum().backward()
        return lp.detach(), critic_forward(critic, seq, mask, R).detach(), lm.model.layers[0].self_attn.q_proj.weight.grad.clone()

    want = run()
    with attention_implementation("eager", lm, critic):
        assert lm.model.layers[0].self_attn.config._attn_implementation == "eager"
        assert critic.trunk.config._attn_implementation == "eager"
        got = run()
    assert lm.config._attn_implementation == "sdpa" and critic.trunk.config._attn_implementation == "sdpa"
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    lm.zero_grad(set_to_none=True)


# ------------------------------------------------------------------ --filter_groups: groups with signal, merged batches


def test_group_has_signal_keeps_groups_with_different_rewards_and_nan():
    r = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 1.0, float("nan"), 2.0, 2.0])
    assert group_has_signal(r, 3).tolist() == [False, True, True]


def test_merged_rollouts_keep_every_rows_logprobs_and_rewards(lm):
    """Rows of two rollouts with different prompt and response lengths, stacked by cat_rollouts, score
    exactly as they did in their own batch (padding is masked), with their rewards and sampling log-probs."""
    torch.manual_seed(3)
    parts = []
    for prompts, R in (([[17, 45, 99], [5, 6, 7, 8, 9]], 6), ([[200, 13, 13, 4, 180, 3, 3], [8, 9]], 3)):
        seq, mask, _ = _batch(prompts, torch.empty(len(prompts), 0, dtype=torch.long))
        ro = generate_rollout(lm, seq, mask, max_new_tokens=R, eos_token_id=EOS, pad_token_id=PAD, temperature=1.0,
                              top_k=0, top_p=1.0, suppress_eos=True, num_generations=2, return_logprobs=True)
        ro.rewards = torch.arange(4.0) + 10 * len(parts)
        parts.append(ro)
    picks = [(parts[0], torch.tensor([2, 3])), (parts[1], torch.tensor([0, 1, 3]))]
    merged = cat_rollouts(picks, PAD)
    assert merged.sequences.shape == (5, 7 + 6) and merged.prompt_len == 7 and merged.response_len == 6
    assert merged.rewards.tolist() == [2.0, 3.0, 10.0, 11.0, 13.0]
    got = policy_forward(lm, merged.sequences, merged.attention_mask, merged.response_len, 1.0)[0]
    row = 0
    for ro, idx in picks:
        own = policy_forward(lm, ro.sequences[idx], ro.attention_mask[idx], ro.response_len, 1.0)[0]
        R = ro.response_len
        for k in range(len(idx)):
            m = ro.response_mask[idx[k]].bool()
            torch.testing.assert_close(got[row, :R][m], own[k][m], atol=1e-5, rtol=1e-5)
            assert torch.equal(merged.old_logprobs[row, :R], ro.old_logprobs[idx[k]])
            assert merged.response_mask[row, R:].eq(0).all()
            row += 1
