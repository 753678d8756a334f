"""The CUDA-graph cache of the static decode step (model/decode_graphs.py), on a CPU: shape buckets, one stream, pool and
weight copy per device, graphs reused across rollouts, padding that changes no real row, the caller's random stream.

torch.cuda's part is played by `StandIn` (a capture records the step and runs nothing, as a real capture runs
nothing; a replay runs it). What only a GPU shows (real captures, reserved memory over 20 rollouts, a capture that
really fails) is in tests/test_gpu.py."""

from __future__ import annotations

import contextlib
import gc
import random
import weakref

import pytest
import torch

import model.decode_graphs as graphs
import model.generation as G
from model.generation import DecodeOptions, sample
from model.loader import build_minimind
from tests.helpers import scramble

EOS, PAD = 2, 0


class StandInGraph:
    def __init__(self, fn):
        self.fn = fn
        self.reset_calls = 0

    def reset(self) -> None:
        self.reset_calls += 1


class StandIn(graphs.Backend):
    """torch.cuda's part on a CPU. fail: every capture fails (as an op that cannot be captured makes it); replaced:
    clean_up reports a generator state it had to replace; host_sync: the step waits for the host (raises inside
    no_host_syncs, as torch.cuda.set_sync_debug_mode("error") makes a real one)."""

    def __init__(self, fail: bool = False, replaced: bool = False):
        self.fail, self.replaced, self.host_sync = fail, replaced, False
        self.calls: list[str] = []
        self.cleaned: list[tuple] = []
        self.probing = False

    def applies(self, device):
        return True

    def canonical(self, device):
        return torch.device("cpu")

    def stream(self, device):
        self.calls.append("stream")
        return "stream"

    def pool(self, device):
        self.calls.append("pool")
        return (0, len(self.calls))

    def generator(self, device):
        return torch.Generator()

    def default_generator(self, device):
        return torch.default_generator

    @contextlib.contextmanager
    def side_stream(self, stream, device):
        yield

    @contextlib.contextmanager
    def no_host_syncs(self):
        self.calls.append("probe")
        self.probing = True
        try:
            yield
        finally:
            self.probing = False

    def capture(self, fn, stream, pool, device, generator):
        self.calls.append("capture")
        assert stream == "stream" and pool[0] == 0
        graph = StandInGraph(fn)
        if self.fail:
            raise graphs.CaptureFailed("operation not permitted when stream is capturing", graph)
        return graph

    def replay(self, graph):
        graph.fn()

    def clean_up(self, graph, device, pool, generators):
        self.calls.append("clean_up")
        self.cleaned.append((graph, generators))
        return self.replaced


@pytest.fixture
def standin(monkeypatch):
    """Graphs on the CPU through StandIn, in a cache of this test's own."""
    b = StandIn()
    monkeypatch.setattr(graphs, "BACKEND", b)
    monkeypatch.setattr(graphs, "_DEVICES", {})
    monkeypatch.setattr(graphs, "FAILED_GRAPHS", [])
    monkeypatch.setattr(G, "_WARNED", set())
    return b


@pytest.fixture(scope="module")
def lm8():
    return scramble(build_minimind(64, 2, vocab_size=8), seed=5, std=0.3).eval()


def batch(rows: int, prompt_len: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """rows left-padded prompts, the longest prompt_len tokens."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 8, (rows, prompt_len), generator=g)
    mask = torch.ones_like(ids)
    for i in range(1, rows):
        pad = int(torch.randint(0, prompt_len // 2 + 1, (1,), generator=g))
        ids[i, :pad], mask[i, :pad] = PAD, 0
    return ids, mask


KW = dict(max_new_tokens=10, eos_token_id=EOS, pad_token_id=PAD, temperature=0.9, return_logprobs=True,
          decode=DecodeOptions(static_step=True))


def draw(m, ids, mask, seed: int = 1, own: bool = False, **kw):
    """sample() from `seed`: torch's default stream, or a generator of the caller's (own)."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed) if own else None
    return sample(m, ids, mask, generator=gen, **{**KW, **kw})


def same(a, b) -> None:
    assert torch.equal(a.sequences, b.sequences) and torch.equal(a.response_mask, b.response_mask)
    assert torch.equal(a.has_eos, b.has_eos)
    assert torch.equal(a.logprobs, b.logprobs) and torch.equal(a.entropy, b.entropy)


# ---------------------------------------------------------------- buckets


def test_shape_bucket_values():
    assert [graphs.shape_bucket(n, 8) for n in (1, 2, 3, 5, 8, 9, 12, 13, 16, 17, 24, 25, 33, 48, 49)] == \
        [1, 2, 4, 8, 8, 12, 12, 16, 16, 24, 24, 32, 48, 48, 64]
    assert [graphs.shape_bucket(n, 64) for n in (20, 64, 65, 96, 97, 128, 129, 200, 300, 500, 700)] == \
        [32, 64, 96, 96, 128, 128, 192, 256, 384, 512, 768]
    for n in range(1, 3000):
        b = graphs.shape_bucket(n, 64)
        assert b >= n and (n <= 64 or 3 * (b - n) < b), n  # above the base, at most a third padding
    assert graphs.graph_shape(5, 150) == (8, 192)
    with pytest.raises(ValueError):
        graphs.shape_bucket(0, 8)


def test_a_steady_run_of_varying_shapes_maps_to_a_handful_of_graphs():
    """A PPO run: a fixed batch, prompts of every length up to 512 tokens, 256 new tokens -> 5 graphs; with the batch
    varying as well (--filter_groups rounds: 5-16 rows) 15, where a graph per shape would be hundreds."""
    rng = random.Random(0)
    fixed = {graphs.graph_shape(32, rng.randint(16, 512) + 256) for _ in range(1000)}
    assert len(fixed) <= 5, fixed
    varying = {graphs.graph_shape(rng.randint(5, 16), rng.randint(16, 512) + 256) for _ in range(1000)}
    assert len(varying) <= 15, varying


# ---------------------------------------------------------------- the cache


def test_graphs_are_kept_per_bucket_with_one_stream_and_pool_and_give_the_eager_samples(lm8, standin):
    """Twelve rollouts of three shapes in two buckets: two captures (not twelve), one stream and one pool, and every
    rollout's samples those of the same step run eagerly (--cuda_graphs 0) from the same seed, bit for bit, under
    torch's default stream and a generator of the caller's."""
    # (rows, prompt) -> buckets (2, 64), (4, 16), (4, 16); the largest K/V first (a larger one later would drop
    # the graphs that read the smaller buffer once: test_kv_views_are_aligned_contiguous_and_growing_drops_the_graphs)
    shapes = [(2, 30), (3, 5), (4, 6)]
    assert len({graphs.graph_shape(r, p + KW["max_new_tokens"]) for r, p in shapes}) == 2
    for i in range(12):
        r, p = shapes[i % 3]
        ids, mask = batch(r, p, seed=i)
        got = draw(lm8, ids, mask, seed=i, own=i % 2 == 1)
        want = draw(lm8, ids, mask, seed=i, own=i % 2 == 1, cuda_graphs=False)
        same(got, want)
    stats = graphs.graph_stats(torch.device("cpu"))
    assert stats["captures"] == 2 and stats["graphs"] == 2 and stats["failures"] == 0
    assert standin.calls.count("stream") == 1 and standin.calls.count("pool") == 1
    assert standin.calls.count("capture") == 2 and standin.calls.count("probe") == 2  # a probe before each capture


def test_least_recently_used_graphs_go_past_the_cap(lm8, standin, monkeypatch):
    monkeypatch.setattr(graphs, "GRAPH_CAP", 2)
    for p in (60, 30, 5, 60):  # buckets of length 96, 64, 16 (the largest K/V first), then 96 again (evicted meanwhile)
        draw(lm8, *batch(2, p))
    stats = graphs.graph_stats(torch.device("cpu"))
    assert stats["graphs"] == 2 and stats["captures"] == 4


def test_padded_rows_and_positions_change_no_real_row(lm8, standin, monkeypatch):
    """Greedy: 3 rows padded to 4 and 15 positions to 16 (a graph's bucket) give the exact shapes' tokens (a CPU's
    own static step), log-probs within rounding. Sampled: whatever the previous rollout (or garbage) left in the
    buffers a graph reuses, the same seed gives the same samples: loading a rollout resets all of them."""
    ids, mask = batch(3, 5, seed=4)
    got = draw(lm8, ids, mask, greedy=True)
    monkeypatch.setattr(graphs, "BACKEND", graphs.Backend())  # a CPU: exact shapes, no graphs
    want = draw(lm8, ids, mask, greedy=True)
    monkeypatch.setattr(graphs, "BACKEND", standin)
    assert torch.equal(got.sequences, want.sequences) and torch.equal(got.response_mask, want.response_mask)
    torch.testing.assert_close(got.logprobs, want.logprobs, atol=1e-5, rtol=0)

    first = draw(lm8, ids, mask, seed=9)
    draw(lm8, *batch(4, 6, seed=5), seed=3)  # the same bucket: every row and slot rewritten
    dev = graphs.device_graphs(torch.device("cpu"))
    dev.arena.fill_(255)  # every K/V byte NaN
    for entry in dev.entries.values():
        for t in entry.dec.state() + [entry.dec.prompt_mask]:
            t.copy_(torch.ones_like(t) if t.dtype == torch.bool else torch.full_like(t, 7))
    same(draw(lm8, ids, mask, seed=9), first)
    assert graphs.graph_stats(torch.device("cpu"))["captures"] == 2  # greedy's graph and the sampled one


@pytest.mark.parametrize("own", [False, True])
def test_the_callers_random_stream_moves_on_as_eager_draws_move_it(lm8, standin, own):
    """The graphs draw from the device's generator: the caller's (or torch's default) state is handed over before
    and back after, so the next draw from it is the one that follows the eager step's draws."""
    ids, mask = batch(3, 5)
    after = []
    for graphed in (True, False):
        torch.manual_seed(11)
        gen = torch.Generator().manual_seed(11) if own else None
        sample(lm8, ids, mask, generator=gen, cuda_graphs=graphed, **KW)
        after.append(torch.rand(4, generator=gen))
    assert torch.equal(after[0], after[1])


def test_new_weights_are_copied_into_the_graphs_weights(lm8, standin):
    """A graph outlives an update: the next rollout's decoder (new weights) is copied into the weights it reads."""
    import copy

    m = copy.deepcopy(lm8)
    ids, mask = batch(3, 5)
    draw(m, ids, mask)
    with torch.no_grad():
        for p in m.parameters():
            p.mul_(1.5)  # in place, as an optimizer step
    got = draw(m, ids, mask, seed=2)
    assert graphs.graph_stats(torch.device("cpu"))["captures"] == 1  # the same graph
    same(got, draw(m, ids, mask, seed=2, cuda_graphs=False))


def test_the_cache_holds_no_reference_to_the_model(standin):
    """A model sampled through the cache is freed when its owner drops it; another model drops the old graphs."""
    m = scramble(build_minimind(64, 2, vocab_size=8), seed=1).eval()
    ids, mask = batch(2, 5)
    draw(m, ids, mask)
    ref = weakref.ref(m)
    del m
    gc.collect()
    assert ref() is None
    other = scramble(build_minimind(64, 2, vocab_size=8), seed=2).eval()
    got = draw(other, ids, mask)
    same(got, draw(other, ids, mask, cuda_graphs=False))
    assert graphs.graph_stats(torch.device("cpu"))["captures"] == 2 and graphs.graph_stats(torch.device("cpu"))["graphs"] == 1


def test_release_cuda_graphs_drops_everything(lm8, standin):
    draw(lm8, *batch(2, 5))
    assert graphs.graph_stats(torch.device("cpu"))["graphs"] == 1
    graphs.release_cuda_graphs()
    assert graphs.graph_stats(torch.device("cpu")) == {"captures": 0, "failures": 0, "refused": 0, "graphs": 0, "kv_bytes": 0}


def test_kv_views_are_aligned_contiguous_and_growing_drops_the_graphs(standin):
    dev = graphs.device_graphs(torch.device("cpu"))
    dev.entries["x"] = graphs.Entry(dec=None)
    k, v = dev.kv([((2, 1, 16, 3), torch.bfloat16), ((2, 1, 16, 3), torch.float32)])
    assert k.dtype == torch.bfloat16 and v.dtype == torch.float32 and k.is_contiguous() and v.is_contiguous()
    assert (v.data_ptr() - dev.arena.data_ptr()) % 256 == 0 and v.data_ptr() >= k.data_ptr() + k.numel() * 2
    assert "x" in dev.entries  # the first buffer: nothing read the old one
    dev.entries["x"] = graphs.Entry(dec=None)
    dev.kv([((2, 1, 16, 3), torch.float32)])  # fits: kept
    assert "x" in dev.entries
    dev.kv([((4, 1, 32, 3), torch.float32)] * 2)  # larger: a new buffer, the graphs that read the old one go
    assert not dev.entries


# ---------------------------------------------------------------- Backend.clean_up (what a failed capture leaves)


def test_clean_up_ends_the_pool_resets_the_graph_and_refreshes_a_stuck_generator(monkeypatch):
    """torch <= 2.12 leaves a generator registered with a failed capture unable to draw: clean_up gives it a fresh
    copy of its state (same seed and offset) and says so; a generator that draws is left alone."""
    ended = []
    monkeypatch.setattr(torch._C, "_cuda_endAllocateToPool", lambda idx, pool: ended.append((idx, pool)), raising=False)

    class Gen:
        def __init__(self, stuck):
            self.stuck, self.state, self.swapped = stuck, torch.tensor([1, 2], dtype=torch.uint8), []

        def get_state(self):
            return self.state.clone()

        def set_state(self, s):
            self.state = s

        def clone_state(self):
            return "fresh copy"

        def graphsafe_set_state(self, s):
            self.swapped.append(s)
            self.stuck = False

    monkeypatch.setattr(graphs, "_draws", lambda g: not g.stuck)
    stuck, fine, graph = Gen(True), Gen(False), StandInGraph(None)
    assert graphs.Backend().clean_up(graph, torch.device("cuda", 1), (0, 5), [stuck, fine]) is True
    assert ended == [(1, (0, 5))] and graph.reset_calls == 1
    assert stuck.swapped == ["fresh copy"] and stuck.state.tolist() == [1, 2] and fine.swapped == []
    assert graphs.Backend().clean_up(graph, torch.device("cuda", 1), (0, 5), [fine]) is False
    monkeypatch.undo()
    g = torch.Generator().manual_seed(3)
    before = g.get_state()
    assert graphs._draws(g) and torch.equal(g.get_state(), before)  # a working generator draws; its state put back


@pytest.mark.parametrize("graphed", [True, False])
def test_the_prefills_kv_are_freed_once_loaded(lm8, standin, monkeypatch, graphed):
    """In bucketed shapes the step reads buffers of its own: the prefill's K/V are let go once copied in, so one copy
    of the K/V is alive while decoding, not two."""
    made = []
    real = G.preallocated_cache
    monkeypatch.setattr(G, "preallocated_cache", lambda *a, **k: made.append(real(*a, **k)) or made[-1])
    draw(lm8, *batch(3, 5), cuda_graphs=graphed)
    assert made and all(layer._k is None and layer.keys is None for layer in made[0].layers)
