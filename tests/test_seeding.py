"""trainer/run/seeding.py: seeds and RNG state round trips (what a resume file carries)."""

import random

import numpy as np
import pytest
import torch

from trainer.run import seeding


def _draws() -> tuple:
    return (random.random(), random.getrandbits(64), np.random.rand(3).tolist(), float(np.random.randn()),
            torch.rand(4).tolist(), torch.randint(0, 1000, (3,)).tolist())


def test_rng_round_trip_through_a_weights_only_file(tmp_path):
    random.seed(3), np.random.seed(3), torch.manual_seed(3)
    np.random.randn()  # leaves a cached gaussian: has_gauss must round-trip too
    state = seeding.capture_rng_state()
    expected = _draws()
    torch.save(state, tmp_path / "rng.pth")
    random.seed(99), np.random.seed(99), torch.manual_seed(99)
    assert _draws() != expected
    seeding.restore_rng_state(torch.load(tmp_path / "rng.pth", weights_only=True))
    assert _draws() == expected


def test_rng_state_is_this_ranks_own_gpu(monkeypatch):
    """Each rank saves and restores its own device's CUDA generator, never every visible GPU's: a run
    saved on 8 GPUs resumes where fewer are visible (set_rng_state_all raised IndexError there)."""
    calls = []
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device: calls.append(("get", device)) or torch.tensor([7], dtype=torch.uint8))
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device: calls.append(("set", device, int(state[0]))))
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: pytest.fail("read every GPU's state"))
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", lambda states: pytest.fail("set every GPU's state"))
    state = seeding.capture_rng_state(torch.device("cuda", 3))
    assert calls == [("get", torch.device("cuda", 3))] and int(state["cuda"][0]) == 7
    seeding.restore_rng_state(state, torch.device("cuda", 1))  # this rank's device on the resuming machine
    assert calls[-1] == ("set", torch.device("cuda", 1), 7)
    old = [torch.tensor([i], dtype=torch.uint8) for i in range(8)]  # an older file: all 8 GPUs' states
    seeding.set_cuda_rng_state(old, torch.device("cuda", 2))
    assert calls[-1] == ("set", torch.device("cuda", 2), 2)
    seeding.set_cuda_rng_state(old[:2], torch.device("cuda", 5))  # fewer saved than this index: no IndexError
    assert calls[-1][0] == "set"
    n = len(calls)
    seeding.restore_rng_state(seeding.capture_rng_state(torch.device("cpu")), torch.device("cpu"))  # CPU: CUDA untouched
    assert len(calls) == n


def test_seed_rngs_is_deterministic():
    s1 = seeding.seed_rngs(123)
    d1 = _draws()
    seeding.restore_rng_state(s1)
    assert _draws() == d1
    seeding.seed_rngs(123)
    assert _draws() == d1
    seeding.seed_rngs(124)
    assert _draws() != d1
