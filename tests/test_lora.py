"""LoRA policies (model/lora.py, --lora_r): the reference is the actor with its adapters off, the old
actor an adapter snapshot, sampling (fast decode included) runs the adapters, the outputs (adapter
directory, merged weights) give the trained policy's logits, resume is exact and checks the LoRA
flags, and 2 gloo processes equal 1 process with the doubled batch."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from model.forward import policy_forward
from model.lora import AdapterSnapshot, AdaptersOff, base_of, check_targets, is_lora, merged_state_dict, trainable
from tests.helpers import (
    ROOT,
    build_update_world,
    deep_equal,
    make_tiny_world,
    read_metrics,
    run_experience,
    run_main,
    run_train,
    run_update,
    sigkill_after,
    spawn_train,
    tiny_flags,
)
from trainer.run import checkpoint as ckpt

LORA = ["--lora_r", "4", "--lora_alpha", "8"]
PREFIX = "ppo_actor_64_resume"


def _name(step: int) -> str:
    return f"{PREFIX}_step{step:08d}.pth"


def _perturb_adapters(model: torch.nn.Module, seed: int = 0, std: float = 0.05) -> None:
    """lora_B starts at zero (the policy = its base); give every adapter a non-zero delta."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in trainable(model).items():
            p.add_(std * torch.randn(p.shape, generator=g))


def _logprobs(model, ro, temperature: float = 1.0) -> torch.Tensor:
    with torch.no_grad():
        return policy_forward(model, ro.sequences, ro.attention_mask, ro.response_len, temperature)[0]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return make_tiny_world(tmp_path_factory.mktemp("lora_world"))


# ------------------------------------------------------------------ models
def test_only_adapters_train_and_the_reference_is_the_actor_with_adapters_off():
    w = build_update_world(LORA)
    m = w.models
    assert is_lora(m.actor) and isinstance(m.ref, AdaptersOff)
    assert list(m.ref.parameters()) == []  # no second copy of the model
    names = list(trainable(m.actor))
    assert names and all(".lora_A." in n or ".lora_B." in n for n in names)
    assert not any("lm_head" in n for n in names)  # all-linear: the trunk's layers, never the LM head
    assert {id(p) for g in w.optim.optims["actor"].param_groups for p in g["params"]} == {id(p) for p in trainable(m.actor).values()}
    assert all(p.requires_grad for p in m.critic.parameters())  # the critic stays a full model
    ro, _ = run_experience(w)
    base = _logprobs(m.ref, ro)
    assert torch.equal(_logprobs(m.actor, ro), base)  # lora_B = 0: the policy starts as its base
    _perturb_adapters(m.actor)
    assert not torch.allclose(_logprobs(m.actor, ro), base, atol=1e-3)
    assert torch.equal(_logprobs(m.ref, ro), base)  # the reference does not move with the adapters


def test_update_moves_adapters_only_and_kl_to_reference_grows():
    w = build_update_world([*LORA, "--learning_rate", "1e-2"])
    m = w.models
    frozen = {n: p.detach().clone() for n, p in m.actor.named_parameters() if not p.requires_grad}
    before = {n: p.detach().clone() for n, p in trainable(m.actor).items()}
    ro, metrics = run_experience(w)
    assert metrics["kl_ref"] == pytest.approx(0.0, abs=1e-6)
    run_update(w, ro)
    assert all(torch.equal(p, frozen[n]) for n, p in m.actor.named_parameters() if not p.requires_grad)
    assert any(not torch.equal(p, before[n]) for n, p in trainable(m.actor).items())
    ro2, metrics2 = run_experience(w)
    assert abs(metrics2["kl_ref"]) > 1e-6


@pytest.mark.parametrize("fast", [1, 0])
def test_sampled_logprobs_match_a_full_forward_with_lora(fast):
    """--rollout_logprobs 1 takes old log-probs from the sampling pass: with LoRA on they must be the
    adapted policy's. The fast decode path folds each adapter into its weight (fast=1 checks it runs)."""
    from model.fast_decode import fast_decoder

    w = build_update_world([*LORA, "--fast_decode", str(fast), "--temperature", "1.0"])
    _perturb_adapters(w.actor, std=0.2)
    base = base_of(w.actor)
    if fast:  # the fast path takes the LoRA layers (in eval mode, as sample() runs the policy)
        base.eval()
        assert fast_decoder(base, "cpu") is not None
        base.train()
    ro, _ = run_experience(w)
    full = _logprobs(w.actor, ro)
    mask = ro.response_mask.bool()
    assert (ro.old_logprobs - full)[mask].abs().max() < 1e-4
    off = _logprobs(w.models.ref, ro)
    assert (off - full)[mask].abs().max() > 1e-2  # the sampled policy was the adapted one, not the base


def test_fast_decoder_is_built_once_per_rollout_and_its_probe_folds_nothing(monkeypatch):
    """One copy of the weights per rollout: --filter_groups' rounds share one FastDecoder while the weights
    stay the same, a weight update gives a new one, and the check whether a layer can be folded computes no
    W + BA (only building the decoder does, once per adapter layer)."""
    from peft.tuners.lora.layer import Linear as LoraLayer

    from model import fast_decode as F

    w = build_update_world([*LORA, "--temperature", "1.0"])
    _perturb_adapters(w.actor, std=0.2)
    lm = base_of(w.actor)
    lm.eval()
    n_layers = sum(isinstance(m, LoraLayer) for m in lm.modules())
    folds, builds = [], []
    real_delta, real_init = LoraLayer.get_delta_weight, F.FastDecoder.__init__
    monkeypatch.setattr(LoraLayer, "get_delta_weight", lambda self, a: (folds.append(a), real_delta(self, a))[1])
    monkeypatch.setattr(F.FastDecoder, "__init__", lambda self, *a, **k: (builds.append(1), real_init(self, *a, **k))[1])
    with F.reuse_decoder(w.actor):
        first = F.fast_decoder(lm, "cpu")
        assert F.fast_decoder(lm, "cpu") is first and len(builds) == 1
        assert len(folds) == n_layers  # the probe folded nothing; the build folded each layer once
        with torch.no_grad():
            next(p for p in lm.parameters() if p.requires_grad).add_(1e-3)  # an optimizer step
        assert F.fast_decoder(lm, "cpu") is not first and len(builds) == 2
    assert lm not in F._REUSED  # nothing outlives the rollout
    F.fast_decoder(lm, "cpu")
    F.fast_decoder(lm, "cpu")
    assert len(builds) == 4  # outside reuse_decoder each sample() builds its own, as before


@pytest.mark.slow
@pytest.mark.parametrize("bf16", [False, True])
def test_fast_decode_with_lora_gives_peft_logits(bf16):
    """The fast decode step of a LoRA policy against peft's own forward. fp32: the adapters folded into
    the weights agree to ~1e-5. bf16 (the CUDA default): the adapters are applied apart, x W + s (x A) B as
    peft does, so the logits agree to one bf16 step, as for a policy without LoRA; a folded bf16 weight
    rounded further (benchmarks/measure_logprob_gap.py)."""
    from tests.test_generation import PROMPTS, _decode_logits, _left_pad

    w = build_update_world([*LORA, "--temperature", "1.0"])
    _perturb_adapters(w.actor, std=0.2)
    lm = base_of(w.actor).eval()
    ids, mask = _left_pad([[t % 200 + 3 for t in p] for p in PROMPTS])
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        want = _decode_logits(lm, ids, mask, 8, fast=False)
        got = _decode_logits(lm, ids, mask, 8, fast=True)
    if bf16:
        torch.testing.assert_close(got, want, atol=want.abs().max().item() * 2 ** -7, rtol=0)
    else:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_old_actor_is_an_adapter_snapshot():
    w = build_update_world([*LORA, "--update_old_actor_freq", "2", "--learning_rate", "1e-2"])
    m = w.models
    assert isinstance(m.old_actor, AdapterSnapshot) and list(m.old_actor.parameters()) == []
    assert set(m.old_actor.state_dict()) == set(trainable(m.actor))
    _perturb_adapters(m.actor)
    m.old_actor.load_state_dict(m.actor.state_dict())  # train_ppo.main's refresh, with a full peft state dict
    ro, _ = run_experience(w)
    start = _logprobs(m.actor, ro)
    assert torch.equal(_logprobs(m.old_actor, ro), start)
    live = {n: p.data for n, p in trainable(m.actor).items()}
    run_update(w, ro)
    assert not torch.allclose(_logprobs(m.actor, ro), start, atol=1e-4)
    assert torch.equal(_logprobs(m.old_actor, ro), start)  # the snapshot keeps the pre-update adapters
    assert all(p.data.data_ptr() == live[n].data_ptr() for n, p in trainable(m.actor).items())  # swapped back


# ------------------------------------------------------------------ outputs
def _probe(vocab: int) -> torch.Tensor:
    return torch.randint(3, vocab, (2, 12), generator=torch.Generator().manual_seed(0))


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")  # peft's loader, not ours
def test_native_outputs_give_the_trained_policys_logits(world, tmp_path):
    """A native run writes the adapter directory (AutoPeftModelForCausalLM, base exported once) and the
    merged .pth (fp16, MiniMind's format): both give the trained policy's logits."""
    from peft import AutoPeftModelForCausalLM

    from model.loader import load_policy

    flags = tiny_flags(world, tmp_path, max_steps=2, lora_r=4, lora_alpha=8, learning_rate=1e-2)
    code, out = run_main([*flags, "--save_weight", "lo"])
    assert code is None, out[-3000:]
    adapters, pth = tmp_path / "out" / "lo_64_lora", tmp_path / "out" / "lo_64.pth"
    assert (adapters / "adapter_model.safetensors").is_file() and (adapters / "base" / "config.json").is_file()
    # The trained policy: the start weights plus the adapters of the last resume file.
    policy, _ = load_policy(weights=Path(world["save_dir"]) / "full_sft_64.pth", hidden_size=64, num_hidden_layers=2)
    from model.lora import add_lora, load_actor_state_dict

    policy = add_lora(policy, 4, 8, 0.0, "all-linear")
    state = ckpt.read_resume(tmp_path / "ckpt" / "lo_64_resume_step00000002.pth")
    assert set(state["actor"]) == set(trainable(policy))  # the resume file holds the adapters only
    load_actor_state_dict(policy, state["actor"])
    policy.eval()
    ids = _probe(policy.config.vocab_size)
    with torch.no_grad():
        want = policy(input_ids=ids).logits
        with policy.disable_adapter():
            base_logits = policy(input_ids=ids).logits
        assert (want - base_logits).abs().max() > 1e-3  # training moved the policy: the check means something
        peft = AutoPeftModelForCausalLM.from_pretrained(str(adapters)).eval()
        assert (peft(input_ids=ids).logits - want).abs().max() < 1e-4
        merged, _ = load_policy(weights=pth, hidden_size=64, num_hidden_layers=2)
        got = merged.eval()(input_ids=ids).logits
    # The .pth is fp16 (MiniMind's format): equal to the merged fp32 weights rounded to fp16, bit for bit.
    saved = torch.load(pth, weights_only=True)
    want_sd = merged_state_dict(policy)
    assert all(torch.equal(saved[k], want_sd[k].half()) for k in saved)
    assert (got - want).abs().max() < 5e-2 * want.abs().max()


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")  # peft's loader, not ours
def test_hf_actor_outputs_give_the_trained_policys_logits(tmp_path):
    """--actor_path: the adapter directory names the HF directory as its base; --save_merged 1 writes
    the merged model where a full run writes its policy (<save_weight>_hf)."""
    from peft import AutoPeftModelForCausalLM
    from transformers import AutoModelForCausalLM

    from tests.tiny_hf import save_tiny_causal_lm

    actor = tmp_path / "llama"
    save_tiny_causal_lm(actor, "llama", hidden=32)
    world = make_tiny_world(tmp_path / "w")
    flags = tiny_flags(world, tmp_path, actor_path=str(actor), save_dir=str(tmp_path / "out"), max_steps=1,
                       batch_size=2, mini_batch_size=2, lora_r=4, lora_alpha=8, learning_rate=5e-2, save_merged=1,
                       lora_target_modules="q_proj,v_proj", save_weight="hl")
    code, out = run_main(flags)
    assert code is None, out[-3000:]
    adapters, merged_dir = tmp_path / "out" / "hl_lora", tmp_path / "out" / "hl_hf"
    state = ckpt.read_resume(tmp_path / "ckpt" / "hl_32_resume_step00000001.pth")
    assert state["actor"] and all(("q_proj" in k or "v_proj" in k) and ".lora_" in k for k in state["actor"])
    ids = _probe(100)
    with torch.no_grad():
        peft = AutoPeftModelForCausalLM.from_pretrained(str(adapters)).eval()
        want = peft(input_ids=ids).logits
        with peft.disable_adapter():
            assert (peft(input_ids=ids).logits - want).abs().max() > 1e-4  # the adapters did train
        got = AutoModelForCausalLM.from_pretrained(str(merged_dir)).eval()(input_ids=ids).logits
    assert (got - want).abs().max() < 1e-4


# ------------------------------------------------------------------ bad input
@pytest.mark.parametrize("flags, needle", [
    (["--lora_r", "-1"], "--lora_r -1 must be >= 0"),
    (["--lora_r", "4", "--lora_target_modules", "c_attn"], "--lora_target_modules 'c_attn' matches no linear layer"),
    (["--lora_r", "4", "--lora_target_modules", "q_proj,nope"], "--lora_target_modules 'nope' matches no linear layer"),
    (["--lora_r", "4", "--lora_alpha", "0"], "--lora_alpha 0.0 must be a finite number > 0"),
    (["--lora_r", "4", "--lora_dropout", "1"], "--lora_dropout 1.0 must be in [0, 1)"),
    (["--lora_r", "4", "--ref_device", "cpu"], "--ref_device cpu: with --lora_r > 0"),
])
def test_bad_lora_flags_are_one_line(world, tmp_path, flags, needle):
    code, out = run_main([*tiny_flags(world, tmp_path), *flags])
    assert isinstance(code, str) and code.startswith("error: ") and "\n" not in code, (code, out[-2000:])
    assert needle in code


def test_a_model_without_linear_layers_is_one_line():
    class NoLinear(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(10, 4)

    with pytest.raises(ValueError, match=r"^--lora_r: NoLinear has no linear layers in its trunk") as e:
        check_targets(NoLinear(), "all-linear")
    assert "\n" not in str(e.value)


# ------------------------------------------------------------------ resume
def test_resume_with_other_lora_flags_names_the_flag(world, tmp_path):
    code, out = run_main(tiny_flags(world, tmp_path, max_steps=1, lora_r=4))
    assert code is None, out[-2000:]
    for flag, value in (("lora_r", 8), ("lora_target_modules", "q_proj"), ("lora_alpha", 32)):
        code, _ = run_main(tiny_flags(world, tmp_path, max_steps=2, from_resume=1, **{"lora_r": 4, flag: value}))
        assert isinstance(code, str) and "\n" not in code and f"--{flag} is {value!r}" in code, code
    code, _ = run_main(tiny_flags(world, tmp_path, max_steps=2, from_resume=1))  # LoRA off on resume
    assert isinstance(code, str) and "--lora_r is 0 but" in code, code


def test_resume_of_a_file_without_lora_flags_into_a_lora_run_is_one_line(world, tmp_path):
    """A full-model resume file written before the LoRA flags were recorded: no flag to compare, so the
    actor's tensors themselves are checked."""
    from model.lora import LORA_FLAGS
    from model.weights import atomic_torch_save

    code, out = run_main(tiny_flags(world, tmp_path, max_steps=1))
    assert code is None, out[-2000:]
    path = tmp_path / "ckpt" / _name(1)
    state = dict(torch.load(path, weights_only=True))
    state["args"] = {k: v for k, v in state["args"].items() if k not in LORA_FLAGS}
    atomic_torch_save(state, path)
    code, _ = run_main(tiny_flags(world, tmp_path, max_steps=2, from_resume=1, lora_r=4))
    assert isinstance(code, str) and "\n" not in code and "not this run's LoRA adapters" in code, code


@pytest.mark.slow
def test_sigkill_then_resume_with_lora_is_bit_identical(world, tmp_path):
    """Run A: 5 steps. Run B: SIGKILLed at an arbitrary moment after step 1 is saved, resumed to the
    end. Adapters, old-actor snapshot (refreshed every 2 steps), critic, optimizers and metrics equal."""
    common = dict(max_steps=5, save_interval=1, keep_checkpoints=2, update_old_actor_freq=2, lora_r=4, lora_alpha=8,
                  learning_rate=1e-2, sample_interval=1)
    a, b = tmp_path / "a", tmp_path / "b"
    code, out = run_main(tiny_flags(world, a, **common))
    assert code is None, out[-3000:]
    p = spawn_train(tiny_flags(world, b, **common), tmp_path, tmp_path / "b1.log")
    sigkill_after(p, b / "ckpt" / _name(1), delay=random.Random().uniform(0.0, 0.1))
    code, out = run_main(tiny_flags(world, b, **common, from_resume=1))
    assert code is None, out[-3000:]
    assert "resumed from " in out
    sa, sb = ckpt.read_resume(a / "ckpt" / _name(5)), ckpt.read_resume(b / "ckpt" / _name(5))
    assert sa["actor"] and all(".lora_" in k for k in sa["actor"])
    assert set(sa["old_actor"]) == set(sa["actor"])
    assert len(sa["optim"]["actor"]["state"]) == len(sa["actor"])  # AdamW state for the adapters only
    skip = {"args", "run", "swanlab_id", "run_id"}
    assert not deep_equal({k: v for k, v in sa.items() if k not in skip}, {k: v for k, v in sb.items() if k not in skip})

    def strip(rows):
        return [{k: v for k, v in r.items() if k not in ("time", "tokens_per_s") and not k.startswith("time/")} for r in rows]

    assert strip(read_metrics(a / "run")) == strip(read_metrics(b / "run"))


# ------------------------------------------------------------------ DDP
@pytest.mark.slow
def test_two_gloo_procs_with_lora_equal_one_proc_with_the_doubled_batch(world, tmp_path):
    """As tests/test_distributed.py's equivalence test, with LoRA: DDP reduces the adapters' gradients
    only (the frozen base has requires_grad False); the adapters, the critic and the metrics agree."""
    fixtures = ROOT / "tests" / "fixtures"
    equiv = dict(device="cpu", greedy=1, rollout_logprobs=0, learning_rate=1e-2, critic_learning_rate=1e-3, kl_coef=0.1,
                 reward_fn=f"{fixtures / 'toy_rewards.py'}:low_id_share", max_steps=3, save_interval=3,
                 lora_r=4, lora_alpha=8, save_weight="ddplora")
    two, one = tmp_path / "two", tmp_path / "one"
    run_train(tiny_flags(world, two, **equiv, batch_size=2, mini_batch_size=2), cwd=tmp_path, torchrun_procs=2)
    run_train(tiny_flags(world, one, **equiv, batch_size=4, mini_batch_size=4), cwd=tmp_path)
    name = "ddplora_64_resume_step00000003.pth"
    a, b = ckpt.read_resume(two / "ckpt" / name), ckpt.read_resume(one / "ckpt" / name)
    assert a["world_size"] == 2 and b["world_size"] == 1
    assert all(".lora_" in k for k in a["actor"])
    moved = max(a["actor"][k].abs().max().item() for k in a["actor"] if ".lora_B." in k)
    assert moved > 1e-3, "adapters barely moved: the comparison would prove nothing"
    for part in ("actor", "critic"):
        diffs = [(a[part][k] - b[part][k]).abs() for k in a[part]]
        # At lr 1e-2 Adam turns fp noise in near-zero gradients into steps on a few elements (5.6e-5 seen on an
        # AVX2 CPU, one Adam step being up to 1e-2); a DDP error would move every adapter, which the mean catches.
        assert max(d.max().item() for d in diffs) < 2e-4, part
        assert max(d.mean().item() for d in diffs) < 1e-6, part
    for ra, rb in zip(read_metrics(two / "run"), read_metrics(one / "run")):
        for key in ("reward/total", "kl_ref", "ppo/approx_kl", "value/explained_var"):
            assert ra[key] == pytest.approx(rb[key], rel=1e-4, abs=1e-6), (ra["step"], key)


def test_the_adapter_export_an_engine_loads_is_peft_format_and_gives_the_policys_logits(tmp_path):
    """model/lora.py adapter_export, what an adapter-only push writes (trainer/engine.py write_adapter): the same
    tensor names as peft's save_pretrained, and the folder loads with PeftModel.from_pretrained on the stock base
    (as vLLM's and SGLang's loaders read it) giving the LoRA actor's logits; no base weights, no tokenizer in it."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from model.lora import adapter_export, export_base_hf, save_adapter
    from trainer.engine import write_adapter

    w = build_update_world(LORA)
    _perturb_adapters(w.actor)
    w.actor.eval()
    base_dir = export_base_hf(w.actor, w.models.tok, tmp_path / "base")
    folder = write_adapter(*adapter_export(w.actor), tmp_path / "push")
    assert sorted(p.name for p in folder.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    saved = save_adapter(w.actor, None, tmp_path / "saved", base_dir)
    ours, peft_own = load_file(str(folder / "adapter_model.safetensors")), load_file(str(saved / "adapter_model.safetensors"))
    assert ours.keys() == peft_own.keys() and all(torch.equal(ours[k], peft_own[k]) for k in ours)
    ids = _probe(base_of(w.actor).config.vocab_size)
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(base_dir)), str(folder)).eval()
    with torch.no_grad():
        want = base_of(w.actor)(input_ids=ids).logits
        assert (loaded(input_ids=ids).logits - want).abs().max() < 1e-4
