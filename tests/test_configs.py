"""The shipped presets (configs/; tests/test_cli.py resolves each one): the SmolLM2 + IFEval recipe runs end to
end on a tiny Llama of SmolLM2's architecture (imported from a GGUF as the real one is): the IFEval reward and its
per-type components, the held-out pass rate during training, a plain HF directory as output that
AutoModelForCausalLM loads, scripts/chat.py talks to and scripts/eval_policy.py re-evaluates to the same figures.
The SmolLM2 tool recipe likewise: multi-turn calculator episodes, the tools listed by its system prompt (the stand-in's
plain ChatML template, as SmolLM2-135M-Instruct's, has no tool section)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ROOT, read_metrics, run_main


@pytest.fixture(scope="module")
def tiny_smollm(tmp_path_factory) -> Path:
    pytest.importorskip("gguf")
    import scripts.import_gguf as I
    from tests.gguf_tiny import write_tiny_llama_gguf
    tmp = tmp_path_factory.mktemp("tiny_smollm")
    I.import_gguf(write_tiny_llama_gguf(tmp / "tiny.gguf"), tmp / "hf")
    return tmp / "hf"


def _recipe_flags(tmp: Path, actor: Path, preset: str = "smollm2_ifeval.yaml", **over) -> list[str]:
    flags = {"actor_path": actor, "max_steps": 2, "batch_size": 2, "num_generations": 2, "mini_batch_size": 4,
             "max_gen_len": 8, "max_seq_len": 256, "eval_samples": 4, "eval_interval": 2, "save_dir": tmp / "out",
             "checkpoint_dir": tmp / "ckpt", "run_dir": tmp / "run", "swanlab_mode": "disabled", "num_threads": 1, **over}
    return ["--config", str(ROOT / "configs" / preset), *(x for k, v in flags.items() for x in (f"--{k}", str(v)))]


PRESET_EVAL = "dataset/ifeval_eval_others.jsonl"  # the preset's eval_data_path: its eval is re-scored from it


@pytest.mark.slow
def test_the_smollm2_ifeval_recipe_runs_on_a_tiny_stand_in_and_gives_a_usable_model(tmp_path, tiny_smollm):
    from transformers import AutoModelForCausalLM

    code, out = run_main(_recipe_flags(tmp_path, tiny_smollm))
    assert code in (None, 0), out
    rows = read_metrics(tmp_path / "run")
    steps = [r for r in rows if "reward/ifeval" in r]
    assert len(steps) == 2 and all(0 <= r["reward/ifeval"] <= 1 for r in steps)
    assert all(f"reward/ifeval/{t}" in steps[0] for t in ("lowercase", "no_comma", "quotation", "number_bullets"))
    evals = [r for r in rows if "eval/ifeval_pass_rate" in r]
    assert [r["step"] for r in evals] == [0, 2] and all("eval/distinct_2" in r for r in evals)
    assert f"eval_data_path: {PRESET_EVAL}" in (ROOT / "configs" / "smollm2_ifeval.yaml").read_text()

    hf = tmp_path / "out" / "smollm2_ifeval_hf"
    model = AutoModelForCausalLM.from_pretrained(hf)  # plain transformers, no peft, no remote code
    assert type(model).__name__ == "LlamaForCausalLM"

    figures = tmp_path / "eval.json"
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "eval_policy.py"), "--hf_path", str(hf),
                        "--ref_hf_path", str(tiny_smollm), "--data_path", str(ROOT / PRESET_EVAL),
                        "--n", "4", "--max_new_tokens", "8", "--max_prompt_len", "256", "--thinking_ratio", "0",
                        "--reward_model_path", "none", "--json", str(figures), "--num_threads", "1"],
                       capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    m = json.loads(figures.read_text())
    assert m["ifeval_pass_rate"] == pytest.approx(evals[-1]["eval/ifeval_pass_rate"])
    assert m["distinct_2"] == pytest.approx(evals[-1]["eval/distinct_2"])
    assert m["kl_ref"] is not None and "IFEval pass rate" in r.stdout

    chat = subprocess.run([sys.executable, str(ROOT / "scripts" / "chat.py"), "--hf_path", str(hf), "--prompt",
                           "Write about the sea. Do not use any commas.", "--max_new_tokens", "8", "--temperature", "0"],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert chat.returncode == 0 and chat.stdout.strip(), chat.stderr[-3000:]


def test_the_recipe_with_a_prompt_file_without_constraints_is_one_line(tmp_path, tiny_smollm):
    # eos_penalty 0: the preset's EOS penalty is a reward beside the ifeval one (a run with it would learn to stop)
    code, out = run_main(_recipe_flags(tmp_path, tiny_smollm, data_path=ROOT / "dataset" / "demo_train.jsonl",
                                       eos_penalty=0))
    assert code is not None and code != 0
    assert "demo_train.jsonl has no row with \"constraints\"" in str(code) and "builders/make_ifeval_data.py" in str(code)
    assert "Traceback" not in out


def test_partial_credit_on_a_prompt_file_without_constraints_is_one_line(tmp_path, tiny_smollm):
    data = ROOT / "dataset" / "demo_train.jsonl"
    code, out = run_main(_recipe_flags(tmp_path, tiny_smollm, data_path=data, ifeval_weight=0, accuracy_weight=1,
                                       ifeval_partial_weight=0.5))
    assert code is not None and code != 0 and "Traceback" not in out
    assert "--ifeval_partial_weight 0.5" in str(code) and "demo_train.jsonl has none" in str(code)


def test_eval_policy_writes_every_reply_beside_its_data_row(tmp_path, tiny_smollm):
    """--replies_out: what scripts/judge_ifeval.py reads (each IFEval row's fields, Google's ids and kwargs among
    them, plus the reply), in the data file's order, the same replies the figures were computed from."""
    from dataset import ifeval
    from scripts import eval_policy

    data, out = ROOT / "dataset" / "ifeval_eval.jsonl", tmp_path / "replies.jsonl"
    m = eval_policy.main(["--hf_path", str(tiny_smollm), "--data_path", str(data), "--n", "3", "--max_new_tokens", "4",
                          "--thinking_ratio", "0", "--reward_model_path", "none", "--json", "", "--num_threads", "1",
                          "--replies_out", str(out)])
    got = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    sources = [json.loads(line) for line in data.read_text(encoding="utf-8").splitlines()[:3]]
    assert [{k: v for k, v in g.items() if k != "reply"} for g in got] == sources
    assert all(isinstance(g["reply"], str) and "instruction_id_list" in g for g in got)
    passed = [all(ok for _, ok in ifeval.results(g["constraints"], g["reply"])) for g in got]
    assert m["ifeval_pass_rate"] == pytest.approx(sum(passed) / 3)
    assert m["kl_ref"] is None and not any("kl_ref" in g for g in got)

    # With a reference: each reply's own KL, whose mean is the figure (the same model: 0 for each).
    m = eval_policy.main(["--hf_path", str(tiny_smollm), "--ref_hf_path", str(tiny_smollm), "--data_path", str(data),
                          "--n", "3", "--max_new_tokens", "4", "--temperature", "0.7", "--thinking_ratio", "0",
                          "--reward_model_path", "none", "--json", "", "--num_threads", "1", "--replies_out", str(out)])
    kls = [json.loads(line)["kl_ref"] for line in out.read_text(encoding="utf-8").splitlines()]
    assert len(kls) == 3 and sum(kls) / 3 == pytest.approx(m["kl_ref"]) and max(map(abs, kls)) < 1e-4


def test_eval_policy_draws_several_replies_per_prompt(tmp_path, tiny_smollm):
    """--samples_per_prompt K: K sampled replies per prompt, each beside its prompt's row, in the data file's order;
    greedy with K > 1 is one line naming the flag."""
    from scripts import eval_policy

    data, out = ROOT / "dataset" / "ifeval_eval.jsonl", tmp_path / "replies.jsonl"
    flags = ["--hf_path", str(tiny_smollm), "--data_path", str(data), "--n", "2", "--max_new_tokens", "12",
             "--thinking_ratio", "0", "--reward_model_path", "none", "--json", "", "--num_threads", "1",
             "--samples_per_prompt", "3"]
    m = eval_policy.main([*flags, "--temperature", "1.0", "--replies_out", str(out)])
    got = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    sources = [json.loads(line) for line in data.read_text(encoding="utf-8").splitlines()[:2]]
    assert [{k: v for k, v in g.items() if k != "reply"} for g in got] == [s for s in sources for _ in range(3)]
    assert m["n"] == 6 and m["samples_per_prompt"] == 3
    assert len({g["reply"] for g in got[:3]}) > 1  # independent samples, not one reply copied
    with pytest.raises(SystemExit, match="--samples_per_prompt 3"):
        eval_policy.main(flags)


@pytest.mark.slow
def test_the_smollm2_tools_recipe_runs_on_a_tiny_stand_in_and_gives_a_usable_model(tmp_path, tiny_smollm):
    from transformers import AutoModelForCausalLM

    code, out = run_main(_recipe_flags(tmp_path, tiny_smollm, "smollm2_tools.yaml", max_seq_len=320, max_gen_len=16))
    assert code in (None, 0), out
    rows = read_metrics(tmp_path / "run")
    steps = [r for r in rows if "reward/tool_ok" in r]
    assert len(steps) == 2 and all(0 <= r["accuracy"] <= 1 and r["reward/turns"] >= 1 for r in steps)
    evals = [r for r in rows if "eval/tool_call_rate" in r]
    assert [r["step"] for r in evals] == [0, 2] and all(0 <= r["eval/tool_ok_rate"] <= r["eval/tool_call_rate"] for r in evals)

    hf = tmp_path / "out" / "smollm2_tools_hf"
    model = AutoModelForCausalLM.from_pretrained(hf)  # plain transformers, no peft, no remote code
    assert type(model).__name__ == "LlamaForCausalLM"

    # scripts/eval_policy.py with the preset's settings (--config) scores the saved directory as the run did.
    figures = tmp_path / "eval.json"
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "eval_policy.py"), "--hf_path", str(hf), "--config",
                        str(ROOT / "configs" / "smollm2_tools.yaml"), "--max_prompt_len", "320", "--max_new_tokens", "16",
                        "--data_path", str(ROOT / "dataset" / "smollm2_tools_eval.jsonl"), "--n", "4",
                        "--reward_model_path", "none", "--json", str(figures), "--num_threads", "1"],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    m = json.loads(figures.read_text())
    assert m["accuracy"] == pytest.approx(evals[-1]["eval/accuracy"])
    assert m["tool_call_rate"] == pytest.approx(evals[-1]["eval/tool_call_rate"]) and "tool calls" in r.stdout
    assert m["examples"][0]["prompt"].startswith("<|im_start|>system\nYou can use these tools:\n<tools>[{")


def test_the_tools_recipe_without_its_system_prompt_is_one_line(tmp_path, tiny_smollm):
    """The stand-in's template ignores tools=: without --tools_system_prompt the policy would never see the tools."""
    import yaml

    preset = yaml.safe_load((ROOT / "configs" / "smollm2_tools.yaml").read_text(encoding="utf-8"))
    del preset["rollout"]["tools_system_prompt"]
    for key in ("data_path",):
        preset["data"][key] = str(ROOT / preset["data"][key])
    preset["rollout"]["tools"] = str(ROOT / preset["rollout"]["tools"])
    path = tmp_path / "no_system_prompt.yaml"
    path.write_text(yaml.safe_dump(preset), encoding="utf-8")
    flags = _recipe_flags(tmp_path, tiny_smollm, max_seq_len=320, eval_data_path="none")
    flags[1] = str(path)
    code, out = run_main(flags)
    assert code is not None and code != 0 and "Traceback" not in out
    assert "the chat template ignores tools= (it has no tool section)" in str(code) and "--tools_system_prompt" in str(code)


def test_eval_policy_takes_the_presets_tool_settings_and_refuses_what_cannot_run(tiny_smollm):
    from scripts import eval_policy

    args = eval_policy.parse_args(["--hf_path", "x", "--config", str(ROOT / "configs" / "smollm2_tools.yaml"),
                                   "--max_turns", "3"])
    assert (args.tools, args.max_turns, args.max_total_len, args.max_prompt_len, args.max_new_tokens, args.thinking_ratio) == (
        "dataset/demo_tools.py", 3, 448, 320, 48, 0.0)  # the preset's, a flag over it
    assert args.tools_system_prompt.startswith("You can use these tools:\n<tools>{tools}</tools>")
    assert (args.data_path, args.reward_model_path) == ("dataset/smollm2_tools_eval.jsonl", "none")  # its held-out file, no RM
    gym = eval_policy.parse_args(["--hf_path", "x", "--config", str(ROOT / "configs" / "smollm2_reasoning_gym.yaml")])
    assert gym.reasoning_gym == "basic_arithmetic:max_terms=2:max_digits=1" and gym.thinking_ratio == 0.0
    base = ["--hf_path", str(tiny_smollm), "--data_path", str(ROOT / "dataset" / "smollm2_tools_eval.jsonl"), "--n", "2",
            "--tools", str(ROOT / "dataset" / "demo_tools.py"), "--reward_model_path", "none", "--json", ""]
    with pytest.raises(SystemExit, match="the chat template ignores tools="):  # the stand-in's ChatML has no tool section
        eval_policy.main(base)
    with pytest.raises(SystemExit, match="--max_total_len 448 must exceed --max_prompt_len 512"):
        eval_policy.main(base + ["--tools_system_prompt", "{tools}", "--max_prompt_len", "512", "--max_total_len", "448"])
    with pytest.raises(SystemExit, match="has no {tools}"):
        eval_policy.main(base + ["--tools_system_prompt", "Use the calculator."])
