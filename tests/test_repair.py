"""--ifeval_repairs (trainer/repair.py, dataset/ifeval.py REPAIRS): rewrites that meet the constraint no sample of a
group met, checked by the reward's own checker, and a rollout that carries them through scoring and the update."""

from __future__ import annotations

import json

import pytest
import torch

from dataset import ifeval
from tests.helpers import ROOT, build_update_world, phase_for, run_update
from trainer.repair import Repair, apply_repairs, plan_repairs

REPLY = "The sea is calm. It has Waves! Boats sail on it? Yes, and Gulls fly over the Harbour."
CASES = [
    {"type": "lowercase"},
    {"type": "quotation"},
    {"type": "repeat_prompt", "request": "Tell me about the sea."},
    {"type": "two_responses"},
    {"type": "number_paragraphs", "num": 3},
    {"type": "paragraph_first_word", "num": 2, "nth": 2, "word": "moreover"},
    {"type": "number_bullets", "num": 4},
]


@pytest.mark.parametrize("c", CASES, ids=[c["type"] for c in CASES])
def test_each_rewrite_meets_its_constraint_by_the_reward_checker(c):
    assert not ifeval.check(c, REPLY), "the test reply must start unmet"
    text = ifeval.repair([c], REPLY, {c["type"]}, sibling="A second, different answer.")
    assert text is not None and ifeval.check(c, text)
    assert "sea" in text.lower() and "harbour" in text.lower()  # the policy's own words, not a stock answer


def test_rewrites_compose_and_never_trade_a_met_constraint_for_another():
    both = [{"type": "lowercase"}, {"type": "quotation"}]
    text = ifeval.repair(both, REPLY, {"lowercase", "quotation"})
    assert text == '"' + REPLY.lower() + '"' and ifeval.reward(both, text) == 1.0
    start = [{"type": "start_phrase", "phrase": "The sea"}, {"type": "quotation"}]  # quoting breaks the met start
    assert ifeval.reward(start, REPLY) == 0.5 and ifeval.repair(start, REPLY, {"quotation"}) is None
    assert ifeval.repair([{"type": "uppercase"}], REPLY, {"uppercase"}) is None  # no rewrite: its KL cost is past the budget
    assert ifeval.repair([{"type": "two_responses"}], REPLY, {"two_responses"}, sibling=REPLY) is None  # two equal answers
    assert ifeval.repair([{"type": "number_paragraphs", "num": 9}], "One sentence only.", {"number_paragraphs"}) is None


def _encode(text: str) -> list[int]:
    return [ord(ch) for ch in text]  # one id per character: lengths are easy to read


def test_plan_rewrites_the_best_ended_reply_in_place_of_the_worst_only_where_no_sample_met():
    lower = [{"type": "lowercase"}, {"type": "no_comma"}]
    responses = ["Yes, Fine.", "No commas Here.", "Cut off, mid", "Also Here.",  # group 0: nobody wrote in lowercase
                 "all lowercase.", "Upper Case.", "More Text.", "End."]  # group 1: one sample met lowercase already
    has_eos = [True, True, False, True, True, True, True, True]
    plan = plan_repairs(responses, has_eos, ["", ""], [lower, lower], 4, 1, _encode, eos_id=0, max_tokens=64)
    # donor: row 1 (it met no_comma); in place of: the cut row
    assert plan == [Repair(row=2, tokens=_encode("no commas here.") + [0], types=("lowercase",))]
    two = plan_repairs(responses, has_eos, ["", ""], [lower, lower], 4, 2, _encode, eos_id=0, max_tokens=64)
    assert [p.row for p in two] == [2, 0]  # the second donor (row 3) goes in place of the next worst not a donor (row 0)
    assert two[1].tokens == _encode("also here.") + [0]
    assert plan_repairs(responses, has_eos, ["", ""], [lower, lower], 4, 1, _encode, eos_id=0, max_tokens=15) == []  # 16 tokens
    assert plan_repairs(responses, has_eos, ["", ""], [None, [{"type": "title"}]], 4, 1, _encode, 0, 64) == []  # no rewrite for title


def test_apply_repairs_widens_the_rollout_and_marks_the_rewrite_as_ended():
    from trainer.rollout import Rollout

    P, R = 3, 4
    seq = torch.arange(2 * (P + R)).view(2, P + R) + 10
    ro = Rollout(sequences=seq, attention_mask=torch.ones(2, P + R, dtype=torch.long), response_mask=torch.ones(2, R, dtype=torch.long),
                 has_eos=torch.tensor([True, False]), prompt_len=P, old_logprobs=torch.full((2, R), -1.0), entropy=torch.ones(2, R))
    out = apply_repairs(ro, [Repair(1, [7, 8, 9, 5, 6, 2], ("quotation",))], pad_token_id=0)
    assert out.response_len == 6 and torch.equal(out.sequences[1, :P], seq[1, :P]) and out.sequences[1, P:].tolist() == [7, 8, 9, 5, 6, 2]
    assert out.sequences[0, P:].tolist() == seq[0, P:].tolist() + [0, 0] and out.response_mask.tolist() == [[1] * 4 + [0, 0], [1] * 6]
    assert out.attention_mask[:, P:].tolist() == out.response_mask.tolist() and out.has_eos.tolist() == [True, True]
    assert out.old_logprobs[0].tolist() == [-1.0] * 4 + [0, 0] and ro.has_eos.tolist() == [True, False]  # the input is untouched


class _Fixed:
    """A rollout source that hands back given replies (the rest of the step runs for real)."""

    def __init__(self, ro):
        self.ro = ro

    def rollout(self, batch, phase):
        return self.ro, None


def test_a_step_scores_the_rewrite_as_the_policy_now_rewards_it_by_the_checker_and_updates(tmp_path):
    import train_ppo as T
    from dataset.rlaif import RLAIFDataset, collate_left_pad, read_rlaif_jsonl
    from model.forward import policy_forward
    from trainer.rollout import Rollout

    rows = [{"prompt": "Describe the sea. Write in lowercase letters only.", "constraints": [{"type": "lowercase"}]},
            {"prompt": "Name a colour.", "constraints": [{"type": "title"}]}]
    data = tmp_path / "c.jsonl"
    data.write_text("".join(json.dumps({"conversations": [{"role": "user", "content": r["prompt"]}, {"role": "assistant", "content": ""}],
                                        **r}) + "\n" for r in rows))
    world = build_update_world(["--data_path", str(data), "--ifeval_repairs", "1", "--num_generations", "4", "--batch_size", "2",
                                "--mini_batch_size", "8", "--advantage_estimator", "grpo", "--format_weight", "0",
                                "--tag_weight", "0", "--accuracy_weight", "0", "--thinking_ratio", "0", "--kl_coef", "0",
                                "--max_gen_len", "32"])
    tok, m = world.models.tok, world.models
    records, _ = read_rlaif_jsonl(data)
    ds = RLAIFDataset(records, tok, max_prompt_len=48, seed=0, thinking_ratio=0.0)
    batch = collate_left_pad([ds[i] for i in range(2)], pad_id=tok.pad_token_id)
    texts = ["The Sea is blue.", "Waves Roll.", "It is Wide.", "Big Sea"] + ["Red.", "Blue.", "Green.", "Grey."]
    ended = [True, True, True, False] + [True] * 4
    R = 12
    resp = torch.full((8, R), tok.pad_token_id)
    mask = torch.zeros(8, R, dtype=torch.long)
    for i, t in enumerate(texts):
        ids = tok(t, add_special_tokens=False)["input_ids"][: R - 1] + ([m.eos_ids[0]] if ended[i] else [])
        resp[i, :len(ids)], mask[i, :len(ids)] = torch.tensor(ids), 1
    prompts = batch["input_ids"].repeat_interleave(4, 0)
    seqs = torch.cat([prompts, resp], 1)
    att = torch.cat([batch["attention_mask"].repeat_interleave(4, 0), mask], 1)
    temp = world.cfg.sample_temperature
    lp, ent = policy_forward(m.actor, seqs, att, R, temp, True)
    ro = Rollout(sequences=seqs, attention_mask=att, response_mask=mask, has_eos=torch.tensor(ended), prompt_len=prompts.shape[1],
                 old_logprobs=lp * mask, entropy=ent * mask)

    exp = T.make_experience(world.cfg, batch, m, world.runtime, 0.0, world.built.custom_fns, phase_for(world), _Fixed(ro))
    out = exp.rollout
    assert out.sequences[3, out.prompt_len:][out.response_mask[3].bool()].tolist() == \
        tok("the sea is blue.", add_special_tokens=False)["input_ids"] + [m.eos_ids[0]]  # the best ended reply, lowercased
    assert out.rewards.tolist()[:4] == [0.0, 0.0, 0.0, 1.0] and exp.metrics["reward/repaired"] == pytest.approx(1 / 8)
    assert bool(out.has_eos[3]) and (out.advantages[3][out.response_mask[3].bool()] > 0).all()
    fresh, _ = policy_forward(m.actor, out.sequences, out.attention_mask, out.response_len, temp)
    keep = out.response_mask.bool()
    torch.testing.assert_close(out.old_logprobs[keep], fresh[keep], atol=1e-5, rtol=0)  # the first ratio is 1, the rewrite's too
    assert torch.equal(out.sequences[4:], torch.nn.functional.pad(seqs[4:], (0, out.response_len - R), value=tok.pad_token_id))
    actor0 = [p.detach().clone() for p in m.actor.parameters()]
    stats = run_update(world, out)
    assert all(torch.isfinite(torch.tensor(v)) for k, v in stats.items() if isinstance(v, float))
    assert any(not torch.equal(a, p) for a, p in zip(actor0, m.actor.parameters()))


def test_the_flag_refuses_what_it_cannot_do():
    from trainer.run import cli as C

    for flags, start in ((["--ifeval_repairs", "-1"], "--ifeval_repairs -1 must be >= 0"),
                         (["--ifeval_repairs", "4", "--num_generations", "4"], "--ifeval_repairs 4 replaces samples")):
        with pytest.raises(SystemExit) as e:
            C.validate(C.parse_args(flags))
        assert str(e.value).startswith(f"error: {start}") and "\n" not in str(e.value)
    with pytest.raises(SystemExit) as e:
        build_update_world(["--ifeval_repairs", "1", "--num_generations", "4", "--data_path", str(ROOT / "dataset" / "demo_train.jsonl")])
    assert "--ifeval_repairs 1 rewrites replies" in str(e.value) and "has none" in str(e.value)
