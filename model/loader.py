"""One loader for policies, tokenizers and reward models, shared by train_ppo.py, scripts/, builders/,
benchmarks/ and notebooks.

    from model.loader import load_policy
    policy, tok = load_policy(weights="out/full_sft_128.pth", hidden_size=128, num_hidden_layers=4)
    policy, tok = load_policy(hf_path="path/to/any/hf/causal-lm")

Native MiniMind weights need the shape flags (the file holds tensors only); an HF directory
carries its own config, tokenizer and chat template. Nothing is ever downloaded: paths must be
local, and remote code runs only with `trust_remote_code=True` (the `--trust_remote_code` flag).
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import re
import shlex
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer, PreTrainedTokenizerBase
from transformers.utils import logging as hf_logging

from .config import MiniMindConfig
from .modeling import MiniMindForCausalLM
from .weights import WeightsError, load_native_weights, read_state_dict

DEFAULT_TOKENIZER_DIR = Path(__file__).resolve().parent  # model/ ships tokenizer.json + config

hf_logging.disable_progress_bar()


def _local_dir(path: str | os.PathLike, flag: str) -> Path:
    p = Path(path)
    if not p.is_dir():
        raise WeightsError(f"{flag} {path}: not a local directory (nothing is downloaded; give a saved Hugging Face folder)")
    return p


def _bin_weight_files(d: Path) -> list[Path]:
    """The pickle-format weight files transformers reads from `d`, in its order of preference:
    pytorch_model.bin, else the shards its index names (never e.g. training_args.bin)."""
    if (d / "pytorch_model.bin").is_file():
        return [d / "pytorch_model.bin"]
    try:
        weight_map = json.loads((d / "pytorch_model.bin.index.json").read_text(encoding="utf-8"))["weight_map"]
        return [d / f for f in sorted(set(weight_map.values()))]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return []


@contextlib.contextmanager
def _refuse_pickled_code(d: Path, flag: str) -> Iterator[None]:
    """Turn torch's refusal of a .bin carrying code into one line naming the file.

    transformers reads .bin weights with torch.load(weights_only=True), whose unpickler raises
    UnpicklingError("Weights only load failed...") at the first global it would have to import:
    nothing in the file has run. Other UnpicklingErrors (a corrupt file) pass through unchanged."""
    try:
        yield
    except pickle.UnpicklingError as e:
        if not str(e).startswith("Weights only load failed"):
            raise
        found = re.search(r"GLOBAL (\S+)", str(e))
        files = _bin_weight_files(d)
        culprit = _first_refused(files) if len(files) > 1 else (files[0] if files else None)
        # transformers 5 reads .bin with weights_only=True whatever from_pretrained is told, so the way
        # out for a trusted file is to rewrite its tensors as model.safetensors (preferred over .bin).
        convert = (
            " or, only if you trust the file, convert it once: python -c \"import sys, torch, safetensors.torch as st; "
            "sd = {}; [sd.update(torch.load(f, weights_only=False)) for f in sys.argv[2:]]; "  # noqa: S301 - printed for the user, for a file they trust
            "st.save_file({k: v.contiguous().clone() for k, v in sd.items() if torch.is_tensor(v)}, sys.argv[1], "
            "metadata={'format': 'pt'})\" " + " ".join(shlex.quote(str(f)) for f in [d / "model.safetensors", *files])
        ) if files else ""
        raise WeightsError(
            f"{flag} {d}: refused {culprit or 'its .bin weights'}: it contains pickled code"
            f"{f' (it would call {found.group(1)})' if found else ''}, which loading would run; "
            f"use safetensors weights (model.safetensors){convert}"
        ) from None


def _first_refused(files: list[Path]) -> Path | None:
    """The first shard torch.load(weights_only=True) refuses (nothing in it runs)."""
    for f in files:
        try:
            torch.load(f, map_location="meta", weights_only=True)
        except pickle.UnpicklingError:
            return f
        except Exception:  # noqa: BLE001 - a shard unreadable for another reason is not the one with code: go on
            continue
    return None


def _warn_unused_remote_code(model: nn.Module, d: Path, flag: str) -> None:
    """A config.json with `auto_map` AND a stock model_type loads transformers' own class without
    --trust_remote_code, silently: say that the directory's code was not used."""
    auto_map = getattr(model.config, "auto_map", None)
    if not auto_map:
        return
    refs = auto_map.values() if isinstance(auto_map, dict) else []
    # An AutoTokenizer entry is a [slow, fast] pair; the others are "module.Class" strings.
    found = sorted({str(r) for v in refs for r in (v if isinstance(v, (list, tuple)) else [v]) if r})
    names = ", ".join(found)[:120] or "custom classes"
    print(f"warning: {flag} {d}: config.json's auto_map names custom code ({names}) that was NOT used: "
          f"transformers' stock {model.config.model_type} class {type(model).__name__} was loaded instead; "
          "pass --trust_remote_code 1 to use the directory's code", file=sys.stderr, flush=True)


def load_tokenizer(path: str | os.PathLike | None = None, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    """A tokenizer directory (ours in model/, a MiniMind one, or an HF model's); pad defaults to eos."""
    p = _local_dir(path or DEFAULT_TOKENIZER_DIR, "--tokenizer_path")
    try:
        tok = AutoTokenizer.from_pretrained(str(p), trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:  # e.g. an empty folder: transformers' own message is several lines
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise WeightsError(f"--tokenizer_path {p}: no loadable tokenizer there ({first})") from e
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token  # needed for left-padded batches; masked out everywhere
    return tok


def detect_arch(state_dict: dict[str, torch.Tensor]) -> str:
    """q_norm weights exist only in the current (qwen3) architecture."""
    return "qwen3" if any(k.endswith("self_attn.q_norm.weight") for k in state_dict) else "llama"


def build_minimind(
    hidden_size: int = 512,
    num_hidden_layers: int = 8,
    use_moe: bool = False,
    arch: str = "qwen3",
    vocab_size: int = 6400,
    **overrides: Any,
) -> MiniMindForCausalLM:
    """A randomly initialised MiniMind model of the given shape (seed torch first for repeatability)."""
    config = MiniMindConfig(
        hidden_size=hidden_size, num_hidden_layers=num_hidden_layers, use_moe=use_moe, arch=arch,
        vocab_size=vocab_size, **overrides,
    )
    return MiniMindForCausalLM(config)


def detect_heads(state_dict: dict[str, torch.Tensor]) -> dict[str, int]:
    """Head counts read off a qwen3-arch file: q_norm is [head_dim], q_proj [heads*head_dim, hidden],
    k_proj [kv_heads*head_dim, hidden]. The llama arch has no q_norm, so nothing can be read there."""
    q_norm = state_dict.get("model.layers.0.self_attn.q_norm.weight")
    q_proj = state_dict.get("model.layers.0.self_attn.q_proj.weight")
    k_proj = state_dict.get("model.layers.0.self_attn.k_proj.weight")
    if q_norm is None or q_proj is None or k_proj is None:
        return {}
    head_dim = q_norm.shape[0]
    return {"num_attention_heads": q_proj.shape[0] // head_dim, "num_key_value_heads": k_proj.shape[0] // head_dim}


def load_policy(
    *,
    weights: str | os.PathLike | None = None,
    hf_path: str | os.PathLike | None = None,
    hidden_size: int = 512,
    num_hidden_layers: int = 8,
    use_moe: bool = False,
    arch: str = "auto",
    num_attention_heads: int = 0,
    num_key_value_heads: int = 0,
    tokenizer_path: str | os.PathLike | None = None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    trust_remote_code: bool = False,
) -> tuple[nn.Module, PreTrainedTokenizerBase]:
    """Policy + tokenizer from a native `.pth` (with shape flags) or a local HF directory.

    weights=None and hf_path=None builds a random MiniMind model (benchmarks, tests).
    arch="auto" reads the architecture off the weights file (q_norm present -> qwen3); head counts
    0 = MiniMind's defaults (8 / 4 or 2), or, for the qwen3 arch, what the file's shapes say.
    """
    if weights is not None and hf_path is not None:
        raise ValueError("give either native weights (--from_weight) or an HF directory (--actor_path), not both")
    if hf_path is not None:
        d = _local_dir(hf_path, "--actor_path")
        with _refuse_pickled_code(d, "--actor_path"):
            model: nn.Module = AutoModelForCausalLM.from_pretrained(str(d), dtype=dtype, trust_remote_code=trust_remote_code)
        if not trust_remote_code:
            _warn_unused_remote_code(model, d, "--actor_path")
        tok = load_tokenizer(tokenizer_path or d, trust_remote_code=trust_remote_code)
    else:
        tok = load_tokenizer(tokenizer_path)
        state = read_state_dict(weights) if weights is not None else None
        if arch == "auto":
            arch = detect_arch(state) if state is not None else "qwen3"
        vocab = len(tok)
        if state is not None and "model.embed_tokens.weight" in state:
            vocab = state["model.embed_tokens.weight"].shape[0]
        if vocab < len(tok):
            raise WeightsError(
                f"tokenizer has {len(tok)} tokens but the model's vocabulary is {vocab}: "
                "use the tokenizer the weights were trained with (--tokenizer_path)"
            )
        heads = {}
        if num_attention_heads:
            heads["num_attention_heads"] = num_attention_heads
        if num_key_value_heads:
            heads["num_key_value_heads"] = num_key_value_heads
        if state is not None:
            # Explicit flags win (a mismatch is then reported key by key); otherwise read them off the file.
            heads = {**detect_heads(state), **heads}
        model = build_minimind(hidden_size, num_hidden_layers, use_moe, arch, vocab_size=vocab, **heads)
        if weights is not None:
            load_native_weights(model, weights)
        model = model.to(dtype)
    model.generation_config.pad_token_id = tok.pad_token_id
    contiguous_head_input(model)
    return model.to(device), tok


def _contiguous(module: nn.Module, args: tuple) -> tuple:
    return (args[0].contiguous(), *args[1:])


def contiguous_head_input(model: nn.Module) -> None:
    """Hand the LM head contiguous hidden states. `logits_to_keep` slices the last positions of [B, T, H], a strided
    view, and torch's matmul of a strided 3-D input with a weight that requires no grad (a frozen reference, old actor
    or eval model) does not fold it into one mm: it expands the weight to [B, H, vocab] and copies it, H x vocab
    elements per row (at a large vocabulary, most of a reference forward's time, and gigabytes on a GPU). A copy of
    the kept hidden states costs B x kept x H instead.
    The hook goes with the module through deepcopy (the frozen copies), DDP, FSDP2 and peft."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if isinstance(head, nn.Module):
        head.register_forward_pre_hook(_contiguous)


def eos_token_ids(model: nn.Module, tok: PreTrainedTokenizerBase) -> list[int]:
    """Every id that ends a reply: the tokenizer's EOS first, then any other stop ids the model's
    generation_config lists (HF chat models often stop on several, e.g. <|im_end|> and <|endoftext|>)."""
    ids = [tok.eos_token_id] if tok.eos_token_id is not None else []
    cfg_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for i in (cfg_eos if isinstance(cfg_eos, (list, tuple)) else [cfg_eos]):
        if i is not None and int(i) not in ids:
            ids.append(int(i))
    if not ids:
        raise WeightsError("neither the tokenizer nor the model's generation_config defines an EOS token: "
                           "set eos_token in tokenizer_config.json")
    return ids


def load_reward_model(
    path: str | os.PathLike,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    trust_remote_code: bool = False,
) -> tuple[nn.Module, PreTrainedTokenizerBase]:
    """A frozen external reward model and its own tokenizer.

    Any local `AutoModelForSequenceClassification` directory; with trust_remote_code, a
    model exposing `get_score(tokenizer, messages)` (InternLM2-Reward style) loaded via AutoModel.
    """
    d = _local_dir(path, "--reward_model_path")
    info = None
    try:
        with _refuse_pickled_code(d, "--reward_model_path"):
            model, info = AutoModelForSequenceClassification.from_pretrained(
                str(d), dtype=dtype, trust_remote_code=trust_remote_code, output_loading_info=True
            )
    except WeightsError:
        raise
    except (ValueError, KeyError) as e:
        if not trust_remote_code:
            raise WeightsError(
                f"--reward_model_path {path}: not a sequence-classification model ({str(e).splitlines()[0]}); "
                "for a get_score() remote-code reward model add --trust_remote_code 1"
            ) from None
        from transformers import AutoModel

        with _refuse_pickled_code(d, "--reward_model_path"):
            model = AutoModel.from_pretrained(str(d), dtype=dtype, trust_remote_code=True)
    if not trust_remote_code:
        _warn_unused_remote_code(model, d, "--reward_model_path")
    if info is not None and info["missing_keys"]:
        raise WeightsError(
            f"--reward_model_path {path}: no trained reward head ({', '.join(sorted(info['missing_keys'])[:3])} "
            "missing; transformers would initialise it randomly): give a reward model, not a causal LM"
        )
    tok = AutoTokenizer.from_pretrained(str(d), trust_remote_code=trust_remote_code)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    if getattr(model.config, "pad_token_id", None) is None:
        model.config.pad_token_id = tok.pad_token_id  # the classifier reads the last non-pad token
    model.eval().requires_grad_(False)
    return model.to(device), tok


__all__ = ["load_policy", "load_tokenizer", "load_reward_model", "eos_token_ids", "build_minimind", "detect_arch", "read_state_dict"]
