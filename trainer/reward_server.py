"""Rewards scored by servers, beside the trainer's own (trainer/rewards.py compute_rewards):

    --reward_model_url http://HOST:8001   the reward model served by vLLM's pooling runner (scripts/serve_reward_model.sh):
                                          the "rm" component, as the in-process model scores it
    --reward_url http://HOST:9000/reward  a plain HTTP reward function: the "url" component (docs/reward_servers.md)

The reward model: the trainer renders each conversation with --reward_model_path's own tokenizer and chat template
and cuts it to its last tokens exactly as the in-process scorer does (trainer/reward_model.py conversation_ids), then
sends the token IDs to vLLM's `POST /classify` with `use_activation: false`: vLLM's classify pooler otherwise applies
sigmoid to a one-label head (softmax to several), and the reward is the raw logit. vLLM reads the score at the last
token (its LAST pooling), as HF's *ForSequenceClassification does at the last non-pad token; the server gets every row
unpadded. So the served score equals the in-process one up to float rounding (tests/test_reward_server.py against a
stand-in, tests/test_engine_vllm.py against vLLM itself). Read off vLLM 0.32.0's source (scripts/setup_engine.sh's
version): vllm/entrypoints/pooling/classify/protocol.py (`input` may be token-ID lists, `use_activation`),
vllm/model_executor/layers/pooler/activations.py (sigmoid below 2 labels), /tokenize, /v1/models.

The reward function: `POST URL` with {"prompts": [...], "replies": [...], "references": [... or null]} (one entry per
row, the same strings a --reward_fn function gets) answered by {"rewards": [one number per row]} (OpenRLHF's remote
reward key). Each rank sends its own rows; an empty batch is sent once at start as a check of the contract.

Both raise RewardServerError, a one-line message naming the server and what to do; the trainer stops with it, every
rank together (train_ppo.py score_responses runs inside the rank-local scoring block). Requests go through
trainer/http_client.py (a total deadline of --reward_timeout, a size cap) and carry the bearer token in
MINIPPO_REWARD_API_KEY where it is set, to both servers and on every route (vLLM checks its --api-key on /v1 routes
only: /classify and /tokenize are open to whoever reaches the port; docs/reward_servers.md). Every request is
idempotent (a score is a function of the request alone: the --reward_url contract says so), so a dropped connection or
HTTP 502 / 503 / 504 is tried again, up to trainer/http_client.py's RETRY_ATTEMPTS tries, inside the same deadline.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from trainer import dist as D
from trainer import http_client as H
from trainer.reward_model import conversation_ids
from trainer.rewards import RewardFnError

__all__ = ["REWARD_KEY_ENV", "RewardServerError", "RemoteRewardModel", "RewardFunctionServer", "exits_on_reward_error"]

# A text the trainer and the server both tokenize at start: a different tokenizer splits it differently.
PROBE_TEXT = "Hello! 12 + 7 = 19. The sea is blue.\n你好，世界。"
ROWS_PER_REQUEST = 256  # a step's rows go in requests of at most this many (vLLM batches them itself)
REWARD_KEY_ENV = "MINIPPO_REWARD_API_KEY"  # both reward servers' bearer token (their --api-key), read by H.Client


class RewardServerError(RuntimeError):
    """A reward server that cannot be reached, refuses a request, answers something else than the contract, or serves
    another model: one line naming the flag, the server and what to do."""


@contextlib.contextmanager
def exits_on_reward_error() -> Iterator[None]:
    """Around the trainer's reward calls: a custom reward function's error (trainer/rewards.py RewardFnError) or a reward
    server's ends the run with its one line (SystemExit "error: ..."), not a traceback; under torchrun the rank-local
    block around it makes every rank stop together."""
    try:
        yield
    except (RewardFnError, RewardServerError) as e:
        raise SystemExit(f"error: {e}") from None


class _Client:
    """trainer/http_client.py's Client of one reward server, its failures as RewardServerError: `flag` names the setting
    in messages, `start_hint` says how to start the server."""

    def __init__(self, url: str, timeout: float, flag: str, start_hint: str) -> None:
        try:
            self.http = H.Client(url, timeout, REWARD_KEY_ENV)
        except ValueError as e:
            raise RewardServerError(str(e)) from None
        self.flag, self.start_hint = flag, start_hint
        self.started = False  # True once the start-up check passed: a later failure is mid-run

    def request(self, path: str, body: Any = None, *, timeout: float | None = None) -> Any:
        where, what = f"{self.flag} {self.http.url}", path or "the batch"
        wait = timeout or self.http.timeout
        due = D.deadline()  # under torchrun the other ranks wait for this one in a collective, for so long only
        if due is not None and due.left() < wait:
            wait = max(due.left(), 0.001)
        try:  # every reward request is idempotent: tried again on a dropped connection or a busy server
            return self.http.request(path, body, timeout=wait, idempotent=True)
        except H.Refused as e:
            raise RewardServerError(f"{where} refused {what}: {e}{self.http.key_hint(e)}") from None
        except H.TimedOut:  # alive but slow (or hung): not a restart's matter
            bound = "--reward_timeout" if wait == (timeout or self.http.timeout) or due is None else due.flag + ", less a margin"
            raise RewardServerError(f"{where} did not answer {what} within {wait:.3g} s ({bound}): is it "
                                    f"overloaded or stuck? Raise --reward_timeout (below --ddp_timeout) or fix the "
                                    f"server, then continue with --from_resume 1") from None
        except H.Unreachable as e:
            hint = ("the last checkpoint is intact: restart the server, then continue with --from_resume 1" if self.started
                    else self.start_hint)
            raise RewardServerError(f"{where} is not reachable ({H.one_line(e, 120)}); {hint}") from None
        except H.BadAnswer as e:
            raise RewardServerError(f"{self.flag}: {e}") from None


def _read_config(path: str | Path) -> dict:
    try:
        return json.loads((Path(path) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


def _num_labels(config: dict) -> int:
    """transformers' rule: num_labels, else the id2label entries, else 2 (PretrainedConfig's default)."""
    if isinstance(config.get("num_labels"), int):
        return int(config["num_labels"])
    return len(config.get("id2label") or {}) or 2


def _shape(config: dict) -> tuple:
    text = config.get("text_config") or config
    arch = (config.get("architectures") or ["?"])[0]
    return arch, text.get("vocab_size"), text.get("num_hidden_layers"), text.get("hidden_size"), _num_labels(config)


def _describe(shape: tuple) -> str:
    """A model's `_shape` in words (its label count for a classifier)."""
    arch, vocab, layers, hidden, labels = shape
    return (f"{arch}, vocab {vocab}, {layers} layers x {hidden}"
            + (f", {labels} label(s)" if "ForSequenceClassification" in str(arch) else ""))


class RemoteRewardModel:
    """The reward model of --reward_model_path scored by a vLLM server (scripts/serve_reward_model.sh): the same
    contract as trainer/reward_model.py RewardModelScorer, `score(conversations) -> clipped fp32 scores`, with the
    tokenizer and chat template read from --reward_model_path here and the weights loaded by the server only.
    `connect()` checks the server before the run: reachable, a classification model with the local config's label
    count, the same tokenizer (a probe text tokenized by both), a context of at least `max_length` tokens, and where
    the server's model directory is readable from here (one machine) its config against the local one."""

    def __init__(self, url: str, tokenizer: Any, model_path: str | Path, max_length: int = 512, clip: float = 3.0,
                 timeout: float = 300.0) -> None:
        self.client = _Client(url, timeout, "--reward_model_url",
                              f"start one with scripts/serve_reward_model.sh {model_path} (docs/reward_servers.md), "
                              f"or drop --reward_model_url to score in this process")
        self.url = self.client.http.url
        self.tokenizer = tokenizer
        self.model_path = str(model_path)
        self.config = _read_config(model_path)
        self.max_length = int(max_length)
        self.clip = float(clip)
        self.model_name: str | None = None

    def _served(self) -> str:
        return f"--reward_model_url {self.url}"

    def connect(self) -> RemoteRewardModel:
        """The start-up checks (one line each when they fail); returns self."""
        data = (self.client.request("/v1/models", timeout=min(self.client.http.timeout, 30.0)) or {}).get("data") or []
        if not data:
            raise RewardServerError(f"{self._served()} serves no model (GET /v1/models is empty)")
        card = data[0]
        self.model_name = str(card.get("id"))
        root, max_len = card.get("root") or card.get("id"), card.get("max_model_len")
        if isinstance(max_len, int) and max_len < self.max_length:
            raise RewardServerError(f"{self._served()} takes at most {max_len} tokens per sequence; the reward model scores "
                                    f"the last {self.max_length}: start it with MAX_MODEL_LEN={self.max_length} "
                                    f"(scripts/serve_reward_model.sh)")
        served = _read_config(root) if root else {}
        local = _shape(self.config)
        if served and _shape(served) != local:
            raise RewardServerError(f"{self._served()} serves another model ({root}: {_describe(_shape(served))}) than "
                                    f"--reward_model_path {self.model_path} ({_describe(local)}): start it on that directory")
        mine = list(self.tokenizer(PROBE_TEXT, add_special_tokens=False, verbose=False)["input_ids"])
        try:
            theirs = (self.client.request("/tokenize", {"model": self.model_name, "prompt": PROBE_TEXT,
                                                        "add_special_tokens": False}) or {}).get("tokens")
        except RewardServerError as e:
            if "HTTP 404" not in str(e):  # a server without /tokenize: nothing to compare
                raise
            theirs = None
        if theirs is not None and list(theirs) != mine:
            raise RewardServerError(f"{self._served()} serves a model with another tokenizer than --reward_model_path "
                                    f"{self.model_path} (a probe text is {len(theirs)} tokens there, {len(mine)} here): "
                                    f"start it on that directory")
        try:
            _, labels = self._classify([mine])
        except RewardServerError as e:
            if "HTTP 404" in str(e) or "not support" in str(e).lower():
                raise RewardServerError(f"{self._served()} serves no classification model ({H.one_line(str(e), 160)}): "
                                        f"start the reward model with scripts/serve_reward_model.sh "
                                        f"{self.model_path}") from None
            raise
        want = _num_labels(self.config)
        if labels[0] != want:
            raise RewardServerError(f"{self._served()} serves a classifier of {labels[0]} label(s) but --reward_model_path "
                                    f"{self.model_path} has {want}: does it serve another model?")
        self.client.started = True
        return self

    def _classify(self, rows: list[list[int]]) -> tuple[list[float], list[int]]:
        """Each row's raw logit of label 0 (the score the in-process scorer reads) and its number of labels."""
        out = self.client.request("/classify", {"model": self.model_name, "input": rows, "use_activation": False,
                                                "add_special_tokens": False})
        items = sorted((out or {}).get("data") or [], key=lambda d: d.get("index", 0))
        if len(items) != len(rows):
            raise RewardServerError(f"{self._served()} returned {len(items)} scores for {len(rows)} conversations")
        try:
            return [float(d["probs"][0]) for d in items], [len(d["probs"]) for d in items]
        except (KeyError, IndexError, TypeError, ValueError):
            raise RewardServerError(f"{self._served()} answered /classify without a score per row "
                                    f"({H.one_line(repr(items[:1]), 80)}): is it vLLM's pooling server?") from None

    @torch.no_grad()
    def score(self, conversations: list[list[dict]]) -> Tensor:
        """One clipped fp32 score per conversation (messages ending with the assistant reply), as RewardModelScorer."""
        if not conversations:
            return torch.zeros(0, dtype=torch.float32)
        rows = conversation_ids(self.tokenizer, conversations, self.max_length)
        scores: list[float] = []
        for start in range(0, len(rows), ROWS_PER_REQUEST):
            scores += self._classify(rows[start:start + ROWS_PER_REQUEST])[0]
        return torch.tensor(scores, dtype=torch.float32).clamp(-self.clip, self.clip)


class RewardFunctionServer:
    """--reward_url: a plain HTTP reward function. `__call__(prompts, replies, references)` posts one batch and returns
    one float per row; `check()` posts an empty batch at start (the server must answer {"rewards": []})."""

    def __init__(self, url: str, timeout: float = 300.0) -> None:
        self.client = _Client(url, timeout, "--reward_url",
                              "start the reward server first (docs/reward_servers.md), or drop --reward_url")
        self.url = self.client.http.url

    def check(self) -> RewardFunctionServer:
        self([], [], [])
        self.client.started = True
        return self

    def __call__(self, prompts: Sequence[str], replies: Sequence[str], references: Sequence[str | None]) -> list[float]:
        out = self.client.request("", {"prompts": list(prompts), "replies": list(replies), "references": list(references)})
        where = f"--reward_url {self.url}"
        rewards = out.get("rewards") if isinstance(out, dict) else None
        if not isinstance(rewards, list):
            raise RewardServerError(f"{where} answered {H.one_line(repr(out), 80)}; it must answer {{\"rewards\": [one "
                                    f"number per reply]}} (docs/reward_servers.md)")
        if len(rewards) != len(replies):
            raise RewardServerError(f"{where} answered {len(rewards)} rewards for {len(replies)} replies")
        bad = next((i for i, r in enumerate(rewards) if isinstance(r, bool) or not isinstance(r, (int, float))), None)
        if bad is not None:
            raise RewardServerError(f"{where} answered {H.one_line(repr(rewards[bad]), 40)} for row {bad} (prompt: "
                                    f"{H.one_line(prompts[bad], 60)!r}); every reward must be a number")
        return [float(r) for r in rewards]
