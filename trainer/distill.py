"""On-policy distillation: the student (the actor) samples, a frozen teacher scores every sampled token, and the
per-token reverse KL to the teacher enters the reward (--distill_coef, --teacher_model_path / --teacher_url).

The objective is GKD's with lambda = 1 (every sequence is the student's own) and beta = 1 (the reverse KL,
KL(pi || p_teacher)): Agarwal et al. 2024, "On-Policy Distillation of Language Models", eq. (4) and Algorithm 1;
TRL's GKDTrainer / DistillationTrainer compute it over the full vocabulary at each sampled position. Here the sampled
token's k1 estimate of it, log pi(y_t) - log p_teacher(y_t), is a per-token reward penalty (Thinking Machines,
"On-Policy Distillation", 2025: advantage = -reverse KL per token), so it mixes with the hybrid reward and works under
every estimator and policy loss: GAE and the critic-free estimators see it as they see the KL-in-reward penalty
(trainer/ppo.py distill_penalty). With --gamma 0 and a critic-free estimator that neither baselines nor whitens it
(dr_grpo with every reward weight 0), a token's advantage is exactly -distill_coef x k1, and the expected policy
gradient is then the gradient of GKD's per-position reverse KL: tests/test_distill.py checks both against TRL's loss.

Why no second form as a loss term: the loss form needs the teacher's whole distribution at every position, which a
vLLM server does not return (its prompt log-probs are per token), and its gradient is what the reward form's is in
expectation; one form keeps one code path for the local and the served teacher.

The teacher is held like the reference: frozen, in eval mode, on --ref_device, sharded under --strategy fsdp2 with
--shard_frozen 1 (trainer/run/setup.py), its log-probs taken by the same forward as the reference's, at the sampling
temperature. A served teacher (--teacher_url) is asked for the prompt log-probs of prompt + response (vLLM's
/v1/completions with prompt_logprobs 0), which vLLM computes from the raw logits (temperature 1: vLLM's
vllm/v1/worker/gpu/sample/prompt_logprob.py calls logits_fn, no temperature), so it needs --temperature 1.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from model.forward import forward_in_row_chunks, policy_forward
from model.loader import load_policy
from model.weights import WeightsError, read_state_dict
from trainer import dist as D
from trainer import http_client as H
from trainer.ppo import distill_penalty, kl_penalty, masked_mean
from trainer.rollout import Rollout
from trainer.runtime import Models, Phase, Runtime, on

__all__ = ["TEACHER_KEY_ENV", "TeacherError", "TeacherServer", "load_teacher", "tokenizer_mismatch", "native_shape",
           "teacher_scored", "reward_penalty", "reverse_kl"]

TEACHER_KEY_ENV = "MINIPPO_TEACHER_API_KEY"  # the teacher server's bearer token (its --api-key); never a config field
PROBE_TEXT = "Hello! 12 + 7 = 19. The sea is blue.\n你好，世界。"  # tokenized by both sides at start
ROWS_PER_REQUEST = 64  # sequences per /v1/completions request
BYTES_PER_TOKEN = 256  # answer cap per scored token (vLLM's prompt_logprobs entry: ~80 B with its decoded token)
LOGPROB_SLACK = 1e-4  # a log-prob above this is not one (a server started with --logprobs-mode raw_logits)


class TeacherError(RuntimeError):
    """A teacher server that cannot be reached, refuses, or answers outside the contract: one line."""


# --------------------------------------------------------------------------------------- the math
def reward_penalty(cfg: Any, ro: Rollout, kl_coef: float) -> tuple[Tensor | None, float]:
    """The per-token penalty [B, R] the estimator subtracts (r_t = -coef x penalty_t) and its coefficient: the KL to the
    reference where it is in the reward (--kl_placement reward; None otherwise), plus with a teacher --distill_coef x k1
    of the reverse KL to it (trainer/ppo.py distill_penalty). Without one: exactly the KL penalty and kl_coef."""
    kl = kl_penalty(ro.old_logprobs, ro.ref_logprobs, cfg.kl_estimator) if cfg.kl_placement == "reward" else None
    return distill_penalty(kl, kl_coef, ro.old_logprobs, ro.teacher_logprobs, cfg.distill_coef)


def reverse_kl(student_logits: Tensor, teacher_logits: Tensor, temperature: float = 1.0) -> Tensor:
    """KL(pi || p_teacher) over the whole vocabulary at each position, [..., V] logits -> [...], fp32: what the k1
    reward estimates with one sample per position (GKD's beta = 1 divergence; the demo's held-out KL)."""
    s = torch.log_softmax(student_logits.float() / temperature, dim=-1)
    t = torch.log_softmax(teacher_logits.float() / temperature, dim=-1)
    return (s.exp() * (s - t)).sum(-1)


# --------------------------------------------------------------------------------------- the teacher
def native_shape(state: dict[str, Tensor], path: str) -> dict[str, Any]:
    """hidden_size, num_hidden_layers and use_moe of a native MiniMind state dict (the head counts are read by
    load_policy itself)."""
    emb = state.get("model.embed_tokens.weight")
    layers = {int(k.split(".")[2]) for k in state if k.startswith("model.layers.") and k.split(".")[2].isdigit()}
    if emb is None or not layers:
        raise WeightsError(f"--teacher_model_path {path}: not a MiniMind causal-LM weights file (no embeddings or layers)")
    return {"hidden_size": int(emb.shape[1]), "num_hidden_layers": max(layers) + 1,
            "use_moe": any(".mlp.experts." in k for k in state)}


def tokenizer_mismatch(student: Any, teacher: Any) -> str | None:
    """Why two tokenizers do not give the same token IDs for the same text (None: they do): their vocabularies
    (token -> id) and special tokens are compared."""
    a, b = student.get_vocab(), teacher.get_vocab()
    if a != b:
        diff = next((k for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)), None)
        return (f"vocabularies differ: {len(a)} tokens against {len(b)}; {diff!r} is id {a.get(diff)} for the actor, "
                f"{b.get(diff)} for the teacher")
    for name in ("eos_token", "bos_token", "unk_token"):
        if getattr(student, name, None) != getattr(teacher, name, None):
            return f"{name} differs: {getattr(student, name, None)!r} against {getattr(teacher, name, None)!r}"
    if sorted(map(str, student.all_special_tokens)) != sorted(map(str, teacher.all_special_tokens)):
        return "special tokens differ"
    return None


def load_teacher(cfg: Any, student_tok: Any, device: torch.device, dtype: torch.dtype) -> nn.Module | None:
    """--teacher_model_path as a frozen model in `dtype` on `device` (None without one): an HF directory with its own
    tokenizer, or a native .pth read with the actor's tokenizer directory (--tokenizer_path, else model/). A tokenizer
    other than the actor's is refused in one line (WeightsError)."""
    if not cfg.teacher_model_path:
        return None
    path = Path(cfg.teacher_model_path)
    if not path.exists():  # checked here, not by validate: a preset names a teacher the user builds first
        raise WeightsError(f"--teacher_model_path {path}: no such directory or .pth file (the demo's teacher: "
                           f"python builders/make_teacher.py)")
    trc = bool(cfg.trust_remote_code)
    # A native model is built with random weights first: that draw must not move the run's random stream.
    with torch.random.fork_rng(devices=[]):
        try:
            if path.is_dir():
                model, tok = load_policy(hf_path=path, trust_remote_code=trc)
            else:
                model, tok = load_policy(weights=path, tokenizer_path=cfg.tokenizer_path,
                                         **native_shape(read_state_dict(path), str(path)))
        except WeightsError as e:  # the loader names the actor's flags
            raise WeightsError(str(e).replace("--actor_path", "--teacher_model_path")) from None
        except (OSError, ValueError) as e:  # transformers' own, e.g. a folder without a model: its first line, named
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise WeightsError(f"--teacher_model_path {path}: no loadable causal LM there ({first})") from None
    why = tokenizer_mismatch(student_tok, tok)
    if why:
        actor = cfg.actor_path or cfg.tokenizer_path or "model/"
        raise WeightsError(f"--teacher_model_path {path}: its tokenizer is not the actor's ({actor}): {why}; distillation "
                           f"compares the log-probs of the same token IDs, so give a teacher with the actor's tokenizer")
    model.config.use_cache = False
    return model.to(device=device, dtype=dtype).eval().requires_grad_(False)


class TeacherServer:
    """--teacher_url: a vLLM server of the teacher. `connect(tok)` checks it at start (a model served, the same
    tokenization of a probe text, log-probs that are log-probs); `logprobs(sequences, attention_mask, R)` gives the
    teacher's log-probs [B, R] of the last R tokens of each row (0 at pads), from the prompt log-probs of the row's
    real tokens. Requests go through trainer/http_client.py (a total deadline, a size cap) with the bearer token in
    MINIPPO_TEACHER_API_KEY."""

    def __init__(self, url: str, timeout: float) -> None:
        try:  # the one place the teacher's key is read (http_client.Client): never a config field
            self.http = H.Client(url, timeout, TEACHER_KEY_ENV)
        except ValueError as e:
            raise TeacherError(str(e)) from None
        self.url, self.timeout = self.http.url, self.http.timeout
        self.model: str | None = None
        self.started = False

    def _request(self, path: str, body: Any = None, *, max_bytes: int = H.MAX_BYTES) -> Any:
        where, wait = f"--teacher_url {self.url}", self.timeout
        due = D.deadline()  # under torchrun the other ranks wait for this one, for so long only
        if due is not None and due.left() < wait:
            wait = max(due.left(), 0.001)
        try:
            return self.http.request(path, body, timeout=wait, max_bytes=max_bytes,
                                     idempotent=True)  # a teacher's log-probs depend on the request alone
        except H.Refused as e:
            raise TeacherError(f"{where} refused {path}: {e}{self.http.key_hint(e)}") from None
        except H.TimedOut:
            raise TeacherError(f"{where} did not answer {path} within {wait:.3g} s (--reward_timeout, or the other ranks' "
                               f"wait): is it overloaded or stuck?") from None
        except H.Unreachable as e:
            hint = ("restart it, then continue with --from_resume 1" if self.started else
                    "start it first (scripts/serve_engine.sh vllm TEACHER_DIR; docs/distillation.md)")
            raise TeacherError(f"{where} is not reachable ({H.one_line(str(e), 120)}); {hint}") from None
        except H.BadAnswer as e:
            raise TeacherError(f"--teacher_url: {e}") from None

    def connect(self, tok: Any) -> TeacherServer:
        models = self._request("/v1/models")
        data = models.get("data") if isinstance(models, dict) else None
        if not data:
            raise TeacherError(f"--teacher_url {self.url} serves no model (GET /v1/models is empty): is it a vLLM server?")
        self.model = str(data[0].get("id"))
        mine = list(tok(PROBE_TEXT, add_special_tokens=False)["input_ids"])
        try:
            theirs = (self._request("/tokenize", {"model": self.model, "prompt": PROBE_TEXT, "add_special_tokens": False})
                      or {}).get("tokens")
        except TeacherError as e:
            if "HTTP 404" not in str(e):
                raise
            theirs = None  # no /tokenize: the vocabulary check below is all there is
        if theirs is not None and list(theirs) != mine:
            raise TeacherError(f"--teacher_url {self.url} serves a model with another tokenizer than the actor's (a probe "
                               f"text is {len(theirs)} tokens there, {len(mine)} here): distillation compares the "
                               f"log-probs of the same token IDs; serve a teacher with the actor's tokenizer")
        self._score([mine])  # a first scoring: the answer's shape and that the values are log-probs
        self.started = True
        return self

    def _score(self, rows: list[list[int]]) -> list[list[float]]:
        """Each row's prompt log-probs of its tokens 1.. (token 0 has none)."""
        body = {"model": self.model, "prompt": rows, "max_tokens": 1, "prompt_logprobs": 0, "temperature": 1.0}
        cap = 65536 + BYTES_PER_TOKEN * sum(len(r) for r in rows)
        out = self._request("/v1/completions", body, max_bytes=cap)
        choices = out.get("choices") if isinstance(out, dict) else None
        where = f"--teacher_url {self.url}"
        if not isinstance(choices, list) or len(choices) != len(rows):
            raise TeacherError(f"{where} answered {len(choices) if isinstance(choices, list) else 'no'} choices for "
                               f"{len(rows)} sequences: is it vLLM's /v1/completions?")
        scored = []
        for row, c in zip(rows, sorted(choices, key=lambda c: c.get("index", 0) if isinstance(c, dict) else 0)):
            lps = c.get("prompt_logprobs") if isinstance(c, dict) else None
            if not isinstance(lps, list) or len(lps) != len(row):
                raise TeacherError(f"{where} answered without a prompt log-prob per token (prompt_logprobs): a vLLM "
                                   f"server answers it for /v1/completions with prompt_logprobs 0")
            values = []
            for tok_id, entry in zip(row[1:], lps[1:]):
                item = entry.get(str(tok_id)) if isinstance(entry, dict) else None
                v = item.get("logprob") if isinstance(item, dict) else None
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                    raise TeacherError(f"{where} answered {H.one_line(repr(entry), 80)} for token {tok_id}: expected "
                                       f"{{\"{tok_id}\": {{\"logprob\": a finite number}}}}")
                if v > LOGPROB_SLACK:
                    raise TeacherError(f"{where} answered a log-prob of {v:g} (> 0): it serves logits, not log-probs; "
                                       f"start it with --logprobs-mode raw_logprobs")
                values.append(float(v))
            scored.append(values)
        return scored

    @torch.no_grad()
    def logprobs(self, sequences: Tensor, attention_mask: Tensor, response_len: int) -> Tensor:
        """The teacher's log p(token) [B, R] of the last `response_len` columns: each row sent as its real tokens
        (pads dropped), each real response token read at its place in that list; pads 0."""
        B, T = sequences.shape
        seqs, real = sequences.tolist(), attention_mask.bool().tolist()
        rows = [[t for t, keep in zip(s, r) if keep] for s, r in zip(seqs, real)]
        out = torch.zeros(B, response_len, dtype=torch.float32)
        for start in range(0, B, ROWS_PER_REQUEST):
            for b, values in zip(range(start, B), self._score(rows[start:start + ROWS_PER_REQUEST])):
                place = -1  # index of the column's token in the row's list of real tokens
                for col in range(T):
                    if not real[b][col]:
                        continue
                    place += 1
                    if col >= T - response_len and place >= 1:
                        out[b, col - (T - response_len)] = values[place - 1]
        return out.to(sequences.device)


def connect_teacher(cfg: Any, tok: Any, rank: int, world_size: int) -> TeacherServer | None:
    """This rank's --teacher_url server (the ranks in contiguous blocks over comma-separated URLs), checked."""
    if not cfg.teacher_url:
        return None
    urls = [u.strip() for u in cfg.teacher_url.split(",") if u.strip()]
    return TeacherServer(urls[H.server_index(rank, world_size, len(urls))], cfg.reward_timeout).connect(tok)


# --------------------------------------------------------------------------------------- a step's scoring
@torch.no_grad()
def teacher_scored(cfg: Any, ro: Rollout, m: Models, rt: Runtime, phase: Phase) -> tuple[Rollout, dict[str, float]]:
    """The rollout with the teacher's log-probs of its tokens (unchanged without a teacher), and what to log: the
    mean k1 reverse KL to the teacher per response token (distill/reverse_kl) and per response (distill/reverse_kl_seq)."""
    if m.teacher is None:
        return ro, {}
    assert ro.old_logprobs is not None  # scored (step 3) before the teacher: the k1 below compares the two
    R = ro.response_len
    if isinstance(m.teacher, nn.Module):  # as the reference: whole weights gathered first (a collective), then rank-local
        with phase("score"), D.unsharded(m.teacher), phase("score_teacher", device=rt.ref_device, rank_local=True):
            lp, _ = forward_in_row_chunks(policy_forward, m.teacher, *on(rt.ref_device, ro.sequences, ro.attention_mask), R,
                                          cfg.sample_temperature, rows=cfg.forward_batch_size, padding_free=bool(cfg.padding_free))
    else:
        with phase("score"), phase("score_teacher", autocast=False, rank_local=True):
            try:
                lp = m.teacher.logprobs(ro.sequences, ro.attention_mask, R)
            except TeacherError as e:  # one line, every rank together (the rank-local block)
                raise SystemExit(f"error: {e}") from None
    lp = lp.float().to(rt.device)
    k1 = torch.where(ro.response_mask.bool(), ro.old_logprobs.float() - lp, 0.0)
    stats = {"distill/reverse_kl": masked_mean(k1, ro.response_mask).item(), "distill/reverse_kl_seq": k1.sum(1).mean().item()}
    return dataclasses.replace(ro, teacher_logprobs=lp), stats
