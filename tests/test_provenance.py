"""run.json: fields, sha256 of files and directories, git version, end and resume records."""

import hashlib
import json
import re
from datetime import datetime
from pathlib import Path

from trainer.run.provenance import (
    append_resume_record,
    changed_inputs,
    code_version,
    hash_path,
    mark_run_end,
    write_run_json,
)

ROOT = Path(__file__).resolve().parents[1]


def make_inputs(tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_bytes(b'{"conversations": []}\n' * 1000)
    weights = tmp_path / "full_sft_128.pth"
    weights.write_bytes(bytes(range(256)) * 5000)  # > 1 MiB: more than one read chunk
    hf = tmp_path / "hf_model"
    (hf / "sub").mkdir(parents=True)
    (hf / "config.json").write_text('{"hidden_size": 64}')
    (hf / "sub" / "model.safetensors").write_bytes(b"\x00\x01" * 100)
    return data, weights, hf


def test_write_run_json_records_everything(tmp_path):
    data, weights, hf = make_inputs(tmp_path)
    args = {"learning_rate": 1e-6, "save_dir": Path("out"), "use_wandb": True}
    info = write_run_json(tmp_path / "run", args=args, world_size=2, device="cpu", seed=42, data_path=str(data),
                          weight_paths=[str(weights), str(hf), str(tmp_path / "gone.pth")], extra={"note": "x"})
    on_disk = json.loads((tmp_path / "run" / "run.json").read_text())
    assert on_disk == info
    assert {"start_time", "status", "args", "argv", "code", "versions", "device", "world_size", "seed", "host",
            "data", "weights", "extra"} <= set(info)
    assert info["args"] == {"learning_rate": 1e-6, "save_dir": "out", "use_wandb": True}
    assert (info["device"], info["world_size"], info["seed"], info["status"]) == ("cpu", 2, 42, "running")
    assert info["extra"] == {"note": "x"}
    assert datetime.fromisoformat(info["start_time"]).utcoffset().total_seconds() == 0  # ISO, UTC
    assert set(info["versions"]) >= {"python", "torch", "transformers", "swanlab"}
    assert info["versions"]["torch"] and info["versions"]["python"].count(".") == 2

    assert info["data"]["sha256"] == hashlib.sha256(data.read_bytes()).hexdigest()
    w_file, w_dir, w_missing = info["weights"]
    assert w_file == {"path": str(weights), "sha256": hashlib.sha256(weights.read_bytes()).hexdigest(),
                      "bytes": 256 * 5000}
    cfg = hashlib.sha256(b'{"hidden_size": 64}').hexdigest()
    st = hashlib.sha256(b"\x00\x01" * 100).hexdigest()
    assert w_dir["files"] == {"config.json": cfg, "sub/model.safetensors": st}
    manifest = f"config.json\0{cfg}\nsub/model.safetensors\0{st}\n".encode()
    assert w_dir["sha256"] == hashlib.sha256(manifest).hexdigest()
    assert w_missing == {"path": str(tmp_path / "gone.pth"), "sha256": None, "missing": True}


def test_changed_inputs_names_exactly_the_files_whose_bytes_changed(tmp_path):
    data, weights, hf = make_inputs(tmp_path)
    info = write_run_json(tmp_path / "run", args={}, world_size=1, device="cpu", seed=0, data_path=str(data),
                          weight_paths=[str(weights), str(hf)])
    assert list(changed_inputs(info)) == []
    weights.write_bytes(bytes(range(256)) * 5000)  # rewritten, same bytes: not a change
    assert list(changed_inputs(info)) == []
    (hf / "sub" / "model.safetensors").write_bytes(b"\x00\x02" * 100)  # one shard of a directory
    data.write_bytes(data.read_bytes() + b'{"conversations": []}\n')
    assert list(changed_inputs(info)) == [str(data), str(hf)]
    weights.unlink()  # gone: left to the loader's own error
    assert list(changed_inputs(info)) == [str(data), str(hf)]
    assert list(changed_inputs({})) == []  # a resume file from before run.json had hashes


def test_no_data_path_and_no_weights(tmp_path):
    info = write_run_json(tmp_path, args={}, world_size=1, device="cpu", seed=0, data_path=None, weight_paths=[])
    assert info["data"] is None and info["weights"] == [] and info["extra"] == {}


def test_directory_hash_does_not_depend_on_creation_order(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    for name in ("x.bin", "y.bin"):
        (a / name).write_bytes(name.encode())
    for name in ("y.bin", "x.bin"):
        (b / name).write_bytes(name.encode())
    assert hash_path(a)["sha256"] == hash_path(b)["sha256"]
    (b / "x.bin").write_bytes(b"changed")
    assert hash_path(a)["sha256"] != hash_path(b)["sha256"]


def test_code_version_inside_and_outside_git(tmp_path, monkeypatch):
    inside = code_version(ROOT)
    if (ROOT / ".git").exists():
        assert re.fullmatch(r"[0-9a-f]{40}", inside["git_commit"])
        assert isinstance(inside["git_dirty"], bool)
    assert code_version(tmp_path) == {"git_commit": "unknown", "git_dirty": "unknown"}
    monkeypatch.setenv("PATH", str(tmp_path))  # no git binary at all: still no exception
    assert code_version(ROOT) == {"git_commit": "unknown", "git_dirty": "unknown"}


def test_git_dirty_flag_follows_the_tree(tmp_path):
    import subprocess

    repo = tmp_path / "repo"
    repo.mkdir()
    git = ["git", "-c", "user.email=t@t", "-c", "user.name=t"]
    subprocess.run([*git, "init", "-q"], cwd=repo, check=True)
    (repo / "f.py").write_text("a = 1\n")
    subprocess.run([*git, "add", "f.py"], cwd=repo, check=True)
    subprocess.run([*git, "commit", "-qm", "init"], cwd=repo, check=True)
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True).stdout.strip()
    assert code_version(repo) == {"git_commit": head, "git_dirty": False}
    (repo / "f.py").write_text("a = 2\n")
    assert code_version(repo) == {"git_commit": head, "git_dirty": True}


def test_mark_run_end_and_resume_records(tmp_path):
    run = tmp_path / "run"
    write_run_json(run, args={"x": 1}, world_size=1, device="cpu", seed=1, data_path=None, weight_paths=[])
    ended = mark_run_end(run, "crashed")
    assert ended["status"] == "crashed" and "end_time" in ended

    first = append_resume_record(run, {"step": 100, "checkpoint": "ckpt_100.pth"})
    second = append_resume_record(run, {"step": 200})
    on_disk = json.loads((run / "run.json").read_text())
    assert on_disk == second
    assert [r["step"] for r in on_disk["resumes"]] == [100, 200]
    r0 = on_disk["resumes"][0]
    assert r0["checkpoint"] == "ckpt_100.pth" and r0["previous_status"] == "crashed"
    assert "previous_end_time" in r0 and "end_time" not in first
    assert datetime.fromisoformat(r0["resumed_at"]).utcoffset().total_seconds() == 0
    assert on_disk["status"] == "running" and on_disk["args"] == {"x": 1}  # the original record is kept

    done = mark_run_end(run, "finished")
    assert done["status"] == "finished" and len(done["resumes"]) == 2


def test_resume_record_without_run_json_creates_it(tmp_path):
    info = append_resume_record(tmp_path / "new", {"step": 5})
    assert [r["step"] for r in info["resumes"]] == [5]
    assert json.loads((tmp_path / "new" / "run.json").read_text()) == info
