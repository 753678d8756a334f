"""MiniMind configuration and its mapping onto transformers' architectures.

MiniMind ships two dense architectures that transformers already implements exactly
(see shared/specs/minimind-format.md):

    arch="qwen3"  current MiniMind ("MiniMind-3"): q/k RMSNorm per head, 8 heads / 4 kv heads
    arch="llama"  earlier MiniMind2:               no q/k norm,         8 heads / 2 kv heads

plus the current architecture's MoE variant (`use_moe=True`: Qwen3-MoE, 4 experts, top-1).
`MiniMindConfig` holds MiniMind's own knobs (the names its CLI uses) and `to_hf_config()` builds
the equivalent transformers config, so all the transformer math lives in transformers.
"""

from __future__ import annotations

import math
from typing import Any

from transformers import LlamaConfig, PreTrainedConfig, Qwen3Config, Qwen3MoeConfig

ARCHS = ("qwen3", "llama")


def default_intermediate_size(hidden_size: int, arch: str) -> int:
    """MiniMind's FFN width rule for each architecture (1664 @512 qwen3, 1408 @512 llama)."""
    if arch == "qwen3":
        return math.ceil(hidden_size * math.pi / 64) * 64
    return 64 * math.ceil(int(hidden_size * 8 / 3) / 64)


class MiniMindConfig(PreTrainedConfig):
    """Shape and architecture of a MiniMind model; defaults are MiniMind-3 at 512x8."""

    model_type = "minimind"

    vocab_size: int = 6400
    hidden_size: int = 512
    num_hidden_layers: int = 8
    num_attention_heads: int = 8
    num_key_value_heads: int | None = None  # None -> the architecture's default (4 or 2)
    intermediate_size: int | None = None  # None -> MiniMind's rule for the architecture
    arch: str = "qwen3"
    use_moe: bool = False
    num_experts: int = 4
    num_experts_per_tok: int = 1
    max_position_embeddings: int = 32768
    rope_theta: float = 1e6
    rms_norm_eps: float | None = None  # None -> 1e-6 (qwen3) / 1e-5 (llama)
    hidden_act: str = "silu"
    initializer_range: float = 0.02
    tie_word_embeddings: bool = True
    use_cache: bool = True
    bos_token_id: int | None = 1
    eos_token_id: int | list[int] | None = 2
    pad_token_id: int | None = 0

    def __post_init__(self, **kwargs: Any) -> None:
        if self.arch not in ARCHS:
            raise ValueError(f"unknown MiniMind architecture {self.arch!r}: use --arch qwen3 or llama")
        if self.use_moe and self.arch != "qwen3":
            raise ValueError("--use_moe 1 is supported for the current (qwen3) architecture only")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"--hidden_size {self.hidden_size} is not divisible by {self.num_attention_heads} heads"
            )
        if self.num_key_value_heads is None:
            self.num_key_value_heads = 4 if self.arch == "qwen3" else 2
        if self.intermediate_size is None:
            self.intermediate_size = default_intermediate_size(self.hidden_size, self.arch)
        if self.rms_norm_eps is None:
            self.rms_norm_eps = 1e-6 if self.arch == "qwen3" else 1e-5
        super().__post_init__(**kwargs)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def to_hf_config(self) -> PreTrainedConfig:
        """The transformers config whose model has exactly MiniMind's parameters and math."""
        intermediate_size = self.intermediate_size
        assert intermediate_size is not None  # __post_init__ sets the architecture's default
        # keyword arguments shared by the three config classes (each takes them under these names)
        common: dict[str, Any] = dict(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            hidden_act=self.hidden_act,
            max_position_embeddings=self.max_position_embeddings,
            rms_norm_eps=self.rms_norm_eps,
            rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta},
            initializer_range=self.initializer_range,
            tie_word_embeddings=self.tie_word_embeddings,
            attention_bias=False,
            use_cache=self.use_cache,
            bos_token_id=self.bos_token_id,
            eos_token_id=self.eos_token_id,
            pad_token_id=self.pad_token_id,
        )
        if self.arch == "llama":
            return LlamaConfig(mlp_bias=False, **common)
        if self.use_moe:
            # MiniMind-3 MoE: every layer sparse, experts as wide as the dense FFN, top-1 routing
            # with renormalised weights (so the chosen expert's output is used at weight 1).
            return Qwen3MoeConfig(
                moe_intermediate_size=intermediate_size,
                num_experts=self.num_experts,
                num_experts_per_tok=self.num_experts_per_tok,
                norm_topk_prob=True,
                decoder_sparse_step=1,
                mlp_only_layers=[],
                output_router_logits=False,
                **common,
            )
        return Qwen3Config(**common)


def stock_hf_config(config: MiniMindConfig, *, token_classification: bool = False) -> PreTrainedConfig:
    """The transformers config (model_type qwen3 / llama / qwen3_moe) of a MiniMind model, with `architectures` set
    to the stock class a plain `from_pretrained` (or an inference engine) should build."""
    hf = config.to_hf_config()
    family = {"qwen3": "Qwen3", "llama": "Llama", "qwen3_moe": "Qwen3Moe"}[hf.model_type]
    hf.architectures = [f"{family}{'ForTokenClassification' if token_classification else 'ForCausalLM'}"]
    if token_classification:
        hf.num_labels = 1
        hf.id2label, hf.label2id = {0: "value"}, {"value": 0}
        hf.classifier_dropout = 0.0  # the value head has no dropout; keep train-mode values equal too
    return hf
