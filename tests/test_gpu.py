"""CUDA-only checks (the `gpu` marker): skipped where torch.cuda.is_available() is False (tests/conftest.py).

    python -m pytest -q -m gpu          # on a GPU machine; benchmarks/gpu_check.py runs them too

They run what the CPU suite can only stand in for: the fast decode path's CUDA layout under bf16 autocast,
train_ppo.py end to end on a GPU in bf16, --deterministic 1 repeating bit for bit on CUDA, the sampler's
log-probs against the scoring forward in bf16, and the decode step's CUDA graphs (bit for bit against the eager
step, kept across rollouts without growing memory, a step that cannot be captured).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from model.generation import DecodeOptions, preallocated_cache, sample
from model.loader import build_minimind
from tests.helpers import ROOT, make_tiny_world, read_metrics, run_train, scramble, tiny_flags

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda", 0)
EOS, PAD = 2, 0
PROMPTS = [[5, 9, 3, 7, 11, 4], [6, 8], [12, 3, 5, 9], [4, 4, 4, 7, 8]]
CLIP_LOG = math.log(1.2)  # |log ratio| at which the default --clip_epsilon 0.2 starts clipping


def _left_pad(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    from tests.test_generation import _left_pad as left_pad_cpu

    ids, mask = left_pad_cpu(prompts, PAD)
    return ids.to(CUDA), mask.to(CUDA)


@torch.no_grad()
def _forced_decode_logits(m: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, tokens: torch.Tensor,
                          fast: bool) -> torch.Tensor:
    """Decode-step logits [B, n, V] (fp32) with the tokens `tokens` [B, n] fed in, by the fast decoder or by
    transformers' forward: both paths see the same inputs, so their logits differ by rounding only."""
    from model.fast_decode import fast_decoder

    B, P = ids.shape
    n = tokens.shape[1]
    cache = preallocated_cache(m, P + n + 1)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    m(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True)
    dec = fast_decoder(m, "cuda") if fast else None
    assert (dec is not None) == fast
    kv = torch.cat([mask.bool(), torch.ones(B, n, dtype=torch.bool, device=CUDA)], 1)
    pos, steps = pos[:, -1:], []
    for i in range(n):
        pos = pos + 1
        nxt = tokens[:, i]
        if fast:
            last = dec.step(nxt, pos, kv[:, : P + i + 1], cache)
        else:
            mask = torch.cat([mask, torch.ones_like(nxt)[:, None]], 1)
            last = m(input_ids=nxt[:, None], attention_mask=mask, position_ids=pos, past_key_values=cache,
                     use_cache=True).logits[:, -1]
        steps.append(last.float())
    return torch.stack(steps, 1)


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_fast_decode_equals_plain_decode_under_bf16_on_cuda(arch):
    """CUDA layout (packed GQA heads, bf16 weights cast once) against transformers' decode, same tokens in.
    Tolerance: two bf16 rounding steps at the logits' scale (max |logit| x 2^-6): the CPU test allows one,
    and CUDA's decode and prefill attention kernels may each round once more. A wrong mask, rotary or
    weight layout is off by whole logits."""
    m = scramble(build_minimind(64, 2, arch=arch, vocab_size=256, num_attention_heads=4, num_key_value_heads=2),
                 seed=3).eval().to(CUDA)
    ids, mask = _left_pad(PROMPTS)
    tokens = torch.randint(3, 256, (len(PROMPTS), 8), generator=torch.Generator().manual_seed(0)).to(CUDA)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        want = _forced_decode_logits(m, ids, mask, tokens, fast=False)
        got = _forced_decode_logits(m, ids, mask, tokens, fast=True)
    torch.cuda.synchronize()
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, atol=want.abs().max().item() * 2 ** -6, rtol=0)
    assert (got.argmax(-1) == want.argmax(-1)).float().mean().item() >= 0.95  # near-ties may flip in bf16


def test_sample_fast_decode_and_plain_decode_agree_on_cuda_bf16():
    """sample() both ways from one seed: the tokens agree up to each row's first rounding-induced flip, and
    the log-probs agree there within 0.1 nats: a few bf16 steps of this model's logits, well under the clip
    threshold log 1.2, while a decoding bug is off by whole nats."""
    m = scramble(build_minimind(64, 2, vocab_size=256), seed=4).eval().to(CUDA)
    ids, mask = _left_pad(PROMPTS)
    kw = dict(max_new_tokens=12, eos_token_id=EOS, pad_token_id=PAD, temperature=0.9, return_logprobs=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        torch.manual_seed(0)
        fast = sample(m, ids, mask, fast_decode=True, **kw)
        torch.manual_seed(0)
        plain = sample(m, ids, mask, fast_decode=False, **kw)
    assert fast.sequences.device.type == "cuda" and fast.logprobs.dtype == torch.float32
    P = ids.shape[1]
    R = min(fast.logprobs.shape[1], plain.logprobs.shape[1])
    same = (fast.sequences[:, P:P + R] == plain.sequences[:, P:P + R]).long().cumprod(1).bool()  # common prefix
    same &= fast.response_mask[:, :R].bool()
    assert same[:, 0].all()  # the first token comes from the shared prefill: always the same draw
    assert same.sum().item() >= 0.5 * fast.response_mask[:, :R].sum().item()  # flips are rare, not the rule
    gap = (fast.logprobs[:, :R] - plain.logprobs[:, :R]).abs()[same]
    assert gap.max().item() <= 0.1, gap.max().item()


def _cuda_flags(world: dict, tmp: Path, name: str, **over) -> list[str]:
    return tiny_flags(world, tmp, device="cuda", dtype="bfloat16", max_steps=2, save_weight=name,
                      checkpoint_dir=str(tmp / f"ckpt_{name}"), run_dir=str(tmp / f"run_{name}"),
                      eval_data_path="none", **over)


def _load(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, map_location="cpu", weights_only=True)


def test_train_ppo_on_cuda_bf16_completes_and_writes_its_policy(tmp_path):
    world = make_tiny_world(tmp_path)
    run_train(_cuda_flags(world, tmp_path, "gpu"), cwd=tmp_path)
    rows = read_metrics(tmp_path / "run_gpu")
    assert [r["step"] for r in rows] == [1, 2]
    policy = _load(tmp_path / "out" / f"gpu_{world['hidden']}.pth")
    start = _load(Path(world["save_dir"]) / f"full_sft_{world['hidden']}.pth")
    assert policy.keys() == start.keys()
    assert all(torch.isfinite(t.float()).all() for t in policy.values())
    assert any(not torch.equal(policy[k].float(), start[k].float()) for k in policy)  # it trained
    run = json.loads((tmp_path / "run_gpu" / "run.json").read_text())
    assert str(run["device"]).startswith("cuda") and run["args"]["dtype"] == "bfloat16"


def test_deterministic_twice_on_cuda_gives_identical_weights(tmp_path):
    """--deterministic 1: torch's deterministic kernels and a fixed cuBLAS workspace; two runs from one seed
    end with the same policy file and the same fp32 actor/critic in the resume file, bit for bit."""
    from trainer.run.checkpoint import list_resume_files, read_resume

    world = make_tiny_world(tmp_path)
    for name in ("det_a", "det_b"):
        run_train(_cuda_flags(world, tmp_path, name, deterministic=1), cwd=tmp_path)
    a, b = (_load(tmp_path / "out" / f"{n}_{world['hidden']}.pth") for n in ("det_a", "det_b"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    states = []
    for name in ("det_a", "det_b"):
        files = list_resume_files(tmp_path / f"ckpt_{name}", f"{name}_{world['hidden']}_resume")
        assert files
        states.append(read_resume(files[0]))
    for part in ("actor", "critic"):
        x, y = states[0][part], states[1][part]
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x), part


def test_sampled_logprobs_match_policy_forward_on_cuda_bf16():
    """--rollout_logprobs 1 on a GPU in bf16 (the shipped 128x4 demo policy): the sampler's old log-probs
    against the update's own forward of the same sequences. Rounding only: a mean gap <= 1e-2 nats and no
    token at the clip boundary (|log ratio| < log 1.2), i.e. the first update does not clip on noise."""
    import train_ppo as T
    from dataset.rlaif import RLAIFDataset, collate_left_pad, read_rlaif_jsonl
    from model.forward import attention_implementation, policy_forward
    from trainer.dist import DistInfo
    from trainer.run.setup import setup

    args = T.parse_args(["--device", "cuda", "--dtype", "bfloat16", "--from_weight", "full_sft",
                         "--save_dir", str(ROOT / "out"), "--reward_model_path", "none", "--rm_weight", "0",
                         "--batch_size", "8", "--mini_batch_size", "8", "--max_gen_len", "32", "--rollout_logprobs", "1",
                         "--swanlab_mode", "disabled", "--data_path", str(ROOT / "dataset" / "demo_train.jsonl"),
                         "--eval_data_path", "none"])
    built = setup(args, DistInfo(device=CUDA))
    m, s, cfg = built.models, built.runtime, built.cfg
    assert s.device == CUDA and cfg.dtype == "bfloat16"
    records, _ = read_rlaif_jsonl(ROOT / "dataset" / "demo_train.jsonl")
    ds = RLAIFDataset(records[:8], m.tok, max_prompt_len=64, seed=0)
    batch = collate_left_pad([ds[i] for i in range(8)], pad_id=m.tok.pad_token_id)
    from trainer.run.phases import phases
    from trainer.run.timing import PhaseTimer

    exp = T.make_experience(cfg, batch, m, s, built.kl_ctl.value, built.custom_fns, phases(PhaseTimer(), s))
    ro = exp.rollout
    assert ro.sequences.device == CUDA
    with torch.no_grad(), s.autocast(), attention_implementation(cfg.train_attn, m.actor):
        lp, _ = policy_forward(m.actor, ro.sequences, ro.attention_mask, ro.response_len, cfg.sample_temperature)
    mask = ro.response_mask.bool()
    gap = (lp - ro.old_logprobs).abs()[mask]
    assert gap.numel() > 0 and torch.isfinite(gap).all()
    assert gap.mean().item() <= 1e-2, gap.mean().item()
    assert gap.max().item() < CLIP_LOG, gap.max().item()


@pytest.mark.parametrize("greedy", [True, False])
@pytest.mark.parametrize("own_generator", [False, True])
def test_cuda_graph_decode_equals_its_eager_step_bit_for_bit(greedy, own_generator):
    """sample() on CUDA with cuda_graphs (the static decode step captured once, replayed per token) against the same
    step launched op by op (cuda_graphs=False): the same tokens, log-probs and entropies, bit for bit, under bf16
    autocast, greedy and seeded sampling, drawing from torch's default CUDA generator or from one of its own (the
    graph advances the generator's Philox offset on every replay as an eager step does). Rows stop at EOS at
    different steps (vocabulary 8), so the host checks every 8 tokens and the cut after them are exercised."""
    from model.decode_graphs import release_cuda_graphs
    from model.generation import StaticDecode

    release_cuda_graphs()  # a cache of this test's own: the first graph run captures
    m = _graph_model()
    ids, mask = _left_pad(PROMPTS)
    kw = dict(max_new_tokens=24, eos_token_id=EOS, pad_token_id=PAD, temperature=0.9, greedy=greedy, return_logprobs=True)
    runs, captured = [], StaticDecode.captured
    for graphs in (True, False, True):
        gen = torch.Generator(CUDA).manual_seed(7) if own_generator else None
        torch.manual_seed(7)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            runs.append(sample(m, ids, mask, cuda_graphs=graphs, generator=gen, **kw))
    assert StaticDecode.captured == captured + 1  # captured once, replayed by both graph runs (no eager fallback)
    for got in (runs[0], runs[2]):
        want = runs[1]
        assert torch.equal(got.sequences, want.sequences) and torch.equal(got.response_mask, want.response_mask)
        assert torch.equal(got.logprobs, want.logprobs) and torch.equal(got.entropy, want.entropy)


def _graph_model() -> torch.nn.Module:
    """Vocabulary 8: rows stop at EOS at different steps."""
    return scramble(build_minimind(64, 2, vocab_size=8, num_attention_heads=4, num_key_value_heads=2), seed=2).eval().to(CUDA)


def _prompts(rows: int, length: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return _left_pad([torch.randint(3, 8, (length - (i % 3),), generator=g).tolist() for i in range(rows)])


def test_cuda_graphs_hold_no_growing_memory_over_20_rollouts():
    """20 rollouts cycling through 4 batch shapes in 3 buckets, bf16, as a PPO run's varying prompt lengths do: the
    graphs are captured in the first cycle only (one stream, one pool, one K/V buffer for all of them), and the
    memory torch reserves after the first cycle does not grow over the next 16 rollouts (before: a new pool and a
    new graph per rollout)."""
    from model.decode_graphs import graph_stats, release_cuda_graphs

    release_cuda_graphs()
    m = _graph_model()
    shapes = [(4, 70), (3, 12), (4, 20), (2, 80)]  # buckets (4, 96), (4, 64), (4, 64), (2, 128) with 24 new tokens
    # EOS suppressed: every rollout of a shape allocates the same, so only the graphs' memory could make it grow
    kw = dict(max_new_tokens=24, eos_token_id=EOS, pad_token_id=PAD, temperature=0.9, return_logprobs=True, suppress_eos=True)
    reserved, captures = [], []
    for i in range(20):
        ids, mask = _prompts(*shapes[i % 4], seed=i)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            s = sample(m, ids.to(CUDA), mask.to(CUDA), cuda_graphs=True, **kw)
        assert torch.isfinite(s.logprobs).all()
        torch.cuda.synchronize()
        if i in (3, 19):
            reserved.append(torch.cuda.memory_reserved(CUDA))
            captures.append(graph_stats(CUDA)["captures"])
    assert captures == [3, 3], captures
    assert reserved[1] <= reserved[0], reserved
    assert graph_stats(CUDA)["failures"] == 0


@pytest.mark.parametrize("probe", [True, False])
def test_a_decode_step_that_syncs_is_not_captured_and_samples_as_eager(probe, monkeypatch):
    """A decode step that reads a device value on the host (as a rotary embedding that checks its length does).
    probe: the warm-up under torch.cuda.set_sync_debug_mode("error") raises and no capture is started. Without the
    probe (switched off here) the capture really fails: what it left in torch is cleaned up. Either way the rollout
    samples what the eager step samples, bit for bit, torch's default generator still draws, and a later capture
    of another bucket works and replays the eager step's bits."""
    import contextlib

    import model.decode_graphs as graphs
    from model.fast_decode import FastDecoder

    graphs.release_cuda_graphs()
    m = _graph_model()
    kw = dict(max_new_tokens=24, eos_token_id=EOS, pad_token_id=PAD, temperature=0.9, return_logprobs=True)

    def both(ids: torch.Tensor, mask: torch.Tensor) -> None:
        runs = []
        for graphed in (True, False):
            torch.manual_seed(7)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                runs.append(sample(m, ids.to(CUDA), mask.to(CUDA), cuda_graphs=graphed, **kw))
        a, b = runs
        assert torch.equal(a.sequences, b.sequences) and torch.equal(a.logprobs, b.logprobs)
        assert torch.equal(a.entropy, b.entropy)

    real = FastDecoder.step

    def syncing(self, tokens, position, *a, **k):
        int(position.max())  # a host read of a device value
        return real(self, tokens, position, *a, **k)

    with monkeypatch.context() as patch:
        patch.setattr(FastDecoder, "step", syncing)
        if not probe:
            patch.setattr(graphs.Backend, "no_host_syncs", lambda self: contextlib.nullcontext())
        both(*_left_pad(PROMPTS))
        stats = graphs.graph_stats(CUDA)
        assert stats["captures"] == 0 and stats["refused"] == 1 and stats["failures"] == (0 if probe else 1), stats
    assert torch.isfinite(torch.rand(4, device=CUDA)).all()  # an eager draw from torch's default generator
    both(*_prompts(4, 60, seed=1))  # another bucket, a step that does not sync
    assert graphs.graph_stats(CUDA)["captures"] == 1


def test_cuda_graph_decode_gives_the_loop_samples_up_to_rounding():
    """The static step (what the graph replays) against the decode loop the CPU runs, on CUDA in fp32: the same
    tokens, log-probs within fp32 rounding of attention over more (masked) slots."""
    m = _graph_model()
    ids, mask = _left_pad(PROMPTS)
    kw = dict(max_new_tokens=24, eos_token_id=EOS, pad_token_id=PAD, temperature=0.9, return_logprobs=True)
    torch.manual_seed(3)
    got = sample(m, ids, mask, cuda_graphs=True, **kw)
    torch.manual_seed(3)
    want = sample(m, ids, mask, decode=DecodeOptions(static_step=False), **kw)
    assert torch.equal(got.sequences, want.sequences)
    torch.testing.assert_close(got.logprobs, want.logprobs, atol=1e-5, rtol=0)
