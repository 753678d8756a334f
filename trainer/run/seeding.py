"""Seeds and RNG state: python, numpy, torch CPU and this rank's CUDA generator. Seeded once at setup
(trainer/run/setup.py), captured into every resume file and restored from it (trainer/run/checkpoint.py,
lifecycle.py), so a resumed run draws exactly the numbers the uninterrupted one would have.
"""

from __future__ import annotations

import random

import numpy as np
import torch


def cuda_rng_state(device: torch.device) -> torch.Tensor | None:
    """This rank's own GPU generator (None off CUDA). Not every visible GPU's: a run resumed where
    fewer GPUs are visible would index past them, and each rank only ever samples on its own."""
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else None


def set_cuda_rng_state(state: torch.Tensor | list | None, device: torch.device) -> None:
    if device.type != "cuda" or state is None:
        return
    if isinstance(state, list):  # files written before per-device states held every visible GPU's
        if not state:
            return
        state = state[device.index or 0] if (device.index or 0) < len(state) else state[0]
    torch.cuda.set_rng_state(state, device)


def capture_rng_state(device: torch.device = torch.device("cpu")) -> dict:
    """Python, numpy, torch CPU and this rank's CUDA generators, as weights_only-loadable values."""
    np_state = np.random.get_state(legacy=False)
    return {
        "python": random.getstate(),
        "numpy": {
            "bit_generator": np_state["bit_generator"],
            "key": torch.from_numpy(np_state["state"]["key"].astype(np.int64)),
            "pos": int(np_state["state"]["pos"]),
            "has_gauss": int(np_state["has_gauss"]),
            "gauss": float(np_state["gauss"]),
        },
        "torch": torch.get_rng_state(),
        "cuda": cuda_rng_state(device),
    }


def restore_rng_state(state: dict, device: torch.device = torch.device("cpu")) -> None:
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    n = state["numpy"]
    np.random.set_state({
        "bit_generator": n["bit_generator"],
        "state": {"key": n["key"].numpy().astype(np.uint32), "pos": n["pos"]},
        "has_gauss": n["has_gauss"],
        "gauss": n["gauss"],
    })
    torch.set_rng_state(state["torch"])
    set_cuda_rng_state(state.get("cuda"), device)


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch (CPU and every CUDA device) from `seed`: the generators a resume
    file captures."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def seed_rngs(seed: int, device: torch.device = torch.device("cpu")) -> dict:
    """seed_everything, then the resulting state: for ranks that a resume file has no RNG state for
    (the world size grew)."""
    seed_everything(seed)
    return capture_rng_state(device)
