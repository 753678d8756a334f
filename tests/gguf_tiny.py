"""A tiny Llama as a GGUF file (random fp32 weights, a byte-level BPE tokenizer with ChatML specials and a chat
template), the stand-in for SmolLM2-135M-Instruct's GGUF in tests: same architecture, same metadata keys."""

from __future__ import annotations

from pathlib import Path

import numpy as np

CHAT_TEMPLATE = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
                 "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def _byte_alphabet() -> list[str]:
    """GPT-2's byte-to-unicode table: every byte as one printable character."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for c in cs]


def write_tiny_llama_gguf(path: Path, arch: str = "llama", seed: int = 0) -> Path:
    import gguf

    rng = np.random.default_rng(seed)
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *_byte_alphabet(), "Ġt", "he"]
    types = [gguf.TokenType.CONTROL] * 3 + [gguf.TokenType.NORMAL] * (len(tokens) - 3)
    vocab, hidden, ff, heads, kv, layers = len(tokens), 16, 32, 2, 1, 2
    head_dim = hidden // heads
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(layers)
    w.add_context_length(64)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ff)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    w.add_rope_dimension_count(head_dim)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(["Ġ t", "h e"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_pad_token_id(2)
    w.add_chat_template(CHAT_TEMPLATE)

    def f32(*shape):
        return (rng.standard_normal(shape) * 0.1).astype(np.float32)

    w.add_tensor("token_embd.weight", f32(vocab, hidden))
    for i in range(layers):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(hidden, dtype=np.float32))
        w.add_tensor(f"blk.{i}.attn_q.weight", f32(hidden, hidden))
        w.add_tensor(f"blk.{i}.attn_k.weight", f32(kv * head_dim, hidden))
        w.add_tensor(f"blk.{i}.attn_v.weight", f32(kv * head_dim, hidden))
        w.add_tensor(f"blk.{i}.attn_output.weight", f32(hidden, hidden))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(hidden, dtype=np.float32))
        w.add_tensor(f"blk.{i}.ffn_gate.weight", f32(ff, hidden))
        w.add_tensor(f"blk.{i}.ffn_up.weight", f32(ff, hidden))
        w.add_tensor(f"blk.{i}.ffn_down.weight", f32(hidden, ff))
    w.add_tensor("output_norm.weight", np.ones(hidden, dtype=np.float32))
    w.add_tensor("output.weight", f32(vocab, hidden))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
