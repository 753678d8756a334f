"""Native MiniMind .pth files: strict load into both architectures, round trips, clear errors, safety.

The reference state dicts are built by hand from the key list in shared/specs/minimind-format.md
(not from our own model), and the reference models are transformers' own Qwen3/Llama classes with
configs written from the spec table, so a mapping mistake in model/ cannot hide behind itself.
"""

from __future__ import annotations

import math
import os
import shlex
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from model.loader import build_minimind
from model.weights import (
    WeightsError,
    atomic_torch_save,
    load_native_weights,
    native_weight_path,
    read_state_dict,
    save_native_weights,
)

HIDDEN, LAYERS, HEADS, HEAD_DIM = 64, 2, 8, 8
VOCAB = 6400
# From the spec table, computed independently of model/config.py.
SPEC = {
    "qwen3": dict(kv_heads=4, inter=math.ceil(HIDDEN * math.pi / 64) * 64, eps=1e-6, qk_norm=True),
    "llama": dict(kv_heads=2, inter=64 * math.ceil(int(HIDDEN * 8 / 3) / 64), eps=1e-5, qk_norm=False),
}


def spec_state_dict(
    arch: str,
    hidden: int = HIDDEN,
    layers: int = LAYERS,
    vocab: int = VOCAB,
    dtype: torch.dtype = torch.float16,
    seed: int = 0,
) -> dict[str, torch.Tensor]:
    """A MiniMind checkpoint in the spec's key layout, random values (norm weights near 1)."""
    g = torch.Generator().manual_seed(seed)
    s = SPEC[arch]
    head_dim = hidden // HEADS
    inter = (math.ceil(hidden * math.pi / 64) * 64) if arch == "qwen3" else 64 * math.ceil(int(hidden * 8 / 3) / 64)

    def w(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * 0.1).to(dtype)

    def norm(n: int) -> torch.Tensor:
        return (1.0 + 0.2 * torch.randn(n, generator=g)).to(dtype)

    sd: dict[str, torch.Tensor] = {"model.embed_tokens.weight": w(vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        sd[p + "self_attn.q_proj.weight"] = w(HEADS * head_dim, hidden)
        sd[p + "self_attn.k_proj.weight"] = w(s["kv_heads"] * head_dim, hidden)
        sd[p + "self_attn.v_proj.weight"] = w(s["kv_heads"] * head_dim, hidden)
        sd[p + "self_attn.o_proj.weight"] = w(hidden, HEADS * head_dim)
        if s["qk_norm"]:
            sd[p + "self_attn.q_norm.weight"] = norm(head_dim)
            sd[p + "self_attn.k_norm.weight"] = norm(head_dim)
        sd[p + "input_layernorm.weight"] = norm(hidden)
        sd[p + "post_attention_layernorm.weight"] = norm(hidden)
        sd[p + "mlp.gate_proj.weight"] = w(inter, hidden)
        sd[p + "mlp.up_proj.weight"] = w(inter, hidden)
        sd[p + "mlp.down_proj.weight"] = w(hidden, inter)
    sd["model.norm.weight"] = norm(hidden)
    sd["lm_head.weight"] = sd["model.embed_tokens.weight"].clone()  # tied in MiniMind
    return sd


def reference_hf_model(arch: str) -> torch.nn.Module:
    """transformers' own class with the spec's hyper-parameters (not via MiniMindConfig)."""
    s = SPEC[arch]
    common = dict(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=s["inter"], num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=s["kv_heads"], head_dim=HEAD_DIM,
        hidden_act="silu", rms_norm_eps=s["eps"], rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        tie_word_embeddings=True, attention_bias=False, max_position_embeddings=32768,
    )
    if arch == "qwen3":
        return Qwen3ForCausalLM(Qwen3Config(**common)).eval()
    return LlamaForCausalLM(LlamaConfig(mlp_bias=False, **common)).eval()


def _ids(batch: int = 2, length: int = 12, vocab: int = VOCAB, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------- spec layout loads strictly, math matches HF


def test_spec_constants():
    assert SPEC["qwen3"]["inter"] == 256 and SPEC["llama"]["inter"] == 192


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_spec_layout_loads_strictly_and_matches_transformers(tmp_path, arch):
    sd = spec_state_dict(arch)
    path = tmp_path / f"full_sft_{HIDDEN}.pth"
    torch.save(sd, path)

    torch.manual_seed(123)
    ours = build_minimind(HIDDEN, LAYERS, arch=arch, vocab_size=VOCAB).eval()
    # Our model's own key set must be exactly the spec's (names and shapes).
    assert {k: tuple(v.shape) for k, v in ours.state_dict().items()} == {k: tuple(v.shape) for k, v in sd.items()}

    load_native_weights(ours, path)
    for k, v in ours.state_dict().items():
        assert torch.equal(v, sd[k].float()), k

    ref = reference_hf_model(arch)
    ref.load_state_dict({k: v.float() for k, v in sd.items()}, strict=True)

    ids = _ids()
    with torch.no_grad():
        got = ours(input_ids=ids).logits
        want = ref(input_ids=ids).logits
    assert got.shape == (2, 12, VOCAB)
    # Same math, same kernels: the spec reports bit-identical logits on unpadded input.
    assert torch.equal(got, want), (got - want).abs().max()
    # Tied head: one tensor shared with the embedding after loading.
    assert ours.lm_head.weight.data_ptr() == ours.model.embed_tokens.weight.data_ptr()


def test_file_without_lm_head_loads_as_tied(tmp_path):
    sd = spec_state_dict("qwen3", vocab=256)
    del sd["lm_head.weight"]
    torch.save(sd, tmp_path / "w.pth")
    m = build_minimind(HIDDEN, LAYERS, vocab_size=256)
    load_native_weights(m, tmp_path / "w.pth")
    assert torch.equal(m.lm_head.weight, sd["model.embed_tokens.weight"].float())


def test_resume_file_model_entry_is_read(tmp_path):
    sd = spec_state_dict("llama", vocab=256)
    resume = {"model": sd, "optimizer": {"state": {}, "param_groups": [{"lr": 1e-5}]}, "epoch": 0, "step": 7}
    torch.save(resume, tmp_path / "ppo_actor_64_resume.pth")
    got = read_state_dict(tmp_path / "ppo_actor_64_resume.pth")
    assert got.keys() == sd.keys()
    assert all(torch.equal(got[k], sd[k]) for k in sd)


# ---------------------------------------------------------------- native round trip


def _file_keys(path: Path) -> dict[str, torch.Tensor]:
    obj = torch.load(path, map_location="cpu", weights_only=True)
    assert isinstance(obj, dict) and all(isinstance(v, torch.Tensor) for v in obj.values())
    return obj


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_native_round_trip_fp16_default(tmp_path, arch):
    torch.manual_seed(0)
    src = build_minimind(HIDDEN, LAYERS, arch=arch, vocab_size=256)
    path = tmp_path / "ppo_actor_64.pth"
    save_native_weights(src, path)

    on_disk = _file_keys(path)
    assert set(on_disk) == set(spec_state_dict(arch, vocab=256))  # MiniMind naming, nothing else
    assert all(v.dtype == torch.float16 for v in on_disk.values())
    assert [p.name for p in tmp_path.iterdir()] == ["ppo_actor_64.pth"]  # no temp file left behind

    torch.manual_seed(1)
    dst = build_minimind(HIDDEN, LAYERS, arch=arch, vocab_size=256)
    load_native_weights(dst, path)
    src_sd = src.state_dict()
    for k, v in dst.state_dict().items():
        assert torch.equal(v, src_sd[k].half().float()), k


def test_native_round_trip_fp32_exact(tmp_path):
    torch.manual_seed(0)
    src = build_minimind(HIDDEN, LAYERS, vocab_size=256)
    path = tmp_path / "w.pth"
    save_native_weights(src, path, dtype=torch.float32)
    assert all(v.dtype == torch.float32 for v in _file_keys(path).values())
    torch.manual_seed(1)
    dst = build_minimind(HIDDEN, LAYERS, vocab_size=256)
    load_native_weights(dst, path)
    src_sd = src.state_dict()
    assert all(torch.equal(v, src_sd[k]) for k, v in dst.state_dict().items())


def test_moe_file_has_per_expert_keys_and_round_trips(tmp_path):
    torch.manual_seed(0)
    src = build_minimind(HIDDEN, LAYERS, use_moe=True, vocab_size=256)
    path = native_weight_path(tmp_path, "ppo_actor", HIDDEN, True)
    assert path.name == "ppo_actor_64_moe.pth"
    save_native_weights(src, path, dtype=torch.float32)

    on_disk = _file_keys(path)
    inter = SPEC["qwen3"]["inter"]
    for i in range(LAYERS):
        p = f"model.layers.{i}.mlp."
        assert on_disk[p + "gate.weight"].shape == (4, HIDDEN)
        for j in range(4):
            assert on_disk[p + f"experts.{j}.gate_proj.weight"].shape == (inter, HIDDEN)
            assert on_disk[p + f"experts.{j}.up_proj.weight"].shape == (inter, HIDDEN)
            assert on_disk[p + f"experts.{j}.down_proj.weight"].shape == (HIDDEN, inter)
        assert p + "gate_proj.weight" not in on_disk
    assert not any(k.endswith(("gate_up_proj", "experts.down_proj")) for k in on_disk)  # no fused keys

    torch.manual_seed(1)
    dst = build_minimind(HIDDEN, LAYERS, use_moe=True, vocab_size=256)
    load_native_weights(dst, path)
    src_sd = src.state_dict()
    assert all(torch.equal(v, src_sd[k]) for k, v in dst.state_dict().items())


def test_moe_per_expert_weights_mean_what_minimind_means(tmp_path):
    """Hand-built per-expert file: the layer's MLP is down_j(silu(gate_j x) * up_j x), j = argmax router."""
    torch.manual_seed(0)
    m = build_minimind(HIDDEN, LAYERS, use_moe=True, vocab_size=256)
    save_native_weights(m, tmp_path / "w.pth", dtype=torch.float32)
    sd = torch.load(tmp_path / "w.pth", weights_only=True)
    g = torch.Generator().manual_seed(5)
    for k in sd:  # distinct random experts so a gate/up swap or an expert reorder shows
        if ".mlp." in k:
            sd[k] = torch.randn(sd[k].shape, generator=g) * 0.2
    torch.save(sd, tmp_path / "w.pth")
    load_native_weights(m, tmp_path / "w.pth")

    x = torch.randn(1, 5, HIDDEN, generator=g)
    p = "model.layers.0.mlp."
    with torch.no_grad():
        got = m.model.layers[0].mlp(x)
        got = got[0] if isinstance(got, tuple) else got
        router = x @ sd[p + "gate.weight"].T  # [1, 5, 4]
        chosen = router.argmax(-1)[0]
        want = torch.stack([
            torch.nn.functional.silu(x[0, t] @ sd[p + f"experts.{j}.gate_proj.weight"].T)
            * (x[0, t] @ sd[p + f"experts.{j}.up_proj.weight"].T)
            @ sd[p + f"experts.{j}.down_proj.weight"].T
            for t, j in enumerate(chosen.tolist())
        ])
    assert torch.allclose(got.reshape(5, HIDDEN), want, atol=1e-5)


def test_failed_save_keeps_the_old_file_and_leaves_no_temp(tmp_path):
    path = tmp_path / "ppo_actor_64.pth"
    atomic_torch_save({"a": torch.ones(2)}, path)
    before = path.read_bytes()
    with pytest.raises(Exception):
        atomic_torch_save({"a": torch.zeros(2), "bad": lambda: 0}, path)  # lambdas cannot be pickled
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["ppo_actor_64.pth"]


# ---------------------------------------------------------------- clear errors


def _model(arch: str = "qwen3", hidden: int = HIDDEN, layers: int = LAYERS, use_moe: bool = False):
    return build_minimind(hidden, layers, use_moe=use_moe, arch=arch, vocab_size=256)


def test_wrong_hidden_size_names_flag(tmp_path):
    torch.save(spec_state_dict("qwen3", hidden=128, vocab=256), tmp_path / "w.pth")
    with pytest.raises(WeightsError, match="--hidden_size") as e:
        load_native_weights(_model(), tmp_path / "w.pth")
    assert str(tmp_path / "w.pth") in str(e.value)


def test_wrong_layer_count_names_flag(tmp_path):
    torch.save(spec_state_dict("qwen3", layers=3, vocab=256), tmp_path / "w.pth")
    with pytest.raises(WeightsError, match="--num_hidden_layers") as e:
        load_native_weights(_model(), tmp_path / "w.pth")
    assert "model.layers.2." in str(e.value)  # the unexpected keys are listed


def test_llama_file_into_qwen3_names_arch(tmp_path):
    torch.save(spec_state_dict("llama", vocab=256), tmp_path / "w.pth")
    with pytest.raises(WeightsError, match="--arch"):
        load_native_weights(_model("qwen3"), tmp_path / "w.pth")


def test_qwen3_file_into_llama_names_arch(tmp_path):
    torch.save(spec_state_dict("qwen3", vocab=256), tmp_path / "w.pth")
    with pytest.raises(WeightsError, match="--arch"):
        load_native_weights(_model("llama"), tmp_path / "w.pth")


def test_dense_into_moe_names_use_moe(tmp_path):
    torch.save(spec_state_dict("qwen3", vocab=256), tmp_path / "w.pth")
    with pytest.raises(WeightsError, match="--use_moe"):
        load_native_weights(_model(use_moe=True), tmp_path / "w.pth")


def test_moe_into_dense_names_use_moe(tmp_path):
    save_native_weights(_model(use_moe=True), tmp_path / "w.pth")
    with pytest.raises(WeightsError, match="--use_moe"):
        load_native_weights(_model(), tmp_path / "w.pth")


def test_single_missing_or_extra_key_is_not_ignored(tmp_path):
    sd = spec_state_dict("qwen3", vocab=256)
    del sd["model.layers.1.mlp.up_proj.weight"]
    torch.save(sd, tmp_path / "missing.pth")
    with pytest.raises(WeightsError, match=r"missing.*model\.layers\.1\.mlp\.up_proj\.weight"):
        load_native_weights(_model(), tmp_path / "missing.pth")

    sd = spec_state_dict("qwen3", vocab=256)
    sd["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(64)
    torch.save(sd, tmp_path / "extra.pth")
    with pytest.raises(WeightsError, match=r"unexpected.*q_proj\.bias"):
        load_native_weights(_model(), tmp_path / "extra.pth")


def test_failed_load_leaves_model_untouched(tmp_path):
    torch.manual_seed(0)
    m = _model()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    torch.save(spec_state_dict("llama", vocab=256), tmp_path / "w.pth")
    with pytest.raises(WeightsError):
        load_native_weights(m, tmp_path / "w.pth")
    assert all(torch.equal(v, before[k]) for k, v in m.state_dict().items())


def test_missing_file_mentions_path(tmp_path):
    path = tmp_path / "out" / "full_sft_64.pth"
    with pytest.raises(WeightsError, match="no such weights file") as e:
        load_native_weights(_model(), path)
    assert str(path) in str(e.value)


def test_truncated_file_is_a_weights_error(tmp_path):
    save_native_weights(_model(), tmp_path / "w.pth")
    data = (tmp_path / "w.pth").read_bytes()
    (tmp_path / "w.pth").write_bytes(data[: len(data) // 2])
    with pytest.raises(WeightsError, match="cannot be read"):
        read_state_dict(tmp_path / "w.pth")


def test_non_tensor_values_are_refused(tmp_path):
    torch.save({"model.norm.weight": torch.ones(4), "note": "hello"}, tmp_path / "w.pth")
    with pytest.raises(WeightsError, match="state dict of tensors"):
        read_state_dict(tmp_path / "w.pth")


class _Payload:
    """Unpickling this runs a shell command (creates the marker file)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {shlex.quote(str(self.marker))}",))


def test_pickled_code_is_refused_and_never_runs(tmp_path):
    marker = tmp_path / "pwned"
    evil = tmp_path / "evil.pth"
    torch.save({"model.norm.weight": torch.ones(4), "x": _Payload(marker)}, evil)
    assert not marker.exists()

    with pytest.raises(WeightsError, match="cannot be read") as e:
        read_state_dict(evil)
    assert str(evil) in str(e.value)
    assert not marker.exists()
    with pytest.raises(WeightsError):
        load_native_weights(_model(), evil)
    assert not marker.exists()

    # Control: the payload is live, an unsafe load would have run it.
    torch.load(evil, weights_only=False)
    assert marker.exists()
