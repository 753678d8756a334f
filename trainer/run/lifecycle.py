"""A run's lifecycle around the PPO loop: resume, run.json, the logger, the position in the data,
saving, and one way out (finished, stopped, or failed), on every rank.

    with Run(args, built) as run:          # resumes (--from_resume 1), opens run.json and the logger
        for batch in run.batches():        # this rank's prompts, from where the run left off
            ...                            # one PPO step
            run.end_step(metrics, samples) # count, log, stop on non-finite steps, save
        run.finish()

Only rank 0 writes (weights, resume files, run.json, logs); every rank takes part in the
collectives a save needs (the RNG states are gathered from all ranks).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch.distributed as dist

from dataset.rlaif import collate_left_pad
from model.weights import native_weight_path, save_native_weights
from trainer.run import checkpoint as ckpt
from trainer.run import distributed as D
from trainer.run.logging import RunLogger
from trainer.run.provenance import append_resume_record, mark_run_end, rehash_inputs, write_run_json
from trainer.run.setup import Setup, actor_weights_path


@dataclass
class Position:
    """Where the run is: saved in every resume file."""

    step: int = 0  # PPO steps done
    epoch: int = 0  # pass over the prompt data
    consumed: int = 0  # global samples of `epoch` already trained on
    nonfinite_run: int = 0  # non-finite steps in a row (--max_nonfinite)


class Run:
    def __init__(self, args: argparse.Namespace, built: Setup) -> None:
        self.args, self.built, self.s = args, built, built.settings
        info, flags = self.s.info, self.s.flags
        use_moe = bool(args.use_moe)
        self.prefix = ckpt.resume_prefix(args.save_weight, self.s.hidden_size, use_moe)
        self.run_dir = Path(args.run_dir or f"runs/{args.save_weight}_{self.s.hidden_size}{'_moe' if use_moe else ''}")
        self.out_path = (Path(args.save_dir) / f"{args.save_weight}_hf" if args.actor_path
                         else native_weight_path(args.save_dir, args.save_weight, self.s.hidden_size, use_moe))
        self._closed = False
        resumed = self._resume() if args.from_resume else None
        self.pos = (Position(resumed.step, resumed.epoch, resumed.consumed, resumed.nonfinite_run)
                    if resumed else Position())
        self.logger = RunLogger(
            run_dir=self.run_dir, enabled=info.is_main, swanlab_mode="disabled" if not args.use_wandb else args.swanlab_mode,
            project=args.wandb_project, experiment_name=f"{args.save_weight}_{self.s.hidden_size}", config=flags,
            total_steps=self.s.total_steps, start_step=self.pos.step, resume_id=resumed.swanlab_id if resumed else None)
        self.provenance = self._write_provenance(resumed) if info.is_main else None
        if resumed:  # after start-up code that draws random numbers (swanlab.init uses `random`)
            ckpt.restore_rng_state(resumed.rng)

    # ---- start
    def _resume(self) -> ckpt.Resumed | None:
        m, o, info = self.built.models, self.built.optim, self.s.info
        trainables = dict(actor=m.actor, critic=m.critic, optims=o.optims, scheds=o.scheds, kl_ctl=self.built.kl_ctl,
                          old_actor=m.old_actor, scaler=o.scaler)
        try:
            return ckpt.resume_run(self.args.checkpoint_dir, self.args.save_weight, self.prefix, self.s.flags, trainables,
                                   check_inputs=bool(self.args.resume_check_inputs), seed=self.args.seed, rank=info.rank,
                                   world_size=info.world_size, say=print if info.is_main else (lambda msg: None))
        except ckpt.ResumeError as e:
            raise SystemExit(f"error: {e}")

    def _write_provenance(self, resumed: ckpt.Resumed | None) -> dict:
        args, info = self.args, self.s.info
        if resumed:
            provenance = append_resume_record(self.run_dir, resumed.record)
            if resumed.changed_inputs:  # accepted with --resume_check_inputs 0: later resumes check the new bytes
                provenance = rehash_inputs(self.run_dir, resumed.changed_inputs)
        else:
            inputs = (actor_weights_path(args), args.actor_path, args.reward_model_path)
            provenance = write_run_json(self.run_dir, args=self.s.flags, world_size=info.world_size, device=str(info.device),
                                        seed=args.seed, data_path=args.data_path,
                                        weight_paths=[str(p) for p in inputs if p and Path(p).exists()])
        if self.built.n_bad_lines:
            self.logger.info(f"skipped {self.built.n_bad_lines} malformed lines in {args.data_path}")
        n_params = sum(p.numel() for p in self.built.models.actor.parameters())
        self.logger.info(f"actor {n_params / 1e6:.2f}M params | {len(self.built.dataset)} prompts | {self.s.total_steps} steps x "
                         f"{args.batch_size * info.world_size} prompts | device {info.device} x{info.world_size} | "
                         f"dtype {self.s.dtype_name} | run dir {self.run_dir}")
        return provenance

    # ---- the loop
    @property
    def step(self) -> int:
        return self.pos.step

    def batches(self) -> Iterator[dict]:
        """This rank's prompt batches, epoch after epoch, from the saved position, until the last step."""
        args, info, pos, ds = self.args, self.s.info, self.pos, self.built.dataset
        pad_id = self.built.models.tok.pad_token_id
        while pos.step < self.s.total_steps and pos.epoch < args.epochs:
            for idx in D.shard_batches(len(ds), args.seed, pos.epoch, pos.consumed, info.rank, info.world_size, args.batch_size):
                yield collate_left_pad([ds[i] for i in idx], pad_id=pad_id)
                if pos.step >= self.s.total_steps:
                    return
            pos.epoch, pos.consumed = pos.epoch + 1, 0

    def end_step(self, metrics: dict[str, float], samples: list[dict]) -> None:
        """After a step's update, with its globally reduced metrics: advance, log, stop after
        --max_nonfinite non-finite steps in a row, save every --save_interval steps and at the end."""
        args, info, pos = self.args, self.s.info, self.pos
        pos.nonfinite_run = pos.nonfinite_run + 1 if metrics["nonfinite"] else 0
        metrics["tokens_per_s"] = metrics.pop("tokens_generated") * info.world_size / max(metrics["time/step"], 1e-9)
        pos.step += 1
        pos.consumed += args.batch_size * info.world_size
        if pos.step % args.log_interval == 0 or pos.step == self.s.total_steps:
            self.logger.log(metrics, pos.step)
        if info.is_main and args.sample_interval and (pos.step % args.sample_interval == 0 or pos.step == 1):
            self.logger.log_samples(samples, pos.step)
        if pos.nonfinite_run >= args.max_nonfinite:
            self.logger.info(f"stopping: {pos.nonfinite_run} non-finite steps in a row (no optimizer step was taken for them); "
                             f"the last good checkpoint in {args.checkpoint_dir}/ is intact. Lower --learning_rate or check --reward_fn.")
            self._close("stopped: non-finite", state="aborted", plots=False)
            raise SystemExit(2)
        if pos.step % args.save_interval == 0 or pos.step >= self.s.total_steps:
            self.save()

    def save(self) -> None:
        """The policy in the usual place and a resume file (atomic; the last --keep_checkpoints kept)."""
        args, info, m, o = self.args, self.s.info, self.built.models, self.built.optim
        rngs = D.all_gather_objects(ckpt.capture_rng_state(), info)  # a collective: every rank takes part
        if not info.is_main:
            return
        if args.actor_path:
            m.actor.save_pretrained(self.out_path)
            m.tok.save_pretrained(self.out_path)
        else:
            save_native_weights(m.actor, self.out_path)
        state = ckpt.training_state(actor=m.actor, critic=m.critic, optims=o.optims, scheds=o.scheds, kl_ctl=self.built.kl_ctl,
                                    old_actor=m.old_actor, scaler=o.scaler)
        state.update(step=self.pos.step, epoch=self.pos.epoch, consumed=self.pos.consumed, nonfinite_run=self.pos.nonfinite_run,
                     rng=rngs, world_size=info.world_size, args=self.s.flags, swanlab_id=self.logger.id, run=self.provenance or {})
        ckpt.save_resume(state, args.checkpoint_dir, self.prefix, self.pos.step, args.keep_checkpoints)

    # ---- the way out
    def finish(self) -> None:
        if self.s.info.is_main:
            self.logger.info(f"done: {self.pos.step} steps; policy saved to {self.out_path}; metrics in {self.run_dir}/metrics.jsonl")
        self._close("finished")

    def _close(self, status: str, state: str = "success", plots: bool = True, error: str | None = None) -> None:
        """Mark run.json, close the logger (plots on success), leave the process group. Once."""
        if self._closed:
            return
        self._closed = True
        if self.s.info.is_main:
            mark_run_end(self.run_dir, status)
        self.logger.finish(plots=plots, state=state, error=error)
        if state == "success":
            D.cleanup(self.s.info)  # waits for every rank: rank 0 may still be writing
        elif dist.is_initialized():
            dist.destroy_process_group()  # no barrier: another rank may never reach one

    def __enter__(self) -> Run:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None or self._closed:
            return
        what = f"{exc_type.__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        if issubclass(exc_type, KeyboardInterrupt):
            self._close("interrupted", state="aborted", plots=False, error=what)
        elif issubclass(exc_type, SystemExit):
            self._close(f"stopped: {exc}", state="aborted", plots=False, error=what)
        else:
            self._close(f"failed: {what}", state="crashed", plots=False, error=what)
