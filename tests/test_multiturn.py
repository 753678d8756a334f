"""trainer/multiturn.py: multi-turn tool episodes, checked token by token on hand-built turns (the policy's sampler
is replaced by a script, so every token of the expected sequence is written out here), and the masks they give to
the advantages and losses."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

import trainer.estimators  # registers the estimators
import trainer.losses  # noqa: F401 - registers the losses
from dataset.rlaif import PromptRecord, RLAIFDataset, collate_left_pad
from model.generation import Samples
from model.loader import load_tokenizer
from tests.helpers import ROOT, read_metrics, run_train, sigkill_after, spawn_train
from trainer import multiturn
from trainer.dist import DistInfo
from trainer.ppo import compute_gae, compute_token_rewards
from trainer.registry import ADVANTAGE_ESTIMATORS, POLICY_LOSSES
from trainer.run.cli import parse_args, resolve
from trainer.tools import ToolRunner, load_tools

TOOLS = ROOT / "dataset" / "demo_tools.py"
CALL = '用计算器算 37 × 8。\n</think>\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "37 * 8"}}\n</tool_call>'
ANSWER = "计算器得出：\n296\n</think>\n<answer>\n296\n</answer>"
# What the template puts between the policy's two turns: the rest of the assistant's line, the tool's reply in a
# user turn, and the next assistant header with the think prefix (open thinking).
OBSERVATION = "\n<|im_start|>user\n<tool_response>\n296\n</tool_response><|im_end|>\n<|im_start|>assistant\n<think>\n"


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


@pytest.fixture(scope="module")
def runner():
    r = ToolRunner(load_tools(TOOLS), timeout=2.0)
    yield r
    r.close()


def batch_of(tok, prompts: list[str], tools: list[dict] | None) -> dict:
    records = [PromptRecord(messages=[{"role": "user", "content": p}], reference=None, where=f"row{i}")
               for i, p in enumerate(prompts)]
    ds = RLAIFDataset(records, tok, max_prompt_len=512, thinking_ratio=1.0, tools=tools)
    return collate_left_pad([ds[i] for i in range(len(ds))], tok.pad_token_id)


def scripted(tok, turns_by_prompt: dict[tuple, list[str]], cut: set[tuple] = frozenset()):
    """A stand-in for model.generation.sample: each row (found by its prompt tokens) emits its next scripted turn
    and EOS (none for a row in `cut`: it runs into the length limit)."""
    eos, start = tok.eos_token_id, tok.convert_tokens_to_ids("<|im_start|>")
    calls = []

    def fake(policy, ids, att, *, max_new_tokens, eos_token_id, pad_token_id, generator=None, **kw):
        rows, stops = [], []
        for row, m in zip(ids, att):
            ctx = row[m.bool()].tolist()
            key = next(k for k in turns_by_prompt if tuple(ctx[:len(k)]) == k)
            turn = ctx[len(key):].count(start) // 2  # each observation opens a user turn and an assistant turn
            toks = tok.encode(turns_by_prompt[key][turn], add_special_tokens=False)
            stop = key not in cut
            toks = (toks + [eos] if stop else toks)[:max_new_tokens]
            rows.append(toks)
            stops.append(stop and toks[-1] == eos)
        calls.append(len(rows))
        R = max(map(len, rows))
        new = torch.full((len(rows), R), pad_token_id)
        mask = torch.zeros((len(rows), R), dtype=torch.bool)
        for r, t in enumerate(rows):
            new[r, :len(t)], mask[r, :len(t)] = torch.tensor(t), True
        return Samples(torch.cat([ids, new], 1), mask, torch.tensor(stops))

    fake.calls = calls
    return fake


def prompt_key(batch, i):
    return tuple(batch["input_ids"][i][batch["attention_mask"][i].bool()].tolist())


def test_two_turn_episode_token_by_token(tok, runner, monkeypatch):
    tools = runner.toolbox.schema_list()
    batch = batch_of(tok, ["37乘以8等于多少？", "What is 2 + 3?"], tools)
    turns = {prompt_key(batch, 0): [CALL, ANSWER], prompt_key(batch, 1): ["\n</think>\n5"]}
    fake = scripted(tok, turns)
    monkeypatch.setattr(multiturn, "draw", fake)
    ro, eps = multiturn.generate_episodes(None, tok, runner, batch, max_turns=3, max_total_len=1024, max_new_tokens=64,
                                          eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)

    def enc(s):
        return tok.encode(s, add_special_tokens=False)

    eos = [tok.eos_token_id]
    turn1, obs, turn2 = enc(CALL) + eos, enc(OBSERVATION), enc(ANSWER) + eos
    P = ro.prompt_len
    assert ro.sequences[0, P:].tolist() == turn1 + obs + turn2
    assert ro.response_mask[0].tolist() == [1.0] * len(turn1) + [0.0] * len(obs) + [1.0] * len(turn2)
    assert ro.attention_mask[0, P:].tolist() == [1] * (len(turn1) + len(obs) + len(turn2))
    # The answer-only row: one turn, then pads that neither attend nor train.
    short = enc("\n</think>\n5") + eos
    R = ro.response_len
    assert ro.sequences[1, P:].tolist() == short + [tok.pad_token_id] * (R - len(short))
    assert ro.response_mask[1].tolist() == [1.0] * len(short) + [0.0] * (R - len(short))
    assert ro.attention_mask[1, P:].tolist() == [1] * len(short) + [0] * (R - len(short))
    assert ro.has_eos.tolist() == [True, True]
    assert eps[0] == multiturn.Episode(("<think>\n" + CALL, "<think>\n" + ANSWER), calls=1, failed=0, finished=True)
    assert eps[0].final_reply == "<think>\n" + ANSWER and eps[1].calls == 0 and eps[1].finished
    assert fake.calls == [2, 1]  # the second turn samples only the row that is still going
    # The whole conversation is the one the template renders (and the SFT script trains on), token for token.
    sys.path.insert(0, str(ROOT / "builders"))
    from train_sft import encode_sft_example
    conv = [{"role": "user", "content": "37乘以8等于多少？"}, {"role": "assistant", "content": "<think>\n" + CALL},
            {"role": "tool", "name": "calculator", "content": "296"}, {"role": "assistant", "content": "<think>\n" + ANSWER}]
    ids, labels = encode_sft_example(tok, conv, tools=tools)
    assert ro.sequences[0][ro.attention_mask[0].bool()].tolist() == ids
    assert [int(t != -100) for t in labels[-R:]] == ro.response_mask[0].int().tolist()[-R:]


def test_only_the_policys_tokens_carry_kl_advantages_and_returns(tok, runner, monkeypatch):
    batch = batch_of(tok, ["37乘以8等于多少？"], runner.toolbox.schema_list())
    monkeypatch.setattr(multiturn, "draw", scripted(tok, {prompt_key(batch, 0): [CALL, ANSWER]}))
    ro, _ = multiturn.generate_episodes(None, tok, runner, batch, max_turns=3, max_total_len=1024, max_new_tokens=64,
                                        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    mask, R = ro.response_mask, ro.response_len
    torch.manual_seed(0)
    kl, values = torch.randn(1, R), torch.randn(1, R)
    token_rewards = compute_token_rewards(torch.tensor([1.0]), kl, mask, kl_coef=0.1)
    adv, ret = compute_gae(token_rewards, values, mask, gamma=1.0, lam=0.95)
    obs = mask[0] == 0
    assert token_rewards[0, obs].abs().sum() == 0 and adv[0, obs].abs().sum() == 0 and ret[0, obs].abs().sum() == 0
    # GAE runs over the policy's tokens as one sequence: the tool's reply is a step of the environment, not of time.
    keep = mask[0].bool()
    adv_c, ret_c = compute_gae(token_rewards[:, keep], values[:, keep], torch.ones(1, int(keep.sum())), 1.0, 0.95)
    assert torch.allclose(adv[:, keep], adv_c) and torch.allclose(ret[:, keep], ret_c)
    # The reward sits on the policy's last token (its final EOS), not on a tool token.
    last = int(keep.nonzero().max())
    assert last == R - 1 and token_rewards[0, last] == pytest.approx(1.0 - 0.1 * kl[0, last].item())


class _Cfg:
    gamma, lam, num_generations, adv_eps, adv_std_unbiased = 1.0, 0.95, 2, 1e-6, 1


@pytest.mark.parametrize("name", sorted(ADVANTAGE_ESTIMATORS))
def test_every_estimator_leaves_tool_tokens_at_zero(name):
    mask = torch.tensor([[1, 1, 0, 0, 1, 0], [1, 1, 1, 0, 0, 0]], dtype=torch.float32)  # row 0: a tool reply at 2-3
    spec = ADVANTAGE_ESTIMATORS[name]
    scores = torch.tensor([1.0, 0.0])
    kl = torch.full((2, 6), 0.1) if spec.kl_placement == "reward" else None
    adv, ret = spec.fn(scores, kl, torch.randn(2, 6), mask, 0.05, _Cfg, baseline=torch.tensor([0.5, 0.5]))
    assert adv[mask == 0].abs().sum() == 0 and ret[mask == 0].abs().sum() == 0
    assert adv[0, 4] != 0  # the policy's answer after the tool reply is credited


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_every_policy_loss_has_no_gradient_on_tool_tokens(name):
    spec = POLICY_LOSSES[name]
    est = spec.estimators[0] if spec.estimators else "grpo"
    cfg = resolve(parse_args(["--policy_loss", name, "--advantage_estimator", est, "--num_generations", "2",
                              "--batch_size", "2", "--mini_batch_size", "0"]), DistInfo())
    mask = torch.tensor([[1, 1, 0, 0, 1, 0], [1, 1, 1, 0, 0, 0]], dtype=torch.float32)
    torch.manual_seed(0)
    old = -torch.rand(2, 6)
    logprobs = (old + 1e-5 * torch.randn(2, 6)).requires_grad_()  # inside every clip range (GSPO's is 3e-4)
    adv = torch.tensor([[1.0] * 6, [-1.0] * 6]) * mask
    loss, _ = spec.fn(logprobs, old, adv, mask, cfg)
    loss.backward()
    assert logprobs.grad[mask == 0].abs().sum() == 0
    assert logprobs.grad[0, 4] != 0  # the turn after the tool reply trains


def test_failures_are_messages_the_policy_reads(tok, runner, monkeypatch):
    bad = '\n</think>\n<tool_call>\n{"name": "calculator", "arguments": {"expression": 37 * 8}\n</tool_call>'
    batch = batch_of(tok, ["37乘以8等于多少？"], runner.toolbox.schema_list())
    monkeypatch.setattr(multiturn, "draw", scripted(tok, {prompt_key(batch, 0): [bad, ANSWER]}))
    ro, eps = multiturn.generate_episodes(None, tok, runner, batch, max_turns=3, max_total_len=1024, max_new_tokens=64,
                                          eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    assert eps[0].calls == 1 and eps[0].failed == 1 and eps[0].finished  # a reward signal, and the episode goes on
    text = tok.decode(ro.sequences[0, ro.prompt_len:].tolist())
    assert "<tool_response>\nerror: the tool call is not valid JSON" in text


def test_a_call_in_the_last_turn_and_the_length_limit_end_the_episode(tok, runner, monkeypatch):
    batch = batch_of(tok, ["37乘以8等于多少？"], runner.toolbox.schema_list())
    key = prompt_key(batch, 0)
    monkeypatch.setattr(multiturn, "draw", scripted(tok, {key: [CALL, ANSWER]}))
    kw = dict(max_new_tokens=64, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    ro, eps = multiturn.generate_episodes(None, tok, runner, batch, max_turns=1, max_total_len=1024, **kw)
    assert eps[0].calls == 1 and not eps[0].finished and len(eps[0].turns) == 1 and ro.has_eos.item()
    # Room for the call but not for the tool's reply and an answer: the episode stops after the call.
    room = len(key) + len(tok.encode(CALL, add_special_tokens=False)) + 5
    ro, eps = multiturn.generate_episodes(None, tok, runner, batch, max_turns=3, max_total_len=room, **kw)
    assert len(eps[0].turns) == 1 and ro.sequences.shape[1] <= room
    # A turn that runs into the limit is cut there, without EOS.
    ro, eps = multiturn.generate_episodes(None, tok, runner, batch, max_turns=3, max_total_len=len(key) + 10, **kw)
    assert ro.response_mask.sum() == 10 and not ro.has_eos.item() and not eps[0].finished
    # A prompt that fills the limit leaves no room for a turn: an empty episode, answered by nothing.
    ro, eps = multiturn.generate_episodes(None, tok, runner, batch, max_turns=3, max_total_len=len(key), **kw)
    assert eps[0].turns == () and eps[0].final_reply == "" and ro.response_mask.sum() == 0


def test_calls_past_max_tool_calls_are_answered_with_an_error_not_run_and_counted(tok, monkeypatch):
    """A policy that floods calls: three in its first turn and two more in its second, under --max_tool_calls 2."""
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "37 * 8"}}\n</tool_call>'
    turns = ["\n</think>\n" + call * 3, "\n</think>\n" + call * 2, ANSWER]
    runner = ToolRunner(load_tools(TOOLS), timeout=2.0, max_calls=2)
    ran = []
    real_call = runner.call
    monkeypatch.setattr(runner, "call", lambda c: ran.append(c) or real_call(c))
    try:
        batch = batch_of(tok, ["37乘以8等于多少？"], runner.toolbox.schema_list())
        monkeypatch.setattr(multiturn, "draw", scripted(tok, {prompt_key(batch, 0): turns}))
        ro, eps = multiturn.generate_episodes(None, tok, runner, batch, max_turns=3, max_total_len=2048, max_new_tokens=128,
                                              eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    finally:
        runner.close()
    assert len(ran) == 2  # the rest were never sent to the tool
    assert eps[0].calls == 5 and eps[0].refused == 3 and eps[0].failed == 3 and eps[0].finished
    text = tok.decode(ro.sequences[0, ro.prompt_len:].tolist())
    assert text.count("<tool_response>\n296\n</tool_response>") == 2
    assert text.count("error: not run: over --max_tool_calls 2 calls this episode") == 3
    assert multiturn.episode_components(eps)["tool_refused"].tolist() == [3]


def test_episode_components_count_calls_and_failures():
    eps = [multiturn.Episode(("a", "b"), 1, 0, True), multiturn.Episode(("a",), 0, 0, True),
           multiturn.Episode(("a", "b", "c"), 2, 1, False)]
    c = multiturn.episode_components(eps)
    assert c["tool_calls"].tolist() == [1, 0, 2] and c["tool_failures"].tolist() == [0, 0, 1]
    assert c["tool_ok"].tolist() == [1, 0, 0] and c["turns"].tolist() == [2, 1, 3]


def test_observation_refuses_a_template_that_rewrites_history(tok):
    class Rewriting:
        eos_token = "<|im_end|>"

        def apply_chat_template(self, messages, add_generation_prompt=False, **kw):
            return json.dumps([m["content"] for m in messages]) + ("!" if add_generation_prompt else "")

    with pytest.raises(ValueError, match="must only append"):
        multiturn.observation(Rewriting(), [{"role": "assistant", "content": "x"}],
                              [{"role": "tool", "content": "1"}], None, True)


# --------------------------------------------------------------------------------------- end to end
def tool_flags(tmp: Path, **over) -> list[str]:
    """configs/demo_tools.yaml, shrunk to seconds: the shipped tool policy (it calls the calculator on some prompts)."""
    out = tmp / "out"
    out.mkdir(parents=True, exist_ok=True)
    shutil.copy(ROOT / "out" / "tool_sft_128.pth", out / "tool_sft_128.pth")
    flags = {"config": str(ROOT / "configs" / "demo_tools.yaml"), "save_dir": str(out), "checkpoint_dir": str(tmp / "ckpt"),
             "run_dir": str(tmp / "run"), "max_steps": 3, "batch_size": 4, "num_generations": 2, "mini_batch_size": 8,
             "eval_interval": 2, "eval_samples": 8, "save_interval": 1, "num_threads": 1, "swanlab_mode": "disabled",
             "data_path": str(ROOT / "dataset" / "demo_tools_train.jsonl"), "tools": str(ROOT / "dataset" / "demo_tools.py"),
             "eval_data_path": str(ROOT / "dataset" / "demo_tools_eval.jsonl"), **over}
    return [x for k, v in flags.items() for x in (f"--{k}", str(v))]


@pytest.mark.slow  # three short runs of the tool demo's policy
def test_tool_run_logs_tool_use_and_resumes_exactly(tmp_path):
    common = dict(advantage_estimator="gae", num_generations=1, batch_size=8)  # the critic's path
    a, b = tmp_path / "a", tmp_path / "b"
    run_train(tool_flags(a, **common), cwd=tmp_path)
    rows = read_metrics(a / "run")
    steps = [r for r in rows if "reward/tool_calls" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert sum(r["reward/tool_calls"] for r in steps) > 0 and sum(r["reward/tool_ok"] for r in steps) > 0  # calls that ran
    evals = [r for r in rows if "eval/tool_call_rate" in r]
    assert len(evals) >= 2 and all(0 <= r["eval/tool_ok_rate"] <= r["eval/tool_call_rate"] <= 1 for r in evals)
    p = spawn_train(tool_flags(b, **common), tmp_path, tmp_path / "b1.log")
    sigkill_after(p, b / "ckpt" / "ppo_tools_128_resume_step00000001.pth", delay=0.0)
    run_train(tool_flags(b, **common, from_resume=1), cwd=tmp_path)

    def last(d):
        return torch.load(d / "ckpt" / "ppo_tools_128_resume_step00000003.pth", weights_only=True)

    sa, sb = last(a), last(b)
    for key in ("actor", "critic"):
        assert all(torch.equal(sa[key][k], sb[key][k]) for k in sa[key]), key


@pytest.mark.slow  # two torchrun processes
def test_tool_run_under_ddp_with_minimind_agent_rows(tmp_path):
    """MiniMind's agent_rl.jsonl rows (tools in the system message, "gt"), two ranks whose episodes take different
    numbers of turns: the same collectives on both, and the run ends."""
    schema = json.dumps([load_tools(TOOLS).schemas["calculator"]], ensure_ascii=False)
    rows = [json.loads(line) for line in (ROOT / "dataset" / "demo_tools_train.jsonl").read_text().splitlines()[:32]]
    agent = [{"conversations": [{"role": "system", "content": "You can use tools.", "tools": schema},
                                r["conversations"][0], {"role": "assistant", "content": ""}],
              "gt": [r["conversations"][1]["content"]]} for r in rows]
    data = tmp_path / "agent_rl.jsonl"
    data.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in agent), encoding="utf-8")
    r = run_train(tool_flags(tmp_path, data_path=data, eval_data_path=data, max_steps=2, eval_interval=1), cwd=tmp_path,
                  torchrun_procs=2, timeout=400)
    assert "device cpu x2" in r.stdout
    metrics = [m for m in read_metrics(tmp_path / "run") if "accuracy" in m]
    assert [m["step"] for m in metrics] == [1, 2]
    assert all(0 <= m["accuracy"] <= 1 for m in metrics) and "eval/accuracy" in metrics[-1]


@pytest.mark.slow
def test_rows_offering_tools_need_a_module_that_has_them(tmp_path):
    row = {"conversations": [{"role": "system", "content": "s", "tools": [{"type": "function", "function": {"name": "weather"}}]},
                             {"role": "user", "content": "Weather in Paris?"}], "gt": ["sunny"]}
    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps(row) + "\n")
    base = ["--data_path", str(data), "--eval_data_path", "none", "--max_steps", "1", "--batch_size", "1",
            "--mini_batch_size", "0", "--checkpoint_dir", str(tmp_path / "c"), "--run_dir", str(tmp_path / "r"),
            "--save_dir", str(ROOT / "out"), "--reward_model_path", "none"]
    r = run_train(base, cwd=tmp_path, check=False)
    assert r.returncode != 0 and "rows.jsonl:1: the row offers tools (weather); give --tools MODULE.py" in r.stderr
    r = run_train(base + ["--tools", str(TOOLS), "--max_seq_len", "256"], cwd=tmp_path, check=False)
    assert r.returncode != 0 and "the row offers weather, which --tools" in r.stderr and "Traceback" not in r.stderr
