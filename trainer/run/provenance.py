"""<run_dir>/run.json: what produced a run (flags, code version, library versions, input hashes).

    info = write_run_json(run_dir, args=vars(args), world_size=2, device="cuda:0", seed=42,
                          data_path="dataset/rlaif.jsonl", weight_paths=["out/full_sft_512.pth"])
    ...                                   # on resume instead: append_resume_record(run_dir, {...})
    mark_run_end(run_dir, "finished")

Hashes are sha256 of the bytes. A directory (e.g. a Hugging Face model folder) gets one digest
over its files in sorted relative-path order: sha256 of the lines "<relpath>\\0<file sha256>\\n",
plus the per-file digests under "files", so a changed shard is easy to spot. Nothing here may
stop a run: git problems give "unknown", a missing input is recorded as such.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import platform
import socket
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

__all__ = ["write_run_json", "mark_run_end", "append_resume_record", "code_version", "library_versions",
           "sha256_file", "hash_path", "read_run_json", "changed_inputs", "rehash_inputs"]

RUN_JSON = "run.json"
_CHUNK = 1 << 20
_LIBRARIES = ("torch", "transformers", "tokenizers", "numpy", "swanlab", "reasoning-gym")  # reasoning-gym: --reasoning_gym rows


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def sha256_file(path: str | Path) -> str:
    """sha256 hex digest of a file, read in 1 MiB chunks (weights can be GBs)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def hash_path(path: str | Path) -> dict[str, Any]:
    """{"path", "sha256", "bytes"} for a file; for a directory also {"files": {relpath: sha256}};
    for a missing path sha256 is None and "missing" is True."""
    p = Path(path)
    if p.is_file():
        return {"path": str(path), "sha256": sha256_file(p), "bytes": p.stat().st_size}
    if p.is_dir():
        files = sorted((f for f in p.rglob("*") if f.is_file()), key=lambda f: f.relative_to(p).as_posix())
        per_file = {f.relative_to(p).as_posix(): sha256_file(f) for f in files}
        manifest = "".join(f"{rel}\0{digest}\n" for rel, digest in per_file.items())
        return {"path": str(path), "sha256": hashlib.sha256(manifest.encode("utf-8")).hexdigest(),
                "bytes": sum(f.stat().st_size for f in files), "files": per_file}
    return {"path": str(path), "sha256": None, "missing": True}


def _git(args: list[str], cwd: Path) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=10,
                             stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError):  # no git binary, timeout, ...
        return None
    return out.stdout if out.returncode == 0 else None


def code_version(repo_dir: str | Path | None = None) -> dict[str, Any]:
    """Git commit and dirtiness of the repo holding this file (or repo_dir); "unknown" outside git.
    Untracked, non-ignored files count as dirty: a new module changes what runs."""
    cwd = Path(repo_dir) if repo_dir is not None else Path(__file__).resolve().parent
    commit = _git(["rev-parse", "HEAD"], cwd)
    if commit is None:
        return {"git_commit": "unknown", "git_dirty": "unknown"}
    status = _git(["status", "--porcelain"], cwd)
    return {"git_commit": commit.strip(), "git_dirty": "unknown" if status is None else bool(status.strip())}


def library_versions() -> dict[str, str | None]:
    """Installed versions (from package metadata, so nothing heavy is imported); None if absent."""
    versions: dict[str, str | None] = {"python": platform.python_version()}
    for name in _LIBRARIES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def read_run_json(run_dir: str | Path) -> dict[str, Any]:
    """run.json as a dict ({} if missing or unreadable, so an end/resume record can still be written)."""
    path = Path(run_dir) / RUN_JSON
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def _write(run_dir: str | Path, info: dict[str, Any]) -> None:
    path = Path(run_dir) / RUN_JSON
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(RUN_JSON + ".tmp")
    # default=str: flags may hold Paths or other simple objects; run.json is for reading, not replay.
    tmp.write_text(json.dumps(info, indent=2, ensure_ascii=False, default=str) + "\n", encoding="utf-8")
    os.replace(tmp, path)  # never a half-written run.json


def write_run_json(run_dir: str | Path, *, args: dict, world_size: int, device: str, seed: int,
                   data_path: str | None, weight_paths: list[str], extra: dict | None = None,
                   run_id: str | None = None) -> dict:
    """Write <run_dir>/run.json for a fresh run and return its content (for the resume file).
    Fields: run_id (also in every resume file of the run), start_time (ISO UTC), status "running", args, argv, code, versions, device,
    world_size, seed, host, data (hash record or None), weights (hash records), extra."""
    info: dict[str, Any] = {
        "run_id": run_id,
        "start_time": _now(),
        "status": "running",
        "args": args,
        "argv": list(sys.argv),
        "code": code_version(),
        "versions": library_versions(),
        "device": device,
        "world_size": world_size,
        "seed": seed,
        "host": socket.gethostname(),
        "data": hash_path(data_path) if data_path else None,
        "weights": [hash_path(p) for p in weight_paths],
        "extra": extra or {},
    }
    info = json.loads(json.dumps(info, default=str))  # the returned dict equals what is on disk
    _write(run_dir, info)
    return info


def mark_run_end(run_dir: str | Path, status: str) -> dict:
    """Add end_time and status (e.g. "finished", "stopped_nonfinite", "crashed") to run.json."""
    info = read_run_json(run_dir)
    info["end_time"] = _now()
    info["status"] = status
    _write(run_dir, info)
    return info


def append_resume_record(run_dir: str | Path, record: dict) -> dict:
    """Append {"resumed_at": <ISO UTC>, **record} to run.json's "resumes" list (created if missing).
    The run is "running" again; the status/end_time it had before moves into the record as
    previous_status/previous_end_time."""
    info = read_run_json(run_dir)
    entry = {"resumed_at": _now(), **record}
    if "status" in info:
        entry.setdefault("previous_status", info["status"])
    if "end_time" in info:
        entry.setdefault("previous_end_time", info.pop("end_time"))
    info.setdefault("resumes", []).append(json.loads(json.dumps(entry, default=str)))
    info["status"] = "running"
    _write(run_dir, info)
    return info


def changed_inputs(run: dict) -> dict[str, dict]:
    """{path: its hash record now} for a run's recorded inputs (prompt data, weights, reward model) whose
    bytes differ from when the run started. Paths that no longer exist are left to the loaders' errors."""
    out = {}
    for r in [run.get("data"), *run.get("weights", [])]:
        if isinstance(r, dict) and r.get("sha256") and Path(r["path"]).exists():
            now = hash_path(r["path"])
            if now["sha256"] != r["sha256"]:
                out[r["path"]] = now
    return out


def rehash_inputs(run_dir: str | Path, changed: dict[str, dict]) -> dict:
    """Put `changed` (inputs a resumed run accepted, from changed_inputs) into run.json's data/weights
    entries, so the next resume checks against what the run now uses. Returns run.json."""
    info = read_run_json(run_dir)
    records = [info.get("data"), *info.get("weights", [])]
    records = [changed.get(r["path"], r) if isinstance(r, dict) else r for r in records]
    info["data"], info["weights"] = records[0], records[1:]
    _write(run_dir, info)
    return info
