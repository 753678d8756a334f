"""trainer/parallel.py: side-by-side actor/critic updates (--parallel_update)."""

from __future__ import annotations

import threading

import pytest
import torch

from tests.helpers import build_update_world, run_experience, run_update
from trainer.parallel import run_side_by_side
from trainer.run.hardware import use_parallel_update


def test_side_by_side_runs_each_piece_single_threaded_and_keeps_order():
    main_threads = torch.get_num_threads()
    seen = []

    def piece(i):
        def fn():
            seen.append(threading.get_ident())
            return i, torch.get_num_threads()
        return fn

    assert run_side_by_side([piece(0), piece(1)], parallel=True) == [(0, 1), (1, 1)]
    assert threading.get_ident() not in seen  # both ran on workers
    assert torch.get_num_threads() == main_threads  # the caller's setting is untouched
    seen.clear()
    assert run_side_by_side([piece(0), piece(1)], parallel=False) == [(0, main_threads), (1, main_threads)]
    assert seen == [threading.get_ident()] * 2


def test_side_by_side_reraises_a_pieces_error():
    def boom():
        raise RuntimeError("critic exploded")

    with pytest.raises(RuntimeError, match="critic exploded"):
        run_side_by_side([lambda: 1, boom], parallel=True)


def test_auto_is_on_only_for_single_process_cpu_bf16_without_reused_values():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert use_parallel_update(-1, cpu, distributed=False, cpu_bf16=True)
        assert not use_parallel_update(-1, cpu, distributed=False, cpu_bf16=False)  # the fp32 demo stays sequential
        assert not use_parallel_update(-1, cpu, distributed=True, cpu_bf16=True)
        assert not use_parallel_update(-1, cuda, distributed=False, cpu_bf16=False)
        # One minibatch reusing the critic's scoring forward: the critic's part is a backward alone.
        assert not use_parallel_update(-1, cpu, distributed=False, cpu_bf16=True, reuse_values=True)
        assert use_parallel_update(1, cpu, distributed=False, cpu_bf16=True, reuse_values=True)
        torch.set_num_threads(1)
        assert not use_parallel_update(-1, cpu, distributed=False, cpu_bf16=True)  # nothing to share
        assert use_parallel_update(1, cpu, distributed=False, cpu_bf16=False)
        assert not use_parallel_update(0, cpu, distributed=False, cpu_bf16=True)
    finally:
        torch.set_num_threads(threads)
    with pytest.raises(SystemExit, match="--parallel_update 1 is for single-process CPU runs"):
        use_parallel_update(1, cpu, distributed=True, cpu_bf16=True)


def _one_update(parallel: int, dtype: str = "bfloat16") -> tuple[dict, dict, dict]:
    """One rollout + one PPO update of a random 64x2 policy on demo prompts; returns the update's stats
    and every trained parameter ({"actor": [...], "critic": [...]}) before and after the update."""
    world = build_update_world(["--parallel_update", str(parallel)], dtype=dtype)
    ro, _ = run_experience(world)

    def trained():
        return {"actor": [p.detach().clone() for p in world.actor.parameters()],
                "critic": [p.detach().clone() for p in world.critic.parameters()]}

    before = trained()
    stats = run_update(world, ro, step=0)
    return stats, before, trained()


def _flat(params: dict) -> list[torch.Tensor]:
    return [*params["actor"], *params["critic"]]


def _assert_moved(before: dict, after: dict) -> None:
    """The update took a step on both models (else the equality tests below prove nothing)."""
    for name in ("actor", "critic"):
        assert len(before[name]) == len(after[name])
        assert not all(torch.equal(a, b) for a, b in zip(before[name], after[name])), f"no {name} parameter moved"


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_parallel_update_matches_the_sequential_one(dtype):
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)  # one thread everywhere: the two schedules run the same kernels
        seq_stats, seq_before, seq_params = _one_update(0, dtype)
        par_stats, par_before, par_params = _one_update(1, dtype)
    finally:
        torch.set_num_threads(threads)
    _assert_moved(seq_before, seq_params)
    _assert_moved(par_before, par_params)
    assert all(torch.equal(a, b) for a, b in zip(_flat(seq_before), _flat(par_before)))  # same start
    assert seq_stats.keys() == par_stats.keys()
    for k in seq_stats:
        assert par_stats[k] == pytest.approx(seq_stats[k], rel=1e-6, abs=1e-7), k
    for a, b in zip(_flat(seq_params), _flat(par_params)):
        torch.testing.assert_close(b, a, rtol=0, atol=0)


@pytest.mark.slow
def test_parallel_update_is_deterministic():
    first = _one_update(1)
    second = _one_update(1)
    _assert_moved(first[1], first[2])
    assert first[0] == second[0]
    assert all(torch.equal(a, b) for a, b in zip(_flat(first[2]), _flat(second[2])))
