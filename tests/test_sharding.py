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


def _global_call(module: str, name: str, arg: str) -> bytes:
    """A protocol-4 pickle that calls `module`'s `name` (protocol 4 walks a dotted name attribute by attribute) with
    one string: what a crafted .metadata file holds."""
    text = lambda x: b"\x8c" + bytes([len(x.encode())]) + x.encode()  # noqa: E731 - SHORT_BINUNICODE
    return b"\x80\x04" + text(module) + text(name) + b"\x93" + text(arg) + b"\x85R."  # STACK_GLOBAL, TUPLE1, REDUCE


@pytest.mark.parametrize("module, name", [
    ("torch.distributed.checkpoint.filesystem", "os.system"),  # a dotted name under DCP's own modules
    ("torch.distributed.checkpoint.metadata", "os.system"),
    ("os", "system"),
])
def test_dcp_metadata_reaching_os_system_is_refused_and_runs_nothing(tmp_path, module, name):
    model, opt = _stepped(1)
    folder = tmp_path / "p_step00000001.dcp"
    sharding.save_shards({"actor": model}, {"actor": opt}, folder, DistInfo())
    marker = tmp_path / "pwned"
    (folder / ".metadata").write_bytes(_global_call(module, name, f"touch {marker}"))
    with pytest.raises(sharding.UnsafeShardsError) as e:
        sharding.load_shards({"actor": build_minimind(64, 2)}, {"actor": torch.optim.AdamW(build_minimind(64, 2).parameters())},
                             folder)
    msg = str(e.value)
    assert "\n" not in msg and f"refused: its DCP metadata carries a pickled {module}.{name}" in msg and str(folder) in msg
    assert not marker.exists()


class _Touch:
    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_a_dcp_bytes_entry_carrying_code_is_refused_and_runs_nothing(tmp_path):
    """DCP stores the optimizer's param_groups (lr, betas, ...) as pickled bytes entries, which its own planner
    reads with torch.load(weights_only=False): an entry swapped for a pickle that creates a file is refused in
    one line, and the file is never created."""
    import io

    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    model, opt = _stepped(2)
    folder = tmp_path / "p_step00000001.dcp"
    sharding.save_shards({"actor": model}, {"actor": opt}, folder, DistInfo())
    meta = pickle.loads((folder / ".metadata").read_bytes())  # the test's own file: trusted here
    fqn = next(k for k, v in meta.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata) and k.endswith(".lr"))
    index = next(i for i in meta.storage_data if i.fqn == fqn)
    info = meta.storage_data[index]
    marker = tmp_path / "pwned"
    blob = io.BytesIO()
    torch.save(_Touch(marker), blob)
    data = folder / info.relative_path
    info.offset, info.length = data.stat().st_size, len(blob.getvalue())
    with data.open("ab") as f:
        f.write(blob.getvalue())
    (folder / ".metadata").write_bytes(pickle.dumps(meta))
    fresh = build_minimind(64, 2)
    with pytest.raises(sharding.UnsafeShardsError) as e:
        sharding.load_shards({"actor": fresh}, {"actor": torch.optim.AdamW(fresh.parameters())}, folder)
    msg = str(e.value)
    assert "\n" not in msg and f"refused: its DCP entry {fqn} is not plain data" in msg
    assert not marker.exists()


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


def _unsharded_grad_bytes(model: torch.nn.Module) -> int:
    """Bytes of whole (unsharded) gradients FSDP2 holds between micro-batches."""
    from trainer.dist import fsdp_modules

    total = 0
    for module in fsdp_modules(model):
        for group in module._get_fsdp_state()._fsdp_param_groups:
            for p in group.fsdp_params:
                for g in (p.unsharded_accumulated_grad, getattr(getattr(p, "_unsharded_param", None), "grad", None)):
                    total += 0 if g is None else g.numel() * g.element_size()
    return total


@pytest.mark.filterwarnings("ignore:FSDP2-wrapped module")
def test_accumulating_micro_batches_keeps_no_whole_gradient(group_of_one):
    """Under fsdp2, gradient accumulation (D.no_sync) still reduce-scatters each micro-batch: no rank holds whole
    fp32 gradients between micro-batches (with FSDP2's sync off it would, +4 bytes per parameter)."""
    from trainer.dist import no_sync

    torch.manual_seed(0)
    model = sharding.shard(build_minimind(64, 2), group_of_one)
    ids = torch.randint(5, 100, (2, 6))
    with no_sync(model):
        model(ids).logits.float().logsumexp(-1).mean().backward()
    assert _unsharded_grad_bytes(model) == 0
    assert all(p.grad is not None for p in model.parameters())  # the shard's gradient, accumulated there
    model(ids).logits.float().logsumexp(-1).mean().backward()  # the synced micro-batch adds to it
    assert _unsharded_grad_bytes(model) == 0


@pytest.mark.filterwarnings("ignore:FSDP2-wrapped module")
def test_a_sharded_save_before_the_first_update_takes_no_hidden_adamw_step(group_of_one):
    """DCP allocates an unstepped optimizer's state with a real AdamW step at lr 0 (its counter then reads 1): a
    save inside --critic_warmup_steps must leave the actor's first update bias-corrected as step 1, exactly as a run
    that never saved."""
    ids = torch.randint(5, 100, (2, 6))

    def first_update(save_first: bool) -> tuple[list[torch.Tensor], list[float]]:
        torch.manual_seed(0)
        model = sharding.shard(build_minimind(64, 2), group_of_one)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        saved_steps = []
        if save_first:  # what DCP would write now
            state = sharding.sharded_state({"actor": model}, {"actor": opt})["optim/actor"]["state"]
            saved_steps = [float(s["step"]) for s in state.values()]
        model(ids).logits.float().logsumexp(-1).mean().backward()
        opt.step()
        return [p.detach().full_tensor().clone() for p in model.parameters()], saved_steps

    plain, _ = first_update(False)
    after_save, saved_steps = first_update(True)
    assert saved_steps and set(saved_steps) == {0.0}  # a fresh AdamW state is written
    assert all(torch.equal(a, b) for a, b in zip(plain, after_save))


def test_fsdp2_builds_its_optimizers_over_the_shards_only(tmp_path, group_of_one, monkeypatch):
    """No optimizer exists while fully_shard replaces the parameters: the whole originals die with sharding (an
    optimizer built before it would keep them, whole and in fp32, on every GPU)."""
    import gc
    import weakref

    from tests.helpers import make_tiny_world, tiny_flags
    from trainer.run import setup as S
    from trainer.run.cli import parse_args

    world = make_tiny_world(tmp_path / "w")
    originals: list = []
    alive_after_sharding: list[int] = []
    real_shard = S.shard_models

    def shard_and_count(cfg, models, info, mesh):
        originals.extend(weakref.ref(p) for p in [*models.actor.parameters(), *models.critic.parameters()])
        real_shard(cfg, models, info, mesh)
        gc.collect()
        alive_after_sharding.append(sum(r() is not None for r in originals))

    monkeypatch.setattr(S, "shard_models", shard_and_count)
    built = S.setup(parse_args(tiny_flags(world, tmp_path, strategy="fsdp2")), DistInfo())
    assert originals and alive_after_sharding == [0]
    trained = {id(p) for o in built.optim.optims.values() for g in o.param_groups for p in g["params"]}
    assert trained == {id(p) for p in [*built.models.actor.parameters(), *built.models.critic.parameters()]}
