"""torch.compile (inductor) on the rollout's decode step, against the eager one, in one process.

    python benchmarks/bench_compile.py --size 512x8 --dtype bfloat16 --variant default
    python benchmarks/bench_compile.py --size 128x4 --dtype float32 --variant freeze_cpp --cache_dir /tmp/inductor

What runs. A random-init MiniMind model of --size (seeded) prefills --batch_size prompts of
--prompt_len random tokens with transformers' forward and a preallocated KV cache, as
`model.generation.sample` does; then --gen_len - 1 greedy decode steps run three ways, their
rollouts taken in turn (A B C A B C ...) so all see the same load on a shared machine:
  fast      model/fast_decode.FastDecoder.step: the trainer's eager decode step (growing cache views;
            under bf16 oneDNN-prepacked weights and packed GQA heads)
  static    the same math over static shapes: K/V buffers of the full length, the new token written
            at a tensor index (index_copy_), attention over the whole buffer with the padding mask
            (positions not written yet masked): one graph for every step
  compiled  `static` under torch.compile with --variant's inductor options:
            default       torch.compile(fullgraph=True)
            freeze_cpp    + inductor freezing (weights as constants, oneDNN weight prepacking) and the
                          C++ wrapper
            max_autotune  mode="max-autotune-no-cudagraphs" (CPU GEMM templates autotuned)
Reported: compile time (the first compiled call, which compiles; with TORCHINDUCTOR_CACHE_DIR set
by --cache_dir a second process reuses inductor's on-disk FX graph cache), median seconds per
rollout of each path after --warmup rollouts, and the largest logit gap of compiled vs fast on the
first rollout (same inputs, greedy tokens from the fast path fed to both).
One variant per process: dynamo caches compiled code per function, so variants must not share one.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="512x8", help="HIDDENxLAYERS")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--variant", default="default", choices=["default", "freeze_cpp", "max_autotune"])
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--prompt_len", type=int, default=64)
    p.add_argument("--gen_len", type=int, default=64)
    p.add_argument("--rollouts", type=int, default=5, help="timed rollouts per path")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--num_threads", type=int, default=0)
    p.add_argument("--cache_dir", default="", help="TORCHINDUCTOR_CACHE_DIR (reuse across processes)")
    p.add_argument("--json", default="")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    o = parse_args(argv)
    if o.cache_dir:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = o.cache_dir
    import torch
    import torch.nn.functional as F

    from model.fast_decode import FastDecoder, _rms, decode_attention, fast_decoder
    from model.generation import preallocated_cache
    from model.loader import build_minimind

    if o.num_threads:
        torch.set_num_threads(o.num_threads)
    H, L = (int(x) for x in o.size.lower().split("x"))
    torch.manual_seed(0)
    model = build_minimind(H, L).eval()
    model.config.use_cache = True
    B, P, R = o.batch_size, o.prompt_len, o.gen_len
    cap = P + R
    dtype = getattr(torch, o.dtype)
    amp = (lambda: torch.autocast("cpu", dtype=dtype)) if dtype != torch.float32 else (lambda: torch.autocast("cpu", enabled=False))
    ids = torch.randint(3, model.config.vocab_size, (B, P), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(B, P, dtype=torch.long)
    with amp():
        fast = fast_decoder(model, "cpu")
    assert fast is not None
    # The static/compiled paths take plain weights (inductor's freezing prepacks them itself).
    plain = FastDecoder(model, dtype if dtype != torch.float32 else None, "cpu", prepack=False)
    trunk = model.model

    def prefill():
        cache = preallocated_cache(model, cap)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        out = model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True, logits_to_keep=1)
        return cache, out.logits[:, -1].float()

    def static_step(tokens, position, kv_mask, index, ks, vs):
        """FastDecoder.step over full-length K/V buffers: the same ops, static shapes."""
        nq, nk, hd = plain.n_heads * plain.head_dim, plain.n_kv * plain.head_dim, plain.head_dim
        h = trunk.embed_tokens(tokens[:, None])
        cos, sin = trunk.rotary_emb(h, position)
        m4 = kv_mask[:, None, None, :]
        for i, (w, layer) in enumerate(zip(plain.weights, trunk.layers)):
            a = layer.self_attn
            qkv = F.linear(_rms(h, layer.input_layernorm), w["qkv"])
            q = qkv[..., :nq].view(B, 1, plain.n_heads, hd)
            k = qkv[..., nq : nq + nk].view(B, 1, plain.n_kv, hd)
            v = qkv[..., nq + nk :].view(B, 1, plain.n_kv, hd).transpose(1, 2)
            if hasattr(a, "q_norm"):
                q, k = _rms(q, a.q_norm), _rms(k, a.k_norm)
            q, k = plain.apply_rotary(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
            ks[i].index_copy_(2, index, k.to(ks[i].dtype))
            vs[i].index_copy_(2, index, v.to(vs[i].dtype))
            o_ = decode_attention(q, ks[i], vs[i], m4, a.scaling, plain.pack_gqa)
            h = h + F.linear(o_.transpose(1, 2).reshape(B, 1, nq), w["o"])
            gate, up = F.linear(_rms(h, layer.post_attention_layernorm), w["gate_up"]).chunk(2, dim=-1)
            h = h + F.linear(F.silu(gate) * up, w["down"])
        return F.linear(_rms(h, trunk.norm), plain.head)[:, -1]

    def run_fast() -> tuple[float, list]:
        with torch.no_grad(), amp():
            cache, last = prefill()
            t = time.perf_counter()
            kv_mask = torch.ones(B, cap, dtype=torch.bool)
            position = torch.full((B, 1), P - 1)
            toks, logits = [], [last]
            for s in range(R - 1):
                nxt = last.argmax(-1)
                toks.append(nxt)
                position = position + 1
                last = fast.step(nxt, position, kv_mask[:, : P + s + 1], cache).float()
                logits.append(last)
            return time.perf_counter() - t, toks, logits

    first_call_s = [0.0]  # the latest rollout's first step call (the compiling one, the first time)

    def run_static(step_fn, toks=None) -> tuple[float, list]:
        with torch.no_grad(), amp():
            cache, last = prefill()
            ks = [l._k.new_zeros(B, l._k.shape[1], cap, l._k.shape[-1]) for l in cache.layers]
            vs = [l._v.new_zeros(B, l._v.shape[1], cap, l._v.shape[-1]) for l in cache.layers]
            for i, l in enumerate(cache.layers):
                ks[i][:, :, :P].copy_(l._k[:, :, :P])
                vs[i][:, :, :P].copy_(l._v[:, :, :P])
            t = time.perf_counter()
            kv_mask = torch.zeros(B, cap, dtype=torch.bool)
            kv_mask[:, :P] = True
            position = torch.full((B, 1), P - 1)
            logits = [last]
            for s in range(R - 1):
                nxt = toks[s] if toks is not None else last.argmax(-1)
                position = position + 1
                kv_mask[:, P + s] = True
                t1 = time.perf_counter()
                last = step_fn(nxt, position, kv_mask, torch.tensor([P + s]), ks, vs).float()
                if s == 0:
                    first_call_s[0] = time.perf_counter() - t1
                logits.append(last)
            return time.perf_counter() - t, logits

    import torch._inductor.config as icfg

    options = {"default": ({}, {}), "freeze_cpp": ({}, {"freezing": True, "cpp_wrapper": True}),
               "max_autotune": ({"mode": "max-autotune-no-cudagraphs"}, {})}[o.variant]
    compiled = torch.compile(static_step, fullgraph=True, **options[0])
    t0 = time.perf_counter()
    with icfg.patch(options[1]):
        _, toks, ref_logits = run_fast()
        _, comp_logits = run_static(compiled, toks)  # compiles on its first step
    compile_s = time.perf_counter() - t0
    first_step_s = first_call_s[0]
    print(f"compiled: first fast + compiled rollouts took {compile_s:.1f} s (load {os.getloadavg()[0]:.1f})", flush=True)
    gap = max((a - b).abs().max().item() for a, b in zip(ref_logits, comp_logits))
    _, static_logits = run_static(static_step, toks)
    gap_static = max((a - b).abs().max().item() for a, b in zip(ref_logits, static_logits))
    times = {"fast": [], "static": [], "compiled": []}
    with icfg.patch(options[1]):
        for r in range(o.warmup + o.rollouts):
            for name in times:
                t = run_fast()[0] if name == "fast" else run_static(compiled if name == "compiled" else static_step)[0]
                if r >= o.warmup:
                    times[name].append(t)
    med = {k: statistics.median(v) for k, v in times.items()}
    res = {"size": o.size, "dtype": o.dtype, "variant": o.variant, "threads": torch.get_num_threads(),
           "cache_dir": o.cache_dir, "compile_plus_first_rollouts_s": compile_s, "first_compiled_call_s": first_step_s,
           "median_rollout_s": med,
           "all_s": times, "max_logit_gap_compiled": gap, "max_logit_gap_static": gap_static,
           "loadavg": os.getloadavg()}
    print(f"{o.size} {o.dtype} {o.variant} (threads {res['threads']}, cache {'on: ' + o.cache_dir if o.cache_dir else 'default'}): "
          f"first compiled call (compiles) {first_step_s:.1f} s, compile + 2 rollouts {compile_s:.1f} s; "
          f"per rollout of {R} tokens: fast {med['fast']:.3f} s, static eager "
          f"{med['static']:.3f} s, compiled {med['compiled']:.3f} s; max logit gap vs fast: compiled {gap:.2e}, "
          f"static {gap_static:.2e}; load {res['loadavg'][0]:.1f}", flush=True)
    if o.json:
        Path(o.json).write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
