"""Sampling from left-padded prompts: cache == no cache, padding invariance, masks after EOS, knobs."""

from __future__ import annotations

import math

import pytest
import torch

from model.generation import (
    DecodeOptions,
    Samples,
    filter_logits,
    kept_logprobs,
    response_mask_from_tokens,
    sample,
    sample_from_logits,
    token_logprobs,
)
from model.loader import build_minimind
from tests.helpers import scramble

EOS, PAD = 2, 0


def _positions(mask: torch.Tensor) -> torch.Tensor:
    """What the trainer does: pads do not count, pad slots get position 0."""
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


def _left_pad(prompts: list[list[int]], pad: int = PAD) -> tuple[torch.Tensor, torch.Tensor]:
    P = max(map(len, prompts))
    ids = torch.full((len(prompts), P), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), P), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, P - len(p):] = torch.tensor(p)
        mask[i, P - len(p):] = 1
    return ids, mask


@pytest.fixture(scope="module")
def lm():
    return scramble(build_minimind(64, 2, vocab_size=256), seed=0).eval()


@pytest.fixture(scope="module")
def lm8():
    """Vocabulary of 8: sampled rows hit EOS (id 2) at varied steps."""
    torch.manual_seed(0)
    return build_minimind(64, 2, vocab_size=8).eval()


PROMPTS = [[17, 45, 99], [5, 6, 7, 8, 9, 10, 11], [200, 13, 13, 4, 180]]


# ---------------------------------------------------------------- response_mask_from_tokens


def test_response_mask_from_tokens_hand_written():
    responses = torch.tensor([
        [5, 6, 2, 7, 8],  # EOS mid-row
        [2, 5, 6, 7, 8],  # EOS first
        [5, 6, 7, 8, 9],  # no EOS
        [5, 2, 2, 0, 0],  # two EOS: the first one ends the response
    ])
    mask, has_eos = response_mask_from_tokens(responses, EOS)
    assert mask.tolist() == [[1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]
    assert has_eos.tolist() == [True, True, False, True]


def test_response_mask_with_several_eos_ids():
    responses = torch.tensor([[5, 9, 6, 2], [5, 6, 7, 8]])
    mask, has_eos = response_mask_from_tokens(responses, [2, 9])
    assert mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1]]
    assert has_eos.tolist() == [True, False]


# ---------------------------------------------------------------- forward: padding invariance


def test_padded_logits_equal_unpadded(lm):
    ids, mask = _left_pad(PROMPTS)
    with torch.no_grad():
        batch = lm(input_ids=ids, attention_mask=mask, position_ids=_positions(mask)).logits
        for i, p in enumerate(PROMPTS):
            alone = lm(input_ids=torch.tensor([p])).logits[0]  # [len, V]
            got = batch[i, ids.shape[1] - len(p):]
            assert torch.allclose(got, alone, atol=1e-5), (i, (got - alone).abs().max())
            # The same prompt, padded on its own (batch of one with pads).
            pad = 4
            ids1 = torch.tensor([[PAD] * pad + p])
            mask1 = torch.tensor([[0] * pad + [1] * len(p)])
            one = lm(input_ids=ids1, attention_mask=mask1, position_ids=_positions(mask1)).logits[0, pad:]
            assert torch.allclose(one, alone, atol=1e-5)


def test_padding_without_attention_mask_would_differ(lm):
    """Guard on the test above: the pads are really there, only the mask hides them."""
    p = PROMPTS[0]
    ids = torch.tensor([[PAD] * 4 + p])
    with torch.no_grad():
        alone = lm(input_ids=torch.tensor([p])).logits[0]
        unmasked = lm(input_ids=ids).logits[0, 4:]
    assert not torch.allclose(unmasked, alone, atol=1e-3)


# ---------------------------------------------------------------- greedy: cache == no cache == manual loop


def _manual_greedy(lm, ids: torch.Tensor, mask: torch.Tensor, n: int) -> torch.Tensor:
    """Full forward every step (no KV cache), argmax of the last position."""
    out = []
    for _ in range(n):
        with torch.no_grad():
            logits = lm(input_ids=ids, attention_mask=mask, position_ids=_positions(mask), use_cache=False).logits
        nxt = logits[:, -1].argmax(-1, keepdim=True)
        out.append(nxt)
        ids = torch.cat([ids, nxt], 1)
        mask = torch.cat([mask, torch.ones_like(nxt)], 1)
    return torch.cat(out, 1)


def test_greedy_with_cache_equals_without(lm):
    ids, mask = _left_pad(PROMPTS)
    n = 12
    s = sample(lm, ids, mask, max_new_tokens=n, eos_token_id=EOS, pad_token_id=PAD, greedy=True, suppress_eos=True)
    assert torch.equal(s.sequences[:, : ids.shape[1]], ids)
    cached = s.sequences[:, ids.shape[1]:]
    assert cached.shape == (3, n)
    assert len(set(cached.flatten().tolist())) > 3  # a non-trivial continuation

    manual = _manual_greedy(lm, ids, mask, n)
    assert torch.equal(cached, manual)
    with torch.no_grad():
        no_cache = lm.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, do_sample=False,
                               use_cache=False, pad_token_id=PAD, eos_token_id=None, suppress_tokens=[EOS])
    assert torch.equal(no_cache[:, ids.shape[1]:], cached)


@pytest.mark.parametrize("arch, use_moe", [("llama", False), ("qwen3", True)])
def test_greedy_cache_and_padding_other_archs(arch, use_moe):
    m = scramble(build_minimind(64, 2, arch=arch, use_moe=use_moe, vocab_size=256), seed=1).eval()
    ids, mask = _left_pad(PROMPTS)
    s = sample(m, ids, mask, max_new_tokens=6, eos_token_id=EOS, pad_token_id=PAD, greedy=True, suppress_eos=True)
    assert torch.equal(s.sequences[:, ids.shape[1]:], _manual_greedy(m, ids, mask, 6))
    p = PROMPTS[1]
    with torch.no_grad():
        alone = m(input_ids=torch.tensor([p])).logits[0]
        batch = m(input_ids=ids, attention_mask=mask, position_ids=_positions(mask)).logits[1, ids.shape[1] - len(p):]
    assert torch.allclose(batch, alone, atol=1e-5)


def test_greedy_prompt_alone_equals_inside_left_padded_batch(lm):
    ids, mask = _left_pad(PROMPTS)
    batch = sample(lm, ids, mask, max_new_tokens=8, eos_token_id=EOS, pad_token_id=PAD, greedy=True, suppress_eos=True)
    for i, p in enumerate(PROMPTS):
        one = sample(lm, torch.tensor([p]), torch.ones(1, len(p), dtype=torch.long), max_new_tokens=8,
                     eos_token_id=EOS, pad_token_id=PAD, greedy=True, suppress_eos=True)
        assert torch.equal(batch.sequences[i, ids.shape[1]:], one.sequences[0, len(p):]), i


# ---------------------------------------------------------------- sample(): masks, EOS, pads


def _check_samples(s: Samples, P: int, max_new: int) -> None:
    responses = s.sequences[:, P:]
    R = responses.shape[1]
    assert 1 <= R <= max_new
    assert s.response_mask.shape == responses.shape and s.response_mask.dtype == torch.long
    for b in range(responses.shape[0]):
        row = responses[b].tolist()
        if EOS in row:
            first = row.index(EOS)
            assert s.has_eos[b]
            assert s.response_mask[b].tolist() == [1] * (first + 1) + [0] * (R - first - 1)
            assert row[first + 1:] == [PAD] * (R - first - 1)  # pads after EOS
        else:
            assert not s.has_eos[b]
            assert R == max_new  # a row without EOS was cut at the limit
            assert s.response_mask[b].tolist() == [1] * R


def test_sample_masks_eos_and_pads(lm8):
    prompts = [[5, 6, 7], [3, 4, 5, 6, 7, 3], [4, 4, 4, 4, 5]]
    ids, mask = _left_pad(prompts)
    max_new = 10
    seen_mid, seen_first, seen_none = False, False, False
    for seed in range(6):
        torch.manual_seed(seed)
        s = sample(lm8, ids, mask, max_new_tokens=max_new, eos_token_id=EOS, pad_token_id=PAD)
        assert torch.equal(s.sequences[:, : ids.shape[1]], ids)
        _check_samples(s, ids.shape[1], max_new)
        for row in s.sequences[:, ids.shape[1]:].tolist():
            if EOS in row:
                seen_first |= row.index(EOS) == 0
                seen_mid |= row.index(EOS) > 0
            else:
                seen_none = True
    # The seeds cover every case the checks distinguish.
    assert seen_mid and seen_first and seen_none


def test_suppress_eos_gives_full_length(lm8):
    ids, mask = _left_pad([[5, 6, 7], [3, 4, 5, 6, 7, 3]])
    for seed in range(3):
        torch.manual_seed(seed)
        s = sample(lm8, ids, mask, max_new_tokens=16, eos_token_id=EOS, pad_token_id=PAD, suppress_eos=True)
        responses = s.sequences[:, ids.shape[1]:]
        assert responses.shape == (2, 16)
        assert not (responses == EOS).any()
        assert s.response_mask.eq(1).all()
        assert not s.has_eos.any()


def test_sample_is_deterministic_under_seed(lm8):
    ids, mask = _left_pad([[5, 6, 7], [3, 4, 5, 6, 7, 3]])
    kw = dict(max_new_tokens=12, eos_token_id=EOS, pad_token_id=PAD, temperature=0.9, top_p=0.95)
    torch.manual_seed(42)
    a = sample(lm8, ids, mask, **kw)
    torch.manual_seed(42)
    b = sample(lm8, ids, mask, **kw)
    assert torch.equal(a.sequences, b.sequences) and torch.equal(a.response_mask, b.response_mask)
    assert torch.equal(a.has_eos, b.has_eos)
    outs = {tuple(a.sequences.flatten().tolist())}
    for seed in range(2):
        torch.manual_seed(seed)
        outs.add(tuple(sample(lm8, ids, mask, **kw).sequences.flatten().tolist()))
    assert len(outs) > 1  # and it does sample


@pytest.fixture
def cuda_like_cumsum(monkeypatch):
    """torch's cumsum as it behaves on CUDA under use_deterministic_algorithms: floating-point input raises
    (torch documents no deterministic kernel for it); integer input works."""
    real_fn, real_method = torch.cumsum, torch.Tensor.cumsum

    def check(x):
        if torch.are_deterministic_algorithms_enabled() and x.is_floating_point():
            raise RuntimeError("cumsum_cuda_kernel does not have a deterministic implementation")

    monkeypatch.setattr(torch, "cumsum", lambda x, *a, **k: (check(x), real_fn(x, *a, **k))[1])
    monkeypatch.setattr(torch.Tensor, "cumsum", lambda x, *a, **k: (check(x), real_method(x, *a, **k))[1])


def test_deterministic_sampling_needs_no_float_cumsum(lm8, cuda_like_cumsum):
    """--deterministic 1 on CUDA: sampling (top-p and the inverse-CDF draw) runs without a float cumsum,
    repeats exactly under a seed, and draws what the default path draws (the fixed-point sums differ from
    float sums below 2^-52)."""
    from model.generation import filter_logits, sample_from_logits

    ids, mask = _left_pad([[5, 6, 7], [3, 4, 5, 6, 7, 3]])
    kw = dict(max_new_tokens=12, eos_token_id=EOS, pad_token_id=PAD, temperature=0.9, top_p=0.9)
    logits = torch.randn(64, 300, generator=torch.Generator().manual_seed(0)) * 3
    plain = sample_from_logits(filter_logits(logits, 0.9, 0, 0.8), torch.Generator().manual_seed(1))
    torch.use_deterministic_algorithms(True)
    try:
        with pytest.raises(RuntimeError, match="deterministic"):  # the stand-in bites
            torch.ones(3).cumsum(0)
        runs = []
        for _ in range(2):
            torch.manual_seed(42)
            runs.append(sample(lm8, ids, mask, **kw))
        det = sample_from_logits(filter_logits(logits, 0.9, 0, 0.8), torch.Generator().manual_seed(1))
        with pytest.raises(RuntimeError, match="non-finite"):
            sample_from_logits(torch.tensor([[0.0, float("nan")]]))
    finally:
        torch.use_deterministic_algorithms(False)
    assert torch.equal(runs[0].sequences, runs[1].sequences)
    assert torch.equal(det, plain)
    torch.manual_seed(42)
    assert torch.equal(sample(lm8, ids, mask, **kw).sequences, runs[0].sequences)


def test_top_k_one_and_tiny_top_p_are_greedy(lm):
    ids, mask = _left_pad(PROMPTS)
    kw = dict(max_new_tokens=6, eos_token_id=EOS, pad_token_id=PAD, suppress_eos=True)
    greedy = sample(lm, ids, mask, greedy=True, **kw).sequences
    torch.manual_seed(0)
    assert torch.equal(sample(lm, ids, mask, top_k=1, temperature=1.5, **kw).sequences, greedy)
    torch.manual_seed(0)
    assert torch.equal(sample(lm, ids, mask, top_p=1e-4, **kw).sequences, greedy)


def test_top_k_restricts_sampled_tokens(lm):
    ids, mask = _left_pad(PROMPTS)
    P = ids.shape[1]
    torch.manual_seed(3)
    s = sample(lm, ids, mask, max_new_tokens=10, eos_token_id=EOS, pad_token_id=PAD,
               temperature=5.0, top_k=3, top_p=0.99)
    full_mask = torch.cat([mask, s.response_mask], 1)
    with torch.no_grad():
        logits = lm(input_ids=s.sequences, attention_mask=full_mask, position_ids=_positions(full_mask)).logits
    top3 = logits[:, P - 1 : -1].topk(3, dim=-1).indices  # [B, R, 3] predictors of each response token
    responses = s.sequences[:, P:]
    ok = (top3 == responses.unsqueeze(-1)).any(-1)
    assert ok[s.response_mask.bool()].all()
    # With temperature 5 over the top 3, not every token is the argmax.
    assert (responses != top3[..., 0])[s.response_mask.bool()].any()


STOP_PROMPTS = [[5, 6, 7], [3, 4, 5, 6, 7, 3], [4, 4, 4, 4, 5], [7, 3], [6, 6, 5, 4]]


@pytest.fixture(scope="module")
def lm8_greedy_stops():
    """Greedy decoding of STOP_PROMPTS stops on EOS after 10, 6, 14, 6 and 4 tokens."""
    m = scramble(build_minimind(64, 2, vocab_size=8), seed=13, std=0.4).eval()
    ids, mask = _left_pad(STOP_PROMPTS)
    s = sample(m, ids, mask, max_new_tokens=24, eos_token_id=EOS, pad_token_id=PAD, greedy=True, sync_interval=1)
    assert s.response_mask.sum(1).tolist() == [10, 6, 14, 6, 4] and s.has_eos.all()
    return m


def _assert_same_samples(a: Samples, b: Samples) -> None:
    assert torch.equal(a.sequences, b.sequences)
    assert torch.equal(a.response_mask, b.response_mask) and a.response_mask.dtype == b.response_mask.dtype
    assert torch.equal(a.has_eos, b.has_eos)
    assert torch.equal(a.logprobs, b.logprobs) and torch.equal(a.entropy, b.entropy)


@pytest.mark.parametrize("interval", [2, 3, 8])
@pytest.mark.parametrize("max_new", [24, 12, 15])
def test_sync_interval_greedy_equals_every_token_checks(lm8_greedy_stops, interval, max_new):
    """CUDA's schedule (stop checked every `interval` tokens; extra steps after the last EOS are cut
    off) returns what the every-token schedule returns: sequences, masks, has_eos, log-probs. max_new
    24: every row stops (at 14); 12: one row is cut at the limit; 15: the limit falls right after it."""
    ids, mask = _left_pad(STOP_PROMPTS)
    kw = dict(max_new_tokens=max_new, eos_token_id=EOS, pad_token_id=PAD, greedy=True, return_logprobs=True)
    # the whole batch each step
    want = sample(lm8_greedy_stops, ids, mask, sync_interval=1, decode=DecodeOptions(drop_finished=False), **kw)
    got = sample(lm8_greedy_stops, ids, mask, sync_interval=interval, **kw)
    _assert_same_samples(got, want)
    _check_samples(got, ids.shape[1], max_new)
    assert got.sequences.shape[1] - ids.shape[1] == min(14, max_new)


def test_sync_interval_sampling_equals_every_token_checks_under_a_seed(lm8):
    """Sampled rows too: the extra steps run after every row stopped, so the draws that chose the
    tokens are the same ones; rows after EOS are pads with mask 0 in both."""
    ids, mask = _left_pad([[5, 6, 7], [3, 4, 5, 6, 7, 3]])
    kw = dict(max_new_tokens=24, eos_token_id=EOS, pad_token_id=PAD, temperature=0.9, return_logprobs=True)
    lengths = []
    for seed in range(8):
        torch.manual_seed(seed)
        want = sample(lm8, ids, mask, sync_interval=1, decode=DecodeOptions(drop_finished=False), **kw)
        torch.manual_seed(seed)
        got = sample(lm8, ids, mask, sync_interval=8, **kw)
        _assert_same_samples(got, want)
        _check_samples(got, ids.shape[1], 24)
        lengths.append(got.sequences.shape[1] - ids.shape[1])
    # Batches that stopped before the first check, on it, between checks, and ran to the limit.
    assert min(lengths) < 8 and 8 in lengths and max(lengths) == 24 and any(n % 8 and n > 8 for n in lengths), lengths


def test_sync_interval_default_is_every_token_on_cpu():
    from model.generation import host_sync_interval

    assert host_sync_interval("cpu") == 1 and host_sync_interval("cuda") > 1


def test_nonfinite_logits_raise_under_either_schedule(lm8):
    import copy

    from model.generation import sample_from_logits

    bad = copy.deepcopy(lm8)
    with torch.no_grad():
        bad.lm_head.weight[3] = float("nan")
    ids, mask = _left_pad([[5, 6, 7], [3, 4, 5, 6, 7, 3]])
    for interval in (1, 8):
        with pytest.raises(RuntimeError, match="non-finite"):
            sample(bad, ids, mask, max_new_tokens=3, eos_token_id=EOS, pad_token_id=PAD, sync_interval=interval)
    # The deferred check: no raise, the flag goes (and stays) False, the index stays in range.
    flag = torch.ones((), dtype=torch.bool)
    tok = sample_from_logits(torch.tensor([[0.0, float("nan")]]), finite=flag)
    assert not flag and 0 <= tok.item() <= 1
    sample_from_logits(torch.tensor([[0.0, 1.0]]), finite=flag)
    assert not flag


def test_sample_restores_training_mode(lm8):
    lm8.train()
    try:
        ids, mask = _left_pad([[5, 6, 7]])
        sample(lm8, ids, mask, max_new_tokens=3, eos_token_id=EOS, pad_token_id=PAD)
        assert lm8.training
    finally:
        lm8.eval()


def _ranks_of_sampled(lm, s: Samples, mask: torch.Tensor, P: int) -> torch.Tensor:
    """Rank (0 = argmax) of every real response token under the model's own logits."""
    full_mask = torch.cat([mask, s.response_mask], 1)
    with torch.no_grad():
        logits = lm(input_ids=s.sequences, attention_mask=full_mask, position_ids=_positions(full_mask)).logits
    pred = logits[:, P - 1 : -1]  # [B, R, V]
    tok_logit = pred.gather(-1, s.sequences[:, P:].unsqueeze(-1))
    ranks = (pred > tok_logit).sum(-1)  # [B, R]
    return ranks[s.response_mask.bool()]


def test_top_k_zero_samples_from_the_full_vocabulary(lm):
    """top_k=0 / top_p=1.0 mean "no truncation": PPO's log-probs are taken over the full softmax, so
    the sampler must not silently apply transformers' default top_k=50 (filled in for unset values)."""
    ids, mask = _left_pad(PROMPTS)
    torch.manual_seed(0)
    # Temperature 50 makes the distribution near-uniform over 256 tokens: ~80% of draws rank >= 50.
    s = sample(lm, ids, mask, max_new_tokens=10, eos_token_id=EOS, pad_token_id=PAD, temperature=50.0,
               top_k=0, top_p=1.0, suppress_eos=True)
    ranks = _ranks_of_sampled(lm, s, mask, ids.shape[1])
    assert (ranks >= 50).any(), f"all {ranks.numel()} sampled tokens are in the top 50: max rank {ranks.max()}"


def test_model_generation_config_does_not_override_sample_arguments(lm):
    """A local HF folder may ship generation_config.json (e.g. top_k=20, repetition_penalty=1.05);
    sample()'s own arguments must decide the sampling distribution, not the folder's defaults."""
    ids, mask = _left_pad(PROMPTS)
    saved = lm.generation_config.top_k
    lm.generation_config.top_k = 1  # would make every draw the argmax
    try:
        torch.manual_seed(0)
        s = sample(lm, ids, mask, max_new_tokens=10, eos_token_id=EOS, pad_token_id=PAD, temperature=50.0,
                   suppress_eos=True)
    finally:
        lm.generation_config.top_k = saved
    ranks = _ranks_of_sampled(lm, s, mask, ids.shape[1])
    assert (ranks > 0).any()


def test_suppress_eos_ignores_extra_eos_ids_from_the_model_generation_config(lm8):
    """An HF folder's generation_config may list several EOS ids. With suppress_eos the rows must
    still run to max_new_tokens; a row that silently stopped on another id would get response_mask
    = 1 over the pads that follow (trained on as if they were tokens)."""
    saved = lm8.generation_config.eos_token_id
    lm8.generation_config.eos_token_id = [EOS, 5]
    try:
        ids, mask = _left_pad([[5, 6, 7], [3, 4, 6]])
        torch.manual_seed(0)
        s = sample(lm8, ids, mask, max_new_tokens=12, eos_token_id=EOS, pad_token_id=PAD, suppress_eos=True)
    finally:
        lm8.generation_config.eos_token_id = saved
    responses = s.sequences[:, ids.shape[1]:]
    assert responses.shape == (2, 12) and s.response_mask.eq(1).all()
    # No row may end in a run of pads after a stop: every position was really generated.
    assert not any(row[-6:] == [PAD] * 6 for row in responses.tolist()), responses.tolist()


def test_preallocated_cache_gives_the_dynamic_cache_logits():
    from transformers import MistralConfig, MistralForCausalLM

    from model.generation import PreallocatedLayer, preallocated_cache

    torch.manual_seed(0)
    m = build_minimind(64, 2, vocab_size=128).eval()
    ids = torch.randint(3, 128, (2, 6))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0  # a left-padded row
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = preallocated_cache(m, capacity=9)
    assert all(isinstance(layer, PreallocatedLayer) for layer in cache.layers)
    with torch.no_grad():
        a = m(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True)
        b = m(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, past_key_values=cache)
        for step in range(3):  # decode three tokens on both caches
            nxt = a.logits[:, -1].argmax(-1, keepdim=True)
            mask = torch.cat([mask, torch.ones_like(nxt)], 1)
            pos = pos[:, -1:] + 1
            a = m(input_ids=nxt, attention_mask=mask, position_ids=pos, past_key_values=a.past_key_values, use_cache=True)
            b = m(input_ids=nxt, attention_mask=mask, position_ids=pos, past_key_values=b.past_key_values, use_cache=True)
            torch.testing.assert_close(b.logits, a.logits)
    assert cache.get_seq_length() == 9
    with pytest.raises(RuntimeError, match="capacity"):
        with torch.no_grad():
            m(input_ids=nxt, attention_mask=torch.cat([mask, torch.ones_like(nxt)], 1), position_ids=pos + 1,
              past_key_values=cache, use_cache=True)
    # Sliding-window attention needs the model's own cache layers: no preallocation there.
    mistral = MistralForCausalLM(MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                               num_attention_heads=2, num_key_value_heads=1, sliding_window=4))
    assert preallocated_cache(mistral, capacity=9) is None


# ---------------------------------------------------------------- fast decode step (model/fast_decode.py)


def _decode_logits(m, ids, mask, n, fast: bool, device_type: str = "cpu"):
    """Greedy-decode n tokens on a preallocated cache; logits of every step from either path
    (device_type: the device the fast decoder is built for; the tensors stay on CPU)."""
    from model.fast_decode import fast_decoder
    from model.generation import preallocated_cache

    B, P = ids.shape
    cache = preallocated_cache(m, P + n)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    dec = fast_decoder(m, device_type) if fast else None
    assert (dec is not None) == fast
    with torch.no_grad():
        last = m(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True).logits[:, -1]
        kv = torch.cat([mask.bool(), torch.ones(B, n, dtype=torch.bool)], 1)
        pos, steps = pos[:, -1:], []
        for i in range(n):
            nxt = last.float().argmax(-1)
            pos = pos + 1
            if fast:
                last = dec.step(nxt, pos, kv[:, : P + i + 1], cache)
            else:
                mask = torch.cat([mask, torch.ones_like(nxt)[:, None]], 1)
                last = m(input_ids=nxt[:, None], attention_mask=mask, position_ids=pos, past_key_values=cache,
                         use_cache=True).logits[:, -1]
            steps.append(last.float())
    return torch.stack(steps, 1)


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
@pytest.mark.parametrize("bf16", [False, True])
def test_fast_decode_logits_equal_transformers_forward(arch, bf16):
    m = scramble(build_minimind(64, 2, arch=arch, vocab_size=256, num_attention_heads=4, num_key_value_heads=2), seed=3).eval()
    ids, mask = _left_pad(PROMPTS)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        want = _decode_logits(m, ids, mask, 8, fast=False)
        got = _decode_logits(m, ids, mask, 8, fast=True)
    if bf16:  # one bf16 rounding step of the logits' scale (a concatenated matmul may round differently)
        torch.testing.assert_close(got, want, atol=want.abs().max().item() * 2 ** -7, rtol=0)
    else:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_sample_fast_decode_equals_transformers_decode():
    m = scramble(build_minimind(64, 2, vocab_size=256), seed=4).eval()
    ids, mask = _left_pad(PROMPTS)
    kw = dict(max_new_tokens=10, eos_token_id=EOS, pad_token_id=PAD, temperature=0.9, return_logprobs=True)
    torch.manual_seed(0)
    fast = sample(m, ids, mask, fast_decode=True, **kw)
    torch.manual_seed(0)
    slow = sample(m, ids, mask, fast_decode=False, **kw)
    assert torch.equal(fast.sequences, slow.sequences)
    torch.testing.assert_close(fast.logprobs, slow.logprobs, atol=1e-5, rtol=0)


def test_fast_decode_declines_what_it_does_not_reproduce():
    from transformers import LlamaConfig, LlamaForCausalLM

    from model.fast_decode import fast_decoder

    assert fast_decoder(build_minimind(64, 2, vocab_size=64), "cpu") is not None
    assert fast_decoder(build_minimind(64, 2, vocab_size=64, use_moe=True), "cpu") is None  # MoE blocks
    biased = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                          num_attention_heads=2, num_key_value_heads=1, attention_bias=True))
    assert fast_decoder(biased, "cpu") is None
    eager = build_minimind(64, 2, vocab_size=64)
    eager.set_attn_implementation("eager")
    assert fast_decoder(eager, "cpu") is None


@pytest.mark.parametrize("n_kv", [1, 2, 4])
def test_decode_attention_packed_heads_equal_enable_gqa(n_kv):
    """The CUDA layout (query heads packed per K/V head) and the CPU one (enable_gqa) are the same
    attention, and both match transformers' repeat_kv expansion (query head h reads K/V head h // n_rep)."""
    import torch.nn.functional as F
    from transformers.integrations.sdpa_attention import repeat_kv

    from model.fast_decode import decode_attention, pack_gqa_heads

    assert pack_gqa_heads("cuda") and not pack_gqa_heads("cpu") and not pack_gqa_heads("cpu", torch.float32)
    assert pack_gqa_heads("cpu", torch.bfloat16)  # CPU SDPA with enable_gqa is slow in bf16
    g = torch.Generator().manual_seed(0)
    B, Hq, n, D = 3, 4, 9, 16
    q = torch.randn(B, Hq, 1, D, generator=g)
    k, v = torch.randn(B, n_kv, n, D, generator=g), torch.randn(B, n_kv, n, D, generator=g)
    mask = torch.rand(B, 1, 1, n, generator=g) > 0.4
    mask[..., -1] = True  # the current token always attends itself
    cpu_path = decode_attention(q, k, v, mask, 0.25, pack=False)
    cuda_path = decode_attention(q, k, v, mask, 0.25, pack=True)
    assert cuda_path.shape == cpu_path.shape == (B, Hq, 1, D)
    torch.testing.assert_close(cuda_path, cpu_path, atol=1e-6, rtol=0)
    expanded = F.scaled_dot_product_attention(q, repeat_kv(k, Hq // n_kv), repeat_kv(v, Hq // n_kv), attn_mask=mask, scale=0.25)
    torch.testing.assert_close(cpu_path, expanded, atol=1e-6, rtol=0)
    # A masked key must not count: changing its value leaves every head's output alone.
    v2 = v.clone()
    v2[~mask[:, 0, 0, :].unsqueeze(1).expand_as(v[..., 0])] += 100.0
    torch.testing.assert_close(decode_attention(q, k, v2, mask, 0.25, pack=True), cuda_path, atol=1e-6, rtol=0)


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_fast_decode_cuda_layout_gives_the_cpu_logits(arch):
    """A decoder built for a CUDA device (packed GQA heads), run on CPU tensors, decodes like the CPU one."""
    from model.fast_decode import fast_decoder

    m = scramble(build_minimind(64, 2, arch=arch, vocab_size=256, num_attention_heads=4, num_key_value_heads=2), seed=5).eval()
    assert fast_decoder(m, "cuda").pack_gqa and not fast_decoder(m, "cpu").pack_gqa
    ids, mask = _left_pad(PROMPTS)
    want = _decode_logits(m, ids, mask, 8, fast=True)
    got = _decode_logits(m, ids, mask, 8, fast=True, device_type="cuda")
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(got.argmax(-1), want.argmax(-1))


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_fast_decode_prepacked_bf16_weights_give_the_same_logits(arch, monkeypatch):
    """On a CPU under bf16 the decode matmuls take oneDNN's prepacked weights: the same kernel as
    F.linear on the bf16 weight, so the logits are bit-identical, and so are the sampled tokens."""
    import torch.nn.functional as F

    import model.fast_decode as fd
    from model.fast_decode import FastDecoder, _onednn_linear, fast_decoder, onednn_prepack

    m = scramble(build_minimind(64, 2, arch=arch, vocab_size=256, num_attention_heads=4, num_key_value_heads=2), seed=6).eval()
    w = torch.randn(48, 64).bfloat16()
    if onednn_prepack(w, "cpu") is None:
        pytest.skip("this torch build has no oneDNN bf16 linear")
    assert onednn_prepack(w, "cuda") is None and onednn_prepack(w.float(), "cpu") is None
    x = torch.randn(3, 1, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(_onednn_linear(x, onednn_prepack(w, "cpu")), F.linear(x, w))
        dec = fast_decoder(m, "cpu")
        assert dec.linear is _onednn_linear and dec.pack_gqa
    ids, mask = _left_pad(PROMPTS)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = _decode_logits(m, ids, mask, 8, fast=True)
    # The same decoder with plain bf16 weights.
    monkeypatch.setattr(fd, "fast_decoder", lambda lm, dt: FastDecoder(lm, torch.bfloat16, dt, prepack=False))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = _decode_logits(m, ids, mask, 8, fast=True)
    assert torch.equal(got, want)


def test_token_logprobs_entropy_hand_computed():
    """The one entropy the trainer logs (sampler and scorer share token_logprobs): fp32, even from bf16."""
    logits = torch.tensor([[0.0, 0.0], [1000.0, 1000.0], [0.0, -1e9]])
    lp, ent = token_logprobs(logits, torch.tensor([0, 1, 0]), with_entropy=True)
    torch.testing.assert_close(ent, torch.tensor([math.log(2), math.log(2), 0.0]))
    torch.testing.assert_close(lp, torch.tensor([-math.log(2), -math.log(2), 0.0]))
    lp, ent = token_logprobs(torch.zeros(1, 3, dtype=torch.bfloat16), torch.tensor([2]), with_entropy=True)
    assert ent.dtype == lp.dtype == torch.float32
    torch.testing.assert_close(ent, torch.tensor([math.log(3.0)]))
    # Temperature: softmax(logits / T); T = 2 turns [0, 2 ln 4] into [0, ln 4]: probs 1/5, 4/5.
    lp, _ = token_logprobs(torch.tensor([[0.0, 2 * math.log(4.0)]]), torch.tensor([1]), temperature=2.0)
    torch.testing.assert_close(lp, torch.tensor([math.log(4 / 5)]))


def test_no_prepacking_where_onednn_has_no_bf16(monkeypatch):
    """A CPU without oneDNN's bf16 support (e.g. AVX2 only, --dtype bfloat16 forced) keeps plain weights."""
    import torch.nn.functional as F

    from model.fast_decode import fast_decoder, onednn_prepack

    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)
    assert onednn_prepack(torch.randn(8, 8).bfloat16(), "cpu") is None
    m = build_minimind(64, 2, vocab_size=64).eval()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert fast_decoder(m, "cpu").linear is F.linear


# ---------------------------------------------------------------- the static decode step (CUDA graphs' step)


def _static_vs_loop(m, ids, mask, seed: int | None = None, **kw) -> tuple[Samples, Samples]:
    """sample() with the static step run eagerly, and with the CPU's decode loop (the fast decoder either way)."""
    out = []
    for static in (True, False):
        if seed is not None:
            torch.manual_seed(seed)
        out.append(sample(m, ids, mask, decode=DecodeOptions(static_step=static), **kw))
    return out[0], out[1]


def _assert_same_up_to_rounding(a: Samples, b: Samples) -> None:
    """Same tokens, masks and stops; log-probs and entropies within fp32 rounding of attention's sums (the static
    step sums over every slot of the full-length buffers, the masked ones as exact zeros, in another order)."""
    assert torch.equal(a.sequences, b.sequences)
    assert torch.equal(a.response_mask, b.response_mask) and torch.equal(a.has_eos, b.has_eos)
    torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-5, rtol=0)
    torch.testing.assert_close(a.entropy, b.entropy, atol=1e-5, rtol=0)


@pytest.mark.parametrize("interval", [1, 3, 8])
def test_static_step_greedy_gives_the_decode_loop_samples(lm8_greedy_stops, interval):
    """The step a CUDA graph captures (full-length K/V written with index_copy_, one mask over every slot, sampling
    inside, outputs written at a device-side column) against the loop, rows stopping at EOS after 10, 6, 14, 6, 4
    tokens, under both host-check schedules."""
    ids, mask = _left_pad(STOP_PROMPTS)
    got, want = _static_vs_loop(lm8_greedy_stops, ids, mask, max_new_tokens=24, eos_token_id=EOS, pad_token_id=PAD,
                                greedy=True, return_logprobs=True, sync_interval=interval)
    _assert_same_up_to_rounding(got, want)
    assert got.response_mask.sum(1).tolist() == [10, 6, 14, 6, 4]


def test_static_step_seeded_sampling_gives_the_decode_loop_samples(lm8):
    """Sampled rows stopping at different steps, both schedules, and top-k/top-p: the same draws from the same
    stream give the same tokens."""
    ids, mask = _left_pad([[5, 6, 7], [3, 4, 5, 6, 7, 3]])
    lengths = []
    for seed in range(6):
        for interval, filters in ((1, {}), (8, {}), (1, {"top_k": 5, "top_p": 0.9})):
            got, want = _static_vs_loop(lm8, ids, mask, seed=seed, max_new_tokens=20, eos_token_id=EOS, pad_token_id=PAD,
                                        temperature=0.9, return_logprobs=True, sync_interval=interval, **filters)
            _assert_same_up_to_rounding(got, want)
            _check_samples(got, ids.shape[1], 20)
            lengths.append(got.sequences.shape[1] - ids.shape[1])
    assert min(lengths) < 20 and max(lengths) == 20, lengths  # some batches stopped early, some ran to the limit


def test_static_step_repeats_bit_for_bit(lm):
    """What a graph replays: the same step on the same inputs and seed gives the same bits (fp32 and bf16)."""
    ids, mask = _left_pad(PROMPTS)
    kw = dict(max_new_tokens=12, eos_token_id=EOS, pad_token_id=PAD, temperature=0.9, return_logprobs=True,
              decode=DecodeOptions(static_step=True))
    for ctx in (torch.autocast("cpu", enabled=False), torch.autocast("cpu", dtype=torch.bfloat16)):
        with ctx:
            runs = [sample(lm, ids, mask, generator=torch.Generator().manual_seed(1), **kw) for _ in range(2)]
        _assert_same_samples(*runs)


def test_static_step_with_a_generator_and_suppressed_eos(lm8):
    ids, mask = _left_pad([[5, 6, 7], [3, 4, 5, 6, 7, 3]])
    kw = dict(max_new_tokens=10, eos_token_id=EOS, pad_token_id=PAD, temperature=1.1, suppress_eos=True, return_logprobs=True)
    got = sample(lm8, ids, mask, decode=DecodeOptions(static_step=True), generator=torch.Generator().manual_seed(3), **kw)
    want = sample(lm8, ids, mask, decode=DecodeOptions(static_step=False), generator=torch.Generator().manual_seed(3), **kw)
    _assert_same_up_to_rounding(got, want)
    assert not got.has_eos.any() and got.response_mask.all()


def test_static_step_nonfinite_logits_raise(lm8):
    import copy

    bad = copy.deepcopy(lm8)
    with torch.no_grad():
        bad.model.norm.weight.fill_(float("nan"))
    ids, mask = _left_pad([[5, 6, 7]])
    with pytest.raises(RuntimeError, match="non-finite logits"):
        sample(bad, ids, mask, decode=DecodeOptions(static_step=True), max_new_tokens=4, eos_token_id=EOS, pad_token_id=PAD)


def test_cpu_sampling_keeps_its_decode_loop(lm8, monkeypatch):
    """On a CPU (cuda_graphs on, the default) the static step is not even built: the demo's numbers stay."""
    import model.generation as G

    monkeypatch.setattr(G, "StaticDecode", None)  # would fail if it were used
    ids, mask = _left_pad([[5, 6, 7]])
    sample(lm8, ids, mask, max_new_tokens=4, eos_token_id=EOS, pad_token_id=PAD, cuda_graphs=True)


@pytest.fixture
def graph_standin(monkeypatch):
    """CUDA graphs on the CPU through tests/test_decode_graphs.py's StandIn, in a cache of this test's own."""
    import model.decode_graphs as graphs
    import model.generation as G
    from tests.test_decode_graphs import StandIn

    b = StandIn()
    monkeypatch.setattr(graphs, "BACKEND", b)
    monkeypatch.setattr(graphs, "_DEVICES", {})
    monkeypatch.setattr(graphs, "FAILED_GRAPHS", [])
    monkeypatch.setattr(G, "_WARNED", set())
    return b


_GRAPH_KW = dict(max_new_tokens=16, eos_token_id=EOS, pad_token_id=PAD, temperature=0.9, return_logprobs=True,
                 decode=DecodeOptions(static_step=True))


def _graphed_and_eager(m, ids, mask, own: bool) -> tuple[Samples, Samples]:
    """sample() with graphs, then with the step launched eagerly (--cuda_graphs 0), from the same seed."""
    out = []
    for graphed in (True, False):
        torch.manual_seed(5)
        gen = torch.Generator().manual_seed(5) if own else None
        out.append(sample(m, ids, mask, generator=gen, cuda_graphs=graphed, **_GRAPH_KW))
    return out[0], out[1]


def test_a_failed_capture_is_cleaned_up_and_samples_as_the_eager_step(lm8, graph_standin, capsys):
    """A capture that fails (as an op that cannot be captured makes it): what it left in torch is cleaned up
    (Backend.clean_up, with the device's generator and torch's default one: a generator left in capture mode would
    make the next eager draw raise), its warm-up undone, and the rollout runs the step eagerly with the eager step's
    samples bit for bit, under torch's default stream and a caller's generator. Its bucket is not tried again, and
    the warning is said once."""
    import model.decode_graphs as graphs

    graph_standin.fail = True
    ids, mask = _left_pad([[5, 6, 7], [3, 4, 5, 6, 7, 3]])
    for own in (False, True):
        got, want = _graphed_and_eager(lm8, ids, mask, own)
        _assert_same_samples(got, want)
    assert graph_standin.calls.count("capture") == 1 and graph_standin.calls.count("clean_up") == 1
    dev = graphs.device_graphs(torch.device("cpu"))
    graph, generators = graph_standin.cleaned[0]
    assert generators == [dev.generator, torch.default_generator] and graphs.FAILED_GRAPHS[-1] is graph
    assert graph_standin.calls.count("pool") == 2  # later captures go to a new pool (the failed one may still be routed)
    assert graphs.graph_stats(torch.device("cpu")) == {"captures": 0, "failures": 1, "refused": 1, "graphs": 0,
                                                       "kv_bytes": dev.arena.numel()}
    assert capsys.readouterr().err.count("could not be captured in a CUDA graph") == 1


def test_a_generator_state_replaced_after_a_failed_capture_drops_the_graphs_registered_with_it(lm8, graph_standin):
    import model.decode_graphs as graphs

    short, long = _left_pad([[5, 6, 7]]), _left_pad([[5, 6, 7] * 8])
    sample(lm8, *long, **_GRAPH_KW)  # captured (the larger K/V first: it holds both)
    assert graphs.graph_stats(torch.device("cpu"))["graphs"] == 1
    graph_standin.fail = graph_standin.replaced = True
    got, want = _graphed_and_eager(lm8, *short, own=False)
    _assert_same_samples(got, want)
    assert graphs.graph_stats(torch.device("cpu"))["graphs"] == 0
    graph_standin.fail = False
    sample(lm8, *long, **_GRAPH_KW)
    assert graphs.graph_stats(torch.device("cpu"))["captures"] == 2  # captured again, registered with the new state


def test_a_step_that_waits_for_the_host_is_never_captured(lm8, graph_standin, monkeypatch, capsys):
    """The warm-up step runs with host syncs made errors (torch.cuda.set_sync_debug_mode("error") on a GPU): a step
    that would wait for the GPU raises there, no capture is started, and the rollout runs eagerly with the eager
    step's samples."""
    from model.fast_decode import FastDecoder

    real = FastDecoder.step

    def syncing(self, *a, **k):
        if graph_standin.probing:
            raise RuntimeError("called a synchronizing CUDA operation")
        return real(self, *a, **k)

    monkeypatch.setattr(FastDecoder, "step", syncing)
    ids, mask = _left_pad([[5, 6, 7], [3, 4, 5, 6, 7, 3]])
    got, want = _graphed_and_eager(lm8, ids, mask, own=True)
    _assert_same_samples(got, want)
    assert "capture" not in graph_standin.calls and graph_standin.calls.count("probe") == 1
    assert "waits for the GPU inside (called a synchronizing CUDA operation)" in capsys.readouterr().err


# ---------------------------------------------------------------- shared prefill of repeated prompts

def _grouped(prompts: list[list[int]], n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO's layout: each prompt's n rows side by side (repeat_interleave)."""
    ids, mask = _left_pad(prompts)
    return ids.repeat_interleave(n, 0), mask.repeat_interleave(n, 0)


def _prefill_rows(model) -> list[int]:
    """Rows of every forward with more than one position (the prefills) of `model` (a hook)."""
    seen: list[int] = []
    model.register_forward_pre_hook(lambda mod, args, kw: seen.append(kw["input_ids"].shape[0])
                                     if kw.get("input_ids") is not None and kw["input_ids"].shape[1] > 1 else None,
                                     with_kwargs=True)
    return seen


@pytest.mark.parametrize("fast", [True, False])
def test_repeated_prompts_are_prefilled_once_with_the_same_samples(fast):
    m = scramble(build_minimind(64, 2, vocab_size=256), seed=5).eval()
    ids, mask = _grouped(PROMPTS, 4)
    seen = _prefill_rows(m)
    kw = dict(max_new_tokens=10, eos_token_id=EOS, pad_token_id=PAD, temperature=0.9, return_logprobs=True,
              fast_decode=fast)
    shared = sample(m, ids, mask, generator=torch.Generator().manual_seed(0), **kw)
    assert seen == [3]  # 12 rows, 3 distinct prompts: one prefill of 3 rows
    each = sample(m, ids, mask, generator=torch.Generator().manual_seed(0), decode=DecodeOptions(share_prefill=False), **kw)
    assert seen == [3, 12]
    assert torch.equal(shared.sequences, each.sequences) and torch.equal(shared.response_mask, each.response_mask)
    torch.testing.assert_close(shared.logprobs, each.logprobs, atol=1e-5, rtol=0)
    assert len({tuple(r) for r in shared.sequences[:4].tolist()}) > 1  # a group's rows still sample apart


def test_shared_prefill_keeps_row_order_of_unsorted_groups():
    """Rows of one prompt need not be adjacent; each row decodes after its own prompt."""
    m = scramble(build_minimind(64, 2, vocab_size=256), seed=6).eval()
    ids, mask = _left_pad([PROMPTS[1], PROMPTS[0], PROMPTS[1], PROMPTS[2], PROMPTS[0]])
    seen = _prefill_rows(m)
    kw = dict(max_new_tokens=6, eos_token_id=EOS, pad_token_id=PAD, greedy=True)
    shared = sample(m, ids, mask, **kw)
    assert seen == [3]
    alone = [sample(m, ids[i : i + 1], mask[i : i + 1], **kw).sequences for i in range(5)]
    for i in range(5):
        assert torch.equal(shared.sequences[i : i + 1, : alone[i].shape[1]], alone[i])


# ---------------------------------------------------------------- shared-prompt attention (SharedPrefix)

def _count_shared_attention(monkeypatch) -> list[int]:
    """How many SharedPrefix.attend calls each sample() made (a wrapper)."""
    from model.fast_decode import SharedPrefix

    calls: list[int] = []
    real = SharedPrefix.attend

    def attend(self, *a, **k):
        calls.append(1)
        return real(self, *a, **k)

    monkeypatch.setattr(SharedPrefix, "attend", attend)
    return calls


@pytest.mark.parametrize("order", ["grouped", "shuffled"])
def test_shared_attention_gives_the_copied_prompt_kv_samples(order, monkeypatch):
    """fp32: attention over each prompt's K/V once equals attention over each row's copy (same tokens, log-probs to
    fp32 rounding), for left-padded prompts of different lengths and rows of one prompt in any order."""
    m = scramble(build_minimind(64, 2, vocab_size=256), seed=7).eval()
    ids, mask = _grouped(PROMPTS, 4)
    if order == "shuffled":
        perm = torch.randperm(ids.shape[0], generator=torch.Generator().manual_seed(1))
        ids, mask = ids[perm], mask[perm]
    calls = _count_shared_attention(monkeypatch)
    kw = dict(max_new_tokens=12, eos_token_id=EOS, pad_token_id=PAD, temperature=0.9, return_logprobs=True)
    shared = sample(m, ids, mask, generator=torch.Generator().manual_seed(0), **kw)
    assert len(calls) > 0  # the shared path ran
    n = len(calls)
    copied = sample(m, ids, mask, generator=torch.Generator().manual_seed(0), decode=DecodeOptions(shared_attention=False), **kw)
    assert len(calls) == n  # ...and the copy did not
    assert torch.equal(shared.sequences, copied.sequences) and torch.equal(shared.response_mask, copied.response_mask)
    torch.testing.assert_close(shared.logprobs, copied.logprobs, atol=1e-5, rtol=0)
    torch.testing.assert_close(shared.entropy, copied.entropy, atol=1e-5, rtol=0)


def test_shared_attention_each_row_equals_its_prompt_alone(monkeypatch):
    """Greedy, rows of two prompts interleaved: every row decodes what its prompt alone decodes."""
    m = scramble(build_minimind(64, 2, vocab_size=256), seed=8).eval()
    ids, mask = _left_pad([PROMPTS[1], PROMPTS[0], PROMPTS[0], PROMPTS[1]])
    calls = _count_shared_attention(monkeypatch)
    kw = dict(max_new_tokens=8, eos_token_id=EOS, pad_token_id=PAD, greedy=True)
    shared = sample(m, ids, mask, **kw)
    assert calls
    for i in range(4):
        alone = sample(m, ids[i : i + 1], mask[i : i + 1], **kw).sequences
        assert torch.equal(shared.sequences[i : i + 1, : alone.shape[1]], alone)


def test_shared_attention_bf16_agrees_with_sdpa_to_bf16_rounding(monkeypatch):
    """Under bf16 autocast the prompt part is computed in fp32 from the cache, SDPA in bf16: the first decoded
    token's log-probs agree to bf16 rounding (the greedy first two tokens are then the same)."""
    m = scramble(build_minimind(64, 2, vocab_size=256), seed=9).eval()
    ids, mask = _grouped(PROMPTS, 4)
    calls = _count_shared_attention(monkeypatch)
    kw = dict(max_new_tokens=2, eos_token_id=EOS, pad_token_id=PAD, greedy=True, return_logprobs=True, suppress_eos=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        shared = sample(m, ids, mask, **kw)
        copied = sample(m, ids, mask, decode=DecodeOptions(shared_attention=False), **kw)
    assert calls
    assert torch.equal(shared.sequences[:, -2], copied.sequences[:, -2])
    second = shared.sequences[:, -1] == copied.sequences[:, -1]
    assert second.float().mean() > 0.9
    # 0.1: a few bf16 roundings of a log-prob near -2 (0.056 seen on an AVX2-only CPU, whose autocast matmuls
    # round differently from AMX's); a prompt attended wrongly moves it by far more.
    torch.testing.assert_close(shared.logprobs[second, 1], copied.logprobs[second, 1], atol=0.1, rtol=0)


# ---------------------------------------------------------------- finished rows leave the decode batch

def _decode_rows(monkeypatch) -> list[int]:
    """The rows of every fast decode step (a wrapper)."""
    from model.fast_decode import FastDecoder

    rows: list[int] = []
    real = FastDecoder.step

    def step(self, tokens, *a, **k):
        rows.append(tokens.shape[0])
        return real(self, tokens, *a, **k)

    monkeypatch.setattr(FastDecoder, "step", step)
    return rows


@pytest.mark.parametrize("layout", ["distinct", "grouped", "shuffled"])
def test_finished_rows_leave_the_decode_batch_with_the_same_samples(layout, monkeypatch):
    """drop_finished: rows that stopped leave the decode batch (the steps run on fewer rows), and every row samples
    what the whole batch samples: the same tokens under a seed (each row keeps its uniform), log-probs and entropy
    to fp32 rounding; with distinct prompts (the copied cache) and GRPO's groups (SharedPrefix), in any row order."""
    m = scramble(build_minimind(64, 2, vocab_size=8), seed=13, std=0.4).eval()
    if layout == "distinct":
        ids, mask = _left_pad(STOP_PROMPTS)
    else:
        ids, mask = _grouped(STOP_PROMPTS[:3], 4)
        if layout == "shuffled":
            perm = torch.randperm(ids.shape[0], generator=torch.Generator().manual_seed(2))
            ids, mask = ids[perm], mask[perm]
    rows = _decode_rows(monkeypatch)
    kw = dict(max_new_tokens=24, eos_token_id=EOS, pad_token_id=PAD, temperature=0.8, return_logprobs=True)
    dropped_any = False
    for seed in range(4):
        rows.clear()
        got = sample(m, ids, mask, generator=torch.Generator().manual_seed(seed), **kw)
        assert rows == sorted(rows, reverse=True)  # the decode batch only shrinks
        dropped_any |= min(rows) < ids.shape[0]
        want = sample(m, ids, mask, generator=torch.Generator().manual_seed(seed), decode=DecodeOptions(drop_finished=False), **kw)
        assert torch.equal(got.sequences, want.sequences) and torch.equal(got.response_mask, want.response_mask)
        assert torch.equal(got.has_eos, want.has_eos)
        torch.testing.assert_close(got.logprobs, want.logprobs, atol=1e-5, rtol=0)
        torch.testing.assert_close(got.entropy, want.entropy, atol=1e-5, rtol=0)
        done = ~got.response_mask.bool()
        assert (got.logprobs[done] == 0).all() and (got.entropy[done] == 0).all()
    assert dropped_any


def test_finished_rows_leave_once_they_are_a_quarter_of_it(lm8_greedy_stops, monkeypatch):
    """Greedy STOP_PROMPTS stop after 10, 6, 14, 6 and 4 tokens: one stopped row of 5 is under a quarter, three
    (after token 6) are not: 2 rows go on; one of those 2 stops after token 10: the last row decodes alone."""
    ids, mask = _left_pad(STOP_PROMPTS)
    rows = _decode_rows(monkeypatch)
    s = sample(lm8_greedy_stops, ids, mask, max_new_tokens=24, eos_token_id=EOS, pad_token_id=PAD, greedy=True)
    assert s.response_mask.sum(1).tolist() == [10, 6, 14, 6, 4]
    # the step after token k computes token k + 1, on the rows left after token k
    assert rows == [5] * 5 + [2] * 4 + [1] * 4


def test_shared_attention_needs_equal_groups():
    from model.fast_decode import SharedPrefix

    assert SharedPrefix.applies(torch.tensor([0, 0, 1, 1, 2, 2]))
    assert SharedPrefix.applies(torch.tensor([1, 0, 2, 0, 1, 2]))
    assert not SharedPrefix.applies(torch.tensor([0, 0, 1, 2, 2, 2]))  # unequal: each row gets a copy instead


# ---------------------------------------------------------------- the two-level draw

@pytest.mark.parametrize("V", [40, 256, 1000, 4099])
def test_draw_from_probs_draws_the_distribution(V):
    """Frequencies of 20,000 draws match the probabilities, zero-probability entries (block edges included) are
    never drawn, for vocabularies below, at and past one block of 256 (and not a multiple of it)."""
    from model.generation import draw_from_probs

    g = torch.Generator().manual_seed(0)
    p = torch.zeros(V)
    hot = torch.randperm(V, generator=g)[:8]
    hot[0] = V - 1  # the vocabulary's last entry...
    if V > 256:
        hot[1] = 255  # ...and a block's last
    p[hot] = torch.rand(8, generator=g) + 0.1
    probs = (p / 3).expand(20000, V)  # unnormalised on purpose
    draws = draw_from_probs(probs, torch.Generator().manual_seed(1))
    assert bool((p[draws] > 0).all())
    freq = torch.bincount(draws, minlength=V).double() / draws.numel()
    want = (p / p.sum()).double()
    assert (freq - want).abs().max() < 0.01


def test_draw_from_probs_never_draws_past_a_blocks_last_positive_entry(monkeypatch):
    """u at the very top of the CDF (rounding may put it past the block's own running sum): the draw is the last
    entry with probability > 0, never a zero entry after it."""
    from model import generation as G

    p = torch.zeros(2, 700)
    p[0, 300], p[0, 301], p[1, 5] = 0.3, 0.7, 1.0  # entries after each last positive are 0
    monkeypatch.setattr(G.torch, "rand", lambda *a, **k: torch.full(a[0], 1.0 - 2.0 ** -53, dtype=torch.float64))
    assert G.draw_from_probs(p).tolist() == [301, 5]


def test_draw_from_probs_raises_or_flags_nonfinite():
    from model.generation import draw_from_probs

    with pytest.raises(RuntimeError, match="non-finite"):
        draw_from_probs(torch.tensor([[0.5, float("nan")]]))
    flag = torch.ones((), dtype=torch.bool)
    tok = draw_from_probs(torch.tensor([[0.5, float("nan")]]), finite=flag)
    assert not bool(flag) and 0 <= int(tok) < 2


@pytest.mark.parametrize("suppress_eos", [False, True])
def test_choose_tokens_plain_temperature_scores_as_token_logprobs(suppress_eos):
    """The fused path (one log-softmax for the draw, the log-prob and the entropy) gives token_logprobs' values bit
    for bit, and with suppress_eos never draws EOS (finished rows aside, which get pads)."""
    from model.generation import choose_tokens

    raw = 3 * torch.randn(64, 300, generator=torch.Generator().manual_seed(2))
    eos = torch.tensor([EOS, 7])
    finished = torch.zeros(64, dtype=torch.bool)
    finished[::5] = True
    nxt, lp, ent = choose_tokens(raw, finished=finished, pad_token_id=PAD, eos_t=eos, temperature=0.7, top_k=0, top_p=1.0, greedy=False,
                                 suppress_eos=suppress_eos, return_logprobs=True, score_temp=0.7,
                                 generator=torch.Generator().manual_seed(3), finite=None)
    want_lp, want_ent = token_logprobs(raw, nxt, 0.7, with_entropy=True)
    assert torch.equal(lp, want_lp) and torch.equal(ent, want_ent)
    assert bool((nxt[finished] == PAD).all())  # finished rows get pads (their log-prob is the pad's, as before)
    if suppress_eos:
        assert not bool(torch.isin(nxt[~finished], eos).any())


@pytest.mark.parametrize("top_k, top_p", [(0, 0.9), (20, 1.0), (20, 0.9)])
def test_kept_logprobs_are_the_distribution_the_sampler_draws_from(top_k, top_p):
    """The local sampler's mu under top-k / top-p: kept_logprobs, softmax over filter_logits renormalised over the kept
    tokens (vLLM's processed log-probs). It sums to 1 over the kept tokens alone, is log p - log S (S the kept mass),
    and the sampler's own draws (choose_tokens: sample_from_logits of filter_logits) land on each token at that rate;
    the full-vocabulary log-prob would be off by S. Without filters it is token_logprobs' value bit for bit."""
    g = torch.Generator().manual_seed(0)
    logits, T, V = torch.randn(3, 64, generator=g), 0.8, 64
    every = torch.arange(V).expand(3, V)
    lp = kept_logprobs(logits[:, None, :].expand(3, V, V), every, T, top_k, top_p)  # [3, V]: each token's
    kept = filter_logits(logits, T, top_k, top_p).isfinite()
    assert torch.equal(lp.isfinite(), kept) and kept.sum(-1).lt(V).all()
    torch.testing.assert_close(lp.exp().sum(-1), torch.ones(3))
    full, _ = token_logprobs(logits[:, None, :].expand(3, V, V), every, T)
    mass = full.exp().where(kept, 0.0).sum(-1, keepdim=True)
    assert mass.max() < 0.99
    torch.testing.assert_close(lp[kept], (full - mass.log()).expand(3, V)[kept])
    n = 20000
    draws = sample_from_logits(filter_logits(logits.repeat(n, 1), T, top_k, top_p), g).view(n, 3)
    freq = torch.stack([torch.bincount(draws[:, r], minlength=V) for r in range(3)]).double() / n
    assert (freq - lp.exp()).abs().max() < 0.015  # a few standard errors of 20,000 draws
    tv = (freq - full.exp()).abs().sum(-1) / 2  # from the untruncated distribution: 1 - S, less the draws' noise
    assert (tv > (1 - mass.squeeze(-1)) - 0.02).all()
    tokens = torch.randint(0, V, (3, 5), generator=g)
    assert torch.equal(kept_logprobs(logits[:, None].expand(3, 5, V), tokens, T),
                       token_logprobs(logits[:, None].expand(3, 5, V), tokens, T)[0])
