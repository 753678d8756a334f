"""Resume files: everything a run depends on, written crash-safely, loaded safely.

A resume file is `checkpoints/<weight>_<hidden>[_moe]_resume_step<NNNNNNNN>.pth`, the last
`--keep_checkpoints` of them kept. It holds the actor and critic in full precision, both
optimizers and schedulers, the step/epoch and the position in the global sample stream, the
RNG states of every rank, the KL controller, the old-actor copy (if any), the swanlab run id,
the flags and the world size. Writes go to a temp file, are fsynced, then renamed, so a kill
during a save leaves the previous file intact (and the partial `*.tmp` it leaves behind is
removed by the next save); a truncated or corrupt newest file (zip CRC32 checked, since
torch.load does not verify it) is detected at load and the previous one is used instead.
Loading uses `weights_only=True`: a file that carries a pickled object which would run code is
refused, never skipped.
"""

from __future__ import annotations

import errno
import glob
import pickle
import re
import shutil
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Protocol

import torch
from torch.distributed.checkpoint.api import CheckpointException

from model.lora import LORA_FLAGS, actor_state_dict, load_actor_state_dict
from model.weights import atomic_torch_save
from trainer.dist import DistInfo, all_gather_objects
from trainer.run.distributed import failing_together, on_main, one_line, stop_all
from trainer.run.provenance import changed_inputs
from trainer.run.seeding import seed_rngs
from trainer.run.sharding import UnsafeShardsError, load_shards, stray_shards

FORMAT_VERSION = 1

# Flags that change what the saved tensors mean or the algorithm's state: resuming with a
# different value would silently train a different thing, so it is refused.
INCOMPATIBLE_FLAGS = (
    "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "use_moe", "arch", "from_weight", "actor_path",
    "tokenizer_path",
    "data_path", "reasoning_gym", "reasoning_gym_size", "seed", "batch_size", "mini_batch_size", "num_generations", "ppo_update_iters",
    "update_old_actor_freq", "adaptive_kl", "kl_estimator", "kl_placement", "max_seq_len", "max_gen_len", "advantage_estimator",
    "filter_groups", "thinking_ratio", "system_prompt_ratio", "reward_norm", "strategy", *LORA_FLAGS,
)
# Flags that differ on every resume by design: not worth reporting as a change.
IGNORED_FLAGS = ("from_resume",)
# Settings that resume files written before the typed config (trainer/config.py) recorded unresolved:
# a saved auto value there is not a change.
UNRESOLVED_BEFORE_CONFIG = {"parallel_update": -1, "frozen_low_precision": -1, "train_attn_implementation": "auto",
                            "save_merged": -1, "device": "auto"}


class Stateful(Protocol):
    """What a resume file keeps of a KL controller, reward normaliser, scheduler, GradScaler or model."""

    def state_dict(self) -> Any: ...
    def load_state_dict(self, state: Any, /) -> Any: ...


class ResumeError(RuntimeError):
    """A resume file that cannot be used (corrupt, unsafe, or from an incompatible run)."""


class UnsafeResumeError(ResumeError):
    """A resume file carrying pickled objects that would run code: refused, never skipped."""


def resume_prefix(save_weight: str, hidden_size: int, use_moe: bool) -> str:
    return f"{save_weight}_{hidden_size}{'_moe' if use_moe else ''}_resume"


def list_resume_files(checkpoint_dir: str | Path, prefix: str) -> list[Path]:
    """Resume files for this run name, newest (highest step) first."""
    pat = re.compile(re.escape(prefix) + r"_step(\d+)\.pth$")
    found = [(int(m.group(1)), p) for p in Path(checkpoint_dir).glob(f"{glob.escape(prefix)}_step*.pth") if (m := pat.match(p.name))]
    return [p for _, p in sorted(found, reverse=True)]


def stray_temp_files(checkpoint_dir: str | Path, prefix: str) -> list[Path]:
    """Partial writes (`<resume file>.<random>.tmp`) left by a save that was killed."""
    return sorted(Path(checkpoint_dir).glob(f"{glob.escape(prefix)}_step*.pth.*.tmp"))


def other_shape_resume_files(checkpoint_dir: str | Path, save_weight: str, prefix: str) -> list[Path]:
    """Resume files of the same --save_weight but another shape (hidden size / MoE), newest first.

    They have another file name, so without this a changed --hidden_size would silently start a
    new run instead of saying which flag differs."""
    pat = re.compile(re.escape(save_weight) + r"_\d+(_moe)?_resume_step\d+\.pth$")
    found = [p for p in Path(checkpoint_dir).glob(f"{glob.escape(save_weight)}_*_resume_step*.pth")
             if pat.match(p.name) and not p.name.startswith(prefix + "_step")]
    return sorted(found, key=lambda p: p.stat().st_mtime, reverse=True)


def resume_path(checkpoint_dir: str | Path, prefix: str, step: int) -> Path:
    return Path(checkpoint_dir) / f"{prefix}_step{step:08d}.pth"


def step_of(path: Path) -> int:
    """The step a resume file's name gives."""
    return int(path.name.removesuffix(".pth").rsplit("_step", 1)[1])


def save_resume(state: dict, checkpoint_dir: str | Path, prefix: str, step: int, keep: int) -> Path:
    """Atomically write the resume file for `step`, then prune to `keep` files: this one and the newest
    `keep - 1` of the older ones (and the DCP folders of a sharded run that no kept file names).

    Pruning runs only after the rename, so a kill at any moment leaves a complete older file. Files of
    later steps are never pruned nor counted: a run only saves below a file it found there when resume
    skipped that file as unreadable, so the one just written is the newest good one, and counting the
    unreadable file instead would prune each new save (with --keep_checkpoints 1). The run's own save
    of that step replaces it."""
    path = resume_path(checkpoint_dir, prefix, step)
    atomic_torch_save({"format_version": FORMAT_VERSION, **state}, path)
    older = [p for p in list_resume_files(checkpoint_dir, prefix) if step_of(p) < step]
    for old in older[max(keep, 1) - 1:]:
        old.unlink(missing_ok=True)
    for tmp in stray_temp_files(checkpoint_dir, prefix):  # only rank 0 saves: no writer is live
        tmp.unlink(missing_ok=True)
    for folder in stray_shards(checkpoint_dir, prefix, list_resume_files(checkpoint_dir, prefix)):
        shutil.rmtree(folder, ignore_errors=True)
    return path


def check_free_space(checkpoint_dir: str | Path, prefix: str, state: dict) -> None:
    """OSError(ENOSPC) before writing when the folder cannot take one more resume file (the newest
    one's size, or the state's tensor bytes for the first): keeping K files needs room for K+1."""
    files = list_resume_files(checkpoint_dir, prefix)
    need = files[0].stat().st_size if files else _tensor_bytes(state)
    Path(checkpoint_dir).mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(checkpoint_dir).free
    if free < need:
        raise OSError(errno.ENOSPC, f"{free / 2**20:.0f} MB free, a resume file needs {need / 2**20:.0f} MB")


def _tensor_bytes(obj: object) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v) for v in obj)
    return 0


def _verify_zip_crc(path: Path) -> None:
    """torch.load checks neither the CRC32s torch.save writes nor, for tensor bytes, anything else:
    a flipped bit would load as a silently different weight. testzip() reads every member."""
    with zipfile.ZipFile(path) as z:
        if not any(m.CRC for m in z.infolist()):  # written with torch's crc32 option off
            return
        bad = z.testzip()
    if bad is not None:
        raise ResumeError(f"{path}: corrupt: checksum mismatch in member {bad}")


def _unsafe_detail(text: str) -> str:
    """The informative line of torch's weights_only error (its first lines are generic advice)."""
    for line in text.splitlines():
        if "unsupported" in line.lower() or "global" in line.lower():
            return line.strip()
    return text.splitlines()[0] if text else "weights_only load failed"


def read_resume(path: str | Path, verify: bool = True) -> dict:
    """Load one resume file (weights_only=True, memory-mapped: the tensors are read as they are
    copied into the models, not all into RAM first); ResumeError / UnsafeResumeError if unusable.
    verify=False skips the CRC pass (other ranks, once rank 0 has checked the file)."""
    path = Path(path)
    try:
        if verify:
            _verify_zip_crc(path)
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except ResumeError:
        raise
    except Exception as e:  # noqa: BLE001 - a damaged file fails in whichever reader trips first (EOFError, KeyError, RuntimeError...)
        text = str(e)
        # With the CRCs verified the pickle is intact, so a weights_only failure is its content.
        if isinstance(e, pickle.UnpicklingError) or "weights only load failed" in text.lower():
            raise UnsafeResumeError(
                f"{path}: refused: it contains a pickled object that would run code when loaded "
                f"({_unsafe_detail(text)}). Resume files are loaded with weights_only=True; do not use "
                f"files from untrusted sources (delete it, or start a new run with --from_resume 0)"
            ) from None
        msg = text.splitlines()[0] if text else type(e).__name__
        raise ResumeError(f"{path}: unreadable (truncated or corrupt): {type(e).__name__}: {msg}") from None
    if not isinstance(state, dict) or state.get("format_version") != FORMAT_VERSION:
        version = state.get("format_version") if isinstance(state, dict) else "?"
        raise ResumeError(f"{path}: not a minippo resume file (format_version {version}, expected {FORMAT_VERSION})")
    return state


def load_latest_resume(checkpoint_dir: str | Path, prefix: str, info: Callable[[str], None] = print) -> tuple[dict, Path] | None:
    """Newest readable resume file; an unreadable newer file is skipped with a message naming it.

    None when there is no resume file at all. An unsafe file (code objects) is never skipped: that
    is an error, not damage. Files that exist but are all unreadable are an error too: starting
    over silently would throw the run away."""
    for tmp in stray_temp_files(checkpoint_dir, prefix):
        info(f"note: ignoring {tmp}: a partial write left by a save that was interrupted")
    files = list_resume_files(checkpoint_dir, prefix)
    for path in files:
        try:
            return read_resume(path), path
        except UnsafeResumeError:
            raise
        except ResumeError as e:
            info(f"warning: {e}; falling back to the previous resume file")
    if files:
        raise ResumeError(f"none of the {len(files)} resume files {checkpoint_dir}/{prefix}_step*.pth is readable "
                          f"(see the warnings above); move them away, or start a new run with --from_resume 0")
    return None


def check_compatible(saved_args: dict, args: dict, source: str = "the resume file") -> list[str]:
    """Raise ResumeError naming every incompatible flag; return the harmless changes ("--flag: old -> new")."""
    bad = [n for n in INCOMPATIBLE_FLAGS if n in saved_args and n in args and saved_args[n] != args[n]]
    if bad:
        what = "; ".join(f"--{n} is {args[n]!r} but {source} was written with --{n} {saved_args[n]!r}" for n in bad)
        raise ResumeError(f"{what}: resume with the same value{'s' if len(bad) > 1 else ''}, "
                          f"or start a new run (--from_resume 0 or another --save_weight)")
    return [f"--{k}: {saved_args[k]!r} -> {args[k]!r}" for k in sorted(args)
            if k in saved_args and k not in IGNORED_FLAGS and saved_args[k] != args[k]
            and not (k in UNRESOLVED_BEFORE_CONFIG and saved_args[k] == UNRESOLVED_BEFORE_CONFIG[k])]


def find_resume(checkpoint_dir: str | Path, save_weight: str, prefix: str, flags: dict,
                info: Callable[[str], None] = print) -> tuple[dict, Path, list[str]] | None:
    """The newest usable resume file for this run, checked against the current flags.

    Returns (state, path, harmless flag changes), or None when there is nothing to resume.
    A changed --hidden_size/--use_moe changes the file name, so files of other shapes are
    checked too: the error names the flag instead of quietly starting over beside them."""
    found = load_latest_resume(checkpoint_dir, prefix, info=info)
    if found is None:
        for other in other_shape_resume_files(checkpoint_dir, save_weight, prefix)[:1]:
            check_compatible(read_resume(other)["args"], flags, source=str(other))
        return None
    state, path = found
    return state, path, check_compatible(state["args"], flags, source=str(path))


def training_state(*, actor: torch.nn.Module, critic: torch.nn.Module | None, optims: dict, scheds: dict, kl_ctl: Stateful,
                   old_actor: torch.nn.Module | None, scaler: Stateful | None, reward_norm: Stateful | None = None,
                   shards: str | None = None) -> dict:
    """Everything trainable or stateful, in full precision (the caller adds step, RNG, flags...). `shards`: the
    DCP folder (a name beside the file) that holds the models and optimizers of a sharded run instead."""
    if shards is not None:
        return {"shards": shards, "actor": None, "critic": None, "optim": None, "old_actor": None,
                "sched": {k: s.state_dict() for k, s in scheds.items()}, "kl_ctl": kl_ctl.state_dict(),
                "reward_norm": reward_norm.state_dict() if reward_norm is not None else None,
                "scaler": scaler.state_dict() if scaler is not None else None}
    return {
        "actor": actor_state_dict(actor), "critic": critic.state_dict() if critic is not None else None,  # None: critic-free
        "optim": {k: o.state_dict() for k, o in optims.items()},
        "sched": {k: s.state_dict() for k, s in scheds.items()},
        "kl_ctl": kl_ctl.state_dict(),
        "reward_norm": reward_norm.state_dict() if reward_norm is not None else None,  # --reward_norm running's moments
        "old_actor": old_actor.state_dict() if old_actor is not None else None,
        "scaler": scaler.state_dict() if scaler is not None else None,  # fp16 loss scale + growth tracker
    }


def load_training_state(state: dict, *, actor: torch.nn.Module, critic: torch.nn.Module | None, optims: dict, scheds: dict,
                        kl_ctl: Stateful, old_actor: torch.nn.Module | None, scaler: Stateful | None,
                        reward_norm: Stateful | None = None) -> None:
    """Inverse of `training_state` (a sharded run's models and optimizers come from its DCP folder: `load_shards`)."""
    if not state.get("shards"):
        try:
            load_actor_state_dict(actor, state["actor"])  # with LoRA: its adapters only
        except ValueError as e:  # e.g. a file written before the LoRA flags were recorded
            raise ResumeError(str(e)) from None
        if critic is not None:
            critic.load_state_dict(state["critic"])
        for k in optims:
            optims[k].load_state_dict(state["optim"][k])
        if old_actor is not None and state.get("old_actor") is not None:
            old_actor.load_state_dict(state["old_actor"])
    for k in optims:
        scheds[k].load_state_dict(state["sched"][k])
    kl_ctl.load_state_dict(state["kl_ctl"])
    if reward_norm is not None and state.get("reward_norm"):  # files from before --reward_norm have none
        reward_norm.load_state_dict(state["reward_norm"])
    if scaler is not None and state.get("scaler"):
        scaler.load_state_dict(state["scaler"])


@dataclass
class Resumed:
    """Where a resumed run picks up, as `resume_run` read it from the newest usable resume file."""

    step: int
    epoch: int
    consumed: int  # global samples of `epoch` already trained on
    nonfinite_run: int
    swanlab_id: str | None
    rng: dict  # this rank's RNG state: restore it just before the loop (start-up code draws numbers)
    record: dict  # the entry for run.json's resume log
    changed_inputs: dict  # {path: new hash record}, accepted with check_inputs=False
    run_id: str | None  # the run the file belongs to (None in files written before run ids)
    ahead: list[dict] | None = None  # this rank's samples of the batches in flight at the save (--async_rollouts)


def resume_run(checkpoint_dir: str | Path, save_weight: str, prefix: str, flags: dict, trainables: dict, *,
               check_inputs: bool, seed: int, info: DistInfo, say: Callable[[str], None] = print) -> Resumed | None:
    """Load the newest usable resume file into `trainables` (load_training_state's keywords).

    Rank 0 chooses the file (CRC-checked, flags compared, inputs re-hashed) and every rank loads that
    file; each rank then confirms what it read, so nodes without a shared --checkpoint_dir stop with
    one line instead of one of them silently starting over. None when there is nothing to resume.
    A file from an incompatible run is an error, and, with check_inputs, so is a starting-weights
    file, reward model or prompt file whose sha256 differs from the run's: the reference and reward
    model are rebuilt from those files, not saved, so other bytes would change what KL and reward measure."""
    picked: dict = {}

    def pick() -> dict | None:
        found = find_resume(checkpoint_dir, save_weight, prefix, flags, info=say)
        if found is None:
            return None
        state, path, changes = found
        changed = changed_inputs(state.get("run") or {})
        if changed and check_inputs:
            raise ResumeError(f"{', '.join(changed)} changed since this run started (its resume file {path} recorded "
                              f"other sha256s): restore the original file(s), start a new run without --from_resume, "
                              f"or pass --resume_check_inputs 0 to continue with the new ones")
        picked["state"] = state  # rank 0 has read it already
        return {"path": str(path), "step": state["step"], "run_id": state.get("run_id"), "changes": changes, "changed": changed}

    choice = on_main(pick, info)
    if choice is None:
        return None
    path = str(Path(checkpoint_dir) / Path(choice["path"]).name)  # rank 0's choice, in this rank's --checkpoint_dir
    with failing_together(info):
        try:
            state = picked.get("state") or read_resume(path, verify=False)
        except ResumeError as e:
            raise ResumeError(f"{e}; rank 0 chose it: every rank must see rank 0's --checkpoint_dir (a shared filesystem)") from None
        shards = Path(path).with_name(state["shards"]) if state.get("shards") else None
        if shards is not None and not (shards / ".metadata").is_file():
            raise ResumeError(f"{path} names its shards {shards}/, which this rank cannot read: every rank must see rank 0's "
                              f"--checkpoint_dir (a shared filesystem), with the folder whole")
    seen = all_gather_objects((state["step"], state.get("run_id")), info)
    stop_all(None if all(x == seen[0] for x in seen) else
             f"ranks read different resume files at {path} (step, run id per rank: {seen}): every rank must see "
             f"rank 0's --checkpoint_dir (a shared filesystem)", info)
    if choice["changed"]:
        say(f"warning: {', '.join(choice['changed'])} changed since this run started; continuing with the new bytes")
    load_training_state(state, **trainables)
    if shards is not None:  # a collective: every rank reads its part, resharded to this world size
        try:
            load_shards({"actor": trainables["actor"], "critic": trainables["critic"], "old_actor": trainables["old_actor"]},
                        trainables["optims"], shards)
        except UnsafeShardsError as e:
            raise UnsafeResumeError(str(e)) from None
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - DCP raises on every rank when any rank's read failed
            raise ResumeError(f"{shards}: unreadable shards ({one_line(e)}); move this step's files away to resume from the "
                              f"previous checkpoint") from None
    step, saved_world, rank, world_size = state["step"], state["world_size"], info.rank, info.world_size
    rngs = state["rng"]
    rng = rngs[rank] if rank < len(rngs) else seed_rngs(seed + rank + 1000003 * step, info.device)
    say(f"resumed from {path} at step {step} (epoch {state['epoch']}, sample {state['consumed']})")
    if saved_world != world_size:
        say(f"world size changed {saved_world} -> {world_size}: continuing at global sample {state['consumed']} of "
            f"epoch {state['epoch']} (no sample repeated or skipped); each process now takes "
            f"{flags['batch_size']} of {flags['batch_size'] * world_size} prompts per step")
        if world_size > len(rngs):
            say(f"ranks {len(rngs)}..{world_size - 1} have no saved RNG state: seeded from --seed, rank and step")
    for c in choice["changes"]:
        say(f"flag changed on resume: {c}")
    record = {"path": path, "step": step, "world_size": world_size, "saved_world_size": saved_world,
              "flag_changes": choice["changes"], "changed_inputs": list(choice["changed"])}
    return Resumed(step=step, epoch=state["epoch"], consumed=state["consumed"], nonfinite_run=state["nonfinite_run"],
                   swanlab_id=state.get("swanlab_id"), rng=rng, record=record, changed_inputs=choice["changed"],
                   run_id=state.get("run_id"),
                   ahead=state["ahead"][rank] if state.get("ahead") and saved_world == world_size else None)
