"""model.loader: native weights with arch detection, local HF directories, tokenizers, reward models."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification, PreTrainedTokenizerFast

from model.loader import DEFAULT_TOKENIZER_DIR, build_minimind, detect_arch, load_policy, load_reward_model, load_tokenizer
from model.modeling import MiniMindForCausalLM
from model.weights import WeightsError, save_native_weights

HAS_PROJECT_TOKENIZER = (DEFAULT_TOKENIZER_DIR / "tokenizer.json").is_file()
WORDS = "hello world how are you the a".split()


def _tiny_tokenizer() -> PreTrainedTokenizerFast:
    """10 tokens with MiniMind's special-token ids (0 pad/unk, 1 bos, 2 eos)."""
    vocab = {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2}
    vocab.update({w: 3 + i for i, w in enumerate(WORDS)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   bos_token="<|im_start|>", unk_token="<|endoftext|>")


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("tok")
    _tiny_tokenizer().save_pretrained(d)
    return d


def _ids() -> torch.Tensor:
    return torch.randint(3, 10, (2, 6), generator=torch.Generator().manual_seed(1))


def _logits(m: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return m.eval()(input_ids=ids).logits


# ---------------------------------------------------------------- native weights


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_load_policy_auto_detects_arch(tmp_path, tok_dir, arch):
    torch.manual_seed(0)
    src = build_minimind(64, 2, arch=arch, vocab_size=256)
    path = tmp_path / "full_sft_64.pth"
    save_native_weights(src, path, dtype=torch.float32)

    policy, tok = load_policy(weights=path, hidden_size=64, num_hidden_layers=2, tokenizer_path=tok_dir)
    assert isinstance(policy, MiniMindForCausalLM)
    assert policy.config.arch == arch and policy.config.vocab_size == 256  # vocab read off the file
    assert len(tok) == 10 and tok.pad_token_id == 0 and tok.eos_token_id == 2
    assert policy.generation_config.pad_token_id == 0
    assert torch.equal(_logits(policy, _ids()), _logits(src, _ids()))


def test_detect_arch_from_keys():
    assert detect_arch({"model.layers.0.self_attn.q_norm.weight": torch.ones(8)}) == "qwen3"
    assert detect_arch({"model.layers.0.self_attn.q_proj.weight": torch.ones(8, 8)}) == "llama"


def test_load_policy_explicit_wrong_arch_names_flag(tmp_path, tok_dir):
    save_native_weights(build_minimind(64, 2, arch="llama", vocab_size=256), tmp_path / "w.pth")
    with pytest.raises(WeightsError, match="--arch"):
        load_policy(weights=tmp_path / "w.pth", hidden_size=64, num_hidden_layers=2, arch="qwen3",
                    tokenizer_path=tok_dir)


def test_load_policy_wrong_shape_flags(tmp_path, tok_dir):
    save_native_weights(build_minimind(64, 2, vocab_size=256), tmp_path / "w.pth")
    with pytest.raises(WeightsError, match="--hidden_size"):
        load_policy(weights=tmp_path / "w.pth", hidden_size=128, num_hidden_layers=2, tokenizer_path=tok_dir)
    with pytest.raises(WeightsError, match="--num_hidden_layers"):
        load_policy(weights=tmp_path / "w.pth", hidden_size=64, num_hidden_layers=3, tokenizer_path=tok_dir)


def test_load_policy_missing_weights_mentions_path(tmp_path, tok_dir):
    path = tmp_path / "nope_64.pth"
    with pytest.raises(WeightsError, match="no such weights file") as e:
        load_policy(weights=path, hidden_size=64, num_hidden_layers=2, tokenizer_path=tok_dir)
    assert str(path) in str(e.value)


def test_load_policy_dtype(tmp_path, tok_dir):
    save_native_weights(build_minimind(64, 2, vocab_size=256), tmp_path / "w.pth")
    policy, _ = load_policy(weights=tmp_path / "w.pth", hidden_size=64, num_hidden_layers=2,
                            tokenizer_path=tok_dir, dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in policy.parameters())


def test_tokenizer_larger_than_vocab_is_refused(tmp_path, tok_dir):
    save_native_weights(build_minimind(64, 2, vocab_size=8), tmp_path / "w.pth")  # 8 < 10 tokens
    with pytest.raises(WeightsError, match="--tokenizer_path"):
        load_policy(weights=tmp_path / "w.pth", hidden_size=64, num_hidden_layers=2, tokenizer_path=tok_dir)


def test_random_policy_takes_vocab_from_tokenizer(tok_dir):
    policy, tok = load_policy(hidden_size=64, num_hidden_layers=2, tokenizer_path=tok_dir)
    assert policy.config.vocab_size == len(tok) == 10 and policy.config.arch == "qwen3"


def test_weights_and_hf_path_together_are_refused(tmp_path):
    with pytest.raises(ValueError, match="not both"):
        load_policy(weights=tmp_path / "w.pth", hf_path=tmp_path)


@pytest.mark.skipif(not HAS_PROJECT_TOKENIZER, reason="model/tokenizer.json not created yet")
def test_project_tokenizer_with_full_vocab_native_file(tmp_path):
    tok = load_tokenizer()
    assert len(tok) == 6400 and tok.pad_token_id == 0 and tok.bos_token_id == 1 and tok.eos_token_id == 2
    torch.manual_seed(0)
    save_native_weights(build_minimind(64, 2, vocab_size=6400), tmp_path / "full_sft_64.pth")
    policy, tok2 = load_policy(weights=tmp_path / "full_sft_64.pth", hidden_size=64, num_hidden_layers=2)
    assert policy.config.vocab_size == 6400 and len(tok2) == 6400


# ---------------------------------------------------------------- local HF directories


def _save_tiny_llama(d: Path, vocab: int, tokenizer) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                      bos_token_id=1, eos_token_id=2, pad_token_id=None)
    m = LlamaForCausalLM(cfg).eval()
    m.save_pretrained(d)
    tokenizer.save_pretrained(d)
    return m


def test_load_policy_from_hf_directory(tmp_path):
    src = _save_tiny_llama(tmp_path, 16, _tiny_tokenizer())
    policy, tok = load_policy(hf_path=tmp_path)
    assert isinstance(policy, LlamaForCausalLM)
    assert len(tok) == 10 and tok.pad_token_id == 0
    assert policy.generation_config.pad_token_id == 0
    assert torch.equal(_logits(policy, _ids()), _logits(src, _ids()))


@pytest.mark.skipif(not HAS_PROJECT_TOKENIZER, reason="model/tokenizer.json not created yet")
def test_load_policy_from_hf_directory_with_project_tokenizer(tmp_path):
    src = _save_tiny_llama(tmp_path, 6400, load_tokenizer())
    policy, tok = load_policy(hf_path=tmp_path)
    assert isinstance(policy, LlamaForCausalLM) and len(tok) == 6400
    ids = tok("hello world", return_tensors="pt")["input_ids"]
    assert torch.equal(_logits(policy, ids), _logits(src, ids))


def test_actor_path_must_be_a_local_directory(tmp_path):
    with pytest.raises(WeightsError, match="--actor_path"):
        load_policy(hf_path=tmp_path / "missing")
    (tmp_path / "model.pth").write_bytes(b"x")
    with pytest.raises(WeightsError, match="--actor_path") as e:
        load_policy(hf_path=tmp_path / "model.pth")
    assert "model.pth" in str(e.value)
    # A hub id is not fetched: it is just not a local directory.
    with pytest.raises(WeightsError, match="--actor_path"):
        load_policy(hf_path="jingyaogong/MiniMind2")


def test_tokenizer_path_must_be_a_local_directory(tmp_path):
    with pytest.raises(WeightsError, match="--tokenizer_path"):
        load_tokenizer(tmp_path / "missing")


# ---------------------------------------------------------------- reward model


def test_load_reward_model_sequence_classifier(tmp_path):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=16, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, num_labels=1, pad_token_id=None)
    LlamaForSequenceClassification(cfg).save_pretrained(tmp_path)
    _tiny_tokenizer().save_pretrained(tmp_path)
    rm, tok = load_reward_model(tmp_path)
    assert not rm.training and not any(p.requires_grad for p in rm.parameters())
    assert rm.config.pad_token_id == tok.pad_token_id == 0
    with torch.no_grad():
        scores = rm(input_ids=_ids()).logits
    assert scores.shape == (2, 1)


def test_load_reward_model_errors(tmp_path):
    with pytest.raises(WeightsError, match="--reward_model_path"):
        load_reward_model(tmp_path / "missing")
    # A MiniMind causal LM has no sequence-classification head class.
    build_minimind(64, 2, vocab_size=16).save_pretrained(tmp_path)
    _tiny_tokenizer().save_pretrained(tmp_path)
    with pytest.raises(WeightsError, match="--trust_remote_code"):
        load_reward_model(tmp_path)


def test_causal_lm_as_reward_model_is_refused_not_given_a_random_head(tmp_path):
    """A causal-LM folder has no score head: transformers would create a RANDOM one (with only a log
    warning), so the 'rewards' would be noise. Like the strict weight loader, this must be an error."""
    _save_tiny_llama(tmp_path, 16, _tiny_tokenizer())
    with pytest.raises(WeightsError, match="--reward_model_path"):
        load_reward_model(tmp_path)


# ---------------------------------------------------------------- untrusted files


class _RunsCode:
    """Unpickling this calls builtins.exec, which creates `marker`: the kind of payload a .bin can carry."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({str(self.marker)!r}, 'w').close()",))


def _save_tiny_rm(d: Path) -> LlamaForSequenceClassification:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=16, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, num_labels=1, pad_token_id=0)
    m = LlamaForSequenceClassification(cfg).eval()
    m.save_pretrained(d)
    _tiny_tokenizer().save_pretrained(d)
    return m


def _as_bin_with_code(d: Path, model: torch.nn.Module, marker: Path, shards: int = 1) -> list[Path]:
    """Replace d/model.safetensors by pickle .bin weights (one file or `shards` files with an index);
    the last file also carries a payload that would create `marker` if it were unpickled freely."""
    (d / "model.safetensors").unlink()
    state = dict(model.state_dict())
    keys = sorted(state)
    if shards == 1:
        files = [d / "pytorch_model.bin"]
        parts = [keys]
    else:
        files = [d / f"pytorch_model-{i + 1:05d}-of-{shards:05d}.bin" for i in range(shards)]
        parts = [keys[i::shards] for i in range(shards)]
        weight_map = {k: files[i].name for i, part in enumerate(parts) for k in part}
        (d / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    for i, (f, part) in enumerate(zip(files, parts)):
        payload = {k: state[k] for k in part}
        if i == len(files) - 1:
            payload["zz_payload"] = _RunsCode(marker)
        torch.save(payload, f)
    return files


def _assert_payload_is_live(path: Path, marker: Path) -> None:
    """The test can fail: the same file unpickled without weights_only does run its code."""
    assert not marker.exists()
    torch.load(path, weights_only=False)
    assert marker.exists()


@pytest.mark.slow
def test_reward_model_bin_with_pickled_code_is_refused_and_never_runs(tmp_path):
    d, marker = tmp_path / "rm", tmp_path / "ran"
    model = _save_tiny_rm(d)
    (f,) = _as_bin_with_code(d, model, marker)
    with pytest.raises(WeightsError) as e:
        load_reward_model(d)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"--reward_model_path {d}: refused {f}: it contains pickled code")
    assert "(it would call exec)" in msg and "use safetensors weights" in msg
    assert not marker.exists()
    # Still refused (and never run) when remote code is trusted: that flag is about code files, not weights.
    with pytest.raises(WeightsError, match="pickled code"):
        load_reward_model(d, trust_remote_code=True)
    assert not marker.exists()
    # The suggested conversion (for a file one trusts) gives a directory that loads with the same weights.
    command = msg.split("convert it once: ", 1)[1].replace("python -c", f"{sys.executable} -c", 1)
    subprocess.run(["bash", "-c", command], check=True)
    assert marker.exists()  # the conversion unpickled the file freely: the payload was live
    rm, _ = load_reward_model(d)
    torch.testing.assert_close(rm.score.weight, model.score.weight)


def test_actor_path_bin_with_pickled_code_is_refused_naming_the_shard(tmp_path):
    d, marker = tmp_path / "actor", tmp_path / "ran"
    model = _save_tiny_llama(d, 16, _tiny_tokenizer())
    files = _as_bin_with_code(d, model, marker, shards=2)
    with pytest.raises(WeightsError) as e:
        load_policy(hf_path=d)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"--actor_path {d}: refused {files[1]}: it contains pickled code")
    assert not marker.exists()
    _assert_payload_is_live(files[1], marker)


def test_plain_bin_weights_still_load(tmp_path):
    """Only code is refused: a tensor-only pytorch_model.bin loads as before."""
    d = tmp_path / "rm"
    model = _save_tiny_rm(d)
    (d / "model.safetensors").unlink()
    torch.save(model.state_dict(), d / "pytorch_model.bin")
    rm, _ = load_reward_model(d)
    torch.testing.assert_close(rm.score.weight, model.score.weight)


def _add_auto_map(d: Path, auto_class: str, marker: Path) -> None:
    """config.json keeps its stock model_type (llama) and gains an auto_map to a module that would
    create `marker` when imported."""
    (d / "custom_model.py").write_text(
        f"open({str(marker)!r}, 'w').close()\n"
        "from transformers import LlamaForCausalLM, LlamaForSequenceClassification\n"
        "class CustomCausalLM(LlamaForCausalLM):\n    pass\n"
        "class CustomRM(LlamaForSequenceClassification):\n    pass\n")
    cfg = json.loads((d / "config.json").read_text())
    cls = "CustomRM" if auto_class == "AutoModelForSequenceClassification" else "CustomCausalLM"
    cfg["auto_map"] = {auto_class: f"custom_model.{cls}"}
    (d / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("kind", ["reward_model", "actor"])
def test_auto_map_without_trust_remote_code_warns_in_one_line(tmp_path, capsys, kind):
    d, marker = tmp_path / kind, tmp_path / "imported"
    if kind == "reward_model":
        _save_tiny_rm(d)
        _add_auto_map(d, "AutoModelForSequenceClassification", marker)
        def load(trust):
            return load_reward_model(d, trust_remote_code=trust)[0]
        flag, stock = "--reward_model_path", LlamaForSequenceClassification
    else:
        _save_tiny_llama(d, 16, _tiny_tokenizer())
        _add_auto_map(d, "AutoModelForCausalLM", marker)
        def load(trust):
            return load_policy(hf_path=d, trust_remote_code=trust)[0]
        flag, stock = "--actor_path", LlamaForCausalLM
    capsys.readouterr()
    model = load(False)
    assert type(model) is stock and not marker.exists()  # the stock class; the custom code never ran
    out = capsys.readouterr()
    lines = [line for line in (out.out + out.err).splitlines() if "auto_map" in line]
    assert len(lines) == 1, out
    assert lines[0].startswith(f"warning: {flag} {d}: ") and "custom_model." in lines[0]
    assert "NOT used" in lines[0] and "--trust_remote_code 1" in lines[0]
    # With the flag the directory's code is what loads (so the marker above could have appeared), silently.
    model = load(True)
    assert type(model).__name__ in ("CustomRM", "CustomCausalLM") and marker.exists()
    out = capsys.readouterr()
    assert "auto_map" not in out.out + out.err


def test_no_warning_without_auto_map(tmp_path, capsys):
    _save_tiny_rm(tmp_path)
    capsys.readouterr()
    load_reward_model(tmp_path)
    out = capsys.readouterr()
    assert "auto_map" not in out.out + out.err and "trust_remote_code" not in out.out + out.err


@pytest.mark.parametrize("source", ["hf", "native"])
def test_the_lm_head_of_a_frozen_copy_gets_contiguous_hidden_states(tmp_path, tok_dir, source):
    """logits_to_keep slices [B, T, H]; torch's matmul of that strided view with a weight that requires no grad (the
    reference, the old actor) copies the head once per row ([B, H, vocab]). The loader's hook hands the head a
    contiguous input instead: the same logits, no per-row copy of the weights."""
    import copy

    if source == "hf":
        _save_tiny_llama(tmp_path, 16, _tiny_tokenizer())
        policy, _ = load_policy(hf_path=tmp_path)
    else:
        policy, _ = load_policy(hidden_size=64, num_hidden_layers=2, tokenizer_path=tok_dir)
    ref = copy.deepcopy(policy).requires_grad_(False).eval()  # as trainer/run/setup.py's frozen_copy makes it
    seen = []
    ref.get_output_embeddings().register_forward_pre_hook(lambda mod, args: seen.append(args[0].is_contiguous()))
    ids = torch.randint(3, 10, (4, 12))
    with torch.no_grad():
        kept = ref(input_ids=ids, logits_to_keep=5).logits
        whole = ref(input_ids=ids).logits
    assert seen == [True, True]
    torch.testing.assert_close(kept, whole[:, -5:], rtol=0, atol=1e-5)
