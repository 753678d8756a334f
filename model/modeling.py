"""MiniMindForCausalLM: a thin causal-LM head over transformers' own trunk.

The trunk (`self.model`) is transformers' `Qwen3Model`, `LlamaModel` or `Qwen3MoeModel`, built
from `MiniMindConfig.to_hf_config()`: attention, RoPE, KV cache, SDPA and masks are theirs.
This class only owns the head and the mapping, which keeps the parameter names identical to
MiniMind's checkpoints (`model.layers.0.self_attn.q_proj.weight`, `lm_head.weight`, ...).

Registered with AutoConfig / AutoModelForCausalLM, so `save_pretrained` / `from_pretrained`
round-trip once `import model` has run.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, GenerationMixin, PreTrainedModel
from transformers.cache_utils import Cache
from transformers.modeling_outputs import CausalLMOutputWithPast

from .config import MiniMindConfig


def kv_cache_of(out: object) -> Cache | None:
    """The KV cache a forward returned, under either of transformers 5.x's names for it (past_key_values -> cache)."""
    if "cache" in getattr(out, "__dataclass_fields__", {}):  # the new name: its old one is a property that warns
        return getattr(out, "cache")
    cache = getattr(out, "cache", None)
    return cache if cache is not None else getattr(out, "past_key_values", None)


class MiniMindPreTrainedModel(PreTrainedModel):
    config_class = MiniMindConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _supports_sdpa = True
    _supports_flash_attn = True
    _supports_flex_attn = True
    _supports_attention_backend = True
    _can_compile_fullgraph = True


class MiniMindForCausalLM(MiniMindPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: MiniMindConfig) -> None:
        super().__init__(config)
        hf_config = config.to_hf_config()
        # The trunk follows the attention implementation chosen for the wrapper (sdpa by default).
        hf_config._attn_implementation = config._attn_implementation
        self.model = AutoModel.from_config(hf_config)
        # transformers 5.x renamed the trunk's KV cache argument; the name this version takes
        self._cache_arg = "cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values"
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self) -> nn.Module:
        return self.model.embed_tokens

    def set_input_embeddings(self, value: nn.Module) -> None:
        self.model.embed_tokens = value

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        past_key_values: Cache | None = None,
        **kwargs: Any,
    ) -> CausalLMOutputWithPast:
        # transformers 5.x renamed the KV cache argument (past_key_values -> cache); take either, pass the trunk's own.
        cache = cache if cache is not None else past_key_values
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            **{self._cache_arg: cache},
            **kwargs,
        )
        hidden = out.last_hidden_state  # [B, T, H]
        # Computing logits only where they are needed saves the [B, T, vocab] projection.
        if isinstance(logits_to_keep, int):
            hidden = hidden[:, -logits_to_keep:, :] if logits_to_keep > 0 else hidden
        else:
            hidden = hidden[:, logits_to_keep, :]
        logits = self.lm_head(hidden)  # [B, T', V]
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        named_cache: dict[str, Any] = {self._cache_arg: kv_cache_of(out)}  # under this transformers version's name
        return CausalLMOutputWithPast(loss=loss, logits=logits, **named_cache)


def _register() -> None:
    try:
        AutoConfig.register("minimind", MiniMindConfig)
    except ValueError:  # already registered (module re-imported under another name)
        pass
    try:
        AutoModelForCausalLM.register(MiniMindConfig, MiniMindForCausalLM)
    except ValueError:
        pass


_register()
