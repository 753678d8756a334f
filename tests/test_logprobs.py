"""model/logprobs.py: log-probs (and entropy) from hidden states and the LM head in token chunks (issue #74.4).

The chunked path must give the plain [rows, tokens, vocab] path's log-probs, entropy and gradients to fp32 rounding,
and must never hold a [tokens, vocab] tensor larger than one chunk: the second is checked op by op, on the outputs
of every aten op of a scoring forward and an update's backward."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import model.logprobs as L
from model.forward import output_head, policy_forward
from model.generation import token_logprobs
from model.loader import build_minimind
from model.logprobs import fused_chunk, head_logprobs, scoring_head, split_scores
from model.lora import AdapterSnapshot, AdaptersOff, add_lora, base_of
from tests.helpers import build_update_world, run_experience, run_update


def _close_at_scale(got: torch.Tensor, want: torch.Tensor, name: str) -> None:
    """Equal to fp32 rounding at the tensor's own scale: a gradient entry is a sum over tokens, and summing them in
    another order (chunk by chunk) moves a near-zero entry by the rounding of the large terms it cancels."""
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()), msg=name)


def _plain(h, w, b, t, temperature, with_entropy):
    return token_logprobs(F.linear(h, w, b), t, temperature, with_entropy)


def _run(fn, h, w, b, t, temperature, with_entropy, g_lp, g_ent):
    lp, ent = fn(h, w, b, t, temperature, with_entropy)
    loss = (lp * g_lp).sum() + ((ent * g_ent).sum() if with_entropy else 0)
    loss.backward()
    grads = [None if x is None or x.grad is None else x.grad.clone() for x in (h, w, b)]
    for x in (h, w, b):
        if x is not None:
            x.grad = None
    return lp.detach(), None if ent is None else ent.detach(), grads


@pytest.mark.parametrize("chunk", [1, 7, 64])  # 7 does not divide 37; 64 > N: one chunk
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("with_entropy", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_chunked_equals_plain_in_fp32(chunk, temperature, with_entropy, bias):
    torch.manual_seed(0)
    N, H, V = 37, 16, 53
    h = torch.randn(N, H, requires_grad=True)
    w = torch.randn(V, H, requires_grad=True)
    b = torch.randn(V, requires_grad=True) if bias else None
    t = torch.randint(0, V, (N,))
    g_lp, g_ent = torch.randn(N), torch.randn(N)
    chunked = _run(lambda *a: head_logprobs(*a[:5], chunk=chunk, with_entropy=a[5]), h, w, b, t, temperature,
                   with_entropy, g_lp, g_ent)
    plain = _run(_plain, h, w, b, t, temperature, with_entropy, g_lp, g_ent)
    torch.testing.assert_close(chunked[0], plain[0], rtol=1e-5, atol=1e-5)
    if with_entropy:
        torch.testing.assert_close(chunked[1], plain[1], rtol=1e-5, atol=1e-5)
    for got, want in zip(chunked[2], plain[2]):
        assert (got is None) == (want is None)
        if got is not None:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_chunked_equals_plain_under_bf16_autocast():
    """Under autocast the head computes in bf16 (nn.Linear's autocast cast), the log-softmax in fp32, as the plain path."""
    torch.manual_seed(1)
    N, H, V = 29, 32, 70
    h = torch.randn(N, H, requires_grad=True)
    w = (torch.randn(V, H) / 4).requires_grad_()
    t = torch.randint(0, V, (N,))
    g_lp, g_ent = torch.randn(N), torch.randn(N)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        chunked = _run(lambda *a: head_logprobs(*a[:5], chunk=6, with_entropy=a[5]), h, w, None, t, 0.8, True, g_lp, g_ent)
        plain = _run(_plain, h, w, None, t, 0.8, True, g_lp, g_ent)
    torch.testing.assert_close(chunked[0], plain[0], rtol=0, atol=1e-6)  # the same bf16 logits, fp32 after
    torch.testing.assert_close(chunked[1], plain[1], rtol=0, atol=1e-6)
    for got, want in zip(chunked[2][:2], plain[2][:2]):  # bf16 logits gradients: bf16 rounding
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("with_entropy", [False, True])
def test_frozen_head_equals_plain(with_entropy):
    """LoRA leaves the head frozen: the forward forms each token's d/dh and the backward only scales it (no second
    projection, no weight gradient); the hidden states' gradient is the plain path's."""
    torch.manual_seed(2)
    h = torch.randn(23, 8, requires_grad=True)
    w = torch.randn(20, 8)
    t = torch.randint(0, 20, (23,))
    g_lp, g_ent = torch.randn(23), torch.randn(23)
    chunked = _run(lambda *a: head_logprobs(*a[:5], chunk=4, with_entropy=a[5]), h, w, None, t, 0.6, with_entropy,
                   g_lp, g_ent)
    plain = _run(_plain, h, w, None, t, 0.6, with_entropy, g_lp, g_ent)
    assert w.grad is None and chunked[2][1] is None
    torch.testing.assert_close(chunked[0], plain[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(chunked[2][0], plain[2][0], rtol=1e-5, atol=1e-5)


class _LargestLogits(TorchDispatchMode):
    """The most tokens any non-view aten op's output holds at the vocabulary's width ([..., V])."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.vocab, self.most = vocab, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not func.is_view:
            for x in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(x, torch.Tensor) and x.dim() >= 2 and x.shape[-1] == self.vocab:
                    self.most = max(self.most, x.numel() // self.vocab)
        return out


@pytest.fixture(scope="module")
def world():
    w = build_update_world(["--temperature", "0.7", "--max_gen_len", "12"])
    torch.manual_seed(0)
    ro, _ = run_experience(w)
    return w, ro


@pytest.mark.parametrize("padding_free", [False, True])
def test_policy_forward_never_holds_the_logits(world, monkeypatch, padding_free):
    """A scoring forward and an update's forward + backward hold at most one chunk of [tokens, vocab]; the plain
    path (CHUNK_SIZE 0, what the code was) holds every response token's logits at once."""
    w, ro = world
    actor, V = w.actor, w.actor.config.vocab_size
    n_tokens = ro.sequences.shape[0] * ro.response_len

    def largest(chunk: int) -> int:
        monkeypatch.setattr(L, "CHUNK_SIZE", chunk)
        spy = _LargestLogits(V)
        with spy:
            lp, ent = policy_forward(actor, ro.sequences, ro.attention_mask, ro.response_len, 0.7, with_entropy=True,
                                     padding_free=padding_free)
            (lp.sum() + ent.sum()).backward()
        actor.zero_grad(set_to_none=True)
        return spy.most

    assert largest(5) <= 5
    assert largest(0) >= n_tokens // 2  # the plain path: the test sees the logits it is meant to catch


@pytest.mark.parametrize("padding_free", [False, True])
def test_policy_forward_equals_plain(world, monkeypatch, padding_free):
    """Log-probs, entropy and every actor gradient through the real model: chunked (5 tokens, which divides no row
    count here) against plain, at temperature 0.7."""
    w, ro = world
    actor = w.actor

    def run(chunk: int):
        monkeypatch.setattr(L, "CHUNK_SIZE", chunk)
        lp, ent = policy_forward(actor, ro.sequences, ro.attention_mask, ro.response_len, 0.7, with_entropy=True,
                                 padding_free=padding_free)
        mask = ro.response_mask
        ((lp * mask).sum() + 0.1 * (ent * mask).sum()).backward()
        grads = {n: p.grad.clone() for n, p in actor.named_parameters() if p.grad is not None}
        actor.zero_grad(set_to_none=True)
        return (lp * mask).detach(), (ent * mask).detach(), grads

    got, want = run(5), run(0)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-5)
    assert got[2].keys() == want[2].keys() and {"lm_head.weight", "model.embed_tokens.weight"} & set(got[2])
    for k in want[2]:
        _close_at_scale(got[2][k], want[2][k], k)


def _one_update(flags: list[str], chunk: int, monkeypatch) -> tuple[dict, dict]:
    monkeypatch.setattr(L, "CHUNK_SIZE", 0)
    w = build_update_world(flags)
    start = {n: p.detach().clone() for n, p in w.actor.named_parameters() if p.requires_grad}
    torch.manual_seed(0)
    ro, _ = run_experience(w)
    monkeypatch.setattr(L, "CHUNK_SIZE", chunk)
    run_update(w, ro)
    return start, {n: p.detach().clone() for n, p in w.actor.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("lora", [False, True])
def test_update_step_equals_plain(monkeypatch, lora):
    """The whole update (policy loss, KL in the loss, entropy bonus, temperature 0.7; a LoRA actor too): the actor's
    parameters after one update (two minibatches) with the chunked path equal the plain path's. AdamW's first steps
    are ~lr x sign(gradient), so an entry whose gradient is near zero turns the gradient's fp32 rounding into a step of
    up to lr: the bound is 1% of the largest step, and almost every entry must agree to 1e-6."""
    flags = ["--temperature", "0.7", "--entropy_coef", "0.01", "--kl_placement", "loss", "--learning_rate", "1e-3"]
    if lora:
        flags += ["--lora_r", "4", "--lora_alpha", "8"]
    start, chunked = _one_update(flags, 3, monkeypatch)
    _, plain = _one_update(flags, 0, monkeypatch)
    assert chunked.keys() == plain.keys() and chunked
    moved = max(float((plain[k] - start[k]).abs().max()) for k in plain)
    assert moved > 1e-4  # it trained
    off = sum(int(((chunked[k] - plain[k]).abs() > 1e-6).sum()) for k in plain)
    assert off <= 1e-3 * sum(v.numel() for v in plain.values())
    for k in plain:
        torch.testing.assert_close(chunked[k], plain[k], rtol=0, atol=0.01 * moved, msg=k)


def test_lora_reference_and_actor_scores_equal_plain(monkeypatch):
    """Scoring through a LoRA actor and its adapters-off reference (model/lora.py's AdaptersOff: the same head)."""
    w = build_update_world(["--lora_r", "4", "--lora_alpha", "8"])
    torch.manual_seed(0)
    for n, p in w.actor.named_parameters():  # adapters off the zero start, so actor and reference differ
        if "lora_B" in n:
            p.data.normal_(0, 0.05)
    ro, _ = run_experience(w)
    out = {}
    for chunk in (4, 0):
        monkeypatch.setattr(L, "CHUNK_SIZE", chunk)
        with torch.no_grad():
            out[chunk] = [policy_forward(m, ro.sequences, ro.attention_mask, ro.response_len, 0.8, with_entropy=True,
                                         padding_free=True) for m in (w.actor, w.models.ref)]
    for (lp, ent), (lp0, ent0) in zip(out[4], out[0]):
        torch.testing.assert_close(lp * ro.response_mask, lp0 * ro.response_mask, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ent * ro.response_mask, ent0 * ro.response_mask, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(out[4][0][0] * ro.response_mask, out[4][1][0] * ro.response_mask)


def test_output_head_is_the_actors_through_its_wrappers():
    """The chunked and packed paths project with output_head: a LoRA run's reference (AdaptersOff) and old actor
    (AdapterSnapshot) have their actor's, as DDP's and peft's wrappers do; a model of its own code has none."""
    actor = add_lora(build_minimind(64, 2), 4, 8.0, 0.0, "all-linear")
    head = base_of(actor).lm_head
    for m in (actor, base_of(actor), AdaptersOff(actor), AdapterSnapshot(actor)):
        assert output_head(m) is head, type(m).__name__
    assert output_head(torch.nn.Linear(2, 2)) is None


def test_scoring_head_restores_the_head_and_checks_shapes():
    head = torch.nn.Linear(4, 9, bias=False)
    x = torch.randn(2, 3, 4)
    with scoring_head(head, torch.zeros(2, 3, dtype=torch.long), 1.0, 2, True):
        lp, ent = split_scores(head(x), True)
        assert lp.shape == ent.shape == (2, 3)
        with pytest.raises(ValueError, match="do not match"):
            head(torch.randn(2, 5, 4))
    assert "forward" not in head.__dict__ and head(x).shape == (2, 3, 9)


def test_fused_chunk_falls_back_where_the_head_output_is_transformed():
    """Plain path: one chunk's worth of tokens, a soft-capped or scaled head output, a compiled model, chunking off."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    cfg = Gemma2Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                       num_key_value_heads=1, head_dim=8)
    gemma = Gemma2ForCausalLM(cfg)
    head = gemma.get_output_embeddings()
    assert cfg.final_logit_softcapping and fused_chunk(gemma, head, 1000, setting=4) == 0
    cfg2 = copy.deepcopy(cfg)
    cfg2.final_logit_softcapping = None
    gemma.config = cfg2
    assert fused_chunk(gemma, head, 1000, setting=4) == 4
    assert fused_chunk(gemma, head, 4, setting=4) == 0  # one chunk: nothing to save
    assert fused_chunk(gemma, head, 1000, setting=0) == 0
    assert fused_chunk(torch.compile(gemma), head, 1000, setting=4) == 0
    assert fused_chunk(gemma, torch.nn.Embedding(3, 3), 1000, setting=4) == 0
    assert L.chunk_tokens(151_936, -1) == (1 << 24) // 151_936


def test_auto_takes_chunks_where_they_cost_no_matmul_or_the_logits_are_large():
    """Auto (-1): scoring (no grad) and a frozen head (LoRA) always chunk; a head that trains only past
    TRAINED_HEAD_BYTES of fp32 logits (its backward projects every chunk again); an explicit size always chunks."""
    from model.loader import build_minimind

    m = build_minimind(32, 1, vocab_size=1000)
    head = m.get_output_embeddings()
    small, large = 100, L.TRAINED_HEAD_BYTES // (4 * 1000) + 1  # tokens: below and past the trained-head bytes
    chunk = L.chunk_tokens(1000, -1)
    assert fused_chunk(m, head, large, setting=-1) == chunk  # trains, logits past the bound
    assert fused_chunk(m, head, chunk + small, setting=-1) == 0  # trains, small logits: the faster plain path
    assert fused_chunk(m, head, chunk + small, setting=7) == 7  # asked for
    with torch.no_grad():
        assert fused_chunk(m, head, chunk + small, setting=-1) == chunk  # scoring
    head.weight.requires_grad_(False)
    assert fused_chunk(m, head, chunk + small, setting=-1) == chunk  # frozen head


@pytest.fixture
def group_of_one(tmp_path):
    """A gloo process group of one in this process (what `--strategy fsdp2` without torchrun gets)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


@pytest.mark.filterwarnings("ignore:FSDP2-wrapped module")
def test_fsdp2_sharded_actor_equals_plain(group_of_one, monkeypatch):
    """Under FSDP2 (trainer/run/sharding.py: the head in the root group, its weight a sharded DTensor outside the
    forward) the chunked path reads the weight FSDP2 gathered for the forward and its gradient reaches the shard:
    log-probs and every gradient equal the unsharded plain path's."""
    from model.loader import build_minimind
    from trainer.dist import whole
    from trainer.run import sharding

    torch.manual_seed(0)
    plain = build_minimind(64, 2)
    sharded = sharding.shard(copy.deepcopy(plain), group_of_one)
    seqs = torch.randint(5, 6000, (3, 20))
    mask = torch.ones_like(seqs)
    mask[0, :4] = 0  # a left-padded row
    out = {}
    for chunk, m in ((7, sharded), (0, plain)):
        monkeypatch.setattr(L, "CHUNK_SIZE", chunk)
        spy = _LargestLogits(plain.config.vocab_size)
        with spy:
            lp, ent = policy_forward(m, seqs, mask, 9, 0.7, with_entropy=True, padding_free=True)
            (lp.sum() + 0.1 * ent.sum()).backward()
        assert (spy.most <= 7) == (chunk == 7)  # the sharded run took the chunked path
        out[chunk] = lp.detach(), {n: whole(p.grad).detach().clone() for n, p in m.named_parameters()}
    torch.testing.assert_close(out[7][0], out[0][0], rtol=1e-5, atol=1e-5)
    assert out[7][1].keys() == out[0][1].keys()
    for k in out[0][1]:
        _close_at_scale(out[7][1][k], out[0][1][k], k)


def test_bf16_world_scores_and_gradients_equal_plain(monkeypatch):
    """--dtype bfloat16 (the run's autocast; the reference held in bf16): the actor's and the reference's log-probs,
    and the actor's gradients, match the plain path to bf16 rounding."""
    w = build_update_world(["--temperature", "0.7"], dtype="bfloat16")
    torch.manual_seed(0)
    ro, _ = run_experience(w)
    mask = ro.response_mask
    out = {}
    for chunk in (5, 0):
        monkeypatch.setattr(L, "CHUNK_SIZE", chunk)
        with w.runtime.autocast():
            lp, ent = policy_forward(w.actor, ro.sequences, ro.attention_mask, ro.response_len, 0.7, with_entropy=True,
                                     padding_free=True)
            with torch.no_grad():
                ref, _ = policy_forward(w.models.ref, ro.sequences, ro.attention_mask, ro.response_len, 0.7,
                                        padding_free=True)
        ((lp * mask).sum() + 0.1 * (ent * mask).sum()).backward()
        grads = {n: p.grad.clone() for n, p in w.actor.named_parameters() if p.grad is not None}
        w.actor.zero_grad(set_to_none=True)
        out[chunk] = (lp * mask).detach(), (ref * mask), grads
    torch.testing.assert_close(out[5][0], out[0][0], rtol=0, atol=1e-4)
    torch.testing.assert_close(out[5][1], out[0][1], rtol=0, atol=1e-4)
    for k in out[0][2]:
        g, want = out[5][2][k], out[0][2][k]
        assert (g - want).abs().max() <= 2e-2 * want.abs().max(), k


def test_bench_expands_the_logprob_paths_at_a_vocabulary():
    """benchmarks/bench_ppo.py: --logprob_chunk_size 0,-1 gives one config per path (each its own process: peak RSS
    is per process) at --vocab_size; the tiny reward model reads the tokenizer's ids, so it is refused there."""
    import benchmarks.bench_ppo as B

    p = B.build_parser()
    cfgs = B.expand_configs(p.parse_args(["--sizes", "896x2", "--vocab_size", "151936", "--dtypes", "float32",
                                          "--update_old_actor_freq", "0", "--reward_model", "none",
                                          "--logprob_chunk_size", "0,-1"]))
    assert [(c["name"], c["vocab_size"], c["logprob_chunk_size"]) for c in cfgs] == [
        ("896x2v151936", 151936, 0), ("896x2v151936", 151936, -1)]
    assert [len(g) for g in B.child_groups(cfgs, False)] == [1, 1]
    with pytest.raises(SystemExit, match="--reward_model none"):
        B.expand_configs(p.parse_args(["--sizes", "64x1", "--vocab_size", "1000"]))
