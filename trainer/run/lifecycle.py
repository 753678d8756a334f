"""A run's lifecycle around the PPO loop: resume, run.json, the logger, the position in the data,
saving, and one way out (finished, stopped, or failed), on every rank.

    with Run(cfg, built, source) as run:   # resumes (--from_resume 1), opens run.json and the logger
        for batch in source.batches(run):  # this rank's prompts, from where the run left off
            ...                            # one PPO step
            run.end_step(metrics, samples) # count, log, stop on non-finite steps, save
        run.finish()

The run's rollout source (trainer/run/rollout_source.py) draws its batches from the run's prompt stream
(`next_batch`, `batches`) and says what a save keeps of it: a source that samples ahead (--async_rollouts)
has drawn batches past the one trained, so a save records its data position after the last trained batch
and the samples of its batches in flight (this rank's), and a resumed run hands them back to it.

A run owns its folders: a lock on --checkpoint_dir and --run_dir keeps a second run out, a run id
(run.json, every resume file) names it, a fresh run refuses a folder holding another run's resume
files or to start over another run's logs or exported policy, and --from_resume 1 refuses a folder
with nothing to resume. SIGTERM / SIGUSR1 / SIGINT stop the run after the current step, saved;
non-finite weights are never saved, and the policy is exported whole or not at all (`export_policy`).
Only rank 0 writes (weights, resume files, run.json, logs); every rank takes part in the
collectives a save needs (the RNG states are gathered from all ranks).
"""

from __future__ import annotations

import errno
import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from dataset.rlaif import collate_left_pad
from model.lora import export_base_hf, is_lora, merged_state_dict, save_adapter
from model.weights import atomic_dir, native_weight_path, save_native_weights
from trainer import dist as D
from trainer.config import Config
from trainer.run import checkpoint as ckpt
from trainer.run import distributed, seeding, sharding
from trainer.run.engine_sync import remove_push_folders
from trainer.run.lock import LOCK_NAME, FolderBusy, FolderLock
from trainer.run.provenance import append_resume_record, mark_run_end, read_run_json, rehash_inputs, write_run_json
from trainer.run.rollout_source import RolloutSource
from trainer.run.run_logger import RunLogger
from trainer.run.setup import Setup, actor_weights_path
from trainer.run.signals import StopRequest


@dataclass
class Position:
    """Where the run is: saved in every resume file."""

    step: int = 0  # PPO steps done
    epoch: int = 0  # pass over the prompt data
    consumed: int = 0  # global samples of `epoch` already trained on
    nonfinite_run: int = 0  # non-finite steps in a row (--max_nonfinite)


class Run:
    def __init__(self, cfg: Config, built: Setup, rollouts: RolloutSource) -> None:
        self.cfg, self.built, self.rt, self.rollouts = cfg, built, built.runtime, rollouts
        info, flags = self.rt.info, cfg.flat()
        use_moe = bool(cfg.use_moe)
        self.prefix = ckpt.resume_prefix(cfg.save_weight, self.cfg.hidden_size, use_moe)
        self.run_dir = Path(cfg.run_dir or f"runs/{cfg.save_weight}_{self.cfg.hidden_size}{'_moe' if use_moe else ''}")
        self.out_path = (Path(cfg.save_dir) / f"{cfg.save_weight}_hf" if cfg.actor_path
                         else native_weight_path(cfg.save_dir, cfg.save_weight, self.cfg.hidden_size, use_moe))
        self._closed = False
        self._plan: tuple[int, int, list[list[int]]] | None = None  # (epoch, start, this rank's batches)
        self._locks: list[FolderLock] = []
        self.stop = StopRequest()
        self.stopped_by: str | None = None  # the signal that stopped the run (every rank agrees on it)
        self.saved_at = -1  # the step of the last save (-1: none in this process)
        self.evaluated_at = -1  # the step of the last held-out evaluation (-1: none in this process)
        try:
            distributed.on_main(self._claim_folders, info)
            resumed = self._resume() if cfg.from_resume else None
            self.run_id = distributed.on_main(lambda: (resumed and resumed.run_id) or uuid.uuid4().hex[:12], info)
            self.pos = (Position(resumed.step, resumed.epoch, resumed.consumed, resumed.nonfinite_run)
                        if resumed else Position())
            rollouts.restore(resumed.ahead if resumed else None)  # this rank's batches in flight at the save
            self.started_at = self.pos.step
            with distributed.failing_together(info):  # rank 0's start-up writes: a failure there must not strand the others
                self.logger = RunLogger(
                    run_dir=self.run_dir, enabled=info.is_main,
                    swanlab_mode=cfg.swanlab_mode, project=cfg.wandb_project,
                    experiment_name=f"{cfg.save_weight}_{self.cfg.hidden_size}", config=flags, total_steps=self.rt.total_steps,
                    start_step=self.pos.step, resume_id=resumed.swanlab_id if resumed else None)
                self.provenance = self._write_provenance(resumed) if info.is_main else None
        except BaseException:
            self._release_locks()
            raise
        if resumed:  # after start-up code that draws random numbers (swanlab.init uses `random`)
            seeding.restore_rng_state(resumed.rng, info.device)
        self.stop.install()

    # ---- start
    def _claim_folders(self) -> None:
        """Rank 0: one run per folder. Lock the checkpoint and run folders (a second run at once is
        refused, naming the holder); a fresh run refuses a folder that holds another run's resume files
        (its saves would be pruned by the old run's higher steps, and --from_resume would continue the
        old run), and refuses to start over another run's logs or exported policy (`_earlier_outputs`)."""
        cfg = self.cfg
        self._lock(cfg.checkpoint_dir, "--checkpoint_dir")
        if self.run_dir.resolve() != Path(cfg.checkpoint_dir).resolve():
            self._lock(self.run_dir, "--run_dir")
        existing = ckpt.list_resume_files(cfg.checkpoint_dir, self.prefix)
        if existing and not cfg.from_resume:
            raise SystemExit(f"error: {cfg.checkpoint_dir}/ holds resume files of an earlier run ({existing[0].name}): "
                             f"continue it with --from_resume 1, or start a new run with another --save_weight "
                             f"(or move those files away)")
        if not existing and cfg.from_resume != 1:  # a new run (--from_resume 1 with nothing to resume stops anyway)
            earlier = self._earlier_outputs()
            if earlier:
                also = " and --run_dir" if cfg.run_dir else ""
                raise SystemExit(f"error: a new run would overwrite an earlier run's {', '.join(map(str, earlier))} "
                                 f"(no resume file of it in --checkpoint_dir {cfg.checkpoint_dir}): continue that run with "
                                 f"its own --checkpoint_dir and --from_resume 1, or give this one another --save_weight{also} "
                                 f"(or move those away)")

    def _lock(self, folder: str | Path, flag: str) -> None:
        """flock `folder` for this run; a filesystem without flock (Lustre's default mount, some NFS) gets a
        warning and no lock: the fresh-run checks still keep a later run off this one's files."""
        try:
            self._locks.append(FolderLock(folder, flag).acquire())
        except FolderBusy as e:
            raise SystemExit(f"error: {e}") from None
        except OSError as e:
            if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                raise SystemExit(f"error: {flag} {folder}: cannot create its lock file {LOCK_NAME}: "
                                 f"{e.strerror or e}") from None
            print(f"warning: {flag} {folder} is on a filesystem without flock ({errno.errorcode.get(e.errno or 0, e)}): "
                  f"running without the lock that refuses a second run in it at the same time; start one run per "
                  f"folder, or use a folder on a filesystem with flock (Lustre: mount with -o flock)")

    def _earlier_outputs(self) -> list[Path]:
        """What a new run would write over: the run folder's logs and the exported policy (the .pth or _hf
        folder, the LoRA adapter folder). Not when run.json there is this run's own earlier start, which
        never saved: the same --checkpoint_dir, --save_dir and resume file names, and no resume file."""
        cfg = self.cfg
        lora = bool(cfg.lora_r)
        outputs = [self.run_dir / name for name in ("run.json", "metrics.jsonl", "samples.jsonl")]
        outputs += ([adapter_dir(self.out_path)] if lora else []) + ([self.out_path] if not lora or cfg.save_merged else [])
        found = [p for p in outputs if p.exists()]
        args = read_run_json(self.run_dir).get("args") or {}

        def same(flag: str) -> bool:
            return args.get(flag) is not None and Path(args[flag]).resolve() == Path(getattr(cfg, flag)).resolve()

        own = (same("checkpoint_dir") and same("save_dir") and self.prefix == ckpt.resume_prefix(
            str(args.get("save_weight")), args.get("hidden_size", -1), bool(args.get("use_moe"))))
        return [] if own else found

    def _resume(self) -> ckpt.Resumed | None:
        cfg, m, o, info = self.cfg, self.built.models, self.built.optim, self.rt.info
        trainables = dict(actor=m.actor, critic=m.critic, optims=o.optims, scheds=o.scheds, kl_ctl=self.built.kl_ctl,
                          old_actor=m.old_actor, scaler=o.scaler, reward_norm=self.built.reward_norm)
        say = print if info.is_main else (lambda msg: None)
        try:
            resumed = ckpt.resume_run(cfg.checkpoint_dir, cfg.save_weight, self.prefix, self.cfg.flat(), trainables,
                                      check_inputs=bool(cfg.resume_check_inputs), seed=cfg.seed, info=info, say=say)
        except ckpt.ResumeError as e:
            raise SystemExit(f"error: {e}")
        # A typo in a folder name must not start over and wipe the logs. (Rank 0's verdict: every rank stops.)
        distributed.stop_all(f"--from_resume 1: nothing to resume in {cfg.checkpoint_dir}/ (no {self.prefix}_step*.pth): "
                   f"check --checkpoint_dir, --save_weight and the model size flags, or use --from_resume 2 "
                   f"to resume when there is something to resume and start a new run otherwise"
                   if resumed is None and cfg.from_resume == 1 else None, info)
        if resumed is None:
            say(f"no resume file {cfg.checkpoint_dir}/{self.prefix}_step*.pth: starting a new run (--from_resume 2)")
        return resumed

    def _write_provenance(self, resumed: ckpt.Resumed | None) -> dict:
        cfg, info = self.cfg, self.rt.info
        if resumed:
            provenance = append_resume_record(self.run_dir, {**resumed.record, "run_id": self.run_id})
            if resumed.changed_inputs:  # accepted with --resume_check_inputs 0: later resumes check the new bytes
                provenance = rehash_inputs(self.run_dir, resumed.changed_inputs)
        else:
            inputs = (actor_weights_path(cfg), cfg.actor_path, cfg.reward_model_path, cfg.teacher_model_path)
            provenance = write_run_json(self.run_dir, args=self.cfg.flat(), world_size=info.world_size, device=str(info.device),
                                        seed=cfg.seed, data_path=None if cfg.reasoning_gym else cfg.data_path,
                                        weight_paths=[str(p) for p in inputs if p and Path(p).exists()],
                                        run_id=self.run_id)
        if self.built.n_bad_lines:
            self.logger.info(f"skipped {self.built.n_bad_lines} malformed lines in {cfg.data_path}")
        n_params = sum(p.numel() for p in self.built.models.actor.parameters())
        self.logger.info(f"actor {n_params / 1e6:.2f}M params | {len(self.built.dataset)} prompts | {self.rt.total_steps} steps x "
                         f"{cfg.batch_size * info.world_size} prompts | device {info.device} x{info.world_size} | "
                         f"dtype {self.cfg.dtype} | run {self.run_id} in {self.run_dir}")
        return provenance

    # ---- the loop
    @property
    def step(self) -> int:
        return self.pos.step

    @property
    def data_position(self) -> tuple[int, int]:
        """(epoch, consumed) after the batches drawn so far: what a save records unless the rollout source has
        drawn past the last trained batch."""
        return self.pos.epoch, self.pos.consumed

    def batches(self) -> Iterator[dict]:
        """This rank's prompt batches, epoch after epoch, from the saved position, until the last step
        (or a stop signal, after the step that was running has been saved)."""
        while self.pos.step < self.rt.total_steps:
            batch = self.next_batch()
            if batch is None:
                return
            yield batch
            if self.pos.step >= self.rt.total_steps or self.stopped_by:
                return

    def next_batch(self) -> dict | None:
        """This rank's next batch of the global prompt stream (None after the last epoch). The position
        saved in resume files advances here, so a step that draws extra batches (--filter_groups) resumes
        after them. Every rank draws together: the position is global."""
        cfg, info, pos, ds = self.cfg, self.rt.info, self.pos, self.built.dataset
        per_step = cfg.batch_size * info.world_size
        while pos.epoch < cfg.epochs:
            if self._plan is None or self._plan[0] != pos.epoch:  # one permutation per epoch, from the saved position
                self._plan = (pos.epoch, pos.consumed, distributed.shard_batches(len(ds), cfg.seed, pos.epoch, pos.consumed, info.rank,
                                                                      info.world_size, cfg.batch_size))
            epoch, start, plan = self._plan
            k = (pos.consumed - start) // per_step
            if k < len(plan):
                pos.consumed += per_step
                return collate_left_pad([ds[i] for i in plan[k]], pad_id=self.built.models.tok.pad_token_id)
            pos.epoch, pos.consumed = pos.epoch + 1, 0
        return None

    @property
    def data_ran_out(self) -> bool:
        """The loop ended before the planned step count: the prompt data ran out first (--filter_groups'
        extra rounds draw prompts of later steps). Not after a stop signal."""
        return self.pos.step < self.rt.total_steps and not self.stopped_by

    def log_eval(self, metrics: dict[str, float], step: int) -> None:
        """Held-out evaluation figures outside a step's record (the one before the first step, and the
        last one of a run whose data ran out)."""
        with distributed.failing_together(self.rt.info):
            self.logger.log(metrics, step)
        self.evaluated_at = step

    def end_step(self, metrics: dict[str, float], samples: list[dict]) -> None:
        """After a step's update, with its globally reduced metrics: advance, log, stop after
        --max_nonfinite non-finite steps in a row, save every --save_interval steps, at the end, and
        when a stop signal reached any rank."""
        cfg, info, pos = self.cfg, self.rt.info, self.pos
        pos.nonfinite_run = pos.nonfinite_run + 1 if metrics["nonfinite"] else 0
        metrics["tokens_per_s"] = metrics.pop("tokens_generated") * info.world_size / max(metrics["time/step"], 1e-9)
        pos.step += 1
        if any(k.startswith("eval/") for k in metrics):
            self.evaluated_at = pos.step
        with distributed.failing_together(info):
            try:
                if pos.step % cfg.log_interval == 0 or pos.step == self.rt.total_steps:
                    self.logger.log(metrics, pos.step)
                if info.is_main and self.cfg.sample_interval and (pos.step % self.cfg.sample_interval == 0 or pos.step == 1):
                    self.logger.log_samples(samples, pos.step)
            except OSError as e:
                raise SystemExit(f"error: {_io_error(e, self.run_dir, 'writing the metrics of step ' + str(pos.step))}") from None
        if pos.nonfinite_run >= cfg.max_nonfinite:
            self.logger.info(f"stopping: {pos.nonfinite_run} non-finite steps in a row (no optimizer step was taken for them); "
                             f"the last good checkpoint in {cfg.checkpoint_dir}/ is intact. Lower --learning_rate or check --reward_fn.")
            self._close("stopped: non-finite", state="aborted", plots=False)
            raise SystemExit(2)
        if D.any_rank(self.stop.signal is not None, info):
            self.stopped_by = self.stop.signal or "a signal on another rank"
        if pos.step % cfg.save_interval == 0 or pos.step >= self.rt.total_steps or self.stopped_by:
            self.save()

    def save(self) -> None:
        """The policy in the usual place and a resume file (atomic; the last --keep_checkpoints kept).
        Weights that are not finite are never written: the last good files stay."""
        cfg, info, m = self.cfg, self.rt.info, self.built.models
        trained = [m.actor] + ([m.critic] if m.critic is not None else [])
        bad = not all(bool(torch.isfinite(D.local(p)).all()) for model in trained for p in model.parameters())
        if D.any_rank(bad, info):
            raise SystemExit(f"error: the weights are not finite after step {self.pos.step}: nothing was saved; the last good "
                             f"checkpoint in {cfg.checkpoint_dir}/ is intact. Lower --learning_rate or --grad_clip.")
        rngs = D.all_gather_objects(seeding.capture_rng_state(info.device), info)  # a collective: every rank takes part
        kept = self.rollouts.state(self.pos.step, stopping=self.stopped_by is not None)  # waits briefly at a stop signal
        ahead = None if kept.in_flight is None else D.all_gather_objects(kept.in_flight, info)
        full, shards = None, None
        if cfg.strategy == "fsdp2":  # collectives: the whole policy to rank 0, every rank's shards to the DCP folder
            full = sharding.full_state_dict(m.actor)
            shards = sharding.shards_path(ckpt.resume_path(cfg.checkpoint_dir, self.prefix, self.pos.step))
            try:
                sharding.save_shards({"actor": m.actor, "critic": m.critic, "old_actor": m.old_actor},
                                     self.built.optim.optims, shards, info)
            except (Exception, CheckpointException) as e:  # noqa: BLE001 - DCP raises on every rank when any rank's write failed
                raise SystemExit(f"error: saving step {self.pos.step}'s shards to {shards}: {distributed.one_line(e)}; the previous "
                                 f"checkpoint is intact") from None
        position = kept.position or self.data_position
        distributed.main_writes(lambda: self._write(rngs, position, full, shards, ahead), info)  # the others wait outside --ddp_timeout
        self.saved_at = self.pos.step

    def _write(self, rngs: list[dict], position: tuple[int, int], full: dict | None = None, shards: Path | None = None,
               ahead: list[list[dict]] | None = None) -> None:
        """Rank 0's part of a save: the policy (`full`: its whole weights under --strategy fsdp2) and the resume
        file (the data position after the last trained batch; naming `shards`, the DCP folder of a sharded run,
        which is written by then; `ahead`: each rank's batches in flight that its rollout source keeps)."""
        cfg, m, o = self.cfg, self.built.models, self.built.optim
        state = ckpt.training_state(actor=m.actor, critic=m.critic, optims=o.optims, scheds=o.scheds, kl_ctl=self.built.kl_ctl,
                                    old_actor=m.old_actor, scaler=o.scaler, reward_norm=self.built.reward_norm,
                                    shards=None if shards is None else shards.name)
        epoch, consumed = position
        if ahead is not None:
            state["ahead"] = ahead  # per rank: the samples of the batches in flight (--async_rollouts)
        state.update(step=self.pos.step, epoch=epoch, consumed=consumed, nonfinite_run=self.pos.nonfinite_run,
                     rng=rngs, world_size=self.rt.info.world_size, args=self.cfg.flat(), swanlab_id=self.logger.id,
                     run=self.provenance or {}, run_id=self.run_id)
        try:
            ckpt.check_free_space(cfg.checkpoint_dir, self.prefix, state)
            export_policy(cfg, m.actor, m.tok, self.out_path, full)
            ckpt.save_resume(state, cfg.checkpoint_dir, self.prefix, self.pos.step, cfg.keep_checkpoints)
        except OSError as e:
            raise SystemExit(f"error: {_io_error(e, cfg.checkpoint_dir, f'saving step {self.pos.step}')}; "
                             f"the previous checkpoint is intact") from None

    # ---- the way out
    def finish(self) -> None:
        """The way out of a run that was not stopped by an error: stopped by a signal (saved at its last
        step), or done, whether at the planned step count or where the data ran out (saved here if the
        last step was not)."""
        cfg = self.cfg
        if self.stopped_by:
            self.logger.info(f"stopped by {self.stopped_by} after step {self.pos.step}, saved in {cfg.checkpoint_dir}/; "
                             f"continue with the same command and --from_resume 1")
            self._close(f"stopped: {self.stopped_by}")
            return
        if self.saved_at != self.pos.step and self.pos.step > self.started_at:
            self.save()
        early = (f" (the prompt data ran out before the planned {self.rt.total_steps}: --filter_groups draws extra "
                 f"prompts; more --epochs give it more)" if self.data_ran_out else "")
        self.logger.info(f"done: {self.pos.step} steps{early}; policy saved to {self.out_path}; "
                         f"metrics in {self.run_dir}/metrics.jsonl")
        self._close("finished")

    def _close(self, status: str, state: str = "success", plots: bool = True, error: str | None = None) -> None:
        """Mark run.json, close the logger (plots on success), leave the process group. Once."""
        if self._closed:
            return
        self._closed = True
        self.stop.restore()
        try:
            if self.rt.info.is_main:
                mark_run_end(self.run_dir, status)
            self.logger.finish(plots=plots, state=state, error=error)
        finally:
            self._release_locks()
            remove_push_folders()  # the default engine push folder (ranks leave by os._exit: no atexit)
            if state == "success":
                distributed.cleanup(self.rt.info)  # waits for every rank: rank 0 may still be writing
            elif dist.is_initialized():
                dist.destroy_process_group()  # no barrier: another rank may never reach one

    def _release_locks(self) -> None:
        for lock in self._locks:
            lock.release()
        self._locks.clear()

    def __enter__(self) -> Run:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if exc_type is None or exc is None or self._closed:  # (a `with` passes both or neither)
            return
        what = distributed.one_line(exc)
        if issubclass(exc_type, KeyboardInterrupt):
            self._close("interrupted", state="aborted", plots=False, error=what)
        elif issubclass(exc_type, SystemExit):
            self._close(f"stopped: {what}", state="aborted", plots=False, error=what)
        else:
            self._close(f"failed: {what}", state="crashed", plots=False, error=what)


def adapter_dir(out_path: Path) -> Path:
    """Where a LoRA run writes its adapters: beside the policy, `<policy name>_lora` (out/ppo_actor_128_lora,
    out/ppo_actor_lora for an --actor_path run)."""
    stem = out_path.stem if out_path.suffix == ".pth" else out_path.name.removesuffix("_hf")
    return out_path.with_name(f"{stem}_lora")


def export_policy(cfg: Config, actor: torch.nn.Module, tok: Any, out_path: Path, full: dict | None = None) -> None:
    """The policy where the run's users look for it (`full`: its whole weights under --strategy fsdp2): a
    LoRA run's outputs, an --actor_path run's save_pretrained folder, or a native .pth. Each is replaced
    whole (a temporary sibling renamed into place), so a kill at any moment leaves the previous export or
    the new one, never half of one."""
    if is_lora(actor):
        save_lora_outputs(cfg, actor, tok, out_path)
    elif cfg.actor_path:
        with atomic_dir(out_path) as tmp:
            actor.save_pretrained(tmp, state_dict=full)
            tok.save_pretrained(tmp)
    else:
        save_native_weights(actor if full is None else full, out_path)


def _link_tree(src: Path, dst: Path) -> None:
    """`src` copied to `dst` as hard links (no second copy of the bytes), plain copies where links fail."""
    def link(a: str, b: str) -> None:
        try:
            os.link(a, b)
        except OSError:
            shutil.copy2(a, b)
    shutil.copytree(src, dst, copy_function=link)


def save_lora_outputs(cfg: Config, actor: torch.nn.Module, tok: Any, out_path: Path) -> None:
    """A LoRA run's policy: the adapter directory (AutoPeftModelForCausalLM loads it: its base is the
    --actor_path directory, or for native weights the start weights exported once into <adapters>/base)
    and, with --save_merged (default for native weights), the merged weights where a full run writes them.
    Each folder is replaced whole (`atomic_dir`); the base moves into each new adapter folder as hard links."""
    adapters = adapter_dir(out_path)
    with atomic_dir(adapters) as tmp:
        if cfg.actor_path:
            base = Path(cfg.actor_path)
        else:
            base = adapters / "base"  # where it will be: the adapter config names it
            if (base / "config.json").is_file():
                _link_tree(base, tmp / "base")
            else:
                export_base_hf(actor, tok, tmp / "base")
        save_adapter(actor, tok, tmp, base)
    if not cfg.save_merged:  # resolved: on for native weights, off for --actor_path unless asked
        return
    merged = merged_state_dict(actor)
    if cfg.actor_path:
        base_lm = getattr(actor, "module", actor).get_base_model()
        with atomic_dir(out_path) as tmp:
            base_lm.save_pretrained(tmp, state_dict=merged)
            tok.save_pretrained(tmp)
    else:
        save_native_weights(merged, out_path)


def _io_error(e: OSError, where: str | Path, doing: str) -> str:
    """A disk error as one line; a full disk named as such."""
    if e.errno == errno.ENOSPC:
        return f"no space left on {where} while {doing}"
    return f"{doing} in {where} failed: {e.strerror or e}"
