"""Distributed training: trainer/dist.py's collectives (D), trainer/run/distributed.py's process group and
failure agreement (distributed), and torchrun DDP runs of train_ppo.py
on CPU (gloo, 2 processes), which is how CI tests DDP without a GPU.

The end-to-end runs share a module-scoped tiny world and one 2-process run (smoke, equivalence
and resume all read it), so the file costs ~4 process launches in all.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import socket
import time
from pathlib import Path

import pytest
import torch

from tests.helpers import ROOT, deep_equal, free_port, make_tiny_world, read_metrics, resume_state, run_train, spawn_ranks, tiny_flags
from trainer import dist as D
from trainer.ppo import explained_variance, masked_whiten
from trainer.run import distributed

FIXTURES = ROOT / "tests" / "fixtures"
SINGLE = D.DistInfo()

# Greedy decoding + deterministic rewards (tiny reward model + low_id_share): the only difference
# between 2 x B/2 and 1 x B is floating-point summation order. The adaptive KL controller is on
# (with a short horizon, so the coefficient moves a lot) because it must see the GLOBAL kl_ref.
# --rollout_logprobs 0: old log-probs from a full forward, as the update computes them, so the first
# ratio is exactly 1 on both sides. Sampling-pass log-probs differ from it by ~1e-6 depending on the
# batch's padding (2 x B/2 vs 1 x B), and Adam turns that into lr-sized steps on a few near-zero-
# gradient weights (max diff 7e-4 observed): fp noise, not a DDP difference, so it stays out of here.
EQUIV = dict(device="cpu", greedy=1, rollout_logprobs=0, learning_rate=1e-3, critic_learning_rate=1e-3, adaptive_kl=1, kl_coef=0.1,
             kl_horizon=4, reward_fn=f"{FIXTURES / 'toy_rewards.py'}:low_id_share", max_steps=3, save_interval=1,
             keep_checkpoints=10, save_weight="ddp")
GLOBAL_BATCH = 4
# Stated tolerance for "same final weights" (fp32, 3 steps at lr 1e-3, weights move ~4e-3):
# max |diff| < 5e-5 and mean |diff| < 1e-7. Observed: max ~7e-6, mean ~2e-9; the max comes from
# Adam turning fp noise in near-zero gradients into lr-sized steps on a few elements.
MAX_ABS, MEAN_ABS = 5e-5, 1e-7


def _resume_files(ckpt_dir: Path) -> list[Path]:
    return sorted(ckpt_dir.glob("*_resume_step*.pth"))


def _load(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


def _timed_run(flags: list[str], cwd: Path, procs: int = 0, timeout: int = 240):
    t0 = time.perf_counter()
    r = run_train(flags, cwd=cwd, torchrun_procs=procs, timeout=timeout)
    return r, time.perf_counter() - t0


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return make_tiny_world(tmp_path_factory.mktemp("dist_world"))


@pytest.fixture(scope="module")
def two_procs(world, tmp_path_factory):
    """torchrun --nproc_per_node 2 train_ppo.py --device cpu --max_steps 3, per-rank batch B/2."""
    tmp = tmp_path_factory.mktemp("two_procs")
    flags = tiny_flags(world, tmp, **EQUIV, batch_size=GLOBAL_BATCH // 2, mini_batch_size=GLOBAL_BATCH // 2)
    r, secs = _timed_run(flags, tmp, procs=2)
    print(f"2-process run: {secs:.1f} s")
    return {"tmp": tmp, "r": r}


@pytest.fixture(scope="module")
def fsdp2_procs(world, tmp_path_factory):
    """The two_procs run under --strategy fsdp2: each rank holds half of every trained tensor."""
    tmp = tmp_path_factory.mktemp("fsdp2_procs")
    flags = tiny_flags(world, tmp, **{**EQUIV, "save_weight": "fsdp2"}, batch_size=GLOBAL_BATCH // 2,
                       mini_batch_size=GLOBAL_BATCH // 2, strategy="fsdp2")
    r, secs = _timed_run(flags, tmp, procs=2)
    print(f"2-process fsdp2 run: {secs:.1f} s")
    return {"tmp": tmp, "r": r}


def final_weights(ckpt_dir: Path) -> dict:
    """The newest resume checkpoint's state with actor and critic whole, whether written whole (ddp) or as shards."""
    return resume_state(_resume_files(ckpt_dir)[-1])


@pytest.fixture(scope="module")
def one_proc(world, tmp_path_factory):
    """Plain `python train_ppo.py`, one process with the whole global batch B."""
    tmp = tmp_path_factory.mktemp("one_proc")
    flags = tiny_flags(world, tmp, **EQUIV, batch_size=GLOBAL_BATCH, mini_batch_size=GLOBAL_BATCH)
    r, secs = _timed_run(flags, tmp)
    print(f"1-process run: {secs:.1f} s")
    return {"tmp": tmp, "r": r}


def _dataset(world: dict):
    from dataset.rlaif import RLAIFDataset, read_rlaif_jsonl
    from model.loader import load_tokenizer

    records, _ = read_rlaif_jsonl(world["data"])
    # Same rendering arguments as the runs (tiny_flags: --max_seq_len 64, default ratios, seed 42).
    return RLAIFDataset(records, load_tokenizer(), max_prompt_len=64, thinking_ratio=1.0, system_prompt_ratio=0.0, seed=42)


# ------------------------------------------------------------------ single-process paths (fast)
def test_the_run_module_does_not_re_export_the_primitives():
    # One name per module: the primitives come from trainer.dist (D), never through trainer.run.distributed.
    public = {name for name in vars(D) if not name.startswith("_") and getattr(getattr(D, name), "__module__", "") == D.__name__}
    assert not public & set(vars(distributed)), public & set(vars(distributed))


def test_single_process_collectives_are_identities():
    vals = {"reward/total": 0.5, "accuracy": math.nan}
    out = D.reduce_mean(vals, SINGLE)
    assert out["reward/total"] == 0.5 and math.isnan(out["accuracy"]) and out is not vals
    assert D.any_rank(True, SINGLE) is True and D.any_rank(False, SINGLE) is False
    x = torch.tensor(3.0)
    s = D.sum_global(x, SINGLE)
    s += 1
    assert x.item() == 3.0 and s.item() == 4.0  # a copy
    assert D.all_gather_objects({"a": 1}, SINGLE) == [{"a": 1}]
    assert D.broadcast_object("x", SINGLE) == "x"
    distributed.barrier(SINGLE)
    distributed.cleanup(SINGLE)


@pytest.mark.slow
def test_init_distributed_without_torchrun_is_one_process(monkeypatch):
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    info = distributed.init_distributed("cpu")
    assert (info.rank, info.world_size, info.enabled, info.is_main) == (0, 1, False, True)
    assert info.device == torch.device("cpu") and not torch.distributed.is_initialized()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA message")
def test_cuda_flag_without_cuda_is_one_line():
    with pytest.raises(SystemExit, match="^error: --device cuda: CUDA is not available.*--device cpu"):
        distributed.resolve_device("cuda")


class _Exited(Exception):
    pass


@pytest.mark.slow
@pytest.mark.parametrize("ending, code", [("finish", 0), ("stop", 2), ("error line", 1), ("crash", 1), ("ctrl-c", 130)])
def test_every_distributed_exit_leaves_by_os_exit(monkeypatch, capsys, ending, code):
    """Under torchrun every way out skips interpreter shutdown (where gloo's group can abort or hang):
    a normal finish too, not only a SystemExit. One process exits as Python does."""
    def main():
        if ending == "stop":
            raise SystemExit(2)
        if ending == "error line":
            raise SystemExit("error: rank 1: the grader is down")
        if ending == "crash":
            raise RuntimeError("boom")
        if ending == "ctrl-c":
            raise KeyboardInterrupt

    def fake_exit(c):
        raise _Exited(c)

    monkeypatch.setattr(distributed.os, "_exit", fake_exit)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(_Exited) as e:
        distributed.exit_after(main)
    assert e.value.args[0] == code
    err = capsys.readouterr().err
    assert ("error: rank 1: the grader is down" in err) == (ending == "error line")
    assert ("RuntimeError: boom" in err) == (ending == "crash")
    monkeypatch.setenv("WORLD_SIZE", "1")
    if ending == "finish":
        assert distributed.exit_after(main) is None
    else:
        with pytest.raises((SystemExit, RuntimeError, KeyboardInterrupt)):
            distributed.exit_after(main)


@pytest.mark.parametrize("ending", ["error line", "crash", "ctrl-c"])
def test_an_exit_by_exception_frees_nothing_before_os_exit(monkeypatch, ending):
    """What main's frames hold (the DDP models, whose reducer owns the gloo group) must outlive the exception:
    freeing them joins a gloo worker thread that waits for the GIL the exiting thread holds (a hang seen in CI)."""
    import weakref

    class Model:
        pass

    ref: list = []

    def main():
        model = Model()
        ref.append(weakref.ref(model))
        if ending == "error line":
            raise SystemExit("error: rank 1: a bad file")
        if ending == "crash":
            raise RuntimeError("boom")
        raise KeyboardInterrupt

    alive_at_exit = []

    def fake_exit(c):
        alive_at_exit.append(ref[0]() is not None)
        raise _Exited(c)

    monkeypatch.setattr(distributed.os, "_exit", fake_exit)
    monkeypatch.setattr(distributed, "_KEPT", [])
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(_Exited):
        distributed.exit_after(main)
    assert alive_at_exit == [True]


def test_shard_batches_interleaves_one_global_stream():
    shard_batches = distributed.shard_batches
    n, seed, batch = 23, 42, 3
    single = shard_batches(n, seed, 0, 0, 0, 1, 2 * batch)  # one process, global batch 6
    r0, r1 = (shard_batches(n, seed, 0, 0, r, 2, batch) for r in (0, 1))
    assert len(single) == len(r0) == len(r1) == 23 // 6  # the uneven tail is dropped on every rank
    for s, (a, b) in enumerate(zip(r0, r1)):
        assert a == single[s][0::2] and b == single[s][1::2]  # rank r: every 2nd sample of the step
    # Resumed at global sample 12 under one process: the same stream continues, nothing repeated.
    flat = [i for step in single for i in step]
    cont = shard_batches(n, seed, 0, 12, 0, 1, batch)
    assert [i for step in cont for i in step] == torch.randperm(n, generator=torch.Generator().manual_seed(
        seed * 1000003))[12:12 + 3 * len(cont)].tolist()
    assert set(flat[:12]).isdisjoint(i for step in cont for i in step)
    # Reseeded per epoch.
    assert shard_batches(n, seed, 1, 0, 0, 1, 6) != single


# ------------------------------------------------------------------ 2 real gloo processes, no trainer
_free_port = free_port


def _join_gloo_group(rank: int, world: int, port: int) -> D.DistInfo:
    """What torchrun's environment gives a worker, for processes started by torch.multiprocessing."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    return distributed.init_distributed("cpu", timeout_s=120)


def _spawn_two(worker, out_dir: Path, timeout: float, what: str) -> None:
    spawn_ranks(worker, 2, out_dir, timeout, what)


def _gloo_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    info = _join_gloo_group(rank, world, port)
    try:
        x, mask, values = _whiten_data()
        rows = slice(rank, None, world)  # this rank's share of the global batch
        res = {
            "mean": D.reduce_mean({"a": float(rank), "acc": 0.25 if rank == 0 else math.nan, "none": math.nan}, info),
            # rank 0: mean 1.0 over 3 tokens, rank 1: mean 4.0 over 1 token -> global token mean 7/4
            "weighted": D.reduce_mean({"ent": 1.0 + 3 * rank, "a": float(rank)}, info, weights={"ent": 3.0 - 2 * rank}),
            "any_one": D.any_rank(rank == 1, info),
            "any_none": D.any_rank(False, info),
            "sum": D.sum_global(torch.tensor(float(rank + 1)), info).item(),
            "whiten": masked_whiten(x[rows], mask[rows], reduce=D.rank_sum(info)),
            "ev": explained_variance(values[rows], x[rows], mask[rows], reduce=D.rank_sum(info)),
            "gathered": D.all_gather_objects({"rank": rank}, info),
            "keys": _error_of(lambda: D.reduce_mean({"a": 1.0, f"only_on_{rank}": 1.0}, info)),
            "bcast": D.broadcast_object(f"from {rank}", info),
        }
        torch.save(res, Path(out_dir) / f"rank{rank}.pt")
    finally:
        distributed.cleanup(info)


def _error_of(fn) -> str | None:
    try:
        fn()
    except ValueError as e:
        return str(e)
    return None


def _whiten_data() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, 5, generator=g) + 2.0
    mask = torch.ones(6, 5)
    mask[0, 3:] = 0  # ranks hold different token counts
    mask[3, 1:] = 0
    mask[5, 2:] = 0
    return x, mask, torch.randn(6, 5, generator=g)


@pytest.mark.slow  # two fresh interpreters import torch
def test_collectives_over_two_gloo_processes(tmp_path):
    _spawn_two(_gloo_worker, tmp_path, 120, "2-process gloo collectives")
    x, mask, values = _whiten_data()
    full = masked_whiten(x, mask)
    for rank in (0, 1):
        res = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        m = res["mean"]
        assert m["a"] == 0.5 and m["acc"] == 0.25 and math.isnan(m["none"])  # NaN: mean over ranks that have it
        assert res["weighted"] == {"ent": 1.75, "a": 0.5}  # a per-token mean weighs each rank by its tokens
        assert res["any_one"] is True and res["any_none"] is False
        assert res["sum"] == 3.0
        # Whitened over both ranks' tokens = one process whitening the whole batch.
        assert torch.allclose(res["whiten"], full[rank::2], atol=1e-6)
        assert not torch.allclose(masked_whiten(x[rank::2], mask[rank::2]), full[rank::2], atol=1e-3)  # per-rank would differ
        assert res["ev"] == pytest.approx(explained_variance(values, x, mask), abs=1e-6)
        assert res["gathered"] == [{"rank": 0}, {"rank": 1}] and res["bcast"] == "from 0"
        # Different metric keys: refused on every rank, naming them, instead of mismatched all-reduces.
        assert res["keys"] == ("ranks logged different metric keys (beyond the common ones: {0: ['only_on_0'], "
                               "1: ['only_on_1']}); every rank must log the same keys")


# ------------------------------------------------------------------ two "nodes" of CUDA ranks, driven on CPU
def _node_worker(rank: int, world: int, port: int, out_dir: str, per_node: int) -> None:
    """A rank of a 2-node job as torchrun starts it (RANK, LOCAL_RANK, GROUP_RANK, LOCAL_WORLD_SIZE), on a
    node with 4 GPUs stood in by fake_cuda (UUIDs naming the node), the process group on gloo."""
    from unittest import mock

    import torch.distributed as dist

    import train_ppo as T
    from tests.helpers import fake_cuda
    from trainer.run import setup as S

    node, local = divmod(rank, per_node)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(local), WORLD_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(per_node), GROUP_RANK=str(node))
    torch.set_num_threads(1)
    init = dist.init_process_group
    results = {}
    with fake_cuda(4, node=f"node{node}"), mock.patch.object(dist, "init_process_group",
                                                            lambda *a, **k: init(*a, **{**k, "backend": "gloo"})):
        info = distributed.init_distributed("auto", timeout_s=60)
        results["device"] = str(info.device)
        for case, flags in (("default", []), ("offset", ["--ref_device", "cuda:+2", "--reward_device", "cuda:+2"]),
                            ("clash", ["--ref_device", "cuda:1"])):  # the last one stops every rank
            try:
                devices = S.model_devices(T.parse_args(flags), info)
                S.check_devices_per_rank(devices, info)
                results[case] = {k: str(v) for k, v in devices.items()}
            except SystemExit as e:
                results[case] = f"exit: {e.code}"
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")


@pytest.mark.slow  # 4 fresh interpreters importing torch
def test_two_nodes_of_gpus_start_and_a_clash_on_one_node_is_one_line(tmp_path):
    """2 nodes x 2 ranks: ranks 0 and 2 are both on their node's cuda:0, which is not a clash (it was: a
    2-node job could not start). A reference fixed on cuda:1 beside rank 1's actor is, on every rank."""
    spawn_ranks(_node_worker, 4, tmp_path, 240, "2-node start", 2)
    res = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(4)]
    assert [r["device"] for r in res] == ["cuda:0", "cuda:1", "cuda:0", "cuda:1"]
    for r in range(4):
        local = r % 2
        assert res[r]["default"] == {k: f"cuda:{local}" for k in ("ref", "critic", "reward")}
        assert res[r]["offset"] == {"ref": f"cuda:{local + 2}", "critic": f"cuda:{local}", "reward": f"cuda:{local + 2}"}
    assert res[0]["clash"].startswith(f"exit: error: rank 0: ranks 0 and 1 both use cuda:1 on {socket.gethostname()}: give each rank")
    assert all(r["clash"] == "exit: 1" for r in res[1:])  # the others stop quietly


# ------------------------------------------------------------------ torchrun end to end
@pytest.mark.slow
def test_torchrun_two_processes_completes_rank0_writes(two_procs, world):
    tmp, r = two_procs["tmp"], two_procs["r"]
    out = r.stdout
    assert "device cpu x2" in out
    # Only rank 0 prints, logs and saves: one header, one sample per step, one "done".
    assert out.count("params |") == 1 and out.count("sample @ step 1 ") == 1 and out.count("done: 3 steps") == 1
    assert [row["step"] for row in read_metrics(tmp / "run")] == [1, 2, 3]
    files = _resume_files(tmp / "ckpt")
    assert [f.name.split("_resume_")[-1] for f in files] == [f"step{i:08d}.pth" for i in (1, 2, 3)]
    last = _load(files[-1])
    assert last["world_size"] == 2 and len(last["rng"]) == 2  # every rank's RNG, gathered to rank 0
    assert (last["step"], last["epoch"], last["consumed"]) == (3, 0, 3 * GLOBAL_BATCH)
    assert (tmp / "out" / f"ddp_{world['hidden']}.pth").is_file()


@pytest.mark.slow
def test_two_procs_half_batch_equal_one_proc_full_batch(two_procs, one_proc, world):
    """2 processes x B/2 and 1 process x B end with the same actor/critic (tolerance: max |diff| <
    5e-5, mean |diff| < 1e-7, with the weights having moved > 1e-3), the same adaptive KL
    coefficient, and the same logged global metrics each step (rel 1e-4)."""
    assert "device cpu x1" in one_proc["r"].stdout
    a, b = _load(_resume_files(two_procs["tmp"] / "ckpt")[-1]), _load(_resume_files(one_proc["tmp"] / "ckpt")[-1])
    assert a["step"] == b["step"] == 3 and a["consumed"] == b["consumed"]
    start = torch.load(Path(world["save_dir"]) / f"full_sft_{world['hidden']}.pth", weights_only=True)
    moved = max((a["actor"][k] - start[k].float()).abs().max().item() for k in start if k in a["actor"])
    assert moved > 1e-3, "weights barely moved: the comparison would prove nothing"
    for part in ("actor", "critic"):
        diffs = [(a[part][k] - b[part][k]).abs() for k in a[part]]
        assert max(d.max().item() for d in diffs) < MAX_ABS, part
        assert max(d.mean().item() for d in diffs) < MEAN_ABS, part
    assert a["kl_ctl"]["value"] == pytest.approx(b["kl_ctl"]["value"], rel=1e-5)
    assert a["kl_ctl"]["value"] != pytest.approx(EQUIV["kl_coef"], rel=1e-3)  # it did adapt
    ma, mb = read_metrics(two_procs["tmp"] / "run"), read_metrics(one_proc["tmp"] / "run")
    assert [m["step"] for m in ma] == [m["step"] for m in mb] == [1, 2, 3]
    for ra, rb in zip(ma, mb):
        for key in ("reward/total", "reward/rm", "kl_ref", "kl_coef", "ppo/approx_kl", "value/explained_var", "response/length",
                    "loss/policy", "loss/value"):  # the losses too: summed over ranks, the whole minibatch's
            assert ra[key] == pytest.approx(rb[key], rel=1e-4, abs=1e-6), (ra["step"], key)
    # The 2-process rank 0 saw exactly rows 0 and 2 of each global step the 1-process run saw.
    sa = [s for s in _samples(two_procs["tmp"])]
    sb = [s for s in _samples(one_proc["tmp"])]
    for step in (1, 2, 3):
        pa = [s["prompt"] for s in sa if s["step"] == step]
        pb = [s["prompt"] for s in sb if s["step"] == step]
        assert pa == pb[0::2], step


@pytest.mark.slow
def test_fsdp2_equals_ddp_and_one_process(fsdp2_procs, two_procs, one_proc, world):
    """2 processes under --strategy fsdp2 end with the same actor/critic as 2 under ddp and as 1 process with the
    doubled batch, within the DDP test's tolerance (fp32: only the summation order differs: FSDP2 reduce-scatters
    where DDP all-reduces), and log the same global metrics. The exported policy is the whole model."""
    out = fsdp2_procs["r"].stdout
    assert "device cpu x2" in out
    f, a, b = (final_weights(p["tmp"] / "ckpt") for p in (fsdp2_procs, two_procs, one_proc))
    assert f["shards"] and f["step"] == 3 and f["consumed"] == a["consumed"]
    start = torch.load(Path(world["save_dir"]) / f"full_sft_{world['hidden']}.pth", weights_only=True)
    assert max((f["actor"][k] - start[k].float()).abs().max().item() for k in start if k in f["actor"]) > 1e-3
    for other in (a, b):
        for part in ("actor", "critic"):
            assert set(f[part]) <= set(other[part]), part
            diffs = [(f[part][k] - other[part][k]).abs() for k in f[part]]
            assert max(d.max().item() for d in diffs) < MAX_ABS, part
            assert max(d.mean().item() for d in diffs) < MEAN_ABS, part
        assert f["kl_ctl"]["value"] == pytest.approx(other["kl_ctl"]["value"], rel=1e-5)
    mf, ma = read_metrics(fsdp2_procs["tmp"] / "run"), read_metrics(two_procs["tmp"] / "run")
    for rf, ra in zip(mf, ma):
        for key in ("reward/total", "kl_ref", "ppo/approx_kl", "value/explained_var", "grad_norm/actor", "grad_norm/critic",
                    "loss/policy", "loss/value"):
            assert rf[key] == pytest.approx(ra[key], rel=1e-4, abs=1e-6), (rf["step"], key)
    exported = torch.load(fsdp2_procs["tmp"] / "out" / "fsdp2_64.pth", weights_only=True)  # MiniMind's format: fp16
    assert set(exported) == set(start)
    key = "model.layers.0.mlp.up_proj.weight"
    assert torch.allclose(exported[key].float(), f["actor"][key], atol=1e-3)


@pytest.mark.slow
def test_fsdp2_resume_is_exact_and_reshards_to_another_world_size(fsdp2_procs, world, tmp_path):
    """A 2-process fsdp2 run resumed from its step-2 checkpoint ends step 3 with bit-identical shards (model and
    AdamW state); the same checkpoint resumed by 1 process is resharded by DCP and continues the sample stream."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    src = fsdp2_procs["tmp"]
    per_rank = GLOBAL_BATCH // 2
    for name, procs, steps in (("same", 2, 3), ("one", 1, 4)):
        d = tmp_path / name
        shutil.copytree(src / "ckpt", d / "ckpt")
        shutil.copytree(src / "run", d / "run")
        for f in (d / "ckpt").glob("*step00000003*"):  # back to the step-2 checkpoint
            shutil.rmtree(f) if f.is_dir() else f.unlink()
        flags = tiny_flags(world, d, **{**EQUIV, "save_weight": "fsdp2", "max_steps": steps}, batch_size=per_rank,
                           mini_batch_size=per_rank, strategy="fsdp2", from_resume=1)
        r, _ = _timed_run(flags, d, procs=procs)
        assert "at step 2 (epoch 0, sample 8)" in r.stdout
        if procs == 2:
            whole = {}
            for run, ckpt in (("straight", src / "ckpt"), ("resumed", d / "ckpt")):
                dcp_to_torch_save(ckpt / "fsdp2_64_resume_step00000003.dcp", d / f"{run}.pt")
                whole[run] = torch.load(d / f"{run}.pt", weights_only=True)
            assert deep_equal(whole["straight"], whole["resumed"]) == []
        else:
            assert "world size changed 2 -> 1: continuing at global sample 8 of epoch 0" in r.stdout
            assert [row["step"] for row in read_metrics(d / "run")] == [1, 2, 3, 4]
            last = final_weights(d / "ckpt")
            assert (last["step"], last["consumed"], last["world_size"]) == (4, 8 + 2 * per_rank, 1)


@pytest.mark.slow
def test_fsdp2_with_whole_frozen_models_old_actor_and_evaluation(world, tmp_path):
    """The other fsdp2 paths in one 2-process run: --shard_frozen 0 (reference and reward model whole on every rank),
    MiniMind's frozen old actor (refreshed from the sharded actor's state dict), a critic-free estimator, and the
    held-out evaluation, which runs on rank 0 while every rank holds the gathered weights."""
    evald = tmp_path / "eval.jsonl"
    evald.write_text("\n".join(Path(world["data"]).read_text(encoding="utf-8").splitlines()[:4]) + "\n", encoding="utf-8")
    flags = tiny_flags(world, tmp_path, device="cpu", batch_size=2, mini_batch_size=4, max_steps=2, strategy="fsdp2",
                       shard_frozen=0, update_old_actor_freq=1, advantage_estimator="grpo", num_generations=2,
                       eval_data_path=str(evald), eval_interval=1, save_weight="whole_frozen")
    r, secs = _timed_run(flags, tmp_path, procs=2)
    print(f"2-process fsdp2 --shard_frozen 0 run: {secs:.1f} s")
    rows = read_metrics(tmp_path / "run")
    assert [row["step"] for row in rows if "kl_ref" in row] == [1, 2]
    assert all(math.isfinite(row["eval/response_length"]) for row in rows if "eval/response_length" in row)
    assert len([row for row in rows if "eval/response_length" in row]) == 3  # steps 0, 1, 2
    assert rows[-1]["kl_ref"] > 0  # the actor moved away from its whole-on-every-rank reference
    state = final_weights(tmp_path / "ckpt")
    assert state["shards"] and "old_actor" in state and set(state["old_actor"]) == set(state["actor"])
    exported = torch.load(tmp_path / "out" / "whole_frozen_64.pth", weights_only=True)
    assert set(exported) == set(torch.load(Path(world["save_dir"]) / "full_sft_64.pth", weights_only=True))


def _samples(tmp: Path) -> list[dict]:
    import json

    return [json.loads(l) for l in (tmp / "run" / "samples.jsonl").read_text(encoding="utf-8").splitlines() if l.strip()]


@pytest.mark.slow
def test_resume_written_by_two_procs_continues_under_one(two_procs, world, tmp_path):
    src = two_procs["tmp"]
    shutil.copytree(src / "ckpt", tmp_path / "ckpt")
    shutil.copytree(src / "run", tmp_path / "run")
    per_rank = GLOBAL_BATCH // 2  # --batch_size is per process and must not change on resume
    flags = tiny_flags(world, tmp_path, **{**EQUIV, "max_steps": 5}, batch_size=per_rank, mini_batch_size=per_rank,
                       from_resume=1)
    r, secs = _timed_run(flags, tmp_path)
    print(f"resume 2 -> 1 process: {secs:.1f} s")
    out = r.stdout
    assert "at step 3 (epoch 0, sample 12)" in out
    assert "world size changed 2 -> 1: continuing at global sample 12 of epoch 0" in out
    assert "flag changed on resume: --max_steps: 3 -> 5" in out
    assert [row["step"] for row in read_metrics(tmp_path / "run")] == [1, 2, 3, 4, 5]
    last = _load(_resume_files(tmp_path / "ckpt")[-1])
    assert (last["step"], last["epoch"], last["consumed"], last["world_size"]) == (5, 0, 12 + 2 * per_rank, 1)
    # The global sample stream continues: steps 4-5 read stream positions 12..15, none seen before.
    ds = _dataset(world)
    stream = [i for b in distributed.shard_batches(len(ds), 42, 0, 0, 0, 1, 1) for i in b]
    rows = _samples(tmp_path)
    for step, pos in ((4, 12), (5, 14)):
        got = [s["prompt"] for s in rows if s["step"] == step]
        assert got == [ds[stream[pos]]["prompt"][-200:], ds[stream[pos + 1]]["prompt"][-200:]], step
    for step in (1, 2, 3):  # the 2-process part: rank 0 took global positions 4(s-1) and 4(s-1)+2
        got = [s["prompt"] for s in rows if s["step"] == step]
        assert got == [ds[stream[4 * (step - 1) + k]]["prompt"][-200:] for k in (0, 2)], step


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_collective_decisions_do_not_hang(world, tmp_path, strategy):
    """NaN reward on rank 1 only at step 1 -> both ranks skip that step; a tiny --early_stop_kl
    stops every later update on both ranks; 11 prompts with a global batch of 4 (uneven) over 2
    epochs -> 2 steps per epoch on every rank, no hang at the epoch ends. A metric of 1.0 (not 0.5)
    after the mean over ranks shows both ranks took the decision. The same with sharded models."""
    lines = Path(world["data"]).read_text(encoding="utf-8").splitlines()[:11]
    data = tmp_path / "prompts11.jsonl"
    data.write_text("\n".join(lines) + "\n", encoding="utf-8")
    flags = tiny_flags(world, tmp_path, device="cpu", data_path=str(data), batch_size=2, mini_batch_size=2, epochs=2,
                       max_steps=0, early_stop_kl=1e-9, ppo_update_iters=2, rm_weight=0, save_interval=1, keep_checkpoints=10,
                       save_weight="collective", reward_fn=f"{FIXTURES / 'dist_rewards.py'}:nan_on_rank1_first_call",
                       strategy=strategy)
    r, secs = _timed_run(flags, tmp_path, procs=2, timeout=240)
    print(f"2-process collective-decisions run: {secs:.1f} s")
    rows = read_metrics(tmp_path / "run")
    assert [row["step"] for row in rows] == [1, 2, 3, 4]
    assert [row["nonfinite"] for row in rows] == [1.0, 0.0, 0.0, 0.0]
    assert [row["ppo/early_stopped"] for row in rows[1:]] == [1.0, 1.0, 1.0]
    files = {(s := resume_state(f))["step"]: s for f in _resume_files(tmp_path / "ckpt")}
    start = torch.load(Path(world["save_dir"]) / f"full_sft_{world['hidden']}.pth", weights_only=True)
    key = "model.layers.0.mlp.up_proj.weight"
    assert torch.equal(files[1]["actor"][key], start[key].float())  # the skipped step moved nothing
    assert not torch.equal(files[2]["actor"][key], start[key].float())
    assert [(files[s]["epoch"], files[s]["consumed"]) for s in (1, 2, 3, 4)] == [(0, 4), (0, 8), (1, 4), (1, 8)]


@pytest.mark.slow  # 2-process runs
def test_repeated_two_process_runs_finish_cleanly(world, tmp_path):
    """Interpreter shutdown after a finished gloo run could abort ("terminate called without an active
    exception") or hang; every run now leaves by os._exit after the final barrier."""
    for i in range(4):
        d = tmp_path / f"run{i}"
        d.mkdir()
        r = run_train(tiny_flags(world, d, max_steps=1, batch_size=2, mini_batch_size=2, device="cpu", sample_interval=0),
                      cwd=d, torchrun_procs=2, timeout=120, check=False)
        assert r.returncode == 0 and "terminate called" not in r.stderr, (i, r.stderr[-2000:])
        assert (d / "ckpt").is_dir() and read_metrics(d / "run")[-1]["step"] == 1


# ------------------------------------------------------------------ ranks that fail or see different disks
def _spawn_ranks(per_rank_flags: list[list[str]], cwd: Path, timeout: int = 240) -> list[tuple[int, str, str]]:
    """Processes started by hand as torchrun would start them (RANK, WORLD_SIZE, MASTER_*), each with its
    own flags: two ranks with different --checkpoint_dir stand for two nodes without a shared disk.
    Returns (exit code, stdout, stderr) per rank. The port is free when chosen but may be taken before rank 0
    binds it (another process's ephemeral port): that start is retried on a new port, as a scheduler would; a
    hang fails with every rank's last output instead of a bare timeout."""
    import subprocess
    import sys

    world = len(per_rank_flags)
    for _ in range(3):
        port, procs = _free_port(), []
        for rank, flags in enumerate(per_rank_flags):
            env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", SWANLAB_MODE="disabled",
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                       WORLD_SIZE=str(world))
            procs.append(subprocess.Popen([sys.executable, str(ROOT / "train_ppo.py"), *flags], cwd=cwd, env=env,
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        deadline, outs = time.monotonic() + timeout, []
        try:
            for p in procs:
                outs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            tails = [(rank, *(x[-1500:] for x in p.communicate())) for rank, p in enumerate(procs)]
            if "address already in use" in "".join(t[2] for t in tails).lower():
                continue
            pytest.fail(f"ranks hung past {timeout} s; last output per rank: {tails}")
        finally:
            for p in procs:
                p.kill()
        if not any("address already in use" in e.lower() for _, e in outs):
            return [(p.returncode, o, e) for p, (o, e) in zip(procs, outs)]
    pytest.fail("no free port for the ranks' rendezvous after 3 tries")


def _only_line(results: list[tuple[int, str, str]]) -> str:
    """Every rank failed; rank 0 says one `error:` line, the others nothing; no traceback anywhere."""
    assert all(code != 0 for code, _, _ in results), [r[1][-1500:] + r[2][-1500:] for r in results]
    for code, out, err in results:
        assert "Traceback" not in err, err[-3000:]
    errors = [l for _, _, err in results for l in err.splitlines() if l.startswith("error:")]
    assert len(errors) == 1 and results[0][2].strip().splitlines()[-1] == errors[0], [r[2][-2000:] for r in results]
    return errors[0]


@pytest.mark.slow
def test_reference_on_some_rows_only_runs_on_two_ranks(world, tmp_path):
    """Step 1: rank 0's prompt has a reference answer, rank 1's has none, so only rank 0 has an accuracy.
    Every rank must still reduce the same metric keys (this aborted gloo with EnforceNotMet before)."""
    import json

    lines = Path(world["data"]).read_text(encoding="utf-8").splitlines()
    rank1_step1 = distributed.shard_batches(len(lines), 42, 0, 0, 1, 2, 1)[0]
    for i in rank1_step1:
        row = json.loads(lines[i])
        row["conversations"][-1]["content"] = "无"  # MiniMind's placeholder: no reference
        lines[i] = json.dumps(row, ensure_ascii=False)
    data = tmp_path / "mixed.jsonl"
    data.write_text("\n".join(lines) + "\n", encoding="utf-8")
    flags = tiny_flags(world, tmp_path, data_path=str(data), batch_size=1, mini_batch_size=1, max_steps=2, device="cpu")
    results = _spawn_ranks([flags, flags], tmp_path)
    assert all(code == 0 for code, _, _ in results), [r[2][-3000:] for r in results]
    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[0]["accuracy"] in (0.0, 1.0)  # rank 0's one row: the mean over the rows that have a reference


@pytest.mark.slow
def test_nodes_without_a_shared_checkpoint_dir_stop_with_one_line(world, tmp_path):
    run_train(tiny_flags(world, tmp_path, max_steps=1, checkpoint_dir=str(tmp_path / "node0")), cwd=tmp_path)
    common = dict(max_steps=2, from_resume=1, device="cpu")  # --batch_size 4 per process, as saved
    results = _spawn_ranks([tiny_flags(world, tmp_path, checkpoint_dir=str(tmp_path / "node0"), **common),
                            tiny_flags(world, tmp_path, checkpoint_dir=str(tmp_path / "node1"), **common)], tmp_path)
    line = _only_line(results)
    assert line.startswith("error: rank 1: ") and "every rank must see rank 0's --checkpoint_dir (a shared filesystem)" in line
    assert "resumed from" not in results[1][1]


@pytest.mark.slow
def test_reward_function_failing_on_one_rank_stops_every_rank_with_its_line(world, tmp_path):
    fn = tmp_path / "rank_reward.py"
    fn.write_text("import os\n\ndef flaky(prompt, reply, reference):\n"
                  "    if os.environ['RANK'] == '1':\n        raise RuntimeError('the grader is down on this node')\n"
                  "    return 0.0\n", encoding="utf-8")
    flags = tiny_flags(world, tmp_path, reward_fn=[f"{fn}:flaky"], max_steps=2, device="cpu", batch_size=2, mini_batch_size=2)
    t0 = time.monotonic()
    line = _only_line(_spawn_ranks([flags, flags], tmp_path))
    assert line.startswith("error: rank 1: --reward_fn flaky raised RuntimeError: the grader is down on this node")
    assert time.monotonic() - t0 < 200  # no rank sat out a collective timeout
    import json
    assert json.loads((tmp_path / "run" / "run.json").read_text())["status"].startswith("stopped: ")


# ------------------------------------------------------------------ each advantage estimator: 2 ranks x B/2 = 1 x B
# Steps 1-3 (sampling, rewards) are rank-local and a group never spans ranks; ranks meet in steps 4-5
# (global whitening, the global token/row counts of the losses, DDP's gradient mean). So: one rollout of
# 4 prompts x 2 responses, its advantages and one update computed in one process, and again with rows
# 0-3 on rank 0 and rows 4-7 on rank 1 (2 gloo processes, DDP), from the same weights.
ESTIMATOR_CASES = [("gae",), ("grpo",), ("dr_grpo", "--loss_agg_mode", "seq_mean_token_mean"), ("rloo",),
                   ("reinforce_pp",), ("reinforce_pp_baseline", "--loss_agg_mode", "seq_mean_token_sum_norm"), ("opo",),
                   ("grpo_passk",), ("gae", "--policy_loss", "cispo"), ("gae", "--policy_loss", "dual_clip"),
                   ("rloo", "--policy_loss", "gspo", "--kl_placement", "loss", "--gspo_clip_low", "0.01", "--gspo_clip_high", "0.01"),
                   ("grpo", "--policy_loss", "gmpo"), ("grpo", "--policy_loss", "sapo"),
                   # every token with positive covariance out of the gradient: the draw is then the same in any layout
                   ("grpo", "--policy_loss", "clip_cov", "--clip_cov_ratio", "1", "--clip_cov_lb", "0"),
                   ("grpo", "--policy_loss", "kl_cov", "--kl_cov_ratio", "0.1")]


def _case_name(case: tuple) -> str:
    return "_".join(c.strip("-") for c in case)


def _estimator_flags(case: tuple, prompts: int) -> list[str]:
    rows = prompts * 2
    return ["--advantage_estimator", case[0], *case[1:], "--num_generations", "2", "--batch_size", str(prompts),
            "--mini_batch_size", str(rows), "--reward_fn", f"{FIXTURES / 'toy_rewards.py'}:low_id_share",
            "--temperature", "1.0", "--learning_rate", "1e-3", "--device", "cpu",
            "--padding_free", "0"]  # padded rows: as tests/test_train_ppo.py's accumulation test says why


def _estimator_update(built, fields: dict, masked_rows: tuple[int, ...] = ()) -> tuple[torch.Tensor, dict]:
    """The advantages and one update of the rollout `fields`; `masked_rows` masked whole after the advantages, as
    --mask_truncated 1 masks a response cut without EOS."""
    import dataclasses

    import train_ppo as T
    from trainer.rollout import Rollout
    from trainer.run.phases import phases
    from trainer.run.timing import PhaseTimer

    ro = Rollout(**fields)
    advantages, returns = T.compute_advantages(built.cfg, ro, built.kl_ctl.value, built.runtime)
    ro = dataclasses.replace(ro, advantages=advantages, returns=returns)
    if masked_rows:
        mask = ro.response_mask.clone()
        mask[list(masked_rows)] = 0
        ro = dataclasses.replace(ro, response_mask=mask)
    T.ppo_update(built.cfg, ro, built.models, built.optim, 0, built.runtime, built.kl_ctl.value,
                 phases(PhaseTimer(), built.runtime))
    return advantages, {k: v.detach().clone() for k, v in built.models.actor.state_dict().items()}


def _estimator_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    import train_ppo as T
    from tests.helpers import UPDATE_BASE_FLAGS
    from trainer.run.setup import setup

    info = _join_gloo_group(rank, world, port)
    try:
        for case in ESTIMATOR_CASES:
            fields = torch.load(Path(out_dir) / f"{_case_name(case)}_rollout.pt", weights_only=False)
            rows = slice(4 * rank, 4 * rank + 4)  # this rank's two prompts, both responses of each
            half = {k: (v[rows] if isinstance(v, torch.Tensor) else v) for k, v in fields.items()}
            args = T.parse_args([*UPDATE_BASE_FLAGS, *_estimator_flags(case, 2)])
            built = setup(args, info)
            torch.save(_estimator_update(built, half), Path(out_dir) / f"{_case_name(case)}_rank{rank}.pt")
    finally:
        distributed.cleanup(info)


def _one_process_updates(cases: list, tmp_path: Path, prefix: str = "", masked_rows: tuple[int, ...] = ()) -> dict:
    """For each case: one process's rollout of the doubled batch (saved as `<prefix><case>_rollout.pt` for the ranks
    to split), its advantages, the actor after one update, the rewards and the starting weights."""
    from tests.helpers import build_update_world, run_experience

    want = {}
    for case in cases:
        flags = _estimator_flags(case, 4)
        ro, _ = run_experience(build_update_world(flags))
        fields = {k: v for k, v in ro.__dict__.items() if k not in ("advantages", "returns", "values_with_grad")}
        fields["values"] = None if fields["values"] is None else fields["values"].detach()
        torch.save(fields, tmp_path / f"{prefix}{_case_name(case)}_rollout.pt")
        w = build_update_world(flags)  # the same starting weights as the ranks build
        start = {k: v.clone() for k, v in w.models.actor.state_dict().items()}
        want[_case_name(case)] = (*_estimator_update(w.built, fields, masked_rows), ro.rewards, start)
    return want


def _assert_ranks_took_its_step(name: str, actor: dict, start: dict, w0: dict, w1: dict) -> None:
    """Both ranks' actors equal (DDP keeps them so) and within DDP's tolerance of one process's update, which moved."""
    assert max((actor[k] - start[k]).abs().max().item() for k in actor) > 1e-4, f"{name}: the update moved nothing"
    for k, v in actor.items():
        assert torch.equal(w0[k], w1[k]), (name, k)
        diff = (w0[k] - v).abs()
        assert diff.max().item() < MAX_ABS and diff.mean().item() < MEAN_ABS, (name, k)


@pytest.mark.slow  # one pair of gloo processes for every case
def test_each_estimator_two_ranks_equal_one_process(tmp_path):
    want = _one_process_updates(ESTIMATOR_CASES, tmp_path)
    _spawn_two(_estimator_worker, tmp_path, 300, "2-process estimator updates")
    for case in ESTIMATOR_CASES:
        name = _case_name(case)
        adv, actor, rewards, start = want[name]
        assert rewards.view(-1, 2).std(1).gt(0).any(), f"{name}: no group with signal, the check would prove nothing"
        a0, w0 = torch.load(tmp_path / f"{name}_rank0.pt", weights_only=True)
        a1, w1 = torch.load(tmp_path / f"{name}_rank1.pt", weights_only=True)
        torch.testing.assert_close(torch.cat([a0, a1]), adv, rtol=0, atol=1e-5, msg=name)
        _assert_ranks_took_its_step(name, actor, start, w0, w1)


# Rows masked whole (--mask_truncated 1): global rows 1, 5 and 6, so rank 0 holds 3 rows with a token and rank 1
# holds 2. The per-response losses divide by the 5 rows with a token of both ranks (trainer/update.py's global row
# count), so 2 ranks take one process's step; a rank-local or all-row count would not.
MASKED_ROWS = (1, 5, 6)
MASKED_CASES = [("grpo", "--policy_loss", "gspo"), ("grpo", "--loss_agg_mode", "seq_mean_token_sum_norm"),
                ("grpo", "--policy_loss", "gmpo")]


def _masked_rows_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    import train_ppo as T
    from tests.helpers import UPDATE_BASE_FLAGS
    from trainer.run.setup import setup

    info = _join_gloo_group(rank, world, port)
    try:
        for case in MASKED_CASES:
            fields = torch.load(Path(out_dir) / f"masked_{_case_name(case)}_rollout.pt", weights_only=False)
            rows = slice(4 * rank, 4 * rank + 4)
            half = {k: (v[rows] if isinstance(v, torch.Tensor) else v) for k, v in fields.items()}
            local = tuple(r - 4 * rank for r in MASKED_ROWS if 4 * rank <= r < 4 * rank + 4)
            built = setup(T.parse_args([*UPDATE_BASE_FLAGS, *_estimator_flags(case, 2)]), info)
            torch.save(_estimator_update(built, half, local), Path(out_dir) / f"masked_{_case_name(case)}_rank{rank}.pt")
    finally:
        distributed.cleanup(info)


@pytest.mark.slow  # one pair of gloo processes
def test_rows_without_tokens_two_ranks_equal_one_process(tmp_path):
    want = _one_process_updates(MASKED_CASES, tmp_path, "masked_", MASKED_ROWS)
    _spawn_two(_masked_rows_worker, tmp_path, 300, "2-process updates with masked rows")
    for case in MASKED_CASES:
        name = _case_name(case)
        _, actor, _, start = want[name]
        _, w0 = torch.load(tmp_path / f"masked_{name}_rank0.pt", weights_only=True)
        _, w1 = torch.load(tmp_path / f"masked_{name}_rank1.pt", weights_only=True)
        _assert_ranks_took_its_step(name, actor, start, w0, w1)


def test_small_collectives_stay_on_the_gpu_beside_a_gloo_backend_for_offloaded_shards():
    """--cpu_offload 1 starts "cuda:nccl,cpu:gloo" (host-memory shards are reduced over gloo): the trainer's own
    decisions and metric sums still go over NCCL on the rank's GPU; a gloo-only group on GPUs uses the CPU."""
    gpu = torch.device("cuda", 3)
    assert D.DistInfo(world_size=2, device=gpu, backend="cuda:nccl,cpu:gloo").comm_device == gpu
    assert D.DistInfo(world_size=2, device=gpu, backend="nccl").comm_device == gpu
    assert D.DistInfo(world_size=2, device=gpu, backend="gloo").comm_device == torch.device("cpu")


@pytest.mark.slow
def test_fsdp2_exports_a_whole_hf_directory(world, tmp_path):
    """--actor_path under fsdp2: the saved policy is a plain Hugging Face directory (its class name, not FSDP's)
    holding the whole trained weights, the same as the run's DCP shards."""
    from transformers import AutoModelForCausalLM

    from tests.tiny_hf import save_tiny_causal_lm

    save_tiny_causal_lm(tmp_path / "llama")
    flags = tiny_flags(world, tmp_path, actor_path=str(tmp_path / "llama"), save_dir=str(tmp_path / "out"), max_steps=2,
                       batch_size=2, mini_batch_size=2, max_gen_len=8, device="cpu", strategy="fsdp2", save_weight="hf_fsdp2",
                       reward_model_path="none", rm_weight=0, reward_fn=f"{FIXTURES / 'toy_rewards.py'}:low_id_share")
    _timed_run(flags, tmp_path, procs=2)
    out = tmp_path / "out" / "hf_fsdp2_hf"
    import json

    assert json.loads((out / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    model = AutoModelForCausalLM.from_pretrained(out)
    saved = final_weights(tmp_path / "ckpt")["actor"]
    start = AutoModelForCausalLM.from_pretrained(tmp_path / "llama").state_dict()
    got = model.state_dict()
    assert set(saved) <= set(got)
    assert all(torch.equal(got[k], saved[k]) for k in saved)
    assert any(not torch.equal(got[k], start[k]) for k in saved)  # it trained


def test_a_group_of_one_on_a_named_gpu_makes_it_the_current_device(monkeypatch):
    """`--strategy fsdp2 --device cuda:1` without torchrun: FSDP2 shards onto the current device, so it must be
    cuda:1 before the process group exists (it was left at cuda:0 while sampling ran on cuda:1). CUDA stood in."""
    import torch.distributed as dist

    calls: list = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(("set_device", torch.device(d))))
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda **kw: calls.append(("init", kw["backend"])))
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    info = distributed.init_distributed("cuda:1", group_of_one=True)
    assert info.device == torch.device("cuda", 1)
    assert calls == [("set_device", torch.device("cuda", 1)), ("init", "nccl")]


def _slow_save_worker(rank: int, world: int, port: int, out_dir: str, through_main_writes: bool) -> None:
    """Rank 0 writes for 4 s, past a 2 s --ddp_timeout; the other rank waits, then both run a collective."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    info = distributed.init_distributed("cpu", timeout_s=2, wait_timeout_s=60)
    outcome = "ok"
    try:
        if through_main_writes:
            distributed.main_writes(lambda: time.sleep(4), info)
        else:  # what the save did before: rank 0 writes while the others wait in a training-group collective
            if info.is_main:
                time.sleep(4)
            D.any_rank(False, info)
        D.any_rank(False, info)
    except BaseException as e:  # noqa: BLE001 - the outcome is the test's
        outcome = type(e).__name__
    Path(out_dir, f"rank{rank}").write_text(outcome)
    os._exit(0)


@pytest.mark.slow
@pytest.mark.parametrize("through_main_writes", [True, False], ids=["main_writes", "collective_wait"])
def test_a_save_slower_than_the_collective_timeout_is_waited_for(tmp_path, through_main_writes):
    """Rank 0's resume file on a slow filesystem outlasts --ddp_timeout: the other ranks wait on their own group
    (--save_timeout) and the run goes on; waiting in a training-group collective instead times out."""
    spawn_ranks(_slow_save_worker, 2, tmp_path, 120, "a slow save", through_main_writes)
    outcomes = [(tmp_path / f"rank{r}").read_text() for r in range(2)]
    if through_main_writes:
        assert outcomes == ["ok", "ok"]
    else:
        assert outcomes[1] != "ok"  # the stand-in for the watchdog: gloo's timeout ended the waiting rank


def _hsdp_worker(rank: int, world: int, port: int, out_dir: str, per_node: int) -> None:
    """One rank of 2 "nodes" x 2 (LOCAL_WORLD_SIZE 2): one SGD step of a tiny policy sharded over all 4 ranks, and
    the same step under HSDP (sharded within a node, replicated across nodes). SGD, not AdamW: its first step is
    about lr * sign(g), which would magnify the rounding of near-zero gradients summed in another order."""
    from model.loader import build_minimind
    from trainer.run import sharding

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank % per_node),
                      WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(per_node))
    torch.set_num_threads(1)
    info = distributed.init_distributed("cpu", timeout_s=120)
    out: dict = {"nodes": info.nodes, "auto": sharding.use_hsdp(-1, info)}
    for hsdp in (True, False):
        torch.manual_seed(0)
        model = sharding.shard(build_minimind(64, 2), sharding.device_mesh(info, hsdp))
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        ids = torch.randint(5, 100, (2, 6), generator=torch.Generator().manual_seed(1 + rank))  # each rank its own rows
        model(ids).logits.float().logsumexp(-1).mean().backward()
        opt.step()
        out[hsdp] = {n: p.detach().full_tensor() for n, p in model.named_parameters()}
        out[f"placements_{hsdp}"] = str(next(model.parameters()).placements)
    torch.save(out, Path(out_dir) / f"rank{rank}.pt")
    os._exit(0)


@pytest.mark.slow  # 4 fresh interpreters importing torch
def test_hsdp_across_two_nodes_takes_the_same_step_as_sharding_over_all(tmp_path):
    """--hsdp (auto on a job that spans nodes): a 2-D mesh, shards within each node and replicas across nodes, takes
    the same step as FSDP2 over every rank (the gradients averaged over all 4 ranks' rows)."""
    spawn_ranks(_hsdp_worker, 4, tmp_path, 240, "hsdp", 2)
    res = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(4)]
    assert all(r["nodes"] == 2 and r["auto"] for r in res)
    assert res[0]["placements_True"] == "(Replicate(), Shard(dim=0))" and res[0]["placements_False"] == "(Shard(dim=0),)"
    for r in res:
        for name, whole in r[True].items():
            assert torch.allclose(whole, res[0][False][name], atol=1e-6), name


def test_hsdp_on_one_node_is_refused_in_one_line():
    from trainer.run.sharding import use_hsdp

    one_node = D.DistInfo(rank=0, world_size=8, local_world_size=8)
    assert D.DistInfo(world_size=16, local_world_size=8).nodes == 2 and one_node.nodes == 1
    assert use_hsdp(-1, one_node) is False and use_hsdp(-1, D.DistInfo(world_size=16, local_world_size=8)) is True
    assert use_hsdp(0, D.DistInfo(world_size=16, local_world_size=8)) is False
    with pytest.raises(SystemExit, match="--hsdp 1 shards within a node and replicates across nodes, but this job runs on one node"):
        use_hsdp(1, one_node)


def _turns_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    """One rank of a 2-process fsdp2 start on one node: when it built its models, and that it holds shards."""
    from trainer.run import setup as S

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    spans = []
    real_build = S._build

    def timed_build(raw, info):
        start = time.monotonic()
        built = real_build(raw, info)
        time.sleep(1.0)  # a build that takes a while: the other rank must not start meanwhile
        spans.append((start, time.monotonic()))
        return built

    S._build = timed_build
    flags = json.loads(Path(out_dir, "flags.json").read_text())
    built = S.setup(T_parse(flags))
    from trainer.dist import fsdp_modules
    torch.save({"spans": spans, "sharded": bool(fsdp_modules(built.models.actor))}, Path(out_dir) / f"rank{rank}.pt")
    distributed.cleanup(built.runtime.info)
    os._exit(0)


def T_parse(flags: list[str]):
    import train_ppo as T

    return T.parse_args(flags)


@pytest.mark.slow  # 2 fresh interpreters building models
def test_fsdp2_ranks_of_a_node_build_their_models_in_turns(tmp_path):
    """Under fsdp2 every rank builds its models whole in host memory before sharding them: the ranks of a node take
    turns, so the node holds one rank's whole models at a time, not every rank's at once."""
    world = make_tiny_world(tmp_path / "w")
    (tmp_path / "flags.json").write_text(json.dumps(tiny_flags(world, tmp_path, strategy="fsdp2")))
    spawn_ranks(_turns_worker, 2, tmp_path, 240, "fsdp2 build in turns")
    res = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]
    assert all(r["sharded"] and len(r["spans"]) == 1 for r in res)
    (a0, a1), (b0, b1) = res[0]["spans"][0], res[1]["spans"][0]
    assert a1 <= b0 or b1 <= a0, "the two ranks built their models at the same time"
