"""Tiny local Hugging Face models of other families (Llama, Qwen2) with their OWN tokenizer.

Nothing is downloaded: the tokenizer is a byte-level BPE trained here on the demo prompts, with a
vocabulary unlike the project's (different size, different special tokens and ids) and a plain
chat template without any think support.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from tests.helpers import byte_level_bpe

ROOT = Path(__file__).resolve().parents[1]

# "role: content</s>" per turn; the generation prompt ends with "assistant:" (no think prefix).
TINY_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def tiny_bpe_tokenizer(vocab_size: int = 400, with_pad: bool = False) -> PreTrainedTokenizerFast:
    """A byte-level BPE trained on 300 demo prompts; <s>=0 bos, </s>=1 eos, optional <pad>=2."""
    lines = []
    for line in (ROOT / "dataset" / "demo_train.jsonl").read_text(encoding="utf-8").splitlines()[:300]:
        lines += [m["content"] for m in json.loads(line)["conversations"]]
    specials = ["<s>", "</s>"] + (["<pad>"] if with_pad else [])
    tk = byte_level_bpe(lines, vocab_size, specials)
    extra = {"pad_token": "<pad>"} if with_pad else {}
    return PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>",
                                   chat_template=TINY_CHAT_TEMPLATE, **extra)


def save_tiny_causal_lm(out_dir: Path, family: str = "llama", seed: int = 0, hidden: int = 32,
                        layers: int = 2) -> tuple[torch.nn.Module, PreTrainedTokenizerFast]:
    """Save a random tiny `LlamaForCausalLM` (tokenizer without pad) or `Qwen2ForCausalLM`
    (tokenizer with a pad token, an EOS *list* and hub-style sampling defaults in its
    generation_config) plus its tokenizer to `out_dir` with save_pretrained."""
    tok = tiny_bpe_tokenizer(with_pad=family == "qwen2")
    torch.manual_seed(seed)
    common = dict(vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, bos_token_id=tok.bos_token_id,
                  eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, max_position_embeddings=512)
    if family == "llama":
        model = LlamaForCausalLM(LlamaConfig(tie_word_embeddings=False, **common))
    elif family == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(tie_word_embeddings=True, **common))
        # Like Qwen's hub folders: several stop ids and sampling suggestions the trainer must not adopt.
        model.generation_config.eos_token_id = [tok.eos_token_id, tok.bos_token_id]
        model.generation_config.do_sample = True
        model.generation_config.top_k = 20
        model.generation_config.repetition_penalty = 1.3
    else:
        raise ValueError(f"unknown family {family!r}")
    model.eval()
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    return model, tok
