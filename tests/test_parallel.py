"""trainer/parallel.py: side-by-side actor/critic updates (--parallel_update)."""

from __future__ import annotations

import threading

import pytest
import torch

import train_ppo as T
from dataset.rlaif import RLAIFDataset, collate_left_pad, read_rlaif_jsonl
from model.loader import eos_token_ids
from tests.helpers import ROOT
from trainer.run.distributed import DistInfo
from trainer.run.parallel import run_side_by_side, use_parallel_update


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


def test_auto_is_on_only_for_single_process_cpu_bf16():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert use_parallel_update(-1, cpu, distributed=False, cpu_bf16=True)
        assert not use_parallel_update(-1, cpu, distributed=False, cpu_bf16=False)  # the fp32 demo stays sequential
        assert not use_parallel_update(-1, cpu, distributed=True, cpu_bf16=True)
        assert not use_parallel_update(-1, cuda, distributed=False, cpu_bf16=False)
        torch.set_num_threads(1)
        assert not use_parallel_update(-1, cpu, distributed=False, cpu_bf16=True)  # nothing to share
        assert use_parallel_update(1, cpu, distributed=False, cpu_bf16=False)
        assert not use_parallel_update(0, cpu, distributed=False, cpu_bf16=True)
    finally:
        torch.set_num_threads(threads)
    with pytest.raises(ValueError, match="--parallel_update 1 is for single-process CPU runs"):
        use_parallel_update(1, cpu, distributed=True, cpu_bf16=True)


def _one_update(parallel: int, dtype: str = "bfloat16") -> tuple[dict, list[torch.Tensor]]:
    """One rollout + one PPO update of a random 64x2 policy on demo prompts; returns the update's stats
    and every trained parameter afterwards."""
    args = T.parse_args(["--hidden_size", "64", "--num_hidden_layers", "2", "--from_weight", "none",
                         "--reward_model_path", "none", "--rm_weight", "0", "--batch_size", "4", "--mini_batch_size", "2",
                         "--max_gen_len", "8", "--dtype", dtype, "--warmup_steps", "0", "--parallel_update", str(parallel)])
    info = DistInfo()
    torch.manual_seed(0)
    amp = T.DTYPES[dtype]
    autocast = lambda: torch.autocast("cpu", dtype=amp, enabled=amp != torch.float32)
    actor, tok, ref, critic, old_actor, rm = T.build_models(args, info.device, torch.float32)
    kl_ctl = T.FixedKLController(args.kl_coef)
    optims, scheds = T.build_optimizers(args, actor, critic, 10)
    models = {"actor": actor, "critic": critic, "ref": ref, "old_actor": old_actor, "kl_ctl": kl_ctl,
              "eos_ids": eos_token_ids(actor, tok), "actor_train": actor, "critic_train": critic}
    records, _ = read_rlaif_jsonl(ROOT / "dataset" / "demo_train.jsonl")
    ds = RLAIFDataset(records[:4], tok, max_prompt_len=48, seed=0)
    batch = collate_left_pad([ds[i] for i in range(4)], pad_id=tok.pad_token_id)
    ro, _, _ = T.make_experience(args, batch, models, tok, rm, {}, kl_ctl, info, autocast)
    stats = T.ppo_update(args, ro, models, optims, scheds, 0, info, autocast, None)
    return stats, [p.detach().clone() for p in [*actor.parameters(), *critic.parameters()]]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_parallel_update_matches_the_sequential_one(dtype):
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)  # one thread everywhere: the two schedules run the same kernels
        seq_stats, seq_params = _one_update(0, dtype)
        par_stats, par_params = _one_update(1, dtype)
    finally:
        torch.set_num_threads(threads)
    assert seq_stats.keys() == par_stats.keys()
    for k in seq_stats:
        assert par_stats[k] == pytest.approx(seq_stats[k], rel=1e-6, abs=1e-7), k
    for a, b in zip(seq_params, par_params):
        torch.testing.assert_close(b, a, rtol=0, atol=0)


def test_parallel_update_is_deterministic():
    first = _one_update(1)
    second = _one_update(1)
    assert first[0] == second[0]
    assert all(torch.equal(a, b) for a, b in zip(first[1], second[1]))
