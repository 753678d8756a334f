"""Types shared by the PPO parts and the run's mechanics: the models, the optimizers, where this rank
computes, and the `Phase` context the PPO steps run their work in. A leaf: nothing here imports the
rest of the project beyond trainer/dist.py.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, ContextManager, Protocol

import torch
from torch import nn

from trainer.dist import DistInfo

__all__ = ["DistInfo", "Models", "Optim", "Runtime", "Phase", "on"]

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass
class Models:
    """The run's models. `*_train` are what the update calls (DDP / compiled wrappers); sampling and
    scoring use the plain modules."""

    actor: nn.Module
    critic: nn.Module | None  # None with a critic-free --advantage_estimator
    ref: nn.Module
    old_actor: nn.Module | None  # MiniMind's frozen copy (--update_old_actor_freq N), else None
    rm_scorer: object | None  # trainer.reward_model.RewardModelScorer, or reward_server.RemoteRewardModel (--reward_model_url)
    tok: Any  # a transformers tokenizer
    eos_ids: list[int]  # HF chat models may stop on several ids (tokenizer EOS + generation_config)
    actor_train: nn.Module | None = None
    critic_train: nn.Module | None = None
    engine: Any = None  # trainer.engine.Engine: the rollout engine that samples for this rank (None: the actor itself)
    reward_url: Any = None  # trainer.reward_server.RewardFunctionServer (--reward_url; None: off)
    teacher: Any = None  # --teacher_model_path: a frozen nn.Module like ref; --teacher_url: trainer.distill.TeacherServer

    @property
    def rm_module(self) -> nn.Module | None:
        """The reward model's module (None without one), e.g. for `unsharded`."""
        return getattr(self.rm_scorer, "model", None)


@dataclass
class Optim:
    """AdamW + LR schedule per trained model, and the fp16 loss scaler (disabled otherwise: a no-op)."""

    optims: dict[str, torch.optim.Optimizer]
    scheds: dict[str, torch.optim.lr_scheduler.LRScheduler]
    scaler: torch.amp.GradScaler

    def zero_grad(self) -> None:
        for o in self.optims.values():
            o.zero_grad(set_to_none=True)


@dataclass(frozen=True)
class Runtime:
    """Where this rank computes, known once the process group and the data exist (the settings themselves
    are in the resolved Config)."""

    info: DistInfo
    ref_device: torch.device  # --ref_device / --critic_device / --reward_device for this rank
    critic_device: torch.device
    reward_device: torch.device
    total_steps: int  # the planned PPO steps (--epochs over the data, capped by --max_steps)
    # (--dtype, frozen models' dtype) per device type the run uses: a reference on the CPU beside a CUDA
    # actor computes as a CPU should, not in the GPU's bf16.
    precisions: dict = field(default_factory=dict)

    @property
    def device(self) -> torch.device:
        return self.info.device

    def autocast(self, device: torch.device | None = None) -> ContextManager:
        """The one autocast context of the run (a no-op in fp32), for the actor's device or `device`, in
        that device type's precision."""
        device = device or self.device
        name = self.precisions.get(device.type, ("float32",))[0]
        if name == "float32":
            return contextlib.nullcontext()
        return torch.autocast(device_type=device.type, dtype=DTYPES[name])

    @property
    def cuda_devices(self) -> list[torch.device]:
        """Every GPU this rank computes on (the actor's and any --ref/--critic/--reward_device)."""
        devices = (self.device, self.ref_device, self.critic_device, self.reward_device)
        return sorted({d for d in devices if d.type == "cuda"}, key=str)


class Phase(Protocol):
    """`with phase("score", device=..., rank_local=True):` times a phase of a step, enters the autocast of
    `device` (the actor's by default; autocast=False: none), and with rank_local=True agrees on a failure
    that happened on some ranks only, so no rank waits in a collective the failed one never reaches (the
    block must then run no collective itself). The run's mechanics provide it (trainer/run/phases.py)."""

    def __call__(self, name: str, *, device: torch.device | None = None, autocast: bool = True,
                 rank_local: bool = False) -> ContextManager: ...


def on(device: torch.device, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The tensors on `device` (no copy where they already are)."""
    return tuple(t.to(device) for t in tensors)
