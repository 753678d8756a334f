"""scripts/convert_model.py: MiniMind .pth <-> stock Hugging Face directories (and the critic)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoModelForTokenClassification,
    AutoTokenizer,
    LlamaForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeForCausalLM,
)

from model.critic import CriticModel
from model.loader import build_minimind, load_policy
from model.weights import save_native_weights
from scripts import convert_model as cm
from tests.tiny_hf import save_tiny_causal_lm

VARIANTS = {  # name -> (build kwargs, stock class, flags)
    "qwen3": ({}, Qwen3ForCausalLM, []),
    "llama": ({"arch": "llama"}, LlamaForCausalLM, []),
    "moe": ({"use_moe": True}, Qwen3MoeForCausalLM, ["--use_moe", "1"]),
}


def _native(tmp: Path, variant: str, dtype=torch.float32, seed: int = 0) -> Path:
    torch.manual_seed(seed)
    model = build_minimind(64, 2, **VARIANTS[variant][0])
    path = tmp / f"src_{variant}_64{'_moe' if variant == 'moe' else ''}.pth"
    save_native_weights(model, path, dtype=dtype)
    return path


def _to_hf(weights: Path, out_dir: Path, variant: str, *extra: str) -> None:
    cm.main(["to_hf", "--weights", str(weights), "--hidden_size", "64", "--num_hidden_layers", "2",
             *VARIANTS[variant][2], "--out_dir", str(out_dir), *extra])


def _ids() -> torch.Tensor:
    return torch.randint(0, 6400, (2, 10), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_native_hf_native_round_trip_is_bit_identical(tmp_path, variant):
    src = _native(tmp_path, variant)
    _to_hf(src, tmp_path / "hf", variant)
    cm.main(["to_native", "--hf_dir", str(tmp_path / "hf"), "--out", str(tmp_path / "back.pth"), "--dtype", "float32"])
    a, b = torch.load(src, weights_only=True), torch.load(tmp_path / "back.pth", weights_only=True)
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype == torch.float32 and torch.equal(a[k], b[k]), k


def test_fp16_native_file_round_trips_exactly_and_defaults_to_fp16(tmp_path):
    src = _native(tmp_path, "qwen3", dtype=torch.float16)
    _to_hf(src, tmp_path / "hf", "qwen3")  # fp32 safetensors hold fp16 values exactly
    cm.main(["to_native", "--hf_dir", str(tmp_path / "hf"), "--out", str(tmp_path / "back.pth")])
    a, b = torch.load(src, weights_only=True), torch.load(tmp_path / "back.pth", weights_only=True)
    assert all(b[k].dtype == torch.float16 and torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_hf_directory_is_stock_and_gives_our_logits(tmp_path, variant):
    src = _native(tmp_path, variant)
    _to_hf(src, tmp_path / "hf", variant)
    ours, tok = load_policy(weights=src, hidden_size=64, num_hidden_layers=2, use_moe=variant == "moe")
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert type(theirs) is VARIANTS[variant][1]
    assert theirs.config.architectures == [VARIANTS[variant][1].__name__]
    ids = _ids()
    with torch.no_grad():
        assert torch.equal(ours.eval()(ids).logits, theirs.eval()(ids).logits)
    gen = theirs.generation_config
    assert (gen.bos_token_id, gen.eos_token_id, gen.pad_token_id) == (1, 2, 0)
    hf_tok = AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert hf_tok.get_vocab() == tok.get_vocab()
    chat = [{"role": "user", "content": "hi"}]
    rendered = hf_tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True, open_thinking=True)
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n"


@pytest.mark.slow  # a new interpreter importing torch + transformers: ~10-25 s on a busy 2-core CPU
def test_fresh_process_loads_it_without_our_code(tmp_path):
    """A Python process that never imports this project (other cwd, no PYTHONPATH) loads the
    directory with plain Auto classes and reproduces our logits exactly."""
    src = _native(tmp_path, "qwen3")
    _to_hf(src, tmp_path / "hf", "qwen3")
    ours, _ = load_policy(weights=src, hidden_size=64, num_hidden_layers=2)
    ids = _ids()
    with torch.no_grad():
        torch.save({"ids": ids, "logits": ours.eval()(ids).logits}, tmp_path / "expected.pt")
    code = textwrap.dedent(f"""
        import sys, torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
        d = {str(tmp_path / "hf")!r}
        model = AutoModelForCausalLM.from_pretrained(d).eval()
        tok = AutoTokenizer.from_pretrained(d)
        exp = torch.load({str(tmp_path / "expected.pt")!r}, weights_only=True)
        with torch.no_grad():
            logits = model(exp["ids"]).logits
        ours = [m for m in sys.modules
                if m.split(".")[0] in ("model", "trainer", "dataset", "scripts", "builders", "benchmarks", "examples")]
        assert not ours, ours
        print(type(model).__name__, len(tok), tok.eos_token, bool(torch.equal(logits, exp["logits"])))
    """)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["Qwen3ForCausalLM", "6400", "<|im_end|>", "True"]


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["qwen3", "llama", "moe"])
def test_critic_export_gives_equal_values(tmp_path, variant):
    src = _native(tmp_path, variant)
    policy, _ = load_policy(weights=src, hidden_size=64, num_hidden_layers=2, use_moe=variant == "moe")
    critic = CriticModel.from_policy(policy)
    torch.manual_seed(1)
    torch.nn.init.normal_(critic.value_head.weight)  # a trained-looking head, bias included
    torch.nn.init.normal_(critic.value_head.bias)
    torch.save({"format_version": 1, "step": 7, "critic": critic.state_dict()}, tmp_path / "r_resume_step00000007.pth")
    _to_hf(src, tmp_path / "hf", variant, "--critic_resume", str(tmp_path / "r_resume_step00000007.pth"))
    exported = AutoModelForTokenClassification.from_pretrained(tmp_path / "hf_critic").eval()
    assert type(exported).__name__.endswith("ForTokenClassification") and exported.config.num_labels == 1
    assert exported.score.bias is not None
    ids = _ids()
    with torch.no_grad():
        assert torch.equal(exported(input_ids=ids).logits[..., 0], critic.eval()(ids))
    # A bare critic state dict works too, into a directory of our choice.
    torch.save(critic.state_dict(), tmp_path / "critic.pth")
    _to_hf(src, tmp_path / "hf2", variant, "--critic_resume", str(tmp_path / "critic.pth"), "--critic_out_dir", str(tmp_path / "c2"))
    assert (tmp_path / "c2" / "model.safetensors").is_file()


def test_critic_of_another_shape_is_refused(tmp_path):
    src = _native(tmp_path, "qwen3")
    torch.manual_seed(0)
    other = CriticModel.from_policy(build_minimind(64, 3))
    torch.save({"critic": other.state_dict()}, tmp_path / "c.pth")
    with pytest.raises(SystemExit, match="critic does not fit"):
        _to_hf(src, tmp_path / "hf", "qwen3", "--critic_resume", str(tmp_path / "c.pth"))


def test_lossy_dtype_is_reported_not_hidden(tmp_path, capsys):
    src = _native(tmp_path, "qwen3")
    _to_hf(src, tmp_path / "hf", "qwen3", "--dtype", "bfloat16")
    out = capsys.readouterr().out
    diff = float(re.search(r"max \|logit difference\| (\S+)", out).group(1))
    assert 0 < diff < 0.1 and "weights rounded to bfloat16" in out  # fp32 weights rounded: reported, not hidden
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "hf").dtype == torch.bfloat16


def test_to_native_prints_the_flags_that_load_it(tmp_path, capsys):
    src = _native(tmp_path, "moe")
    _to_hf(src, tmp_path / "hf", "moe")
    capsys.readouterr()
    cm.main(["to_native", "--hf_dir", str(tmp_path / "hf"), "--out", str(tmp_path / "x_64_moe.pth")])
    out = capsys.readouterr().out
    assert "--hidden_size 64 --num_hidden_layers 2 --use_moe 1 --arch qwen3" in out
    assert "--tokenizer_path" not in out  # the directory carries our own tokenizer


def test_to_native_refuses_what_minimind_cannot_express(tmp_path):
    save_tiny_causal_lm(tmp_path / "qwen2", "qwen2")
    with pytest.raises(SystemExit, match="model_type 'qwen2' cannot be written as MiniMind"):
        cm.main(["to_native", "--hf_dir", str(tmp_path / "qwen2"), "--out", str(tmp_path / "x.pth")])
    save_tiny_causal_lm(tmp_path / "llama", "llama")  # untied lm_head
    with pytest.raises(SystemExit, match="lm_head is not tied"):
        cm.main(["to_native", "--hf_dir", str(tmp_path / "llama"), "--out", str(tmp_path / "x.pth")])
    biased = Qwen3ForCausalLM(Qwen3Config(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                          num_attention_heads=4, num_key_value_heads=2, head_dim=8, attention_bias=True))
    biased.save_pretrained(tmp_path / "biased")
    with pytest.raises(SystemExit, match="attention_bias: True"):
        cm.main(["to_native", "--hf_dir", str(tmp_path / "biased"), "--out", str(tmp_path / "x.pth")])
    with pytest.raises(SystemExit, match="no config.json"):
        cm.main(["to_native", "--hf_dir", str(tmp_path), "--out", str(tmp_path / "x.pth")])
    assert not (tmp_path / "x.pth").exists()


def test_wrong_shape_flags_fail_with_one_line(tmp_path):
    src = _native(tmp_path, "qwen3")
    with pytest.raises(SystemExit, match="--hidden_size"):
        cm.main(["to_hf", "--weights", str(src), "--hidden_size", "96", "--num_hidden_layers", "2", "--out_dir", str(tmp_path / "o")])


def test_help_says_weights_are_full_and_merged(capsys):
    with pytest.raises(SystemExit):
        cm.main(["--help"])
    assert "always full, merged" in " ".join(capsys.readouterr().out.split())


@pytest.mark.slow
def test_exports_actor_and_critic_of_a_real_run(tmp_path):
    """The files a real (tiny, 1-step) PPO run writes convert, critic values equal the resume's critic."""
    from tests.helpers import make_tiny_world, run_train, tiny_flags

    world = make_tiny_world(tmp_path / "w", n_prompts=8)
    run_train(tiny_flags(world, tmp_path, max_steps=1, batch_size=2, mini_batch_size=2, save_weight="conv",
                         reward_model_path="none", rm_weight=0), cwd=tmp_path)
    actor = tmp_path / "out" / "conv_64.pth"
    resume = sorted((tmp_path / "ckpt").glob("conv_64_resume_step*.pth"))[-1]
    _to_hf(actor, tmp_path / "hf", "qwen3", "--critic_resume", str(resume))
    state = torch.load(resume, weights_only=True)
    policy, _ = load_policy(weights=actor, hidden_size=64, num_hidden_layers=2)
    critic = CriticModel.from_policy(policy)
    critic.load_state_dict(state["critic"])
    exported = AutoModelForTokenClassification.from_pretrained(tmp_path / "hf_critic").eval()
    ids = _ids()
    with torch.no_grad():
        assert torch.equal(exported(input_ids=ids).logits[..., 0], critic.eval()(ids))
        assert torch.equal(AutoModelForCausalLM.from_pretrained(tmp_path / "hf")(ids).logits, policy.eval()(ids).logits)
