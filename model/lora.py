"""LoRA policies through `peft`: the actor trains low-rank adapters on its frozen trunk.

With `--lora_r R > 0` the actor is a `peft.PeftModelForCausalLM` (adapters on every linear layer of
the trunk by default, never the LM head; the critic is a separate model and has none). What LoRA
changes elsewhere, all built here:

  reference   `AdaptersOff(actor)`: the actor's own forward inside peft's `disable_adapter()`, i.e.
              the frozen base weights. No second copy of the model.
  old actor   `AdapterSnapshot(actor)` (--update_old_actor_freq N): a copy of the adapter tensors
              only, swapped into the actor for its forward.
  resume      `actor_state_dict` / `load_actor_state_dict`: the adapter tensors only (the base
              weights are the --from_weight / --actor_path file, whose sha256 run.json checks).
  outputs     `save_adapter` (a `save_pretrained` directory AutoPeftModelForCausalLM loads) and
              `merged_state_dict` (W + B A scale for --save_merged, without touching the model).
  engines     `adapter_export`: the adapters alone in peft's format, pushed to a rollout engine that
              serves the base (trainer/run/engine_sync.py; docs/engines.md "Adapter-only pushes").
  sampling    model/fast_decode.py folds each adapter into its weight once per sample() call
              (`effective_weight`), so the fast decode path runs LoRA policies too.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from model.weights import atomic_dir

LORA_FLAGS = ("lora_r", "lora_alpha", "lora_dropout", "lora_target_modules")
ADAPTER = "default"  # peft's adapter name; one adapter per run


def is_lora(model: nn.Module) -> bool:
    """True for a (DDP-wrapped) peft model."""
    model = getattr(model, "module", model)
    return hasattr(type(model), "get_base_model") and hasattr(type(model), "disable_adapter")


def base_of(model: nn.Module) -> nn.Module:
    """The causal LM the forward runs: a peft model's base (its adapters injected in place), else the
    model itself (DDP unwrapped). Its forward takes logits_to_keep and its `.model` is the trunk."""
    model = getattr(model, "module", model)
    return model.get_base_model() if is_lora(model) else model


def parse_targets(spec: str) -> str | list[str]:
    """--lora_target_modules: 'all-linear' (every linear layer of the trunk) or a comma list of names."""
    spec = spec.strip()
    if spec == "all-linear":
        return spec
    return [t.strip() for t in spec.split(",") if t.strip()]


def _trunk_linears(model: nn.Module) -> list[str]:
    """Names (in the causal LM) of the linear layers LoRA may wrap: the trunk's, never the LM head."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return [n for n, m in model.named_modules()
            if isinstance(m, nn.Linear) and m is not head and not n.endswith("lm_head")]


def check_targets(model: nn.Module, spec: str) -> None:
    """ValueError (one line, naming the flag) when the targets match no layer of the trunk, or any name
    of a comma list matches none: peft itself ignores names that match nothing if another one does."""
    linears = _trunk_linears(model)
    kind = type(model).__name__
    if not linears:
        raise ValueError(f"--lora_r: {kind} has no linear layers in its trunk for LoRA adapters "
                         f"(--lora_target_modules {spec}); use --lora_r 0")
    targets = parse_targets(spec)
    if targets == "all-linear":
        return
    if not targets:
        raise ValueError("--lora_target_modules is empty: give 'all-linear' or a comma list such as q_proj,v_proj")
    leaves = sorted({n.rsplit(".", 1)[-1] for n in linears})
    for t in targets:
        if not any(n == t or n.endswith("." + t) for n in linears):
            raise ValueError(f"--lora_target_modules {t!r} matches no linear layer of {kind}'s trunk "
                             f"(its linear layers are named {', '.join(leaves)}; or use all-linear)")


def add_lora(model: nn.Module, r: int, alpha: float, dropout: float, targets: str) -> nn.Module:
    """`model` wrapped by peft with fresh adapters (lora_B = 0: the policy starts as the base model).
    The base weights are frozen (requires_grad False), so optimizers and DDP see the adapters only."""
    from peft import LoraConfig, get_peft_model

    check_targets(model, targets)
    cfg = LoraConfig(r=r, lora_alpha=alpha,  # type: ignore[arg-type]  # peft annotates int, uses alpha / r: a float works
                     lora_dropout=dropout, target_modules=parse_targets(targets), task_type="CAUSAL_LM", bias="none")
    with warnings.catch_warnings():  # peft probes transformers' deprecated is_gradient_checkpointing
        warnings.simplefilter("ignore", FutureWarning)
        try:
            return get_peft_model(model, cfg)
        except ValueError as e:
            raise ValueError(f"--lora_target_modules {targets}: {str(e).splitlines()[0]}") from None


def trainable(model: nn.Module) -> dict[str, torch.Tensor]:
    """The trained tensors by name (a LoRA actor's adapters; a full model's every parameter)."""
    model = getattr(model, "module", model)
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def actor_state_dict(actor: nn.Module) -> dict[str, torch.Tensor]:
    """What a resume file stores for the actor: the whole state dict, or with LoRA the adapters only."""
    actor = getattr(actor, "module", actor)
    if not is_lora(actor):
        return actor.state_dict()
    return {n: p.detach() for n, p in trainable(actor).items()}


def load_actor_state_dict(actor: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Inverse of actor_state_dict. A LoRA actor takes exactly its adapter tensors (names and shapes)."""
    actor = getattr(actor, "module", actor)
    if not is_lora(actor):
        actor.load_state_dict(state)
        return
    params = trainable(actor)
    if set(state) != set(params) or any(state[n].shape != p.shape for n, p in params.items()):
        raise ValueError("the resume file's actor tensors are not this run's LoRA adapters "
                         "(compare --lora_r / --lora_target_modules with the run's)")
    with torch.no_grad():
        for n, p in params.items():
            p.copy_(state[n])


class AdaptersOff(nn.Module):
    """The reference policy of a LoRA run: the actor with its adapters disabled (its frozen base).

    Shares every tensor with the actor (none registered here, so it holds no parameters of its own);
    forward takes the causal LM's arguments."""

    def __init__(self, actor: nn.Module) -> None:
        super().__init__()
        self._actor = [actor]  # a list: not a submodule (no parameters, no state_dict entries)

    @property
    def config(self) -> Any:
        return base_of(self._actor[0]).config

    def set_attn_implementation(self, impl: str) -> None:
        base_of(self._actor[0]).set_attn_implementation(impl)

    def get_output_embeddings(self) -> nn.Module | None:  # the actor's LM head: model/forward.py output_head
        return base_of(self._actor[0]).get_output_embeddings()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        actor = getattr(self._actor[0], "module", self._actor[0])
        with actor.disable_adapter():
            return base_of(actor)(*args, **kwargs)


class AdapterSnapshot(nn.Module):
    """MiniMind's frozen old actor (--update_old_actor_freq N) for a LoRA actor: a copy of the adapter
    tensors only, swapped into the actor for the forward and back out after it.

    state_dict() is the snapshot; load_state_dict(actor.state_dict()) (train_ppo's refresh) copies the
    adapters out of a full peft state dict, and a resume file's snapshot loads back the same way."""

    def __init__(self, actor: nn.Module) -> None:
        super().__init__()
        self._actor = [actor]
        self.snapshot = {n: p.detach().clone() for n, p in trainable(actor).items()}

    @property
    def config(self) -> Any:
        return base_of(self._actor[0]).config

    def set_attn_implementation(self, impl: str) -> None:
        base_of(self._actor[0]).set_attn_implementation(impl)

    def get_output_embeddings(self) -> nn.Module | None:  # the actor's LM head: model/forward.py output_head
        return base_of(self._actor[0]).get_output_embeddings()

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, torch.Tensor]:  # type: ignore[override]  # the snapshot alone
        return dict(self.snapshot)

    def load_state_dict(self, state: dict[str, torch.Tensor], strict: bool = True,  # type: ignore[override]  # snapshot only
                        assign: bool = False) -> Any:
        missing = [n for n in self.snapshot if n not in state]
        if missing:
            raise ValueError(f"old-actor snapshot: {len(missing)} adapter tensors missing (e.g. {missing[0]})")
        with torch.no_grad():
            for n, t in self.snapshot.items():
                t.copy_(state[n])
        return None

    @torch.no_grad()
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        params = trainable(self._actor[0])
        live = {n: p.data for n, p in params.items()}
        try:
            for n, p in params.items():
                p.data = self.snapshot[n]
            return base_of(self._actor[0])(*args, **kwargs)
        finally:
            for n, p in params.items():
                p.data = live[n]


def _lora_layers(model: nn.Module) -> dict[str, nn.Module]:
    """The peft LoRA layers of a peft model's base, by module name."""
    return {n: m for n, m in base_of(model).named_modules()
            if hasattr(m, "base_layer") and hasattr(m, "get_delta_weight") and hasattr(m, "lora_A")}


def foldable(m: nn.Module) -> bool:
    """True when `effective_weight` gives m's weight: an unbiased nn.Linear, or a peft LoRA layer in eval
    mode, not merged, whose active adapters are plain LoRA (no DoRA, no LoRA bias). Nothing is computed."""
    if isinstance(m, nn.Linear):
        return m.bias is None
    base = getattr(m, "base_layer", None)
    if not (isinstance(base, nn.Linear) and base.bias is None and hasattr(m, "get_delta_weight")):
        return False
    if getattr(m, "merged", False) or getattr(m, "training", False):  # merged twice / dropout on
        return False
    if getattr(m, "disable_adapters", False):
        return True
    return not any(m.use_dora.get(a, False) or getattr(m, "lora_bias", {}).get(a, False)
                   for a in m.active_adapters if a in m.lora_A)


def effective_weight(m: nn.Module) -> torch.Tensor | None:
    """The weight an unbiased linear layer applies: nn.Linear's own, or for a peft LoRA layer (eval mode,
    not merged, plain LoRA) base + B A scale of its active adapters; None for anything else (`foldable`)."""
    if not foldable(m):
        return None
    if isinstance(m, nn.Linear):
        return m.weight
    w = m.base_layer.weight
    if getattr(m, "disable_adapters", False):
        return w
    for a in m.active_adapters:
        if a in m.lora_A:
            w = w + m.get_delta_weight(a).to(w.dtype)
    return w


def adapter_parts(m: nn.Module) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor, float]]] | None:
    """A foldable layer as peft computes it: its base weight and, per active adapter, (A, B, scale), so
    that y = x W^T + scale (x A^T) B^T. nn.Linear: (weight, []). None where `foldable` is False."""
    if not foldable(m):
        return None
    if isinstance(m, nn.Linear):
        return m.weight, []
    if getattr(m, "disable_adapters", False):
        return m.base_layer.weight, []
    return m.base_layer.weight, [(m.lora_A[a].weight, m.lora_B[a].weight, float(m.scaling[a]))
                                 for a in m.active_adapters if a in m.lora_A]


@torch.no_grad()
def merged_state_dict(model: nn.Module, adapters: bool = True) -> dict[str, torch.Tensor]:
    """The base causal LM's state dict in its own key names with each adapter folded into its weight
    (W + B A scale; adapters=False: the base weights as they are). The model is not changed."""
    base = base_of(model)
    layers = _lora_layers(model)
    out: dict[str, torch.Tensor] = {}
    for key, t in base.state_dict().items():
        if ".lora_" in key:  # lora_A / lora_B tensors: folded into their layer's weight below
            continue
        if ".base_layer." in key:
            layer_name, key = key.split(".base_layer.")[0], key.replace(".base_layer.", ".")
            m = layers.get(layer_name)
            if adapters and m is not None and key.endswith(".weight"):
                t = t + sum(m.get_delta_weight(a).to(t.dtype) for a in m.active_adapters if a in m.lora_A)
        out[key] = t
    return out


def save_adapter(model: nn.Module, tok: Any, out_dir: str | os.PathLike, base_path: str | os.PathLike) -> Path:
    """`save_pretrained` of the adapters (+ tokenizer) into out_dir, naming `base_path` (an HF model
    directory, made absolute) as their base: `AutoPeftModelForCausalLM.from_pretrained(out_dir)` loads it."""
    model = getattr(model, "module", model)
    out_dir = Path(out_dir)
    cfg = model.peft_config[ADAPTER]
    before = cfg.base_model_name_or_path
    cfg.base_model_name_or_path = str(Path(base_path).resolve())
    try:
        with warnings.catch_warnings():  # peft looks for the base's config on the hub when it cannot read it
            warnings.simplefilter("ignore", UserWarning)
            model.save_pretrained(str(out_dir), save_embedding_layers=False)  # adapters never touch the embeddings
    finally:
        cfg.base_model_name_or_path = before
    if tok is not None:
        tok.save_pretrained(str(out_dir))
    return out_dir


@torch.no_grad()
def adapter_export(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict]:
    """The adapters in peft's saved format, what `save_pretrained` writes and vLLM's / SGLang's adapter loaders
    read: adapter_model.safetensors' tensors (peft's names, e.g. base_model.model.model.layers.0.self_attn.q_proj.
    lora_A.weight, on the CPU) and adapter_config.json's dict (sets as sorted lists, inference_mode on). Nothing
    else: no tokenizer, no README, no base weights (the engine serves the base)."""
    from peft import get_peft_model_state_dict

    model = getattr(model, "module", model)
    tensors = {k: v.detach().to("cpu").contiguous()
               for k, v in get_peft_model_state_dict(model, adapter_name=ADAPTER, save_embedding_layers=False).items()}
    config = model.peft_config[ADAPTER].to_dict()
    config = {k: sorted(v) if isinstance(v, set) else v for k, v in config.items()}
    config["inference_mode"] = True
    return tensors, config


def export_base_hf(model: nn.Module, tok: Any, out_dir: str | os.PathLike) -> Path:
    """A native MiniMind actor's frozen base weights as a stock transformers directory (Qwen3/Llama
    class, scripts/convert_model.py's layout), the base a native run's adapter directory names.
    Written once: the base never changes during a run."""
    from transformers import AutoModelForCausalLM

    from model.config import MiniMindConfig

    out_dir = Path(out_dir)
    if (out_dir / "config.json").is_file():
        return out_dir
    base = base_of(model)
    cfg: MiniMindConfig = base.config
    hf = cfg.to_hf_config()
    family = {"qwen3": "Qwen3", "llama": "Llama", "qwen3_moe": "Qwen3Moe"}[hf.model_type]
    hf.architectures = [f"{family}ForCausalLM"]
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if getattr(tok, name, None) is not None:
            setattr(hf, name, getattr(tok, name))
    with torch.random.fork_rng(devices=[]):  # from_config's random init must not move the run's RNG (exact resume)
        stock = AutoModelForCausalLM.from_config(hf)
    stock.load_state_dict({k: v.float() for k, v in merged_state_dict(model, adapters=False).items()}, strict=True)
    with atomic_dir(out_dir) as tmp:  # whole or not at all: a killed save leaves no partial base
        stock.save_pretrained(str(tmp))
        tok.save_pretrained(str(tmp))
    return out_dir
