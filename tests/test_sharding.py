"""trainer/run/sharding.py: which layers are sharded, the DCP part of a resume checkpoint (its round trip into a
fresh optimizer, its crash-safe commit and clean-up, its restricted metadata reader). The sharded runs
themselves (2 fsdp2 processes == ddp == 1 process, exact resume, 2 -> 1 resharding, rank-local failures and
signals) are in tests/test_distributed.py and tests/test_lifecycle.py."""

from __future__ import annotations

import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from model.critic import CriticModel
from model.loader import build_minimind
from trainer.run import checkpoint as ckpt
from trainer.run import sharding
from trainer.runtime import DistInfo

# DCP in one process without a process group says so once per call; that is the point here.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def test_decoder_layers_of_policy_critic_and_hf_models(tmp_path):
    from transformers import AutoModelForCausalLM

    from tests.tiny_hf import save_tiny_causal_lm

    policy = build_minimind(64, 3)
    assert sharding.decoder_layers(policy) is policy.model.layers
    critic = CriticModel.from_policy(policy)
    assert sharding.decoder_layers(critic) is critic.trunk.layers
    save_tiny_causal_lm(tmp_path / "llama")
    llama = AutoModelForCausalLM.from_pretrained(tmp_path / "llama")
    assert sharding.decoder_layers(llama) is llama.model.layers
    with pytest.raises(ValueError, match="no list of decoder layers"):
        sharding.decoder_layers(torch.nn.Linear(2, 2))


def _stepped(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = build_minimind(64, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randint(5, 100, (2, 6))).logits.float().logsumexp(-1).mean().backward()
    opt.step()
    return model, opt


def test_dcp_round_trip_fills_a_fresh_optimizer(tmp_path):
    """What save_shards writes (model + AdamW state) loads into a model and an optimizer that has never stepped
    (its state is allocated first), exactly; the restricted metadata reader reads DCP's own records."""
    model, opt = _stepped(0)
    folder = tmp_path / "p_step00000001.dcp"
    sharding.save_shards({"actor": model, "critic": None}, {"actor": opt}, folder, DistInfo())
    assert (folder / ".metadata").is_file() and not (tmp_path / "p_step00000001.dcp.tmp").exists()
    fresh = build_minimind(64, 2)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
    sharding.load_shards({"actor": fresh, "critic": None}, {"actor": fresh_opt}, folder)
    for (n, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), n
    for a, b in zip(opt.state.values(), fresh_opt.state.values()):
        assert all(torch.equal(a[k], b[k]) for k in ("exp_avg", "exp_avg_sq", "step"))


class _Boom:
    def __reduce__(self):
        return (print, ("this would have run",))


def test_dcp_metadata_that_would_run_code_is_refused(tmp_path):
    model, opt = _stepped(1)
    folder = tmp_path / "p_step00000001.dcp"
    sharding.save_shards({"actor": model}, {}, folder, DistInfo())
    (folder / ".metadata").write_bytes(pickle.dumps(_Boom()))
    with pytest.raises(sharding.UnsafeShardsError, match="refused: its DCP metadata carries a pickled builtins.print"):
        sharding.load_shards({"actor": build_minimind(64, 2)}, {}, folder)
    with pytest.raises(CheckpointException, match="refused"):  # inside dcp.load too, reported as a read failure
        dcp.load(sharding.sharded_state({"actor": build_minimind(64, 2)}, {}), checkpoint_id=str(folder),
                 storage_reader=sharding.SafeReader(folder))


def test_a_save_killed_midway_leaves_the_last_committed_checkpoint_and_is_cleaned_up(tmp_path):
    """A sharded step counts once its .pth exists (written after the .dcp folder is complete): a kill while the
    shards were written (a .dcp.tmp folder) or before the .pth (a .dcp folder nobody names) leaves the previous
    step the newest; the next save removes both leftovers, and pruning removes a pruned step's folder too."""
    prefix = "p_64_resume"
    state = {"step": 0, "shards": None}
    for step in (1, 2):
        (tmp_path / f"{prefix}_step{step:08d}.dcp").mkdir()
        ckpt.save_resume({**state, "step": step, "shards": f"{prefix}_step{step:08d}.dcp"}, tmp_path, prefix, step, keep=2)
    (tmp_path / f"{prefix}_step00000003.dcp.tmp").mkdir()  # killed while the ranks wrote step 3's shards
    (tmp_path / f"{prefix}_step00000004.dcp").mkdir()      # killed after the rename, before the .pth
    assert [p.name for p in ckpt.list_resume_files(tmp_path, prefix)][0] == f"{prefix}_step00000002.pth"
    (tmp_path / f"{prefix}_step00000005.dcp").mkdir()
    ckpt.save_resume({**state, "step": 5, "shards": f"{prefix}_step00000005.dcp"}, tmp_path, prefix, 5, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{prefix}_step00000002.dcp", f"{prefix}_step00000002.pth",
                                                          f"{prefix}_step00000005.dcp", f"{prefix}_step00000005.pth"]


def test_resuming_across_strategies_is_refused_in_one_line():
    with pytest.raises(ckpt.ResumeError, match="--strategy is 'fsdp2' but the resume file was written with --strategy 'ddp'"):
        ckpt.check_compatible({"strategy": "ddp"}, {"strategy": "fsdp2"})


@pytest.mark.slow
def test_one_process_without_torchrun_runs_sharded(tmp_path):
    """`python train_ppo.py --strategy fsdp2` with no torchrun gets a process group of one (FSDP2 needs one)."""
    from tests.helpers import make_tiny_world, run_train, tiny_flags

    world = make_tiny_world(tmp_path / "w")
    run_train(tiny_flags(world, tmp_path, max_steps=1, strategy="fsdp2"), cwd=tmp_path)
    assert list((tmp_path / "ckpt").glob("*.dcp"))


@pytest.mark.filterwarnings("ignore:FSDP2-wrapped module")  # the trainer filters it too (trainer/run/sharding.py)
def test_a_bf16_parameter_policy_keeps_the_critic_head_in_fp32(tmp_path):
    """fsdp2 with bf16 parameters (GPUs with --dtype bfloat16): the critic's value head reads fp32 hidden
    states, so its own parameters must stay fp32 (it failed with a dtype mismatch on an H200, 2026-11-26).
    The same policy on a CPU process group of one stands in for the GPU's."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        critic = CriticModel.from_policy(build_minimind(64, 2))
        torch.nn.init.normal_(critic.value_head.weight)
        whole = CriticModel.from_policy(build_minimind(64, 2))
        whole.load_state_dict(critic.state_dict())
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        sharding.shard(critic, init_device_mesh("cpu", (1,)), mp)
        ids = torch.randint(5, 100, (2, 7))
        values = critic(ids, attention_mask=torch.ones_like(ids))
        assert values.dtype == torch.float32 and values.shape == (2, 7)
        ref = whole(ids, attention_mask=torch.ones_like(ids))
        assert (values - ref).abs().max() < 0.1 * ref.abs().max()  # bf16 trunk, fp32 head
    finally:
        dist.destroy_process_group()
