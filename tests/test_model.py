"""MiniMindConfig / MiniMindForCausalLM: sizes, Auto-class registration, save_pretrained round trip."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import model  # noqa: F401  (registers the `minimind` model type)
from model.config import MiniMindConfig, default_intermediate_size
from model.loader import build_minimind
from model.modeling import MiniMindForCausalLM


def _n_params(m: torch.nn.Module) -> int:
    return sum(p.numel() for p in m.parameters())  # parameters() counts the tied head once


def test_tiny_current_arch_parameter_count():
    m = build_minimind(64, 2, vocab_size=6400)
    # 6400*64 embedding + 2 layers * (q 64*64 + k,v 2*32*64 + o 64*64 + q/k norm 2*8 + 2 norms 2*64
    # + FFN 3*256*64) + final norm 64; lm_head tied.
    per_layer = 64 * 64 + 2 * 32 * 64 + 64 * 64 + 2 * 8 + 2 * 64 + 3 * 256 * 64
    assert 6400 * 64 + 2 * per_layer + 64 == 532_832
    assert _n_params(m) == 532_832
    assert round(_n_params(m) / 1e6, 3) == 0.533
    assert m.lm_head.weight is m.model.embed_tokens.weight or (
        m.lm_head.weight.data_ptr() == m.model.embed_tokens.weight.data_ptr()
    )


@pytest.mark.parametrize(
    "hidden, arch, inter",
    [(512, "qwen3", 1664), (512, "llama", 1408), (768, "qwen3", 2432), (64, "qwen3", 256), (64, "llama", 192)],
)
def test_intermediate_size_rule(hidden, arch, inter):
    assert default_intermediate_size(hidden, arch) == inter
    assert MiniMindConfig(hidden_size=hidden, arch=arch).intermediate_size == inter


def test_arch_defaults():
    q = MiniMindConfig(hidden_size=64, num_hidden_layers=2)
    assert (q.num_key_value_heads, q.rms_norm_eps, q.head_dim, q.rope_theta) == (4, 1e-6, 8, 1e6)
    ll = MiniMindConfig(hidden_size=64, num_hidden_layers=2, arch="llama")
    assert (ll.num_key_value_heads, ll.rms_norm_eps) == (2, 1e-5)
    assert type(q.to_hf_config()).__name__ == "Qwen3Config"
    assert type(ll.to_hf_config()).__name__ == "LlamaConfig"
    moe = MiniMindConfig(hidden_size=64, num_hidden_layers=2, use_moe=True).to_hf_config()
    assert type(moe).__name__ == "Qwen3MoeConfig"
    assert (moe.num_experts, moe.num_experts_per_tok, moe.norm_topk_prob, moe.moe_intermediate_size) == (4, 1, True, 256)


def test_known_sizes_parameter_counts():
    # MiniMind2 512x8 (llama) is 25.83M per the spec; counted on the meta device to stay fast.
    with torch.device("meta"):
        m = MiniMindForCausalLM(MiniMindConfig(hidden_size=512, num_hidden_layers=8, arch="llama"))
    assert round(_n_params(m) / 1e6, 2) == 25.83


@pytest.mark.parametrize(
    "kwargs, flag",
    [
        (dict(arch="gpt2"), "--arch"),
        (dict(arch="llama", use_moe=True), "--use_moe"),
        (dict(hidden_size=100), "--hidden_size"),
    ],
)
def test_bad_config_names_flag(kwargs, flag):
    with pytest.raises(ValueError, match=flag):
        MiniMindConfig(**kwargs)


def test_logits_to_keep_slices_last_positions():
    torch.manual_seed(0)
    m = build_minimind(64, 2, vocab_size=256).eval()
    ids = torch.randint(3, 256, (2, 7))
    with torch.no_grad():
        full = m(input_ids=ids).logits
        last3 = m(input_ids=ids, logits_to_keep=3).logits
    assert last3.shape == (2, 3, 256)
    assert torch.allclose(last3, full[:, -3:], atol=1e-6)


def test_labels_give_shifted_cross_entropy():
    torch.manual_seed(0)
    m = build_minimind(64, 2, vocab_size=256).eval()
    ids = torch.randint(3, 256, (2, 7))
    with torch.no_grad():
        out = m(input_ids=ids, labels=ids)
    want = torch.nn.functional.cross_entropy(out.logits[:, :-1].reshape(-1, 256), ids[:, 1:].reshape(-1))
    assert torch.allclose(out.loss, want, atol=1e-5)


@pytest.mark.parametrize("arch, use_moe", [("qwen3", False), ("llama", False), ("qwen3", True)])
def test_save_pretrained_round_trip_through_auto_classes(tmp_path, arch, use_moe):
    torch.manual_seed(0)
    src = build_minimind(64, 2, use_moe=use_moe, arch=arch, vocab_size=256).eval()
    src.save_pretrained(tmp_path)

    cfg = AutoConfig.from_pretrained(tmp_path)
    assert isinstance(cfg, MiniMindConfig) and cfg.arch == arch and cfg.use_moe == use_moe
    dst = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert isinstance(dst, MiniMindForCausalLM)
    assert dst.lm_head.weight.data_ptr() == dst.model.embed_tokens.weight.data_ptr()  # still tied

    src_sd = src.state_dict()
    assert dst.state_dict().keys() == src_sd.keys()
    assert all(torch.equal(v, src_sd[k]) for k, v in dst.state_dict().items())
    ids = torch.randint(3, 256, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(src(input_ids=ids).logits, dst(input_ids=ids).logits)


def test_reading_the_kv_cache_of_an_output_uses_its_current_name(monkeypatch):
    """A forward without a cache (every scoring and update forward) must not fall back to transformers 5.x's old
    `past_key_values` name, whose property prints a deprecation line (once per run, seen in every training log)."""
    import transformers.utils.generic as generic
    from transformers.modeling_outputs import CausalLMOutputWithPast

    from model.modeling import kv_cache_of

    said = []
    monkeypatch.setattr(generic.logger, "warning_once", lambda msg, *a, **k: said.append(msg))
    assert kv_cache_of(CausalLMOutputWithPast(logits=torch.zeros(1))) is None
    cache = object()
    assert kv_cache_of(CausalLMOutputWithPast(logits=torch.zeros(1), cache=cache)) is cache
    assert said == []
