"""MiniMind `.pth` weights <-> stock Hugging Face model directories (Qwen3 / Llama / Qwen3-MoE), checked.

The HF directory needs no code from this project: `AutoModelForCausalLM.from_pretrained(dir)` and
`AutoTokenizer.from_pretrained(dir)` load it (no remote code) and give the same logits as
`model.loader.load_policy(weights=...)`. Every conversion is checked on a probe batch before it
is reported done. Weights are always full tensors (a LoRA run's merged ones: --save_merged).
scripts/convert_model.py is the command line; rollout engines and tests start from policy_to_hf's directories.

The critic (`trunk.*` + `value_head` = Linear(hidden, 1) with bias) maps onto transformers'
`<Arch>ForTokenClassification` with num_labels=1 (`model.*` + `score` = Linear(hidden, 1) with
bias): `logits[..., 0]` are the per-token values.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForTokenClassification,
    GenerationConfig,
    PreTrainedConfig,
    PreTrainedTokenizerBase,
)

from .config import MiniMindConfig
from .config import stock_hf_config as stock_config
from .critic import CriticModel
from .modeling import MiniMindForCausalLM
from .weights import check_state_dict, from_native, save_native_weights

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
HF_TYPES = ("qwen3", "llama", "qwen3_moe")

# Config entries that do not change the forward pass of a trained model (bookkeeping, special
# ids, training-only knobs); every other entry must match what MiniMind rebuilds, or the
# conversion would silently change the model's math.
_NON_MATH_KEYS = frozenset({
    "transformers_version", "architectures", "output_hidden_states", "output_attentions", "return_dict",
    "dtype", "torch_dtype", "chunk_size_feed_forward", "is_encoder_decoder", "id2label", "label2id",
    "problem_type", "max_position_embeddings", "initializer_range", "use_cache", "pad_token_id",
    "bos_token_id", "eos_token_id", "_name_or_path", "router_aux_loss_coef", "output_router_logits",
    "attention_dropout", "pretraining_tp", "max_window_layers", "sliding_window", "tie_word_embeddings",
    "model_type",
})


class ConvertError(ValueError):
    """A model or file this converter cannot express in the other format."""


# --------------------------------------------------------------------------------------- helpers
def probe_ids(vocab_size: int, batch: int = 2, length: int = 12, seed: int = 0) -> torch.Tensor:
    """A fixed random batch of token ids for checking a conversion."""
    return torch.randint(0, vocab_size, (batch, length), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def _logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    was = model.training
    model.eval()
    try:
        return model(input_ids=ids, use_cache=False).logits.float()
    finally:
        model.train(was)


def _lossless(state: dict[str, torch.Tensor], dtype: torch.dtype) -> bool:
    return all(torch.equal(t.to(dtype).to(t.dtype), t) for t in state.values() if t.is_floating_point())


def _check_equal(ours: torch.Tensor, theirs: torch.Tensor, what: str, exact: bool) -> float:
    """Max |difference|; raises when an exact conversion is not exact (or a lossy one is far off)."""
    diff = (ours - theirs).abs().max().item()
    if exact and diff != 0.0:
        raise ConvertError(f"{what}: outputs differ by {diff:.3g} after conversion (expected identical); please report this")
    if not exact and diff > 1e-1 * max(1.0, ours.abs().max().item()):
        raise ConvertError(f"{what}: outputs differ by {diff:.3g} after a lossy dtype cast; convert with --dtype float32")
    return diff


def _write_tokenizer(tok: PreTrainedTokenizerBase, config: PreTrainedConfig, out_dir: Path) -> None:
    """Tokenizer files (incl. chat template) and a generation_config with the special ids only."""
    tok.save_pretrained(out_dir)
    GenerationConfig(bos_token_id=tok.bos_token_id if tok.bos_token_id is not None else config.bos_token_id,
                     eos_token_id=tok.eos_token_id if tok.eos_token_id is not None else config.eos_token_id,
                     pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else config.pad_token_id,
                     ).save_pretrained(out_dir)


def _set_special_ids(hf: PreTrainedConfig, tok: PreTrainedTokenizerBase) -> None:
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = getattr(tok, name, None)
        if value is not None:
            setattr(hf, name, value)


# --------------------------------------------------------------------------------------- native -> HF
def policy_to_hf(policy: MiniMindForCausalLM, tok: PreTrainedTokenizerBase, out_dir: str | Path,
                 dtype: torch.dtype = torch.float32) -> float:
    """Write `policy` as a stock HF causal-LM directory; returns the max |logit difference| (0 when
    the dtype cast is lossless), checked by reloading the directory."""
    out_dir = Path(out_dir)
    if not isinstance(policy.config, MiniMindConfig):
        raise ConvertError(f"policy_to_hf writes MiniMind models; {type(policy).__name__} has a {type(policy.config).__name__}")
    hf_config = stock_config(policy.config)
    _set_special_ids(hf_config, tok)
    hf_model = AutoModelForCausalLM.from_config(hf_config)
    state = policy.state_dict()
    hf_model.load_state_dict(state, strict=True)  # same key names by construction (model.py)
    hf_model.to(dtype).save_pretrained(out_dir)
    _write_tokenizer(tok, hf_config, out_dir)
    reloaded = AutoModelForCausalLM.from_pretrained(str(out_dir), dtype=torch.float32)
    ids = probe_ids(policy.config.vocab_size)
    return _check_equal(_logits(policy.float(), ids), _logits(reloaded, ids), f"{out_dir}", _lossless(state, dtype))


def read_critic_state(path: str | Path) -> dict[str, torch.Tensor]:
    """The critic's state dict from a minippo resume file (key "critic"), a MiniMind resume file
    (key "critic_model") or a bare critic state dict (`trunk.*` + `value_head.*`)."""
    path = Path(path)
    if not path.is_file():
        raise ConvertError(f"--critic_resume {path}: no such file")
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - torch.load's many errors for an unreadable file (UnpicklingError, RuntimeError, ...): one line each
        first = str(e).splitlines()[0] if str(e) else ""
        raise ConvertError(f"--critic_resume {path}: cannot be read safely ({type(e).__name__}: {first})") from None
    if isinstance(obj, dict):
        for key in ("critic", "critic_model"):
            if isinstance(obj.get(key), dict):
                obj = obj[key]
                break
    if not (isinstance(obj, dict) and any(str(k).startswith("value_head.") for k in obj)):
        raise ConvertError(f"--critic_resume {path}: no critic found (expected a resume file with a 'critic' entry "
                           "or a state dict with value_head.* keys)")
    return obj


def critic_hf_state(critic_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """trunk.* / model.* -> model.*, value_head.* -> score.* (a MiniMind critic's lm_head is unused)."""
    out = {}
    for key, t in critic_state.items():
        if key.startswith("trunk."):
            out["model." + key[len("trunk."):]] = t
        elif key.startswith("model."):
            out[key] = t
        elif key.startswith("value_head."):
            out["score." + key[len("value_head."):]] = t
        elif not key.startswith("lm_head."):
            raise ConvertError(f"critic state: unexpected key {key!r} (expected trunk.*, value_head.*)")
    for needed in ("score.weight", "score.bias"):
        if needed not in out:
            raise ConvertError(f"critic state: {needed.replace('score', 'value_head')} is missing")
    return out


def critic_to_hf(critic_state: dict[str, torch.Tensor], config: MiniMindConfig, tok: PreTrainedTokenizerBase,
                 out_dir: str | Path, dtype: torch.dtype = torch.float32) -> float:
    """Write a critic as a stock `<Arch>ForTokenClassification` (num_labels=1) directory; returns the
    max |value difference| against our CriticModel on a probe batch."""
    out_dir = Path(out_dir)
    hf_config = stock_config(config, token_classification=True)
    _set_special_ids(hf_config, tok)
    hf_model = AutoModelForTokenClassification.from_config(hf_config)
    state = from_native(critic_hf_state(critic_state))  # MiniMind per-expert keys -> fused
    expected = {k for k in hf_model.state_dict()}
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        raise ConvertError(f"critic does not fit --hidden_size/--num_hidden_layers/--use_moe/--arch: "
                           f"missing {missing[:4]}, unexpected {unexpected[:4]}")
    try:
        hf_model.load_state_dict(state, strict=True)
    except RuntimeError as e:
        raise ConvertError(f"critic does not fit the shape flags: {str(e).splitlines()[-1].strip()}") from None
    hf_model.to(dtype).save_pretrained(out_dir)
    tok.save_pretrained(out_dir)

    # Our critic with the same tensors, as the reference for the check.
    trunk = MiniMindForCausalLM(config).model
    critic = CriticModel(trunk, config.hidden_size)
    critic.load_state_dict({("trunk." + k[len("model."):] if k.startswith("model.") else "value_head." + k[len("score."):]): v
                            for k, v in state.items()}, strict=True)
    reloaded = AutoModelForTokenClassification.from_pretrained(str(out_dir), dtype=torch.float32).eval()
    ids = probe_ids(config.vocab_size)
    with torch.no_grad():
        ours = critic.eval()(ids)
        theirs = reloaded(input_ids=ids).logits[..., 0].float()
    return _check_equal(ours, theirs, f"critic {out_dir}", _lossless(state, dtype))


# --------------------------------------------------------------------------------------- HF -> native
def minimind_config_from_hf(hf: PreTrainedConfig) -> MiniMindConfig:
    """The MiniMindConfig of a stock qwen3 / llama / qwen3_moe config; refuses anything MiniMind's
    architecture cannot express (biases, other head_dim, RoPE scaling, sliding windows, ...)."""
    if hf.model_type not in HF_TYPES:
        raise ConvertError(f"model_type {hf.model_type!r} cannot be written as MiniMind weights: only "
                           f"{', '.join(HF_TYPES)} (MiniMind-3, MiniMind2 = llama, MiniMind-3 MoE) are supported")
    rope = getattr(hf, "rope_parameters", None) or {}
    moe = hf.model_type == "qwen3_moe"
    kw = dict(
        arch="llama" if hf.model_type == "llama" else "qwen3", use_moe=moe, vocab_size=hf.vocab_size,
        hidden_size=hf.hidden_size, num_hidden_layers=hf.num_hidden_layers,
        num_attention_heads=hf.num_attention_heads, num_key_value_heads=hf.num_key_value_heads,
        intermediate_size=hf.moe_intermediate_size if moe else hf.intermediate_size,
        max_position_embeddings=hf.max_position_embeddings, rope_theta=float(rope.get("rope_theta", 10000.0)),
        rms_norm_eps=hf.rms_norm_eps, hidden_act=hf.hidden_act,
        tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
        bos_token_id=hf.bos_token_id, eos_token_id=hf.eos_token_id, pad_token_id=hf.pad_token_id,
    )
    if moe:
        kw.update(num_experts=hf.num_experts, num_experts_per_tok=hf.num_experts_per_tok)
    try:
        mm = MiniMindConfig(**kw)
    except ValueError as e:
        raise ConvertError(f"{hf.model_type} config cannot be expressed as MiniMind: {e}") from None
    ours, theirs = mm.to_hf_config().to_dict(), hf.to_dict()
    diffs = [f"{k}: {theirs.get(k, '<absent>')!r} (MiniMind needs {v!r})" for k, v in ours.items()
             if k not in _NON_MATH_KEYS and theirs.get(k) != v]
    if diffs:
        raise ConvertError(f"this {hf.model_type} model differs from MiniMind's architecture: " + "; ".join(diffs[:4]))
    return mm


def hf_to_native(hf_dir: str | Path, out: str | Path, dtype: torch.dtype = torch.float16) -> tuple[MiniMindConfig, float]:
    """Write a local qwen3 / llama / qwen3_moe directory as a MiniMind `.pth` (strict key check,
    probe-checked); returns the config (for the shape flags) and the max |logit difference|."""
    hf_dir = Path(hf_dir)
    if not (hf_dir / "config.json").is_file():
        raise ConvertError(f"--hf_dir {hf_dir}: no config.json (give a local Hugging Face model directory)")
    hf_config = AutoConfig.from_pretrained(str(hf_dir))
    mm = minimind_config_from_hf(hf_config)
    src = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    state = src.state_dict()
    if not mm.tie_word_embeddings:
        # MiniMind files always tie lm_head to embed_tokens; an untied head that differs would be lost.
        if not torch.equal(state["lm_head.weight"], state["model.embed_tokens.weight"]):
            raise ConvertError(f"--hf_dir {hf_dir}: lm_head is not tied to embed_tokens (tie_word_embeddings=false); "
                               "MiniMind checkpoints require tied embeddings")
        mm.tie_word_embeddings = True
    model = MiniMindForCausalLM(mm)
    check_state_dict(model, state, str(hf_dir))
    model.load_state_dict(state, strict=True)
    ids = probe_ids(mm.vocab_size)
    diff = _check_equal(_logits(src, ids), _logits(model, ids), str(hf_dir), exact=True)
    save_native_weights(model, out, dtype=dtype)
    return mm, diff
