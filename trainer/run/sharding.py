"""--strategy fsdp2: torch's FSDP2 for the run's models, their whole weights for the exported policy, and
the sharded part of a resume checkpoint through torch.distributed.checkpoint (DCP).

Sharding: `fully_shard` on every decoder layer, then on the root (embeddings, final norm, LM head, the
critic's value head), over a one-dimensional mesh of all ranks. The actor and critic train sharded (FSDP2's
MixedPrecisionPolicy on GPUs: bf16 parameters for compute, fp32 gradient reduction; fp32 on CPUs), the
old actor is sharded like the actor, the reference and reward model with --shard_frozen 1. Forwards that
run on one rank only (sampling, rank-local scoring, evaluation) happen inside `trainer.dist.unsharded`.

A sharded resume checkpoint is the usual `<prefix>_stepNNNNNNNN.pth` (step, RNG states, schedulers, flags,
...; it names its shards) beside a DCP folder `<prefix>_stepNNNNNNNN.dcp/` that every rank writes its
own part of (model and AdamW state). The folder is written under a temporary name and renamed once every
rank has finished; the .pth is written after it and is what makes the step count, so a kill at any moment
leaves the previous checkpoint whole. DCP reads the shards into any world size (resharding on load).
Loading runs nothing from the folder: DCP's metadata pickle is read with an exact allow-list of DCP's record
classes, and its pickled entries (the optimizers' param_groups) with torch.load(weights_only=True).
"""

from __future__ import annotations

import glob
import io
import pickle
import shutil
import warnings
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.futures import Future

from trainer.config import Config
from trainer.dist import DistInfo, fsdp_modules
from trainer.run.distributed import barrier
from trainer.runtime import Models

SHARDS_SUFFIX = ".dcp"

# FSDP2 warns when a sharded module returns a view (the critic's values are value_head(...).squeeze(-1)):
# an in-place op on it would skip the pre-backward hook. Nothing here modifies a forward's output in place.
warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")


def device_mesh(info: DistInfo, hsdp: bool = False) -> DeviceMesh:
    """The ranks' device mesh (a collective: every rank calls it). One data-parallel dimension over every rank; with
    `hsdp`, two: nodes x the node's ranks, so fully_shard shards within a node and replicates across nodes (HSDP),
    and a layer's all-gather never crosses the nodes' slower links (only the gradients' all-reduce does)."""
    if hsdp:
        return init_device_mesh(info.device.type, (info.nodes, info.world_size // info.nodes),
                                mesh_dim_names=("replicate", "shard"))
    return init_device_mesh(info.device.type, (info.world_size,), mesh_dim_names=("dp",))


def use_hsdp(flag: int, info: DistInfo) -> bool:
    """--hsdp: -1 = when the job spans nodes. 1 on one node is refused: there is nothing to replicate across."""
    if flag == 1 and info.nodes == 1:
        raise SystemExit(f"error: --hsdp 1 shards within a node and replicates across nodes, but this job runs on one node "
                         f"({info.world_size} processes): drop --hsdp (or give 0)")
    return info.nodes > 1 if flag == -1 else bool(flag)


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder blocks of a causal LM, critic or reward model: the longest ModuleList in it (`model.layers`
    in Llama/Qwen/MiniMind, `transformer.h` in GPT-2)."""
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
    if not lists:
        raise ValueError(f"{type(model).__name__} has no list of decoder layers to shard")
    return max(lists, key=len)


def shard(model: nn.Module, mesh: DeviceMesh, mp: MixedPrecisionPolicy | None = None,
          offload: OffloadPolicy | None = None) -> nn.Module:
    """fully_shard each decoder layer (freed after its forward, gathered again for the backward), then the
    root, which keeps its own parameters between forward and backward. In place; returns the model."""
    kw = {"mesh": mesh, "mp_policy": mp or MixedPrecisionPolicy(), "offload_policy": offload or OffloadPolicy()}
    for layer in decoder_layers(model):
        fully_shard(layer, reshard_after_forward=True, **kw)
    head = getattr(model, "value_head", None)
    if isinstance(head, nn.Linear) and mp is not None:
        # The critic's head reads fp32 hidden states (model/critic.py): under a bf16 parameter policy it would
        # get bf16 weights and fail ("mat1 and mat2 must have the same dtype"), seen on an H200. Its own group
        # keeps it in fp32.
        fully_shard(head, reshard_after_forward=False,
                    **{**kw, "mp_policy": MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)})
    fully_shard(model, reshard_after_forward=False, **kw)
    return model


def shard_models(cfg: Config, models: Models, info: DistInfo, mesh: DeviceMesh) -> None:
    """Shard the run's models in place over `mesh` (before their optimizers are built: sharding replaces the
    parameters). No collective: each rank keeps its slice of each parameter."""
    gpu = info.device.type == "cuda"
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if gpu and cfg.dtype == "bfloat16" else None
    offload = CPUOffloadPolicy() if cfg.cpu_offload else None
    shard(models.actor, mesh, mp, offload)
    if models.critic is not None:
        shard(models.critic, mesh, mp, offload)
    if models.old_actor is not None:  # scores like the actor: the same parameter dtype, so the first ratio is 1
        shard(models.old_actor, mesh, mp, offload)
    rm = getattr(models.rm_scorer, "model", None)
    if cfg.shard_frozen:
        shard(models.ref, mesh, offload=offload)
        if rm is not None:
            try:
                shard(rm, mesh, offload=offload)
            except ValueError:  # a remote-code reward model without a findable decoder stack: kept whole
                pass
    for frozen in (models.ref, rm):  # built in host memory (setup): what stays whole goes to the rank's device
        if frozen is not None and not is_sharded(frozen):
            frozen.to(info.device)


def is_sharded(model: nn.Module | None) -> bool:
    return bool(fsdp_modules(model))


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole state dict of a sharded model on rank 0, in host memory ({} on the other ranks). A collective."""
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


# ---------------------------------------------------------------------------------------------- DCP
def shards_path(resume_file: str | Path) -> Path:
    """The DCP folder beside a resume file."""
    p = Path(resume_file)
    return p.with_name(p.name.removesuffix(".pth") + SHARDS_SUFFIX)


def _temp_path(final: Path) -> Path:
    return final.with_name(final.name + ".tmp")


def sharded_state(models: dict[str, nn.Module | None], optims: dict[str, torch.optim.Optimizer]) -> dict:
    """What DCP saves and loads: each model's ("actor", "critic", "old_actor"; None = absent) and each optimizer's
    state (keyed by the model it trains) as DTensors."""
    state = {name: get_model_state_dict(model) for name, model in models.items() if model is not None}
    for name, opt in optims.items():
        fresh = not opt.state
        state[f"optim/{name}"] = get_optimizer_state_dict(models[name], opt)
        if fresh:
            # An optimizer that has not stepped (the actor inside --critic_warmup_steps, a resume's fresh one) gets its
            # state made by a real AdamW step at lr 0; its counter would then read 1, and the first real update would
            # be bias-corrected as the second. Step 0 with zero moments is exactly a fresh AdamW state.
            for param_state in opt.state.values():
                if torch.is_tensor(param_state.get("step")):
                    param_state["step"].zero_()
                elif "step" in param_state:
                    param_state["step"] = 0
    return state


def save_shards(models: dict[str, nn.Module | None], optims: dict, final: Path, info: DistInfo) -> None:
    """Every rank writes its part of the model and optimizer state into `final` (a DCP folder), via a
    temporary folder renamed by rank 0 once all parts are written (DCP's save ends with a gather of every
    rank's write results, so the rename sees them all). A collective."""
    tmp = _temp_path(final)
    if info.is_main:
        shutil.rmtree(tmp, ignore_errors=True)  # a save killed at this step before
    barrier(info)
    dcp.save(sharded_state(models, optims), checkpoint_id=str(tmp))
    if info.is_main:
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
    barrier(info)


def load_shards(models: dict[str, nn.Module | None], optims: dict, folder: Path) -> None:
    """Load a DCP folder written by `save_shards` into the sharded models and optimizers, resharding to this
    run's world size (an optimizer that has not stepped yet gets its state allocated first, so there is
    somewhere to load it). A collective."""
    SafeReader(folder).read_metadata()  # an unsafe file refused as such (inside dcp.load it is one failure among others)
    state = sharded_state(models, optims)
    try:
        dcp.load(state, checkpoint_id=str(folder), storage_reader=SafeReader(folder))
    except CheckpointException as e:  # a refused bytes entry on any rank: refused as such, not as damage
        unsafe = [exc for exc, _ in e.failures.values() if isinstance(exc, UnsafeShardsError)]
        if unsafe:
            raise unsafe[0] from None
        raise
    for name, model in models.items():
        if model is not None:
            set_model_state_dict(model, state[name])
    for name, opt in optims.items():
        set_optimizer_state_dict(models[name], opt, state[f"optim/{name}"])


class UnsafeShardsError(RuntimeError):
    """DCP files that carry something other than DCP's own records and plain values: refused, never loaded."""


_DCP = "torch.distributed.checkpoint"
# Exactly what DCP's metadata pickle names (torch 2.x: torch/distributed/checkpoint/metadata.py and filesystem.py), by
# (module, name) pair: no prefix match and no dotted name (protocol 4 would walk `module.os.system`-style paths).
_METADATA_GLOBALS = frozenset(
    {(f"{_DCP}.metadata", n) for n in ("Metadata", "StorageMeta", "MetadataIndex", "TensorStorageMetadata",
                                        "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
                                        "_MEM_FORMAT_ENCODING")}
    | {(f"{_DCP}.filesystem", "_StorageInfo"), ("torch", "Size"), ("torch.serialization", "_get_layout"),
       ("pathlib", "PosixPath"), ("pathlib._local", "PosixPath"),  # the checkpoint id (pathlib._local: Python 3.13+)
       ("collections", "OrderedDict"), ("builtins", "set"), ("builtins", "frozenset"), ("builtins", "slice")}
    | {("torch", n) for n in dir(torch) if isinstance(getattr(torch, n, None), torch.dtype)})


class _MetadataUnpickler(pickle.Unpickler):
    """DCP's metadata file is a pickle, which plain pickle.load would let run code; this one builds only the
    (module, name) pairs of `_METADATA_GLOBALS`: DCP's record classes, torch dtypes / Size / layout, paths and
    plain containers."""

    def find_class(self, module: str, name: str) -> Any:  # a class or function, as pickle's own
        if (module, name) in _METADATA_GLOBALS:
            return super().find_class(module, name)
        raise UnsafeShardsError(f"{module}.{name}")


class _SafeBytes:
    """The load planner DCP hands `read_data`, with its bytes entries (the optimizers' param_groups: lr, betas, ...,
    which DCP stores pickled) read by torch.load(weights_only=True): DCP's own planner reads them with the
    unrestricted unpickler, which would run whatever a crafted entry carries. What passes is handed on re-pickled from
    the plain values read, so the planner's own load never sees the file's bytes."""

    def __init__(self, planner: LoadPlanner, folder: object) -> None:
        self._planner, self._folder = planner, folder

    def __getattr__(self, name: str) -> Any:
        return getattr(self._planner, name)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        try:
            obj = torch.load(value, map_location="cpu", weights_only=True)
        except Exception as e:
            if not (isinstance(e, pickle.UnpicklingError) or "weights only load failed" in str(e).lower()):
                raise  # damage, not content: DCP reports it as an unreadable folder
            detail = next((line.strip() for line in str(e).splitlines() if "unsupported" in line.lower()
                           or "global" in line.lower()), type(e).__name__)
            raise UnsafeShardsError(
                f"{self._folder}: refused: its DCP entry {read_item.dest_index.fqn} is not plain data ({detail}); "
                f"do not use checkpoints from untrusted sources") from None
        clean = io.BytesIO()
        torch.save(obj, clean)
        clean.seek(0)
        self._planner.load_bytes(read_item, clean)


class SafeReader(dcp.FileSystemReader):
    """DCP's file reader with its metadata read by `_MetadataUnpickler` and its bytes entries by `_SafeBytes` (the
    tensors themselves DCP reads with torch.load(weights_only=True))."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            try:
                metadata = _MetadataUnpickler(f).load()
            except UnsafeShardsError as e:
                raise UnsafeShardsError(
                    f"{self.path}: refused: its DCP metadata carries a pickled {e} that would run code when loaded; "
                    f"do not use checkpoints from untrusted sources") from None
        if not isinstance(metadata, Metadata):
            raise UnsafeShardsError(f"{self.path}: refused: its DCP metadata is a {type(metadata).__name__}, "
                                    f"not DCP's Metadata record")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        return super().read_data(plan, cast(LoadPlanner, _SafeBytes(planner, self.path)))


def stray_shards(checkpoint_dir: str | Path, prefix: str, keep: list[Path]) -> list[Path]:
    """DCP folders of this run that no kept resume file names: the temporary folders of killed saves and the
    shards of pruned or never-committed steps."""
    wanted = {shards_path(p).name for p in keep}
    return sorted(p for p in Path(checkpoint_dir).glob(f"{glob.escape(prefix)}_step*{SHARDS_SUFFIX}*")
                  if p.is_dir() and p.name not in wanted)
