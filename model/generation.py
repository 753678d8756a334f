"""Batched sampling from left-padded prompts, on transformers' `generate` (KV cache included).

Position ids follow the attention mask (pads do not count), so a prompt gives the same tokens
alone and inside a left-padded batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers import GenerationConfig


@dataclass
class Samples:
    sequences: torch.Tensor  # [B, P+R] prompt (left-padded) + response (right-padded with pad_id)
    response_mask: torch.Tensor  # [B, R] 1 on real response tokens, up to and including EOS
    has_eos: torch.Tensor  # [B] bool: the row stopped by itself (else it was cut at max_new_tokens)


def response_mask_from_tokens(responses: torch.Tensor, eos_token_id: int | list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Mask = 1 up to and including the first EOS of each row; rows without EOS are all ones."""
    eos_ids = torch.tensor(eos_token_id if isinstance(eos_token_id, list) else [eos_token_id], device=responses.device)
    is_eos = torch.isin(responses, eos_ids)  # [B, R]
    has_eos = is_eos.any(dim=1)
    # Count EOS seen strictly before each position: tokens after the first EOS have count >= 1.
    eos_before = torch.cumsum(is_eos.int(), dim=1) - is_eos.int()
    return (eos_before == 0).long(), has_eos


@torch.no_grad()
def sample(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    max_new_tokens: int,
    eos_token_id: int | list[int],
    pad_token_id: int,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    greedy: bool = False,
    suppress_eos: bool = False,
) -> Samples:
    """Sample responses for a left-padded batch [B, P]; per-row stop at EOS, pads after it."""
    model = getattr(model, "module", model)  # generate on the unwrapped module (DDP has no generate)
    config = GenerationConfig(
        max_new_tokens=max_new_tokens,
        do_sample=not greedy,
        # Explicit neutral values: None would be filled from model.generation_config and then
        # transformers' global defaults (top_k=50), silently truncating the sampling distribution.
        temperature=temperature if not greedy else 1.0,
        top_k=top_k if not greedy else 0,
        top_p=top_p if not greedy else 1.0,
        min_p=0.0, typical_p=1.0, repetition_penalty=1.0, no_repeat_ngram_size=0,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        use_cache=True,
        # A benchmark needs fixed lengths: EOS is masked at every step (min_new_tokens masks all the
        # EOS ids generate knows, including extra ones from the model's generation_config).
        min_new_tokens=max_new_tokens if suppress_eos else 0,
    )
    was_training = model.training
    model.eval()
    try:
        sequences = model.generate(input_ids=input_ids, attention_mask=attention_mask, generation_config=config)
    finally:
        model.train(was_training)
    P = input_ids.shape[1]
    responses = sequences[:, P:]  # [B, R]; R <= max_new_tokens (generation stops when all rows hit EOS)
    if responses.shape[1] == 0:
        raise RuntimeError("generation returned no tokens (max_new_tokens must be >= 1)")
    response_mask, has_eos = response_mask_from_tokens(responses, eos_token_id)
    if suppress_eos:
        has_eos = torch.zeros_like(has_eos)
    # generate() already pads finished rows with pad_token_id; make it explicit for safety.
    sequences[:, P:] = torch.where(response_mask.bool(), responses, torch.full_like(responses, pad_token_id))
    return Samples(sequences=sequences, response_mask=response_mask, has_eos=has_eos)
