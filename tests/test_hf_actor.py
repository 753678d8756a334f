"""--actor_path with local Hugging Face causal LMs of other families (Llama, Qwen2), each with its
own tokenizer and chat template, and a reward model whose tokenizer differs from the policy's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM, Qwen2ForCausalLM

from model.critic import CriticModel
from model.loader import eos_token_ids, load_policy, load_reward_model
from tests.helpers import ROOT, make_tiny_world, read_metrics, run_train, tiny_flags
from tests.tiny_hf import TINY_CHAT_TEMPLATE, save_tiny_causal_lm
from trainer.reward_model import RewardModelScorer
from trainer.rewards import compute_rewards

CUSTOM = str(ROOT / "examples" / "custom_rewards.py")


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict:
    """Prompts + a tiny reward model that uses the PROJECT tokenizer (6400 tokens, ChatML)."""
    return make_tiny_world(tmp_path_factory.mktemp("world"), n_prompts=8)


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    for family in ("llama", "qwen2"):
        save_tiny_causal_lm(root / family, family)
    return {"llama": root / "llama", "qwen2": root / "qwen2"}


def _flags(world, tmp, actor: Path, **over) -> list[str]:
    return tiny_flags(world, tmp, actor_path=str(actor), save_dir=str(tmp / "out"), max_steps=2, batch_size=2,
                      mini_batch_size=2, max_gen_len=8, **over)


# ---------------------------------------------------------------- pieces

def test_loaded_with_own_tokenizer_pad_and_stop_ids(hf_dirs):
    llama, tok = load_policy(hf_path=hf_dirs["llama"])
    assert isinstance(llama, LlamaForCausalLM) and len(tok) == 400
    assert tok.pad_token_id == tok.eos_token_id == 1  # no pad token in the folder: EOS pads (masked anyway)
    assert eos_token_ids(llama, tok) == [1]
    qwen2, tok2 = load_policy(hf_path=hf_dirs["qwen2"])
    assert isinstance(qwen2, Qwen2ForCausalLM) and tok2.pad_token_id == 2
    assert eos_token_ids(qwen2, tok2) == [1, 0]  # tokenizer EOS first, then generation_config's other stop ids
    assert tok2.chat_template == TINY_CHAT_TEMPLATE


def test_critic_is_built_from_the_foreign_trunk(hf_dirs):
    policy, tok = load_policy(hf_path=hf_dirs["llama"])
    critic = CriticModel.from_policy(policy)
    ids = tok("72 + 87 = ?", return_tensors="pt")["input_ids"]
    values = critic(ids)
    assert values.shape == ids.shape and torch.equal(values, torch.zeros_like(values, dtype=torch.float32))
    assert type(critic.trunk).__name__ == "LlamaModel"
    assert critic.trunk.embed_tokens.weight.data_ptr() != policy.model.embed_tokens.weight.data_ptr()


def test_reward_model_with_another_tokenizer_gets_retokenised_text(world, hf_dirs):
    """The RM never sees the policy's token ids: each reply is rendered with the RM's own chat
    template and tokenised by the RM's tokenizer."""
    rm, rm_tok = load_reward_model(world["rm"])
    _, policy_tok = load_policy(hf_path=hf_dirs["llama"])
    seen: list[torch.Tensor] = []
    rm.register_forward_pre_hook(lambda mod, args, kwargs: seen.append(kwargs["input_ids"].clone()), with_kwargs=True)
    messages = [{"role": "user", "content": "8和74哪个更大？"}]
    reply = "74 is larger"
    total, comps = compute_rewards(prompts=["p"], messages=[messages], replies=[reply], references=[None],
                                   has_eos=[True], weights={"rm": 1.0}, rm=RewardModelScorer(rm, rm_tok),
                                   reasoning=False, custom_fns={})
    expected_text = "<|im_start|>user\n8和74哪个更大？<|im_end|>\n<|im_start|>assistant\n74 is larger<|im_end|>\n"
    expected_ids = rm_tok(expected_text, add_special_tokens=False)["input_ids"]
    assert seen[0][0].tolist() == expected_ids
    assert policy_tok(expected_text, add_special_tokens=False)["input_ids"] != expected_ids
    assert torch.isfinite(comps["rm"]).all() and total.item() == comps["rm"].item()


# ---------------------------------------------------------------- end to end

@pytest.mark.slow
def test_llama_actor_trains_end_to_end(world, hf_dirs, tmp_path):
    r = run_train(_flags(world, tmp_path, hf_dirs["llama"], save_weight="hf_llama"), cwd=tmp_path)
    assert "<s>user:" in r.stdout  # prompts rendered with the actor's own template
    rows = read_metrics(tmp_path / "run")
    assert [row["step"] for row in rows] == [1, 2]
    assert all(torch.isfinite(torch.tensor(row["reward/rm"])) for row in rows)  # RM with the project tokenizer
    out = tmp_path / "out" / "hf_llama_hf"
    trained = AutoModelForCausalLM.from_pretrained(out)
    start = AutoModelForCausalLM.from_pretrained(hf_dirs["llama"])
    assert isinstance(trained, LlamaForCausalLM)
    assert not torch.equal(trained.model.layers[0].mlp.up_proj.weight, start.model.layers[0].mlp.up_proj.weight)
    assert AutoTokenizer.from_pretrained(out).chat_template == TINY_CHAT_TEMPLATE


@pytest.mark.slow
def test_qwen2_actor_with_stop_id_list_and_custom_rewards(world, hf_dirs, tmp_path):
    r = run_train(_flags(world, tmp_path, hf_dirs["qwen2"], save_weight="hf_qwen2",
                         reward_fn=[f"{CUSTOM}:numeric_closeness", f"{CUSTOM}:same_language"]), cwd=tmp_path)
    rows = read_metrics(tmp_path / "run")
    assert len(rows) == 2
    for key in ("reward/custom/numeric_closeness", "reward/custom/same_language", "reward/rm"):
        assert key in rows[-1], key
    assert (tmp_path / "out" / "hf_qwen2_hf" / "model.safetensors").is_file()
    assert "done: 2 steps" in r.stdout + r.stderr


@pytest.mark.slow  # a train_ppo subprocess (~10 s of interpreter start-up on this CPU)
def test_tokenizer_without_chat_template_is_a_one_line_error(world, tmp_path):
    d = tmp_path / "base"
    save_tiny_causal_lm(d, "llama")
    (d / "chat_template.jinja").unlink()  # a base model: no chat template
    assert not AutoTokenizer.from_pretrained(d).chat_template
    r = run_train(_flags(world, tmp_path, d), cwd=tmp_path, check=False)
    assert r.returncode != 0 and "no chat_template" in r.stderr and "Traceback" not in r.stderr
