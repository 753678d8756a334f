"""trainer/run/setup.py: the CUDA-only switches (TF32) and the DDP wrapping, driven on CPU."""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import trainer.run.setup as setup_mod
from trainer.run.distributed import DistInfo


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


@pytest.mark.parametrize("device, ids", [(torch.device("cpu"), None), (torch.device("cuda", 1), [1])])
def test_ddp_wraps_without_broadcasting_buffers(monkeypatch, device, ids):
    """Training changes no buffer, so DDP must not broadcast them from rank 0 before every forward."""
    _RecordingDDP.calls = []
    monkeypatch.setattr(setup_mod, "DDP", _RecordingDDP)
    models = SimpleNamespace(actor=nn.Linear(2, 2), critic=nn.Linear(2, 1), actor_train=None, critic_train=None)
    args = argparse.Namespace(use_moe=0, use_compile=0)
    setup_mod.wrap_for_training(args, models, DistInfo(rank=0, world_size=2, device=device))
    assert len(_RecordingDDP.calls) == 2
    for kw in _RecordingDDP.calls:
        assert kw == {"device_ids": ids, "find_unused_parameters": False, "broadcast_buffers": False}
    assert models.actor_train.module is models.actor and models.critic_train.module is models.critic
    # One process: no DDP at all.
    _RecordingDDP.calls = []
    setup_mod.wrap_for_training(args, models, DistInfo())
    assert _RecordingDDP.calls == [] and models.actor_train is models.actor
