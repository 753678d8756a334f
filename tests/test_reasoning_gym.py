"""--reasoning_gym (dataset/rgym.py): rows generated from fixed seeds, held-out rows kept out of training, the
accuracy reward equal to the task's own score_answer, one-line errors, and the preset end to end on a tiny stand-in."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

rg = pytest.importorskip("reasoning_gym", reason="reasoning-gym is optional: pip install reasoning-gym==0.1.25")

from dataset import rgym as R  # noqa: E402
from tests.helpers import ROOT, read_metrics, run_main  # noqa: E402
from tests.tiny_hf import save_tiny_causal_lm  # noqa: E402
from trainer import verifier  # noqa: E402
from trainer.evaluate import score_replies  # noqa: E402
from trainer.rewards import compute_rewards  # noqa: E402
from trainer.run import cli as C  # noqa: E402
from trainer.runtime import DistInfo  # noqa: E402

SPEC = "chain_sum:max_terms=3:max_digits=2"


def _questions(records) -> list[str]:
    return [r.rg["entry"]["question"] for r in records]


# ---------------------------------------------------------------- rows
def test_rows_are_generated_the_same_from_the_same_seed_and_held_out_rows_stay_out_of_training():
    a, b = R.training(SPEC, 200, seed=3), R.training(SPEC, 200, seed=3)
    assert [(r.messages, r.rg) for r in a] == [(r.messages, r.rg) for r in b]
    assert _questions(R.training(SPEC, 200, seed=4)) != _questions(a)  # another --seed, other rows
    held = R.held_out(SPEC)
    assert len(held) == R.HELD_OUT_ROWS and _questions(held) == _questions(R.held_out(SPEC))
    assert not set(_questions(a)) & set(_questions(held))
    assert 0 < len(a) <= 200  # the rows asking a held-out question are dropped
    shown = R.example(R.parse_spec(SPEC)[0])["question"]
    assert shown not in _questions(a) + _questions(held)


def test_a_row_is_a_one_shot_chat_with_reasoning_gyms_direct_prompt_and_carries_what_the_verifier_reads():
    row = R.held_out("chain_sum,leg_counting", 2)
    assert [r.rg["task"] for r in row] == ["chain_sum", "leg_counting"]  # the tasks in turn
    m = row[0].messages
    assert [x["role"] for x in m] == ["system", "user", "assistant", "user"]
    assert m[0]["content"] == rg.utils.SYSTEM_PROMPTS["direct"].strip()
    assert m[2]["content"].startswith("<answer>") and m[2]["content"].endswith("</answer>")
    assert m[3]["content"] == row[0].rg["entry"]["question"] and row[0].reference is None
    assert set(row[0].rg) == {"task", "config", "entry", "template"} and row[0].rg["config"] == {}
    assert row[0].rg["template"] == "train"


# ---------------------------------------------------------------- templates the training never uses
GYM = "basic_arithmetic:max_terms=2:max_digits=1"  # the preset's task


def _system(messages: list[dict]) -> str | None:
    return messages[0]["content"] if messages[0]["role"] == "system" else None


def test_no_held_out_template_is_the_training_template_in_its_system_prompt_layout_or_wording():
    direct = rg.utils.SYSTEM_PROMPTS["direct"].strip()
    train = R.training(GYM, 200, seed=42)
    assert {r.rg["template"] for r in train} == {"train"} and {_system(r.messages) for r in train} == {direct}
    train_layout = {tuple(m["role"] for m in r.messages) for r in train}
    assert train_layout == {("system", "user", "assistant", "user")}  # the example as its own turns
    trained_texts = {m["content"] for r in train for m in r.messages}
    held = {name: R.held_out(GYM, 40, name) for name in R.template_names() if name not in ("train", "heldout")}
    assert len(held) >= 3
    seen = R.held_out(GYM, 40)
    for name, rows in held.items():
        assert {r.rg["template"] for r in rows} == {name}
        for row, same in zip(rows, seen, strict=True):
            assert row.rg["entry"] == same.rg["entry"]  # the same question, asked otherwise
            question = row.rg["entry"]["question"]
            assert _system(row.messages) != direct, name  # another system prompt, or none
            assert question not in row.messages[-1]["content"], name  # the question reworded
            # No system or user turn that training ever shows (the example's answer turn is the same "<answer>16</answer>").
            assert not {m["content"] for m in row.messages if m["role"] != "assistant"} & trained_texts, name
    layouts = {tuple(m["role"] for m in rows[0].messages) for rows in held.values()}
    assert ("user",) in layouts and ("system", "user") in layouts  # the example inside the user turn, with and without
    assert any(_system(rows[0].messages) is None for rows in held.values())  # a system prompt


def test_heldout_rotates_its_templates_over_the_same_rows_and_a_task_meets_each():
    both = "basic_arithmetic:max_terms=2:max_digits=1,chain_sum"
    rows, seen = R.held_out(both, 24, "heldout"), R.held_out(both, 24)
    assert [r.rg["entry"] for r in rows] == [r.rg["entry"] for r in seen]
    names = [t.name for t in R.HELD_OUT_TEMPLATES]
    for task in ("basic_arithmetic", "chain_sum"):
        assert [r.rg["template"] for r in rows if r.rg["task"] == task][: 2 * len(names)] == names * 2
    with pytest.raises(R.ReasoningGymError, match="--rg_template nope: no such template; one of train, heldout, "):
        R.held_out(GYM, 4, "nope")


def test_the_held_out_column_is_scored_by_the_same_verifier_as_the_training_template():
    for row, same in zip(R.held_out(GYM, 8, "heldout"), R.held_out(GYM, 8), strict=True):
        answer = row.rg["entry"]["answer"]
        replies = [f"<answer>{answer}</answer>", f"<answer>{int(answer) + 1}</answer>", answer, f"<answer>= {answer}</answer>"]
        n = len(replies)
        scores = [compute_rewards(prompts=["p"] * n, messages=[[]] * n, replies=replies, references=[None] * n,
                                  has_eos=[True] * n, weights={"accuracy": 1.0}, rm=None, reasoning=False, custom_fns={},
                                  rg=[r.rg] * n)[1]["accuracy"].tolist() for r in (row, same)]
        own = rg.get_score_answer_fn("basic_arithmetic")
        assert scores[0] == scores[1] == pytest.approx([own(rg.utils.extract_answer(x), row.rg["entry"]) for x in replies])
        assert scores[0][:3] == [1.0, 0.0, 0.0]


# ---------------------------------------------------------------- the reward
def test_the_accuracy_reward_of_a_row_is_the_tasks_own_score_answer_of_the_answer_in_the_tags():
    row = R.held_out(SPEC, 1)[0]
    answer = row.rg["entry"]["answer"]
    replies = [f"<answer>{answer}</answer>",                # right: 1
               f"<answer>{int(answer) + 1}</answer>",       # wrong: 0
               answer,                                      # right, but no <answer> tag: 0
               f"<answer>= {answer}</answer>",              # the task's partial credit: len(answer) / len(text)
               f"<answer>1</answer> then <answer>{answer}</answer>"]  # the last tags count
    n = len(replies)
    _, comps = compute_rewards(prompts=["p"] * n, messages=[[]] * n, replies=replies, references=[None] * n,
                               has_eos=[True] * n, weights={"accuracy": 1.0}, rm=None, reasoning=False, custom_fns={},
                               rg=[row.rg] * n)
    own = rg.get_score_answer_fn("chain_sum")
    expected = [own(rg.utils.extract_answer(r), row.rg["entry"]) for r in replies]
    assert comps["accuracy"].tolist() == pytest.approx(expected)
    assert expected[:3] == [1.0, 0.0, 0.0] and 0 < expected[3] < 1 and expected[4] == 1.0
    # Held-out evaluation counts a row correct at score 1 only.
    assert score_replies(replies, [None] * n, rg=[row.rg] * n)["correct"] == [True, False, False, False, True]


@pytest.fixture()
def short_verifier(monkeypatch):
    v = verifier.Verifier(timeout=1.0)  # --verifier_timeout 1, as the process's verifier
    monkeypatch.setattr(verifier, "_shared", [v])
    yield v
    v.close()


def test_an_answer_that_evals_forever_scores_0_within_the_verifier_timeout_and_is_counted(short_verifier):
    """countdown's score_answer hands the answer to sympy's parse_expr: 9**9**9**9 would run for hours in the trainer."""
    row = R.held_out("countdown", 1)[0]
    right = f"<answer>{row.rg['entry']['answer']}</answer>"
    replies = [right, "<answer>9**9**9**9</answer>", right, "<answer>1 + 2</answer>"]
    n = len(replies)
    assert verifier.score(right, row.rg) == 1.0  # the worker is up (reasoning-gym imported) before the clock starts
    t0 = time.monotonic()
    _, comps = compute_rewards(prompts=["p"] * n, messages=[[]] * n, replies=replies, references=[None] * n,
                               has_eos=[True] * n, weights={"accuracy": 1.0}, rm=None, reasoning=False, custom_fns={},
                               rg=[row.rg] * n)
    took = time.monotonic() - t0
    assert comps["accuracy"].tolist() == pytest.approx([1.0, 0.0, 1.0, R.score(replies[3], row.rg)])
    assert verifier.timeouts() == short_verifier.timeouts == 1 and verifier.failures() == 0
    assert took < 1.0 + 15  # the reply's 1 s, then a fresh worker imports reasoning-gym for the next reply


def test_the_verifier_worker_scores_rows_whose_entries_json_would_change():
    """rearc's entry holds tuples its verifier compares: through JSON the right answer would score 0.05, not 1."""
    row = R.held_out("rearc", 1)[0].rg
    right = f"<answer>{row['entry']['answer']}</answer>"
    assert R.score(right, row) == 1.0 and R.score(right, json.loads(json.dumps(row))) < 1.0
    for reply in (right, "<answer>1 2\n3 4</answer>", "no tags"):
        assert verifier.score(reply, row) == R.score(reply, row)


# ---------------------------------------------------------------- bad input, one line each
def _error(argv: list[str]) -> str:
    with pytest.raises(SystemExit) as e:
        C.validate(C.parse_args(argv))
    msg = str(e.value)
    assert msg.startswith("error: ") and "\n" not in msg, msg
    return msg


def test_a_task_that_does_not_exist_is_one_line_naming_the_close_ones():
    msg = _error(["--reasoning_gym", "chain_sum,basic_arithmetc"])
    assert msg.startswith("error: --reasoning_gym basic_arithmetc: no such task; close: basic_arithmetic, ")


def test_bad_task_settings_and_a_prompt_file_beside_it_are_one_line():
    assert "chain_sum has no setting 'max_digit'" in _error(["--reasoning_gym", "chain_sum:max_digit=2"])
    assert "max_terms must be >= min_terms" in _error(["--reasoning_gym", "chain_sum:max_terms=0"])
    assert "both give the training prompts" in _error(["--reasoning_gym", "chain_sum", "--data_path", "dataset/demo_eval.jsonl"])


def test_a_missing_package_is_one_line_with_the_pip_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # `import reasoning_gym` now raises ImportError
    assert _error(["--reasoning_gym", "chain_sum"]) == (
        "error: --reasoning_gym needs the reasoning-gym package: pip install reasoning-gym==0.1.25")


def test_resolve_points_the_held_out_evaluation_at_the_generated_rows():
    info = DistInfo()
    assert C.resolve(C.parse_args(["--reasoning_gym", "chain_sum"]), info, None).eval_data_path == R.HELD_OUT
    assert C.resolve(C.parse_args(["--reasoning_gym", "chain_sum", "--eval_data_path", "none"]), info, None).eval_data_path is None
    off = C.resolve(C.parse_args(["--reasoning_gym", "none"]), info, None)
    assert off.reasoning_gym is None and off.eval_data_path != R.HELD_OUT


# ---------------------------------------------------------------- end to end on a tiny stand-in
@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("tiny") / "llama"
    save_tiny_causal_lm(d, "llama")
    return d


def _preset(tmp: Path, actor: Path, **over) -> list[str]:
    flags = {"actor_path": actor, "reasoning_gym": "chain_sum", "reasoning_gym_size": 64, "max_steps": 2, "batch_size": 2,
             "num_generations": 2, "mini_batch_size": 4, "max_gen_len": 8, "eval_samples": 4, "eval_interval": 2,
             "save_dir": tmp / "out", "checkpoint_dir": tmp / "ckpt", "run_dir": tmp / "run", "swanlab_mode": "disabled",
             "num_threads": 1, **over}
    return ["--config", str(ROOT / "configs" / "smollm2_reasoning_gym.yaml"), *(x for k, v in flags.items() for x in (f"--{k}", str(v)))]


def test_eval_policy_asks_the_held_out_rows_in_the_held_out_templates_and_reports_each(tmp_path, tiny, capsys):
    from scripts import eval_policy

    base = ["--hf_path", str(tiny), "--reasoning_gym", GYM, "--n", "8", "--max_new_tokens", "4", "--max_prompt_len", "128",
            "--thinking_ratio", "0", "--reward_model_path", "none", "--json", "", "--num_threads", "1"]
    m = eval_policy.main([*base, "--rg_template", "heldout", "--replies_out", str(tmp_path / "r.jsonl")])
    assert m["n"] == m["n_with_reference"] == 8
    assert sorted(m["by_task"]) == sorted(f"basic_arithmetic/{t.name}" for t in R.HELD_OUT_TEMPLATES)
    assert all(t["n"] == 2 for t in m["by_task"].values())
    replies = [json.loads(line)["reply"] for line in (tmp_path / "r.jsonl").read_text().splitlines()]
    assert m["rg_tags_rate"] == sum(rg.utils.extract_answer(r) is not None for r in replies) / 8
    asked = [json.loads(line)["conversations"] for line in (tmp_path / "r.jsonl").read_text().splitlines()]
    assert asked == [r.messages for r in R.held_out(GYM, 8, "heldout")]
    assert "(held-out rows, template heldout)" in capsys.readouterr().out
    assert list(eval_policy.main(base)["by_task"]) == ["basic_arithmetic"]  # the training template: as before
    with pytest.raises(SystemExit, match="--rg_template what_is asks --reasoning_gym's rows"):
        eval_policy.main(["--hf_path", str(tiny), "--rg_template", "what_is", "--reward_model_path", "none", "--json", ""])
    with pytest.raises(SystemExit):  # argparse: invalid choice, the names listed
        eval_policy.parse_args(["--hf_path", "x", "--rg_template", "nope"])


@pytest.mark.slow
def test_the_preset_runs_on_a_tiny_stand_in_and_writes_a_plain_hf_directory(tmp_path, tiny, capsys):
    from transformers import AutoModelForCausalLM

    code, out = run_main(_preset(tmp_path, tiny))
    assert code in (None, 0), out
    rows = read_metrics(tmp_path / "run")
    steps = [r for r in rows if "reward/accuracy" in r]
    assert len(steps) == 2 and all(0 <= r["reward/accuracy"] <= 1 for r in steps)
    assert [r["step"] for r in rows if "eval/accuracy" in r] == [0, 2]
    run = json.loads((tmp_path / "run" / "run.json").read_text())
    assert run["data"] is None and run["versions"]["reasoning-gym"] == "0.1.25"
    assert run["args"]["eval_data_path"] == R.HELD_OUT
    hf = tmp_path / "out" / "smollm2_basic_arithmetic_hf"
    assert type(AutoModelForCausalLM.from_pretrained(hf)).__name__ == "LlamaForCausalLM"

    from scripts import eval_policy  # the same held-out rows, re-evaluated from the saved directory

    m = eval_policy.main(["--hf_path", str(hf), "--reasoning_gym", "chain_sum", "--n", "4", "--max_new_tokens", "8",
                          "--max_prompt_len", "128", "--thinking_ratio", "0", "--reward_model_path", "none", "--json", "",
                          "--num_threads", "1"])
    assert m["n"] == 4 and m["n_with_reference"] == 4 and m["by_task"]["chain_sum"]["n"] == 4
    assert "reasoning-gym chain_sum (held-out rows)" in capsys.readouterr().out


@pytest.mark.slow
def test_the_preset_with_a_prompt_file_without_answers_is_one_line(tmp_path, tiny):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"conversations": [{"role": "user", "content": f"Say {i}."},
                                                             {"role": "assistant", "content": "无"}]}) + "\n" for i in range(8)))
    code, out = run_main(_preset(tmp_path, tiny, reasoning_gym="none", data_path=prompts))
    assert code not in (None, 0) and "Traceback" not in out
    assert "prompts.jsonl has no row with an answer to check" in str(code) and "--reasoning_gym TASK" in str(code)
