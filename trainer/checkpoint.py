"""Resume files: everything a run depends on, written crash-safely, loaded safely.

A resume file is `checkpoints/<weight>_<hidden>[_moe]_resume_step<NNNNNNNN>.pth`, the last
`--keep_checkpoints` of them kept. It holds the actor and critic in full precision, both
optimizers and schedulers, the step/epoch and the position in the global sample stream, the
RNG states of every rank, the KL controller, the old-actor copy (if any), the swanlab run id,
the flags and the world size. Writes go to a temp file, are fsynced, then renamed, so a kill
during a save leaves the previous file intact; a truncated or corrupt newest file is detected
at load and the previous one is used instead. Loading uses `weights_only=True`: a file that
carries a pickled object which would run code is refused.
"""

from __future__ import annotations

import random
import re
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from model.weights import atomic_torch_save

FORMAT_VERSION = 1

# Flags that change what the saved tensors mean or the algorithm's state: resuming with a
# different value would silently train a different thing, so it is refused.
INCOMPATIBLE_FLAGS = (
    "hidden_size", "num_hidden_layers", "use_moe", "arch", "from_weight", "actor_path", "tokenizer_path",
    "data_path", "seed", "batch_size", "mini_batch_size", "num_generations", "ppo_update_iters",
    "update_old_actor_freq", "adaptive_kl", "kl_estimator", "kl_placement", "max_seq_len", "max_gen_len",
    "thinking_ratio", "system_prompt_ratio", "epochs",
)


class ResumeError(RuntimeError):
    """A resume file that cannot be used (corrupt, unsafe, or from an incompatible run)."""


def resume_prefix(save_weight: str, hidden_size: int, use_moe: bool) -> str:
    return f"{save_weight}_{hidden_size}{'_moe' if use_moe else ''}_resume"


def list_resume_files(checkpoint_dir: str | Path, prefix: str) -> list[Path]:
    """Resume files for this run name, newest (highest step) first."""
    pat = re.compile(re.escape(prefix) + r"_step(\d+)\.pth$")
    found = [(int(m.group(1)), p) for p in Path(checkpoint_dir).glob(f"{prefix}_step*.pth") if (m := pat.match(p.name))]
    return [p for _, p in sorted(found, reverse=True)]


def save_resume(state: dict, checkpoint_dir: str | Path, prefix: str, step: int, keep: int) -> Path:
    """Atomically write the resume file for `step`, then prune to the newest `keep` files."""
    path = Path(checkpoint_dir) / f"{prefix}_step{step:08d}.pth"
    atomic_torch_save({"format_version": FORMAT_VERSION, **state}, path)
    for old in list_resume_files(checkpoint_dir, prefix)[max(keep, 1):]:
        old.unlink(missing_ok=True)
    return path


def read_resume(path: str | Path) -> dict:
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        if "weights_only" in str(e) or "Unsupported global" in str(e) or "UnpicklingError" in type(e).__name__:
            raise ResumeError(
                f"{path}: refused: it contains pickled objects that would run code when loaded "
                f"(weights_only=True). Do not use files from untrusted sources. ({msg})"
            ) from None
        raise ResumeError(f"{path}: unreadable (truncated or corrupt): {msg}") from None
    if not isinstance(state, dict) or state.get("format_version") != FORMAT_VERSION:
        raise ResumeError(f"{path}: not a minippo resume file (format_version {state.get('format_version') if isinstance(state, dict) else '?'})")
    return state


def load_latest_resume(checkpoint_dir: str | Path, prefix: str, info: Callable[[str], None] = print) -> tuple[dict, Path] | None:
    """Newest readable resume file; an unreadable newer file is skipped with a message.

    An unsafe file (code objects) is never skipped silently: that is an error, not damage."""
    files = list_resume_files(checkpoint_dir, prefix)
    for path in files:
        try:
            return read_resume(path), path
        except ResumeError as e:
            if "refused" in str(e):
                raise
            info(f"warning: {e}; falling back to the previous resume file")
    return None


def check_compatible(saved_args: dict, args: dict) -> list[str]:
    """Raise ResumeError naming the first incompatible flag; return the harmless changes."""
    for name in INCOMPATIBLE_FLAGS:
        if name in saved_args and name in args and saved_args[name] != args[name]:
            raise ResumeError(
                f"--{name} is {args[name]!r} but the resume file was written with --{name} {saved_args[name]!r}: "
                f"resume with the same value, or start a new run (--from_resume 0 or another --save_weight)"
            )
    return [f"--{k}: {saved_args[k]!r} -> {args[k]!r}" for k in sorted(args) if k in saved_args and saved_args[k] != args[k]]


def capture_rng_state() -> dict:
    """Python, numpy, torch CPU and CUDA generators, as weights_only-loadable values."""
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
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def restore_rng_state(state: dict) -> None:
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
    if torch.cuda.is_available() and state.get("cuda"):
        torch.cuda.set_rng_state_all(state["cuda"])
