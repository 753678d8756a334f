"""Chat with a policy: native MiniMind `.pth` or a local Hugging Face directory.

    python scripts/chat.py --weights out/ppo_actor_128.pth --hidden_size 128 --num_hidden_layers 4
    python scripts/chat.py --hf_path out/ppo_actor_128_hf --temperature 0.7 --top_p 0.9
    python scripts/chat.py --hf_path out/ppo_actor_128_hf --prompt "12 + 7 = ?" --prompt "再乘以 2 呢？"

Interactive by default: a multi-turn REPL (`/clear` forgets the history, `/exit` or Ctrl-D quits).
With one or more `--prompt`, the prompts are sent as successive turns of one conversation and the
script exits. Replies stream as they are generated (the thinking part dimmed on a terminal), then
the think part and the answer part are shown separately. Only the answer goes back into the
history, as in Qwen3-style templates, so old reasoning does not fill the context.
`--temperature 0` decodes greedily.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch
from torch import nn
from transformers import GenerationConfig, PreTrainedTokenizerBase
from transformers.generation.streamers import BaseStreamer

from dataset.rlaif import detect_assistant_prefix, render_prompt
from model.loader import eos_token_ids, load_policy
from model.weights import WeightsError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DIM, RESET = "\033[2m", "\033[0m"


@dataclass
class Settings:
    temperature: float = 0.7
    top_p: float = 0.9
    top_k: int = 0
    max_new_tokens: int = 512
    repetition_penalty: float = 1.0
    open_thinking: bool = True


@dataclass
class Turn:
    user: str
    prompt_text: str  # the full rendered prompt the model saw
    reply: str  # forced assistant prefix + generated text
    think: str | None
    answer: str
    new_tokens: int
    stopped: bool  # emitted EOS (else cut at max_new_tokens)
    seconds: float


def split_reply(reply: str) -> tuple[str | None, str]:
    """(think, answer) of an assistant reply. Think is None when the reply has no <think> block;
    a block never closed (cut at the token limit) is all think and no answer."""
    text = reply.lstrip()
    if not text.startswith("<think>"):
        return None, reply.strip()
    body = text[len("<think>"):]
    if "</think>" not in body:
        return body.strip(), ""
    think, answer = body.split("</think>", 1)
    return think.strip(), answer.strip()


class ReplyStreamer(BaseStreamer):
    """Hands each newly decoded piece of the reply to `on_text` as tokens arrive; holds back a
    trailing incomplete UTF-8 character (decoded as U+FFFD) until its remaining bytes come."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, on_text: Callable[[str], None]):
        self.tokenizer, self.on_text = tokenizer, on_text
        self.ids: list[int] = []
        self.sent = 0
        self.prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:  # generate() first passes the prompt
            self.prompt_seen = True
            return
        self.ids.extend(value.reshape(-1).tolist())
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True).rstrip("\ufffd")
        if len(text) > self.sent:
            self.on_text(text[self.sent:])
            self.sent = len(text)

    def end(self) -> None:
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if len(text) > self.sent:
            self.on_text(text[self.sent:])
        self.sent = len(text)


class StyledWriter:
    """Writes a streamed reply, dimming its <think> part on a terminal."""

    def __init__(self, out, color: bool, prefix: str):
        self.out, self.color = out, color
        self.reply = ""
        self.write(prefix)

    def write(self, piece: str) -> None:
        start = len(self.reply)
        self.reply += piece
        end_think = self.reply.find("</think>")
        thinking_until = (end_think + len("</think>")) if end_think >= 0 else (
            len(self.reply) if self.reply.lstrip().startswith("<think>") else 0)
        dim_part, rest = piece[: max(0, thinking_until - start)], piece[max(0, thinking_until - start):]
        if dim_part:
            self.out.write(f"{DIM}{dim_part}{RESET}" if self.color else dim_part)
        self.out.write(rest)
        self.out.flush()


def generation_config(settings: Settings, eos_ids: list[int], pad_id: int) -> GenerationConfig:
    """Every sampling knob explicit, so a folder's generation_config.json (e.g. top_k=20) does not
    silently change what the flags ask for."""
    greedy = settings.temperature <= 0
    # Greedy: the neutral values (transformers' defaults, which it does not warn about) rather than
    # None, which generate() would fill from the folder's generation_config.
    return GenerationConfig(
        max_new_tokens=settings.max_new_tokens, do_sample=not greedy,
        temperature=1.0 if greedy else settings.temperature,
        top_k=50 if greedy else settings.top_k,  # sampling: 0 = off (no TopK warper)
        top_p=1.0 if greedy else settings.top_p,
        min_p=None if greedy else 0.0, typical_p=1.0, no_repeat_ngram_size=0,
        repetition_penalty=settings.repetition_penalty,
        eos_token_id=eos_ids, pad_token_id=pad_id, use_cache=True,
    )


@torch.no_grad()
def chat_turn(model: nn.Module, tok: PreTrainedTokenizerBase, history: list[dict], user: str, settings: Settings,
              on_text: Callable[[str], None] | None = None) -> Turn:
    """Render history + the user's message, generate one reply (streamed to `on_text`), split it."""
    messages = history + [{"role": "user", "content": user}]
    prompt_text = render_prompt(tok, messages, settings.open_thinking)
    prefix = detect_assistant_prefix(prompt_text)
    ids = tok(prompt_text, add_special_tokens=False, return_tensors="pt")["input_ids"].to(model.device)
    eos_ids = eos_token_ids(model, tok)
    streamer = ReplyStreamer(tok, on_text) if on_text else None
    t0 = time.perf_counter()
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), streamer=streamer,
                         generation_config=generation_config(settings, eos_ids, tok.pad_token_id))
    seconds = time.perf_counter() - t0
    new = out[0, ids.shape[1]:].tolist()
    stopped = any(t in eos_ids for t in new)
    if stopped:
        new = new[: next(i for i, t in enumerate(new) if t in eos_ids) + 1]
    reply = prefix + tok.decode(new, skip_special_tokens=True)
    think, answer = split_reply(reply)
    return Turn(user=user, prompt_text=prompt_text, reply=reply, think=think, answer=answer,
                new_tokens=len(new), stopped=stopped, seconds=seconds)


def show_turn(turn: Turn, out, color: bool) -> None:
    """The think and answer parts, labelled, after the streamed reply."""
    dim = (lambda s: f"{DIM}{s}{RESET}") if color else (lambda s: s)
    if turn.think is not None:
        out.write(dim(f"[think]\n{turn.think or '(empty)'}\n"))
    cut_thinking = turn.think is not None and "</think>" not in turn.reply
    empty = "(none: the reply was cut while thinking; raise --max_new_tokens)" if cut_thinking else "(empty)"
    out.write(f"[answer]\n{turn.answer or empty}\n")
    end = "EOS" if turn.stopped else f"cut at --max_new_tokens {turn.new_tokens}"
    out.write(dim(f"({turn.new_tokens} tokens, {turn.new_tokens / max(turn.seconds, 1e-9):.1f} tok/s, {end})\n"))
    out.flush()


def run_turn(model, tok, history: list[dict], user: str, settings: Settings, out, color: bool, stream: bool,
             show_prompt: bool) -> Turn:
    if show_prompt:
        out.write(f"[prompt]\n{render_prompt(tok, history + [{'role': 'user', 'content': user}], settings.open_thinking)}\n[/prompt]\n")
    writer = None
    if stream:
        out.write("assistant> ")
        # The forced prefix (e.g. "<think>\n") is part of the reply; show it before the stream.
        prefix = detect_assistant_prefix(render_prompt(tok, history + [{"role": "user", "content": user}], settings.open_thinking))
        writer = StyledWriter(out, color, prefix)
    turn = chat_turn(model, tok, history, user, settings, writer.write if writer else None)
    if stream:
        out.write("\n")
    show_turn(turn, out, color)
    return turn


# --------------------------------------------------------------------------------------- CLI
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    src = p.add_argument_group("policy (one of)")
    src.add_argument("--weights", default=None, help="native MiniMind .pth (needs the shape flags)")
    src.add_argument("--hf_path", default=None, help="local Hugging Face causal-LM directory")
    p.add_argument("--hidden_size", type=int, default=128)
    p.add_argument("--num_hidden_layers", type=int, default=4)
    p.add_argument("--use_moe", type=int, default=0, choices=(0, 1))
    p.add_argument("--arch", default="auto", choices=("auto", "qwen3", "llama"))
    p.add_argument("--tokenizer_path", default=None, help="default: model/ for --weights, the directory for --hf_path")
    p.add_argument("--trust_remote_code", type=int, default=0, choices=(0, 1))
    p.add_argument("--temperature", type=float, default=0.7, help="0 = greedy")
    p.add_argument("--top_p", type=float, default=0.9)
    p.add_argument("--top_k", type=int, default=0, help="0 = off")
    p.add_argument("--repetition_penalty", type=float, default=1.0)
    p.add_argument("--max_new_tokens", type=int, default=512)
    p.add_argument("--open_thinking", type=int, default=1, choices=(0, 1),
                   help="1: the reply starts with '<think>\\n'; 0: thinking closed (templates without think support ignore it)")
    p.add_argument("--system", default=None, help="system message for the conversation")
    p.add_argument("--prompt", action="append", default=[], help="non-interactive: one turn per --prompt, then exit")
    p.add_argument("--history", type=int, default=1, choices=(0, 1), help="0: every turn starts a new conversation")
    p.add_argument("--stream", type=int, default=1, choices=(0, 1))
    p.add_argument("--show_prompt", type=int, default=0, choices=(0, 1), help="print the rendered prompt of each turn")
    p.add_argument("--transcript", default=None, help="append each turn as a JSON line to this file")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=list(DTYPES))
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if (args.weights is None) == (args.hf_path is None):
        raise SystemExit("error: give exactly one of --weights PATH (native .pth) or --hf_path DIR")
    if args.max_new_tokens < 1 or not 0 < args.top_p <= 1 or args.top_k < 0:
        raise SystemExit("error: --max_new_tokens must be >= 1, --top_p in (0, 1], --top_k >= 0")
    try:
        model, tok = load_policy(weights=args.weights, hf_path=args.hf_path, hidden_size=args.hidden_size,
                                 num_hidden_layers=args.num_hidden_layers, use_moe=bool(args.use_moe), arch=args.arch,
                                 tokenizer_path=args.tokenizer_path, dtype=DTYPES[args.dtype], device=args.device,
                                 trust_remote_code=bool(args.trust_remote_code))
    except (WeightsError, ValueError, OSError) as e:
        raise SystemExit(f"error: {e}")
    if not getattr(tok, "chat_template", None):
        raise SystemExit("error: the tokenizer has no chat template (tokenizer_config.json / chat_template.jinja); "
                         "give --tokenizer_path with one")
    model.eval()
    torch.manual_seed(args.seed)
    settings = Settings(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                        max_new_tokens=args.max_new_tokens, repetition_penalty=args.repetition_penalty,
                        open_thinking=bool(args.open_thinking))
    out = sys.stdout
    color = out.isatty() and "NO_COLOR" not in os.environ
    base = [{"role": "system", "content": args.system}] if args.system else []
    history = list(base)

    def one(user: str) -> None:
        nonlocal history
        turn = run_turn(model, tok, history, user, settings, out, color, bool(args.stream), bool(args.show_prompt))
        if args.transcript:
            with open(args.transcript, "a", encoding="utf-8") as f:
                f.write(json.dumps(turn.__dict__, ensure_ascii=False) + "\n")
        history = history + [{"role": "user", "content": user}, {"role": "assistant", "content": turn.answer}] \
            if args.history else list(base)

    if args.prompt:
        for user in args.prompt:
            out.write(f"user> {user}\n")
            one(user)
        return
    src = args.weights or args.hf_path
    out.write(f"chatting with {src} ({sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params); "
              "/clear resets the history, /exit quits\n")
    while True:
        try:
            user = input("user> ").strip()
        except (EOFError, KeyboardInterrupt):
            out.write("\n")
            return
        if not user:
            continue
        if user in ("/exit", "/quit"):
            return
        if user == "/clear":
            history = list(base)
            out.write("(history cleared)\n")
            continue
        try:
            one(user)
        except KeyboardInterrupt:
            out.write("\n(interrupted)\n")


if __name__ == "__main__":
    main()
