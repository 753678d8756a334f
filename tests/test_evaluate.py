import math

import pytest
import torch

from dataset.rlaif import PromptRecord
from model.forward import policy_forward
from model.generation import Samples
from model.loader import build_minimind, load_tokenizer
from trainer import evaluate as ev
from trainer import rollout
from trainer.evaluate import EvalSettings, evaluate_policy, score_replies

FULL_7 = "<think>\n3+4=7\n</think>\n<answer>\n7\n</answer>"
FULL_8 = "<think>\n3+4=8\n</think>\n<answer>\n8\n</answer>"
PLAIN_7 = "<think>\n\n</think>\n7"

EXPECTED_KEYS = {"n", "format_rate", "accuracy", "n_with_reference", "accuracy_formatted", "accuracy_unformatted",
                 "mean_response_len", "eos_rate", "rm_score_mean", "kl_ref"}


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


def tiny_model(tok, seed: int = 0):
    torch.manual_seed(seed)
    return build_minimind(32, 1, vocab_size=len(tok)).eval()


def records(n: int = 5, last_has_reference: bool = False) -> list[PromptRecord]:
    out = []
    for i in range(n):
        ref = None if i == n - 1 and not last_has_reference else str(i + 3)
        out.append(PromptRecord(messages=[{"role": "user", "content": f"What is {i} + 3?"}], reference=ref,
                                where=f"mem:{i + 1}"))
    return out


def test_score_replies_hand_counted():
    replies = [FULL_7, PLAIN_7, FULL_8, "no idea", FULL_7]
    refs = ["7", "7", "7", "7", None]
    tasks = ["add", "add", "mul", "mul", "mul"]
    s = score_replies(replies, refs, tasks)
    assert s["n"] == 5
    assert s["format_ok"] == [True, False, True, False, True]
    assert s["correct"] == [True, True, False, False, None]
    assert s["format_rate"] == pytest.approx(3 / 5)
    assert s["n_with_reference"] == 4
    assert s["accuracy"] == pytest.approx(2 / 4)
    assert s["accuracy_formatted"] == pytest.approx(1 / 2)  # FULL_7 right, FULL_8 wrong
    assert s["accuracy_unformatted"] == pytest.approx(1 / 2)  # PLAIN_7 right, "no idea" wrong
    assert s["by_task"] == {
        "add": {"n": 2, "format_rate": 0.5, "accuracy": 1.0},
        "mul": {"n": 3, "format_rate": pytest.approx(2 / 3), "accuracy": 0.0},
    }


def test_score_replies_without_references_gives_none_not_nan():
    s = score_replies([FULL_7], [None])
    assert s["accuracy"] is None and s["accuracy_formatted"] is None and s["n_with_reference"] == 0
    with pytest.raises(ValueError, match="2 replies but 1 references"):
        score_replies([FULL_7, FULL_7], ["7"])


def test_evaluate_policy_on_random_model_is_in_range_and_deterministic(tok):
    policy, ref_policy = tiny_model(tok), tiny_model(tok, seed=1)
    kwargs = dict(ref_policy=ref_policy)
    m = evaluate_policy(policy, tok, records(), EvalSettings(batch_size=2, max_new_tokens=6, temperature=1.0, seed=3), **kwargs)
    assert EXPECTED_KEYS <= set(m)
    assert m["n"] == 5 and m["n_with_reference"] == 4
    for key in ("format_rate", "accuracy", "eos_rate"):
        assert 0.0 <= m[key] <= 1.0
    assert 1.0 <= m["mean_response_len"] <= 6.0
    assert m["rm_score_mean"] is None
    assert math.isfinite(m["kl_ref"])
    # Same seed -> same samples; the caller's RNG is left untouched.
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    again = evaluate_policy(policy, tok, records(), EvalSettings(batch_size=2, max_new_tokens=6, temperature=1.0, seed=3),
                            **kwargs)
    assert again == m
    assert torch.equal(torch.rand(1), before)


def test_evaluation_never_reseeds_the_gpus_sampling_stream(tok, monkeypatch):
    """On CUDA, torch.manual_seed also reseeds every GPU's generator: an evaluation that used it would
    send rank 0's training samples back to step 0's stream after every evaluation. Recorded here with
    stand-ins for torch.cuda's seeding calls; the sampled replies are the same as before."""
    policy = tiny_model(tok)
    settings = EvalSettings(batch_size=2, max_new_tokens=6, temperature=1.0, seed=3)
    before = evaluate_policy(policy, tok, records(), settings, return_rows=True)
    calls = []
    for name in ("manual_seed", "manual_seed_all", "set_rng_state", "set_rng_state_all"):
        monkeypatch.setattr(torch.cuda, name, lambda *a, name=name, **k: calls.append(name))
    torch.manual_seed(5)
    stream = torch.rand(3)
    torch.manual_seed(5)
    calls.clear()
    after = evaluate_policy(policy, tok, records(), settings, return_rows=True)
    assert calls == []  # no GPU generator touched
    assert [r["reply"] for r in after["rows"]] == [r["reply"] for r in before["rows"]]
    assert torch.equal(torch.rand(3), stream)  # the caller's CPU stream neither advanced nor reseeded


def test_kl_to_itself_is_zero_and_kl_is_trainings_logprob_difference(tok, monkeypatch):
    policy, ref_policy = tiny_model(tok), tiny_model(tok, seed=1)
    settings = EvalSettings(batch_size=3, max_new_tokens=4, temperature=1.0)
    m = evaluate_policy(policy, tok, records(3), settings, ref_policy=policy)
    assert m["kl_ref"] == pytest.approx(0.0, abs=1e-6)
    # kl_ref is the summed difference of training's log-prob forward (model/forward.py policy_forward) on the
    # sampled rollout's response tokens: recomputed here from the rollout the evaluation sampled.
    seen = []
    real = rollout.generate_rollout
    monkeypatch.setattr(ev, "generate_rollout", lambda *a, **k: seen.append(real(*a, **k)) or seen[-1])
    m = evaluate_policy(policy, tok, records(3), settings, ref_policy=ref_policy)
    (ro,) = seen
    with torch.no_grad():
        lp, _ = policy_forward(policy, ro.sequences, ro.attention_mask, ro.response_len)
        ref, _ = policy_forward(ref_policy, ro.sequences, ro.attention_mask, ro.response_len)
    assert m["kl_ref"] == pytest.approx(((lp - ref) * ro.response_mask).sum(1).mean().item(), rel=1e-6)


class FakeScorer:
    """Scores a conversation by the length of its final assistant reply; records what it saw."""

    def __init__(self):
        self.seen = []

    def score(self, conversations):
        self.seen += conversations
        return torch.tensor([float(len(c[-1]["content"])) for c in conversations])


def test_bookkeeping_with_a_scripted_sampler(tok, monkeypatch):
    """The sampler returns known tokens: replies, lengths, EOS and RM inputs are checked by hand."""
    texts = ["3+4=7\n</think>\n<answer>\n3\n</answer>", "\n</think>\n4", "\n</think>\n9"]  # right, right, wrong
    eos, pad = tok.eos_token_id, tok.pad_token_id
    bodies = [tok.encode(t, add_special_tokens=False) for t in texts]
    has_eos = [True, True, False]

    def fake_sample(model, input_ids, attention_mask, **kw):
        B, P = input_ids.shape
        rows = [b + [eos] if e else b for b, e in zip(bodies[:B], has_eos[:B])]
        R = max(len(r) for r in rows) + 2  # trailing pads after EOS, as generate() leaves them
        resp = torch.full((B, R), pad, dtype=torch.long)
        mask = torch.zeros((B, R), dtype=torch.long)
        for i, r in enumerate(rows):
            resp[i, : len(r)] = torch.tensor(r)
            mask[i, : len(r)] = 1
        return Samples(sequences=torch.cat([input_ids, resp], 1), response_mask=mask, has_eos=torch.tensor(has_eos[:B]))

    monkeypatch.setattr(rollout, "sample", fake_sample)  # the one sampler evaluation goes through
    scorer = FakeScorer()
    m = evaluate_policy(tiny_model(tok), tok, records(3, last_has_reference=True), EvalSettings(batch_size=8),
                        rm_scorer=scorer, return_rows=True)
    replies = ["<think>\n" + t for t in texts]
    assert [r["reply"] for r in m["rows"]] == replies
    assert m["format_rate"] == pytest.approx(1 / 3)
    assert m["accuracy"] == pytest.approx(2 / 3)  # references are "3", "4", "5"
    assert m["accuracy_formatted"] == 1.0 and m["accuracy_unformatted"] == 0.5
    lengths = [len(b) + e for b, e in zip(bodies, has_eos)]
    assert m["mean_response_len"] == pytest.approx(sum(lengths) / 3)
    assert m["eos_rate"] == pytest.approx(2 / 3)
    assert m["rm_score_mean"] == pytest.approx(sum(len(r) for r in replies) / 3)
    assert scorer.seen[1] == [{"role": "user", "content": "What is 1 + 3?"}, {"role": "assistant", "content": replies[1]}]


def test_bad_arguments_fail_clearly(tok):
    with pytest.raises(ValueError, match="no records"):
        evaluate_policy(tiny_model(tok), tok, [])
    with pytest.raises(ValueError, match="temperature"):
        EvalSettings(temperature=-1.0)
    with pytest.raises(ValueError, match="batch_size"):
        EvalSettings(batch_size=0)


def test_instruction_following_and_diversity_figures_by_hand():
    from trainer.evaluate import score_instructions, text_diversity

    replies = ["one two", "One, two three", "anything"]
    cons = [[{"type": "lowercase"}, {"type": "no_comma"}], [{"type": "no_comma"}], None]
    got = score_instructions(replies, cons)
    assert got == {"ifeval_pass_rate": 0.5, "ifeval_constraint_rate": 2 / 3,
                   "ifeval_by_type": {"lowercase": 1.0, "no_comma": 0.5}}
    assert score_instructions(replies, [None] * 3) == {"ifeval_pass_rate": None, "ifeval_constraint_rate": None,
                                                       "ifeval_by_type": None}
    # bigrams: (a b), (b a), (a b) | (a b): 2 distinct of 4
    assert text_diversity(["a b a b", "a b"]) == {"mean_words": 3.0, "distinct_2": 0.5}
