"""The frozen external reward model of the "rm" reward component (trainer/rewards.py compute_rewards), and the
padding builders/train_reward_model.py shares with it so training and PPO see the same tokens."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

__all__ = ["pad_ids", "conversation_ids", "RewardModelScorer"]


def pad_ids(rows: list[list[int]], pad_id: int, left: bool = False) -> tuple[Tensor, Tensor]:
    """input_ids [N, T] and attention_mask [N, T] for token-id rows of any lengths, padded on one side."""
    width = max(len(r) for r in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        span = slice(width - len(r), width) if left else slice(0, len(r))
        input_ids[i, span] = torch.tensor(r, dtype=torch.long)
        attention_mask[i, span] = 1
    return input_ids, attention_mask


def _render(tokenizer: Any, conversation: list[dict]) -> tuple[str, bool]:
    """Text for one conversation and whether the tokenizer should add special tokens."""
    if getattr(tokenizer, "chat_template", None):
        # The template already writes BOS/role markers; adding special tokens would double BOS.
        return tokenizer.apply_chat_template(conversation, tokenize=False), False
    return "\n".join(f"{m['role']}: {m['content']}" for m in conversation), True


def conversation_ids(tokenizer: Any, conversations: list[list[dict]], max_length: int) -> list[list[int]]:
    """The token IDs a sequence-classification reward model scores, one row per conversation: its chat template
    (or "role: content" lines without one), at most the last `max_length` tokens. The in-process scorer and the
    served one (trainer/reward_server.py RemoteRewardModel) both score these rows, so they see the same tokens."""
    rendered = [_render(tokenizer, conv) for conv in conversations]
    add_special = rendered[0][1]  # the same for every conversation: it depends on the template only
    ids = tokenizer([text for text, _ in rendered], add_special_tokens=add_special, verbose=False)["input_ids"]
    # Keep the END: the classifier reads the last token, and the reply is at the end.
    return [list(row)[-max_length:] for row in ids]


class RewardModelScorer:
    """A frozen external reward model, in one of two forms:

    - a sequence-classification model (e.g. `AutoModelForSequenceClassification`, num_labels=1)
      with its own tokenizer, which may differ from the policy's;
    - a remote-code model exposing `get_score(tokenizer, messages) -> float` (InternLM2-Reward).

    Scores are clipped to [-clip, clip].
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        max_length: int = 512,
        batch_size: int = 16,
        clip: float = 3.0,
    ) -> None:
        if max_length < 1 or batch_size < 1:
            raise ValueError(
                f"RewardModelScorer: max_length ({max_length}) and batch_size ({batch_size}) must be >= 1"
            )
        self.model = model
        self.tokenizer = tokenizer
        self.max_length = int(max_length)
        self.batch_size = int(batch_size)
        self.clip = float(clip)
        self.uses_get_score = callable(getattr(model, "get_score", None))
        if hasattr(model, "eval"):
            model.eval()
        if hasattr(model, "requires_grad_"):
            model.requires_grad_(False)
        if not self.uses_get_score:
            self._prepare_padding()

    def _prepare_padding(self) -> None:
        tok = self.tokenizer
        if tok.pad_token is None:
            if tok.eos_token is None:
                raise ValueError(
                    "reward model tokenizer has neither a pad nor an eos token: give it a pad_token "
                    "(--reward_model_path tokenizer_config.json)"
                )
            tok.pad_token = tok.eos_token
        config = self.model.config
        text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
        # HF *ForSequenceClassification reads the score at the last token != config.pad_token_id;
        # without it a padded batch would read it at a pad and batch scores would differ.
        if getattr(text_config, "pad_token_id", None) is None:
            text_config.pad_token_id = tok.pad_token_id
        self.pad_id = int(text_config.pad_token_id)

    def _tokenize(self, conversations: list[list[dict]]) -> list[list[int]]:
        return conversation_ids(self.tokenizer, conversations, self.max_length)

    @torch.no_grad()
    def score(self, conversations: list[list[dict]]) -> Tensor:
        """One clipped fp32 score per conversation (messages ending with the assistant reply)."""
        if not conversations:
            return torch.zeros(0, dtype=torch.float32)
        if self.uses_get_score:
            raw = [float(self.model.get_score(self.tokenizer, conv)) for conv in conversations]
            scores = torch.tensor(raw, dtype=torch.float32)
        else:
            device = next(self.model.parameters()).device
            rows = self._tokenize(conversations)
            # Batch by length so batches carry little padding; scores return in input order.
            order = sorted(range(len(rows)), key=lambda i: len(rows[i]))
            left = getattr(self.tokenizer, "padding_side", "right") == "left"
            scores = torch.empty(len(rows), dtype=torch.float32)
            for start in range(0, len(order), self.batch_size):
                idx = order[start:start + self.batch_size]
                ids, attn = pad_ids([rows[i] for i in idx], self.pad_id, left=left)
                out = self.model(input_ids=ids.to(device), attention_mask=attn.to(device))
                scores[idx] = out.logits[:, 0].float().cpu()
        return scores.clamp(-self.clip, self.clip)
