"""Native MiniMind weight files (`out/<weight>_<hidden>[_moe].pth`): strict load, atomic save (and
`atomic_dir`, the same promise for an exported folder).

A file is a plain `torch.save` of a tensor-only state dict in Hugging Face key naming, usually
fp16. MiniMind loads these with `strict=False`, which hides real mistakes (a wrong
`--hidden_size` silently gives a random model); here every key is checked and the error says
which flag is probably wrong.

MoE layers: MiniMind stores experts one by one (`mlp.experts.{j}.gate_proj.weight`, ...) while
transformers' Qwen3-MoE keeps them fused (`mlp.experts.gate_up_proj` [E, 2*I, H],
`mlp.experts.down_proj` [E, H, I]); `to_native` / `from_native` convert between the two.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import nn

_EXPERT_KEY = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


class WeightsError(ValueError):
    """A weights file that does not fit the model built from the flags."""


def native_weight_path(save_dir: str | os.PathLike, weight: str, hidden_size: int, use_moe: bool) -> Path:
    """MiniMind's file naming: `<save_dir>/<weight>_<hidden>[_moe].pth`."""
    return Path(save_dir) / f"{weight}_{hidden_size}{'_moe' if use_moe else ''}.pth"


def to_native(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers layout -> MiniMind layout (un-fuses MoE experts, keeps everything else)."""
    out: dict[str, torch.Tensor] = {}
    for key, t in state_dict.items():
        if key.endswith(".mlp.experts.gate_up_proj"):
            prefix = key[: -len(".gate_up_proj")]
            inter = t.shape[1] // 2
            for j in range(t.shape[0]):
                out[f"{prefix}.{j}.gate_proj.weight"] = t[j, :inter].clone()
                out[f"{prefix}.{j}.up_proj.weight"] = t[j, inter:].clone()
        elif key.endswith(".mlp.experts.down_proj"):
            prefix = key[: -len(".down_proj")]
            for j in range(t.shape[0]):
                out[f"{prefix}.{j}.down_proj.weight"] = t[j].clone()
        else:
            out[key] = t
    return out


def from_native(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """MiniMind layout -> transformers layout (fuses per-expert MoE weights)."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for key, t in state_dict.items():
        m = _EXPERT_KEY.match(key)
        if m:
            experts.setdefault(m.group(1), {}).setdefault(int(m.group(2)), {})[m.group(3)] = t
        else:
            out[key] = t
    for prefix, by_idx in experts.items():
        idx = sorted(by_idx)
        if idx != list(range(len(idx))) or any(len(by_idx[j]) != 3 for j in idx):
            # Leave the pieces as they are: the strict key check will report them by name.
            for j in idx:
                for name, t in by_idx[j].items():
                    out[f"{prefix}.{j}.{name}.weight"] = t
            continue
        out[f"{prefix}.gate_up_proj"] = torch.stack(
            [torch.cat([by_idx[j]["gate_proj"], by_idx[j]["up_proj"]], dim=0) for j in idx]
        )
        out[f"{prefix}.down_proj"] = torch.stack([by_idx[j]["down_proj"] for j in idx])
    return out


def _suggest(expected: dict, found: dict, shape_errors: list[str]) -> str:
    """Guess which flag produced the mismatch, from the kind of keys involved."""
    hints = []

    def layers(d: dict) -> set[int]:
        return {int(m.group(1)) for k in d if (m := re.search(r"layers\.(\d+)\.", k))}

    def has(d: dict, part: str) -> bool:
        return any(part in k for k in d)

    if layers(expected) != layers(found):
        hints.append(f"--num_hidden_layers (the file has {len(layers(found))} layers, the model {len(layers(expected))})")
    if has(expected, "q_norm") != has(found, "q_norm"):
        hints.append("--arch (q_norm/k_norm exist only in the current 'qwen3' MiniMind architecture; MiniMind2 is 'llama')")
    if has(expected, ".experts.") != has(found, ".experts."):
        hints.append("--use_moe (the file and the model disagree on mixture-of-experts layers)")
    if shape_errors:
        if any(s.startswith(("model.embed_tokens", "lm_head")) for s in shape_errors):
            hints.append("--hidden_size (or the vocabulary: --tokenizer_path must match the weights)")
        elif any("self_attn" in s and "norm" in s for s in shape_errors):
            hints.append("--num_attention_heads / --num_key_value_heads (the file's head size differs)")
        elif not hints:
            hints.append("--hidden_size or --arch (the FFN width and kv heads differ between architectures)")
    return "; check " + " and ".join(hints) if hints else ""


def _listing(name: str, keys: list[str], limit: int = 6) -> str:
    shown = ", ".join(keys[:limit]) + (f", ... (+{len(keys) - limit} more)" if len(keys) > limit else "")
    return f"{len(keys)} {name} [{shown}]"


def check_state_dict(model: nn.Module, state_dict: dict[str, torch.Tensor], source: str) -> None:
    """Raise WeightsError listing missing / unexpected / wrongly shaped keys (MiniMind names), with a flag hint."""
    expected = to_native(model.state_dict())
    state_dict = to_native(state_dict)
    missing = sorted(k for k in expected if k not in state_dict)
    unexpected = sorted(k for k in state_dict if k not in expected)
    shape_errors = [
        f"{k}: file {tuple(state_dict[k].shape)} vs model {tuple(expected[k].shape)}"
        for k in sorted(expected)
        if k in state_dict and tuple(state_dict[k].shape) != tuple(expected[k].shape)
    ]
    if not (missing or unexpected or shape_errors):
        return
    parts = []
    if missing:
        parts.append(_listing("missing", missing))
    if unexpected:
        parts.append(_listing("unexpected", unexpected))
    if shape_errors:
        parts.append(_listing("wrongly shaped", shape_errors, limit=3))
    raise WeightsError(f"{source} does not fit the model: " + "; ".join(parts) + _suggest(expected, state_dict, shape_errors))


def read_state_dict(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """`torch.load` with weights_only=True: a file carrying code objects is refused, not executed."""
    path = Path(path)
    if not path.is_file():
        raise WeightsError(f"{path}: no such weights file (check --save_dir / --from_weight / --hidden_size)")
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any read failure is the file's (UnpicklingError: code objects; RuntimeError: truncated zip)
        raise WeightsError(f"{path}: cannot be read as a tensor-only state dict ({type(e).__name__}: {str(e).splitlines()[0]})") from None
    if isinstance(obj, dict) and "model" in obj and isinstance(obj["model"], dict):
        obj = obj["model"]  # a MiniMind resume file: take its actor weights
    if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise WeightsError(f"{path}: expected a state dict of tensors")
    return obj


def load_native_weights(model: nn.Module, path: str | os.PathLike) -> None:
    """Load a MiniMind `.pth` into `model` strictly (all keys, all shapes), in the model's dtype."""
    state = from_native(read_state_dict(path))
    # A tied lm_head is one tensor with the embedding; MiniMind files carry both names.
    if "lm_head.weight" not in state and "model.embed_tokens.weight" in state:
        if getattr(model.config, "tie_word_embeddings", False):
            state["lm_head.weight"] = state["model.embed_tokens.weight"]
    check_state_dict(model, state, str(path))
    model.load_state_dict(state, strict=True)


def atomic_torch_save(obj: Any, path: str | os.PathLike) -> None:
    """Write to a temp file in the same folder, fsync, then rename: a kill never leaves half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def atomic_dir(final: str | os.PathLike) -> Iterator[Path]:
    """A folder written whole or not at all (a save_pretrained export): yields a private temporary folder beside
    `final` (same filesystem, unique name) to write into; on success its files are synced and it takes `final`'s
    place (the previous folder is renamed aside first, then removed); on an error it is removed. A kill at any
    moment leaves the previous folder or the new one, each complete: in the instant between the two renames
    the previous one stands beside `final` as `.<name>.*.old`, and the next write puts it back first.
    Temporary folders of killed writes (`.<name>.*.tmp`) are removed by the next write."""
    final = Path(final)
    parent, name = final.parent, final.name
    parent.mkdir(parents=True, exist_ok=True)
    asides = sorted(parent.glob(f".{glob.escape(name)}.*.old"), key=lambda p: p.stat().st_mtime)
    if asides and not final.exists():
        os.rename(asides.pop(), final)  # killed between the renames: the previous export back in its place
    for stale in [*asides, *parent.glob(f".{glob.escape(name)}.*.tmp")]:
        shutil.rmtree(stale, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", suffix=".tmp", dir=parent))  # 0700 while it is written
    try:
        yield tmp
        probe = tmp / ".mode"
        probe.mkdir()  # what a plain mkdir gives under this umask: the export's own mode
        mode = probe.stat().st_mode & 0o7777
        probe.rmdir()
        for root, _, files in os.walk(tmp):
            for f in files:
                _fsync(Path(root) / f)
        os.chmod(tmp, mode)
        _fsync(tmp)
        if final.exists():
            aside = Path(tempfile.mkdtemp(prefix=f".{name}.", suffix=".old", dir=parent))
            os.rename(final, aside)  # onto an empty folder: replaces it
            try:
                os.rename(tmp, final)
            except BaseException:
                os.rename(aside, final)
                raise
            shutil.rmtree(aside, ignore_errors=True)
        else:
            os.rename(tmp, final)
        _fsync(parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def save_native_weights(model: nn.Module | dict[str, torch.Tensor], path: str | os.PathLike,
                        dtype: torch.dtype = torch.float16) -> None:
    """Save in MiniMind's format (per-expert keys, fp16 by default) so its scripts load our output.
    `model` may also be a state dict in transformers' key names (a LoRA actor's merged weights)."""
    sd = model if isinstance(model, dict) else getattr(model, "module", model).state_dict()  # unwrap DDP
    state = {k: v.detach().to("cpu", dtype=dtype).clone() for k, v in to_native(sd).items()}
    atomic_torch_save(state, path)
