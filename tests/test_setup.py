"""trainer/run/setup.py: what a run is built from: models, devices, optimizers, DDP, seeds."""

from __future__ import annotations

import argparse
import contextlib
import os
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import train_ppo as T
from model.forward import attention_implementation, policy_forward
from tests.helpers import UPDATE_BASE_FLAGS, build_update_world, fake_cuda, run_experience
from trainer.dist import DistInfo
from trainer.run import cli as C
from trainer.run import hardware as H
from trainer.run import setup as S
from trainer.run import setup as setup_mod
from trainer.runtime import Runtime


def _args(*flags: str):
    return T.parse_args([*UPDATE_BASE_FLAGS, *flags])


def test_the_run_is_built_from_the_resolved_config():
    world = build_update_world(["--greedy", "1", "--debug_mode", "--debug_interval", "7"])
    cfg = world.cfg
    assert cfg.resolved and cfg.dtype == "float32" and cfg.flat()["dtype"] == "float32"
    assert cfg.sample_temperature == 1.0 and cfg.temperature == 0.8  # greedy scores under T = 1
    assert cfg.sample_interval == 7  # MiniMind's --debug_mode 1 shows samples every --debug_interval steps
    assert world.runtime.total_steps == 10 and cfg.hidden_size == 64
    auto = build_update_world(["--dtype", "auto"])
    assert auto.cfg.dtype == "float32" and auto.runtime.precisions == {"cpu": ("float32", torch.float32)}


@pytest.mark.slow
def test_old_actor_scores_with_the_actors_numerics():
    """The reference may be held in bf16; the old actor never is: the PPO ratio is exactly 1 before any update."""
    world = build_update_world(["--update_old_actor_freq", "1", "--frozen_low_precision", "1"], dtype="bfloat16")
    m = world.models
    assert {p.dtype for p in m.old_actor.parameters()} == {p.dtype for p in m.actor.parameters()} == {torch.float32}
    assert {p.dtype for p in m.ref.parameters()} == {torch.bfloat16}
    ro, metrics = run_experience(world)  # old log-probs scored by the old-actor copy
    # The update's forward (its attention kernel: eager under bf16 on CPU) gives exactly the old log-probs.
    with torch.no_grad(), world.runtime.autocast(), attention_implementation(world.cfg.train_attn, m.actor):
        own, _ = policy_forward(m.actor, ro.sequences, ro.attention_mask, ro.response_len, world.cfg.sample_temperature)
    assert world.cfg.train_attn == "eager" and torch.equal(ro.old_logprobs, own)
    assert metrics["kl_ref"] != 0.0  # the bf16 reference: its rounding gap shows up as kl_ref at step 0


@pytest.mark.slow
def test_random_init_is_the_same_on_every_rank_and_sampling_is_not():
    """--from_weight none under torchrun: every rank builds the same models (the reference must be one
    model), then samples with its own stream; rank 0 keeps the single-process stream."""
    args = _args()
    built0 = S._build(args, DistInfo(rank=0, world_size=2))
    draw0 = torch.rand(3)
    built1 = S._build(args, DistInfo(rank=1, world_size=2))
    draw1 = torch.rand(3)
    for a, b in ((built0.models.actor, built1.models.actor), (built0.models.critic, built1.models.critic),
                 (built0.models.ref, built1.models.ref)):
        assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert not torch.equal(draw0, draw1)
    S._build(args, DistInfo())
    assert torch.equal(torch.rand(3), draw0)  # one process = rank 0


def test_minimind_flags_are_accepted_and_engine_flags_without_an_engine_warn(capsys):
    args = T.parse_args(["--rollout_engine", "torch", "--sglang_base_url", "http://localhost:8998", "--sglang_model_path",
                         "../model", "--sglang_shared_path", "./sglang_ckpt_ppo", "--debug_mode", "--debug_interval", "20",
                         "--debug_log_ratio"])
    assert (args.debug_mode, args.debug_interval, args.debug_log_ratio) == (1, 20, 1)
    C.validate(args)
    lines = C.warn_unused(args)
    assert any(line.startswith("warning: --sglang_base_url, --sglang_model_path, --sglang_shared_path are not acted on: "
                               "the policy samples in this process") for line in lines)
    # MiniMind's --rollout_engine sglang alone: its default server URL, a shared folder of its own
    cfg = C.resolve(T.parse_args(["--rollout_engine", "sglang"]), DistInfo())
    assert cfg.engine_url == "http://localhost:8998" and cfg.engine_shared_path


def test_deterministic_mode_sets_what_it_says(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    before = torch.are_deterministic_algorithms_enabled()
    try:
        S.set_deterministic(False, torch.device("cuda", 0))
        assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ and not torch.are_deterministic_algorithms_enabled()
        S.set_deterministic(True, torch.device("cpu"))
        assert torch.are_deterministic_algorithms_enabled() and "CUBLAS_WORKSPACE_CONFIG" not in os.environ
        S.set_deterministic(True, torch.device("cuda", 0))  # read by cuBLAS when it starts: set before any matmul
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    finally:
        torch.use_deterministic_algorithms(before)


def test_deterministic_cpu_run_equals_the_plain_one():
    def one(*flags):
        world = build_update_world(list(flags))
        ro, _ = run_experience(world)
        return ro.sequences, ro.advantages
    try:
        det = one("--deterministic", "1")
    finally:
        torch.use_deterministic_algorithms(False)
    plain = one()
    assert torch.equal(det[0], plain[0]) and torch.equal(det[1], plain[1])


def test_model_devices_are_plumbed_and_default_to_the_actors(monkeypatch):
    """--ref_device / --critic_device / --reward_device (seed 001's two-GPU layout): on this CPU machine
    only `cpu` exists, so this checks the plumbing: resolved once, models placed there, same results."""
    default = build_update_world()
    assert (default.runtime.ref_device, default.runtime.critic_device, default.runtime.reward_device) == (torch.device("cpu"),) * 3
    ro_a, _ = run_experience(default)  # before the next build: each build reseeds the sampler
    placed = build_update_world(["--ref_device", "cpu", "--critic_device", "cpu", "--reward_device", "cpu"])
    assert next(placed.models.ref.parameters()).device == placed.runtime.ref_device == torch.device("cpu")
    ro_b, _ = run_experience(placed)
    assert torch.equal(ro_a.ref_logprobs, ro_b.ref_logprobs) and torch.equal(ro_a.values, ro_b.values)
    with pytest.raises(SystemExit, match=r"^error: --critic_device tpu:0: expected cpu, cuda, cuda:N or cuda:\+K"):
        C.validate(_args("--critic_device", "tpu:0"))
    with pytest.raises(SystemExit, match="CUDA is not available"):
        S.model_devices(_args("--ref_device", "cuda:1"), DistInfo())


def test_ranks_must_not_share_a_gpu(monkeypatch):
    """GPUs are compared by identity: the same name on two hosts is two GPUs, two names for one GPU clash."""
    stopped = []
    monkeypatch.setattr(S, "stop_all", lambda error, info: stopped.append(error))
    monkeypatch.setattr(S, "gpu_identity", lambda d: f"here-{d.index}")
    cuda = lambda i: torch.device("cuda", i)  # noqa: E731
    info = DistInfo(rank=0, world_size=2, device=cuda(0))
    # Rank 0: actor cuda:0, reference cuda:1; rank 1 (same host): actor cuda:1 -> both use cuda:1.
    monkeypatch.setattr(S, "all_gather_objects", lambda obj, info: [obj, ("hostA", [("here-1", "cuda:1")])])
    S.check_devices_per_rank({"ref": cuda(1), "critic": cuda(0), "reward": cuda(0)}, info)
    assert stopped[-1].startswith("ranks 0 and 1 both use cuda:1 on hostA: give each rank its own GPUs")
    assert "cuda:+K" in stopped[-1]
    monkeypatch.setattr(S, "all_gather_objects", lambda obj, info: [obj, ("hostA", [("here-2", "cuda:2"), ("here-3", "cuda:3")])])
    S.check_devices_per_rank({"ref": cuda(1), "critic": cuda(0), "reward": torch.device("cpu")}, info)
    assert stopped[-1] is None  # every rank its own GPUs (CPU is not a GPU to share)
    # Another node's cuda:0 is another GPU.
    monkeypatch.setattr(S, "all_gather_objects", lambda obj, info: [obj, ("hostB", [("there-0", "cuda:0")])])
    S.check_devices_per_rank({"ref": cuda(0), "critic": cuda(0), "reward": cuda(0)}, info)
    assert stopped[-1] is None


def test_gpu_identity_is_the_uuid_or_the_physical_index(monkeypatch):
    from trainer.run import distributed

    with fake_cuda(4, node="n7"):
        assert distributed.gpu_identity(torch.device("cuda", 2)) == "GPU-n7-gpu2"
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: SimpleNamespace(uuid=None))
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")  # this process's cuda:1 is the host's GPU 5
        assert distributed.gpu_identity(torch.device("cuda", 1)).endswith(":5")


@pytest.mark.slow
def test_model_device_flags_per_rank(monkeypatch):
    """--ref_device/--critic_device/--reward_device under torchrun: cuda:+K counts from the rank's own GPU,
    so ranks on cuda:0-3 put their models on cuda:4-7; what cannot work is one line."""
    cuda = lambda i: torch.device("cuda", i)  # noqa: E731
    with fake_cuda(8):
        for local in range(4):
            info = DistInfo(rank=4 + local, local_rank=local, world_size=8, device=cuda(local), backend="nccl")
            got = S.model_devices(_args("--ref_device", "cuda:+4", "--reward_device", "cpu", "--critic_device", "cuda"), info)
            assert got == {"ref": cuda(local + 4), "critic": cuda(local), "reward": torch.device("cpu")}
        assert S.model_devices(_args("--ref_device", "cuda:6"), info)["ref"] == cuda(6)  # a fixed GPU
        assert S.model_devices(_args(), info) == {"ref": cuda(3), "critic": cuda(3), "reward": cuda(3)}
        with pytest.raises(SystemExit, match=r"^error: --ref_device cuda:\+6: cuda:9 \(rank 7's own GPU is cuda:3\) but only 8 GPUs"):
            S.model_devices(_args("--ref_device", "cuda:+6"), info)
        with pytest.raises(SystemExit, match=r"^error: --critic_device cpu: the critic trains under DDP, and NCCL"):
            S.model_devices(_args("--critic_device", "cpu"), info)
        # One process, or gloo: a CPU critic is fine.
        assert S.model_devices(_args("--critic_device", "cpu"), DistInfo(device=cuda(0)))["critic"] == torch.device("cpu")
        gloo = DistInfo(rank=1, local_rank=1, world_size=2, device=cuda(1), backend="gloo")
        assert S.model_devices(_args("--critic_device", "cpu"), gloo)["critic"] == torch.device("cpu")
        with pytest.raises(SystemExit, match=r"^error: --ref_device cuda:\+1: cuda:\+K counts from the rank's own GPU"):
            S.model_devices(_args("--ref_device", "cuda:+1"), DistInfo())
    C.validate(_args("--ref_device", "cuda:+4"))
    with pytest.raises(SystemExit, match=r"^error: --reward_device cuda:-1: expected"):
        C.validate(_args("--reward_device", "cuda:-1"))


def test_frozen_models_on_a_cpu_beside_a_gpu_actor_keep_cpu_precision(monkeypatch):
    """A --ref_device cpu reference of a bf16 GPU run is held and run as a CPU would (fp32 for a model
    below the CPU's bf16 threshold), not in the GPU's bf16."""
    monkeypatch.setattr(H, "cpu_native_bf16", lambda: False)
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    with fake_cuda(2, capability=(8, 0)):
        assert H.resolve_precision(_args(), cuda) == ("bfloat16", torch.bfloat16)
        assert H.resolve_precision(_args(), cpu) == ("float32", torch.float32)
        assert H.resolve_precision(_args("--dtype", "float16"), cpu) == ("float32", torch.float32)  # no fp16 on a CPU
    cuda0 = torch.device("cuda", 0)
    s = Runtime(info=DistInfo(device=cuda0), ref_device=cpu, critic_device=cuda0, reward_device=cuda0, total_steps=1,
                precisions={"cuda": ("bfloat16", torch.bfloat16), "cpu": ("float32", torch.float32)})
    entered = []
    monkeypatch.setattr(torch, "autocast", lambda device_type, dtype: entered.append((device_type, dtype)) or contextlib.nullcontext())
    with s.autocast(cpu), s.autocast(cuda), s.autocast():
        pass
    assert entered == [("cuda", torch.bfloat16)] * 2  # the CPU's fp32 needs no autocast


def test_phase_timer_waits_for_the_gpus():
    from trainer.run.timing import PhaseTimer

    cuda = lambda i: torch.device("cuda", i)  # noqa: E731
    with fake_cuda(8) as synced:
        timer = PhaseTimer([cuda(0), torch.device("cpu"), cuda(4)])
        with timer("generate"):
            assert synced == [cuda(0), cuda(4)]  # queued work of the previous phase is not billed here
        assert synced == [cuda(0), cuda(4)] * 2  # and this phase's kernels are
        with timer("update_actor_fwd"):  # a sub-phase on the hot path: no host wait
            pass
        assert synced == [cuda(0), cuda(4)] * 2
    assert PhaseTimer([torch.device("cpu")])._cuda == []


# ------------------------------------------------------------------ CUDA-only switches, driven on CPU
@pytest.fixture
def tf32_flags(monkeypatch):
    """Stand-ins for torch's TF32 switches: what allow_tf32 sets, without touching the process."""
    matmul, cudnn = SimpleNamespace(allow_tf32=False), SimpleNamespace(allow_tf32=False)
    monkeypatch.setattr(torch.backends.cuda, "matmul", matmul)
    monkeypatch.setattr(torch.backends, "cudnn", cudnn)
    return matmul, cudnn


@pytest.mark.parametrize("device", ["cuda", "cuda:3"])
def test_allow_tf32_turns_tf32_on_for_cuda(tf32_flags, device):
    setup_mod.allow_tf32(torch.device(device))
    assert tf32_flags[0].allow_tf32 and tf32_flags[1].allow_tf32


def test_allow_tf32_leaves_cpu_alone(tf32_flags):
    setup_mod.allow_tf32(torch.device("cpu"))
    assert not tf32_flags[0].allow_tf32 and not tf32_flags[1].allow_tf32


def test_allow_tf32_on_cpu_keeps_fp32_matmul_precision():
    """The real switches, unpatched: a CPU run's fp32 matmuls (the demo's numerics) stay full precision."""
    before = (torch.get_float32_matmul_precision(), torch.backends.mkldnn.matmul.fp32_precision)
    setup_mod.allow_tf32(torch.device("cpu"))
    assert (torch.get_float32_matmul_precision(), torch.backends.mkldnn.matmul.fp32_precision) == before
    assert before[0] == "highest"


def test_setup_passes_its_device_to_allow_tf32(monkeypatch, tmp_path):
    """setup() hands allow_tf32 the run's device (a CPU run here, where it is a no-op)."""
    from tests.helpers import make_tiny_world, tiny_flags
    from train_ppo import parse_args

    seen: list[torch.device] = []
    monkeypatch.setattr(setup_mod, "allow_tf32", seen.append)
    world = make_tiny_world(tmp_path)
    setup_mod.setup(parse_args(tiny_flags(world, tmp_path)), DistInfo())
    assert seen == [torch.device("cpu")]


class _RecordingDDP(nn.Module):
    calls: list[dict] = []

    def __init__(self, module: nn.Module, **kw):
        super().__init__()
        self.module = module
        _RecordingDDP.calls.append(kw)


class _OnDevice(nn.Module):
    """A model whose parameters report `device` (CUDA layouts, without a GPU)."""

    def __init__(self, device: torch.device):
        super().__init__()
        self.device = device

    def parameters(self, recurse: bool = True):
        yield SimpleNamespace(device=self.device)


@pytest.mark.parametrize("actor_dev, critic_dev, ids", [
    (torch.device("cpu"), torch.device("cpu"), [None, None]),
    (torch.device("cuda", 1), torch.device("cuda", 1), [[1], [1]]),
    (torch.device("cuda", 1), torch.device("cuda", 5), [[1], [5]]),  # --critic_device cuda:5
])
def test_ddp_wraps_without_broadcasting_buffers(monkeypatch, actor_dev, critic_dev, ids):
    """Training changes no buffer, so DDP must not broadcast them from rank 0 before every forward; each
    model is wrapped on the device it lives on."""
    _RecordingDDP.calls = []
    monkeypatch.setattr(setup_mod, "DDP", _RecordingDDP)
    models = SimpleNamespace(actor=_OnDevice(actor_dev), critic=_OnDevice(critic_dev), actor_train=None, critic_train=None)
    args = argparse.Namespace(use_moe=0, use_compile=0, strategy="ddp")
    setup_mod.wrap_for_training(args, models, DistInfo(rank=0, world_size=2, device=actor_dev))
    assert [kw["device_ids"] for kw in _RecordingDDP.calls] == ids
    for kw in _RecordingDDP.calls:
        assert kw["find_unused_parameters"] is False
        assert kw["gradient_as_bucket_view"] is True  # no second copy of the gradients in the buckets
        assert kw.get("forward_sync_buffers", kw.get("broadcast_buffers")) is False
        assert kw.keys() & {"forward_sync_buffers", "broadcast_buffers"} == setup_mod.NO_FORWARD_BUFFER_SYNC.keys()
    assert models.actor_train.module is models.actor and models.critic_train.module is models.critic
    # One process: no DDP at all.
    _RecordingDDP.calls = []
    setup_mod.wrap_for_training(args, models, DistInfo())
    assert _RecordingDDP.calls == [] and models.actor_train is models.actor


def test_evaluation_is_on_for_the_demo_and_off_for_other_data(tmp_path):
    demo = "dataset/demo_train.jsonl"
    assert C.eval_data_path(T.parse_args(["--data_path", demo])) == "dataset/demo_eval.jsonl"
    assert C.eval_data_path(T.parse_args(["--data_path", demo, "--eval_data_path", "none"])) is None
    mine = tmp_path / "rlaif.jsonl"
    assert C.eval_data_path(T.parse_args(["--data_path", str(mine)])) is None  # a user's data: no demo questions
    assert C.eval_data_path(T.parse_args(["--data_path", str(mine), "--eval_data_path", "held.jsonl"])) == "held.jsonl"


def test_ranks_that_resolve_different_precisions_stop_with_one_line(monkeypatch):
    stopped = []
    monkeypatch.setattr(S, "stop_all", lambda error, info: stopped.append(error))
    info = DistInfo(rank=0, world_size=2)
    monkeypatch.setattr(S, "all_gather_objects", lambda obj, info: [obj, ("float32", "float32")])
    S.check_same_precision("bfloat16", torch.bfloat16, info)
    assert stopped[-1] == ("ranks chose different precisions (rank 0: bfloat16/bfloat16, rank 1: float32/float32; "
                           "--dtype auto follows each CPU's native bf16): give --dtype and --frozen_low_precision explicitly")
    S.check_same_precision("float32", torch.float32, info)
    assert stopped[-1] is None
