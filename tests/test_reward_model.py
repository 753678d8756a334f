"""trainer/reward_model.py: the frozen reward model scorer on a tiny local classifier and a get_score fake."""

import pytest
import torch

from trainer.reward_model import RewardModelScorer, pad_ids

ZH = "<think>\n3加4等于7\n</think>\n<answer>\n7\n</answer>"


def _tiny_tokenizer(padding_side="right", chat_template=None):
    from transformers import PreTrainedTokenizerFast

    from tests.helpers import byte_level_bpe

    tok = byte_level_bpe(["user assistant: what is 3 plus 4? 3加4等于几 <think> </think> <answer> 7"], 300,
                         ["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", padding_side=padding_side)
    if chat_template:
        fast.chat_template = chat_template
    return fast


def _tiny_rm(seed=0):
    from transformers import Qwen3Config, Qwen3ForSequenceClassification

    torch.manual_seed(seed)
    cfg = Qwen3Config(
        vocab_size=320, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, intermediate_size=64, num_labels=1,
    )
    model = Qwen3ForSequenceClassification(cfg)
    with torch.no_grad():
        model.score.weight.mul_(20.0)  # spread scores so clipping has something to do
    return model


CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
)


def _conversations():
    q = [{"role": "user", "content": "what is 3 plus 4?"}]
    q_zh = [{"role": "user", "content": "3加4等于几"}]
    return [
        q + [{"role": "assistant", "content": "7"}],
        q_zh + [{"role": "assistant", "content": ZH}],
        q + [{"role": "assistant", "content": "<think>\nthree plus four\n</think>\n<answer>\n7\n</answer>"}],
        q_zh + [{"role": "assistant", "content": "八"}],
        [{"role": "system", "content": "be brief"}] + q + [{"role": "assistant", "content": "seven"}],
    ]


@pytest.mark.parametrize("padding_side", ["right", "left"])
@pytest.mark.parametrize("template", [None, CHATML])
def test_rm_batch_scores_equal_one_by_one(padding_side, template):
    model = _tiny_rm()
    tok = _tiny_tokenizer(padding_side, template)
    assert model.config.pad_token_id is None and tok.pad_token is None
    convs = _conversations()
    batched = RewardModelScorer(model, tok, max_length=512, batch_size=4, clip=100.0).score(convs)
    # the scorer filled the missing pad token / config pad id
    assert tok.pad_token == "<|im_end|>" and model.config.pad_token_id == tok.pad_token_id
    single = RewardModelScorer(model, tok, max_length=512, batch_size=1, clip=100.0).score(convs)
    assert batched.shape == (5,) and batched.dtype == torch.float32
    torch.testing.assert_close(batched, single, atol=1e-5, rtol=1e-5)
    assert batched.std() > 1e-3  # different conversations score differently


def test_pad_ids_right_and_left():
    ids, mask = pad_ids([[5, 6, 7], [8]], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [8, 0, 0]] and mask.tolist() == [[1, 1, 1], [1, 0, 0]]
    ids, mask = pad_ids([[5, 6, 7], [8]], pad_id=0, left=True)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]] and mask.tolist() == [[1, 1, 1], [0, 0, 1]]


def test_rm_scores_come_back_in_input_order_when_batched_by_length():
    model = _tiny_rm()
    tok = _tiny_tokenizer("right", CHATML)
    convs = _conversations()
    convs = convs + convs[::-1]  # lengths out of order, and duplicates that must score the same
    scores = RewardModelScorer(model, tok, max_length=512, batch_size=3, clip=100.0).score(convs)
    single = torch.stack([RewardModelScorer(model, tok, max_length=512, batch_size=1, clip=100.0).score([c])[0]
                          for c in convs])
    torch.testing.assert_close(scores, single, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(scores[:5], scores[5:].flip(0), atol=1e-5, rtol=1e-5)


def test_rm_scores_match_a_direct_forward_and_truncation_keeps_the_end():
    model = _tiny_rm()
    tok = _tiny_tokenizer("right", CHATML)
    conv = _conversations()[1]
    ids = tok(tok.apply_chat_template(conv, tokenize=False), add_special_tokens=False)["input_ids"]
    assert len(ids) > 8
    scorer = RewardModelScorer(model, tok, max_length=8, clip=100.0)
    with torch.no_grad():
        full = model(input_ids=torch.tensor([ids])).logits[0, 0]
        tail = model(input_ids=torch.tensor([ids[-8:]])).logits[0, 0]
    torch.testing.assert_close(scorer.score([conv])[0], tail)
    scorer_long = RewardModelScorer(model, tok, max_length=512, clip=100.0)
    torch.testing.assert_close(scorer_long.score([conv])[0], full)


def test_rm_clipping():
    model = _tiny_rm()
    tok = _tiny_tokenizer()
    convs = _conversations()
    raw = RewardModelScorer(model, tok, clip=100.0).score(convs)
    c = float(raw.abs().median())  # about half the scores exceed this
    clipped = RewardModelScorer(model, tok, clip=c).score(convs)
    assert (raw.abs() > c + 1e-6).any()
    torch.testing.assert_close(clipped, raw.clamp(-c, c))
    assert clipped.abs().max() <= c + 1e-6


class FakeGetScoreRM:
    """InternLM2-Reward style: get_score(tokenizer, messages) -> float."""

    def __init__(self):
        self.calls = []

    def get_score(self, tokenizer, messages):
        self.calls.append((tokenizer, messages))
        return len(messages[-1]["content"]) / 10.0


def test_rm_get_score_path():
    fake = FakeGetScoreRM()
    tok = object()
    scorer = RewardModelScorer(fake, tok, clip=3.0)
    convs = [
        [{"role": "user", "content": "q"}, {"role": "assistant", "content": "abcde"}],  # 0.5
        [{"role": "user", "content": "q"}, {"role": "assistant", "content": "x" * 50}],  # 5.0 -> 3.0
    ]
    scores = scorer.score(convs)
    torch.testing.assert_close(scores, torch.tensor([0.5, 3.0]))
    assert [m for _, m in fake.calls] == convs and all(t is tok for t, _ in fake.calls)
