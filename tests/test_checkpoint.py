"""Resume files: exact resume after a real SIGKILL, crash-safe writes, fallback, flag checks, safe loading,
and the sample-stream arithmetic that makes a resume under another world size exact."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import time
import zipfile
from pathlib import Path

import pytest
import torch

from tests.helpers import deep_equal, make_tiny_world, read_metrics, run_main, run_train, sigkill_after, spawn_train, tiny_flags
from trainer.run import checkpoint as ckpt
from trainer.run.distributed import shard_batches

PREFIX = "ppo_actor_64_resume"
TIMING_KEYS = ("time", "tokens_per_s")  # plus every "time/..." key


def _name(step: int) -> str:
    return f"{PREFIX}_step{step:08d}.pth"








def wait_for_line(log: Path, prefix: str, proc: subprocess.Popen, timeout: float = 240) -> str:
    t_end = time.monotonic() + timeout
    while True:
        line = next((l for l in log.read_text().splitlines() if l.startswith(prefix)), None)
        if line is not None:
            return line
        assert proc.poll() is None and time.monotonic() < t_end, log.read_text()[-3000:]
        time.sleep(0.05)


def resumed_step(out: str) -> int:
    line = next(l for l in out.splitlines() if l.startswith("resumed from "))
    return int(line.split(" at step ")[1].split()[0])




def step_metrics(run_dir: Path) -> list[dict]:
    return [{k: v for k, v in row.items() if k not in TIMING_KEYS and not k.startswith("time/")}
            for row in read_metrics(run_dir)]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ckworld")
    w = make_tiny_world(tmp)
    from model.loader import build_minimind
    from model.weights import save_native_weights

    # Weights for another shape, so a changed --hidden_size gets as far as the resume check.
    torch.manual_seed(1)
    save_native_weights(build_minimind(96, w["layers"]), Path(w["save_dir"]) / "full_sft_96.pth", dtype=torch.float32)
    # A reward that draws from python's and numpy's global RNGs: exact resume must restore those
    # too, and restore them after swanlab's start-up, which draws from python's `random`.
    (tmp / "noisy_reward.py").write_text(
        "import random\nimport numpy as np\n\n"
        "def noisy(prompt, reply, reference):\n"
        "    return 0.05 * random.random() + 0.05 * float(np.random.rand())\n", encoding="utf-8")
    w["noisy"] = f"{tmp / 'noisy_reward.py'}:noisy"
    return w


@pytest.fixture(scope="module")
def short_run(world, tmp_path_factory):
    """A finished 3-step run, resume files for steps 1, 2, 3 (copy before modifying)."""
    tmp = tmp_path_factory.mktemp("short")
    code, out = run_main(tiny_flags(world, tmp, max_steps=3, keep_checkpoints=3))
    assert code is None, out[-3000:]
    assert [p.name for p in ckpt.list_resume_files(tmp / "ckpt", PREFIX)] == [_name(3), _name(2), _name(1)]
    return tmp


def copy_run(src: Path, dst: Path) -> None:
    shutil.copytree(src / "ckpt", dst / "ckpt")
    shutil.copytree(src / "run", dst / "run")


# ------------------------------------------------------------------------------ 1. exact resume
@pytest.mark.slow
def test_sigkill_twice_then_resume_is_bit_identical(world, tmp_path, monkeypatch):
    """Run A: 6 steps uninterrupted. Run B: SIGKILLed at an arbitrary moment after step 1 is saved,
    resumed (with swanlab on, which draws random numbers at start-up) and SIGKILLed again two steps
    later, then resumed to the end. The old-actor copy is refreshed every 2 steps, so a resume at an
    odd step must use the restored copy; adaptive KL moving; a reward drawing from python's and
    numpy's RNGs."""
    monkeypatch.chdir(tmp_path)  # swanlab writes ./swanlog
    common = dict(max_steps=6, save_interval=1, keep_checkpoints=2, update_old_actor_freq=2, adaptive_kl=1,
                  kl_target=0.01, kl_horizon=50, reward_fn=[world["noisy"]], sample_interval=1)
    a, b = tmp_path / "a", tmp_path / "b"
    code, out = run_main(tiny_flags(world, a, **common))
    assert code is None, out[-3000:]

    rng = random.Random()  # the kill moments are deliberately not reproducible
    p = spawn_train(tiny_flags(world, b, **common), tmp_path, tmp_path / "b1.log")
    # A tiny step outlasts the 0-0.1 s delay: kills land inside a step, and the second one always leaves at
    # least two steps to run, so a quiet, fast machine cannot finish the run before the kill.
    sigkill_after(p, b / "ckpt" / _name(1), delay=rng.uniform(0.0, 0.1))
    log2 = tmp_path / "b2.log"
    p = spawn_train(tiny_flags(world, b, **common, from_resume=1, swanlab_mode="offline"), tmp_path, log2)
    first = resumed_step(wait_for_line(log2, "resumed from ", p))
    assert 1 <= first <= 3  # the kill came after step 1 was saved, well before the end
    sigkill_after(p, b / "ckpt" / _name(min(first + 2, 4)), delay=rng.uniform(0.0, 0.1))
    code, out3 = run_main(tiny_flags(world, b, **common, from_resume=1))
    assert code is None, out3[-3000:]

    second = resumed_step(out3)
    assert first < second < 6, (first, second)  # killed at two different steps
    out2 = log2.read_text()
    assert "swanlab offline run" in out2 and "flag changed on resume: --swanlab_mode: 'disabled' -> 'offline'" in out2
    assert "--from_resume" not in out2  # differs on every resume by design: not reported

    files = ckpt.list_resume_files(b / "ckpt", PREFIX)
    assert [f.name for f in files] == [_name(6), _name(5)]  # --keep_checkpoints 2
    assert not ckpt.stray_temp_files(b / "ckpt", PREFIX)
    sa, sb = ckpt.read_resume(a / "ckpt" / _name(6)), ckpt.read_resume(files[0])
    for key in ("actor", "critic", "old_actor"):
        assert sa[key].keys() == sb[key].keys()
        diff = [k for k in sa[key] if not torch.equal(sa[key][k], sb[key][k])]
        assert not diff, f"{key} differs after resume: {diff[:5]}"
    # Everything else that drives the rest of the run too: optimizers, schedulers, KL state, RNGs.
    skip = {"args", "run", "swanlab_id", "run_id"}  # run_id: two runs, two ids
    assert not deep_equal({k: v for k, v in sa.items() if k not in skip}, {k: v for k, v in sb.items() if k not in skip})
    assert sa["kl_ctl"]["value"] != 0.02  # the adaptive controller did move

    ma, mb = step_metrics(a / "run"), step_metrics(b / "run")
    assert [r["step"] for r in mb] == [1, 2, 3, 4, 5, 6]
    assert ma == mb

    def sam(d: Path) -> list[str]:
        return (d / "run" / "samples.jsonl").read_text().splitlines()

    assert sam(a) == sam(b)


def _uninterrupted_equals_killed_at_2(world, tmp_path: Path, common: dict) -> tuple[dict, list[dict]]:
    """Run `common` straight through, and again SIGKILLed once its step-2 resume file exists and resumed: the
    last resume files and the metrics are equal. Returns the last resume file and the metrics."""
    a, b = tmp_path / "a", tmp_path / "b"
    code, out = run_main(tiny_flags(world, a, **common))
    assert code is None, out[-3000:]
    steps = common["max_steps"]

    def name(step: int) -> str:
        return f"{common['save_weight']}_64_resume_step{step:08d}.pth"

    p = spawn_train(tiny_flags(world, b, **common), tmp_path, tmp_path / "b1.log")
    sigkill_after(p, b / "ckpt" / name(2), delay=0.05)
    code, out2 = run_main(tiny_flags(world, b, **common, from_resume=1))
    assert code is None, out2[-3000:]
    assert 2 <= resumed_step(out2) < steps
    sa, sb = ckpt.read_resume(a / "ckpt" / name(steps)), ckpt.read_resume(b / "ckpt" / name(steps))
    skip = {"args", "run", "swanlab_id", "run_id"}
    assert not deep_equal({k: v for k, v in sa.items() if k not in skip}, {k: v for k, v in sb.items() if k not in skip})
    ma, mb = step_metrics(a / "run"), step_metrics(b / "run")
    assert ma == mb
    return sa, ma


@pytest.mark.slow
def test_critic_free_run_with_dynamic_sampling_resumes_bit_identical_after_sigkill(world, tmp_path):
    """grpo with --filter_groups: no critic in the resume file, and the position in the prompt stream
    counts the extra batches each step drew, so a run killed and resumed draws exactly the prompts and
    random numbers an uninterrupted one does."""
    common = dict(max_steps=5, save_interval=1, keep_checkpoints=2, advantage_estimator="grpo", num_generations=2,
                  batch_size=2, mini_batch_size=2, filter_groups=1, temperature=1.3, rm_weight=0,
                  reward_fn=[f"{Path(__file__).parent / 'fixtures' / 'toy_rewards.py'}:coarse"], save_weight="grpo")
    sa, ma = _uninterrupted_equals_killed_at_2(world, tmp_path, common)
    assert sa["critic"] is None and list(sa["optim"]) == ["actor"]
    assert [r["step"] for r in ma] == [1, 2, 3, 4, 5]
    extra = sum(r["filter/extra_rollouts"] for r in ma)
    assert extra > 0 and sum(r["filter/groups_dropped"] for r in ma) > 0, "no group was filtered: the test would prove little"
    assert sa["consumed"] == 2 * (5 + extra)


@pytest.mark.slow
def test_running_reward_norm_resumes_bit_identical_after_sigkill(world, tmp_path):
    """--reward_norm running: its moments are in the resume file, so a killed and resumed run normalises the
    next rewards exactly as the uninterrupted one."""
    common = dict(max_steps=4, save_interval=1, keep_checkpoints=2, advantage_estimator="rloo", num_generations=2,
                  batch_size=2, mini_batch_size=2, reward_norm="running", reward_clip=1.5, temperature=1.3, rm_weight=0,
                  reward_fn=[f"{Path(__file__).parent / 'fixtures' / 'toy_rewards.py'}:coarse"], save_weight="norm")
    sa, _ = _uninterrupted_equals_killed_at_2(world, tmp_path, common)
    assert sa["reward_norm"]["count"] == 4 * 4  # every reward of 4 steps x 4 responses


# ------------------------------------------------------------------------------ 2. crash-safe writes
def test_truncated_newest_and_partial_tmp_fall_back_with_warning(world, short_run, tmp_path):
    copy_run(short_run, tmp_path)
    ck = tmp_path / "ckpt"
    newest = ck / _name(3)
    data = newest.read_bytes()
    newest.write_bytes(data[: len(data) // 2])  # a save torn in half (what a non-atomic write leaves)
    stray = ck / (_name(4) + ".k1ll3d.tmp")  # what atomic_torch_save leaves when killed mid-write
    stray.write_bytes(data[:1000])
    code, out = run_main(tiny_flags(world, tmp_path, max_steps=4, keep_checkpoints=2, from_resume=1))
    assert code is None, out[-3000:]
    warn = next(l for l in out.splitlines() if l.startswith("warning:"))
    assert str(newest) in warn and "truncated or corrupt" in warn and "falling back" in warn
    assert f"ignoring {stray}" in out
    assert resumed_step(out) == 2
    # Steps 3 and 4 were re-run and saved; the torn file was replaced; exactly 2 kept; tmp cleaned.
    assert sorted(p.name for p in ck.iterdir() if p.name != ".minippo.lock") == [_name(3), _name(4)]
    assert ckpt.read_resume(ck / _name(4))["step"] == 4
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [1, 2, 3, 4]


def test_flipped_bit_is_detected_by_crc(short_run, tmp_path):
    """torch.load itself would return the damaged tensor without complaint."""
    src = short_run / "ckpt" / _name(3)
    dst = tmp_path / _name(3)
    data = bytearray(src.read_bytes())
    with zipfile.ZipFile(src) as z:
        big = max(z.infolist(), key=lambda m: m.file_size)
    name_len = int.from_bytes(data[big.header_offset + 26: big.header_offset + 28], "little")
    extra_len = int.from_bytes(data[big.header_offset + 28: big.header_offset + 30], "little")
    start = big.header_offset + 30 + name_len + extra_len
    data[start + big.file_size // 2] ^= 0x01
    dst.write_bytes(bytes(data))
    torch.load(dst, weights_only=True)  # loads "fine"
    with pytest.raises(ckpt.ResumeError, match="checksum mismatch"):
        ckpt.read_resume(dst)


def test_every_file_unreadable_is_an_error_not_a_fresh_start(tmp_path):
    for step in (1, 2):
        (tmp_path / _name(step)).write_bytes(b"PK\x03\x04 not really")
    msgs: list[str] = []
    with pytest.raises(ckpt.ResumeError, match="none of the 2 resume files"):
        ckpt.load_latest_resume(tmp_path, PREFIX, info=msgs.append)
    assert len(msgs) == 2 and _name(2) in msgs[0] and _name(1) in msgs[1]
    assert ckpt.load_latest_resume(tmp_path / "empty", PREFIX) is None  # nothing saved yet: new run


# ------------------------------------------------------------------------------ 3. flag mismatch
def _one_line_error(code) -> str:
    assert isinstance(code, str) and code.startswith("error: ") and "\n" not in code, code
    return code


def test_changed_hidden_size_names_the_flag(world, short_run, tmp_path):
    copy_run(short_run, tmp_path)
    code, out = run_main(tiny_flags(world, tmp_path, hidden_size=96, from_resume=1))
    msg = _one_line_error(code)
    assert "--hidden_size is 96" in msg and "--hidden_size 64" in msg and _name(3) in msg
    assert not list((tmp_path / "ckpt").glob("ppo_actor_96_*"))  # did not quietly start a new run


def test_changed_batch_size_names_the_flag(world, short_run, tmp_path):
    copy_run(short_run, tmp_path)
    code, out = run_main(tiny_flags(world, tmp_path, batch_size=2, from_resume=1))
    msg = _one_line_error(code)
    assert "--batch_size is 2" in msg and "--batch_size 4" in msg
    assert [p.name for p in ckpt.list_resume_files(tmp_path / "ckpt", PREFIX)][0] == _name(3)  # untouched


def test_harmless_flag_changes_are_allowed_and_reported(world, short_run, tmp_path):
    copy_run(short_run, tmp_path)
    code, out = run_main(tiny_flags(world, tmp_path, max_steps=4, save_interval=2, from_resume=1))
    assert code is None, out[-3000:]
    assert resumed_step(out) == 3
    assert "flag changed on resume: --max_steps: 3 -> 4" in out
    assert "flag changed on resume: --save_interval: 1 -> 2" in out
    assert "--from_resume" not in out
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [1, 2, 3, 4]
    assert ckpt.read_resume(tmp_path / "ckpt" / _name(4))["args"]["max_steps"] == 4


def test_changed_starting_weights_refuse_to_resume_unless_asked(tmp_path):
    """The reference model is rebuilt from --from_weight on resume: a retrained SFT file under the same
    name would silently change what the KL measures, so the resume is refused with a one-line error."""
    from model.loader import build_minimind
    from model.weights import save_native_weights

    w = make_tiny_world(tmp_path, n_prompts=16)
    code, out = run_main(tiny_flags(w, tmp_path, max_steps=1))
    assert code is None, out[-3000:]
    sft = Path(w["save_dir"]) / "full_sft_64.pth"
    torch.manual_seed(7)
    save_native_weights(build_minimind(64, w["layers"]), sft, dtype=torch.float32)
    code, out = run_main(tiny_flags(w, tmp_path, max_steps=2, from_resume=1))
    msg = _one_line_error(code)
    assert str(sft) in msg and "--resume_check_inputs 0" in msg
    assert [p.name for p in ckpt.list_resume_files(tmp_path / "ckpt", PREFIX)] == [_name(1)]  # nothing trained
    code, out = run_main(tiny_flags(w, tmp_path, max_steps=2, from_resume=1, resume_check_inputs=0))
    assert code is None, out[-3000:]
    assert resumed_step(out) == 1 and f"warning: {sft} changed since this run started" in out
    # Accepted once: run.json now records the new bytes, so the next resume needs no flag.
    run = json.loads((tmp_path / "run" / "run.json").read_text())
    assert run["resumes"][-1]["changed_inputs"] == [str(sft)]
    code, out = run_main(tiny_flags(w, tmp_path, max_steps=3, from_resume=1))
    assert code is None, out[-3000:]
    assert resumed_step(out) == 2 and "warning" not in out


# ------------------------------------------------------------------------------ 4. safety
class _RunsCode:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # unpickling this calls os.system("touch <marker>")
        return (os.system, (f"touch {self.marker}",))


def _plant_unsafe(ckpt_dir: Path, step: int, marker: Path) -> Path:
    path = ckpt_dir / _name(step)
    torch.save({"format_version": ckpt.FORMAT_VERSION, "args": {}, "actor": _RunsCode(marker)}, path)
    return path


def test_unsafe_pickle_is_refused_unit(tmp_path):
    marker = tmp_path / "pwned"
    path = _plant_unsafe(tmp_path, 7, marker)
    torch.save({"format_version": ckpt.FORMAT_VERSION, "args": {}}, tmp_path / _name(6))  # an older, fine file
    with pytest.raises(ckpt.UnsafeResumeError, match="refused") as e:
        ckpt.load_latest_resume(tmp_path, PREFIX, info=lambda m: None)  # not skipped in favour of step 6
    assert str(path) in str(e.value) and "posix.system" in str(e.value) and "weights_only=True" in str(e.value)
    assert not marker.exists()


@pytest.mark.slow
def test_unsafe_pickle_is_refused_by_the_cli(world, short_run, tmp_path):
    copy_run(short_run, tmp_path)
    marker = tmp_path / "pwned"
    path = _plant_unsafe(tmp_path / "ckpt", 9, marker)
    r = run_train(tiny_flags(world, tmp_path, from_resume=1), cwd=tmp_path, check=False)
    assert r.returncode != 0
    assert "Traceback" not in r.stderr and "refused" in r.stderr and str(path) in r.stderr, r.stderr[-2000:]
    assert not marker.exists()


# ------------------------------------------------------------------------------ 5. sample stream
def _global_order(n: int, seed: int, epoch: int, start: int, world: int, batch: int) -> list[int]:
    """The samples all ranks take, in global stream order (step by step, rank-interleaved)."""
    per_rank = [shard_batches(n, seed, epoch, start, r, world, batch) for r in range(world)]
    assert len({len(b) for b in per_rank}) == 1  # same number of steps on every rank
    return [per_rank[r][t][i] for t in range(len(per_rank[0])) for i in range(batch) for r in range(world)]


def test_stream_is_a_permutation_per_epoch():
    e0 = shard_batches(64, 42, 0, 0, 0, 1, 4)
    e1 = shard_batches(64, 42, 1, 0, 0, 1, 4)
    assert sorted(i for b in e0 for i in b) == list(range(64)) == sorted(i for b in e1 for i in b)
    assert e0 != e1 and e0 == shard_batches(64, 42, 0, 0, 0, 1, 4)


@pytest.mark.parametrize("start", [0, 8, 12, 13])
def test_two_ranks_together_take_the_one_rank_stream(start):
    one = [i for b in shard_batches(64, 42, 0, start, 0, 1, 4) for i in b]
    two = _global_order(64, 42, 0, start, 2, 4)
    # Ranks 0 and 1 of a step take 8 consecutive stream samples; a tail that cannot fill 2 x 4 is dropped.
    assert two == one[: len(two)] and len(one) - len(two) < 8
    r0, r1 = (shard_batches(64, 42, 0, start, r, 2, 4) for r in (0, 1))
    assert not set(i for b in r0 for i in b) & set(i for b in r1 for i in b)


@pytest.mark.parametrize("world_a,k,world_b,batch", [(2, 3, 1, 4), (1, 5, 2, 4), (2, 2, 3, 2), (3, 1, 2, 3)])
def test_resume_under_another_world_size_continues_the_global_stream(world_a, k, world_b, batch):
    """k steps under world_a, then resume at consumed = k * batch * world_a under world_b: the two
    parts together are a prefix of the global stream, nothing repeated, nothing skipped."""
    n, seed = 61, 7
    stream = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1000003 + 0)).tolist()
    before = _global_order(n, seed, 0, 0, world_a, batch)[: k * batch * world_a]
    consumed = k * batch * world_a
    after = _global_order(n, seed, 0, consumed, world_b, batch)
    seen = before + after
    assert len(set(seen)) == len(seen)
    assert seen == stream[: len(seen)]
    assert n - len(seen) < batch * world_b  # only the last partial global batch is dropped


def test_start_past_the_end_gives_no_batches():
    assert shard_batches(16, 0, 0, 16, 0, 1, 4) == [] and shard_batches(16, 0, 0, 14, 1, 2, 2) == []


# ------------------------------------------------------------------------------ 6. checkpoint.py units
def test_list_orders_by_step_and_ignores_other_files(tmp_path):
    for name in (_name(2), _name(10), _name(100), f"{PREFIX}_step123456789.pth",  # wider than the padding
                 "ppo_actor_640_resume_step00000500.pth", "ppo_actor_64_moe_resume_step00000500.pth",
                 _name(300) + ".x1.tmp", "other.pth"):
        (tmp_path / name).write_bytes(b"")
    names = [p.name for p in ckpt.list_resume_files(tmp_path, PREFIX)]
    assert names == [f"{PREFIX}_step123456789.pth", _name(100), _name(10), _name(2)]
    assert [p.name for p in ckpt.stray_temp_files(tmp_path, PREFIX)] == [_name(300) + ".x1.tmp"]
    others = {p.name for p in ckpt.other_shape_resume_files(tmp_path, "ppo_actor", PREFIX)}
    assert others == {"ppo_actor_640_resume_step00000500.pth", "ppo_actor_64_moe_resume_step00000500.pth"}


def test_save_resume_keeps_newest_k_and_cleans_partial_writes(tmp_path):
    (tmp_path / (_name(3) + ".dead.tmp")).write_bytes(b"partial")
    for step in (1, 2, 3, 4):
        path = ckpt.save_resume({"step": step, "w": torch.full((2,), float(step))}, tmp_path, PREFIX, step, keep=2)
        assert path.name == _name(step)
    assert sorted(p.name for p in tmp_path.iterdir()) == [_name(3), _name(4)]
    state = ckpt.read_resume(tmp_path / _name(4))
    assert state["format_version"] == ckpt.FORMAT_VERSION and torch.equal(state["w"], torch.tensor([4.0, 4.0]))
    ckpt.save_resume({"step": 5}, tmp_path, PREFIX, 5, keep=0)  # keep < 1 still keeps the file just written
    assert [p.name for p in tmp_path.iterdir()] == [_name(5)]


def test_a_corrupt_newest_file_never_costs_the_good_ones(tmp_path):
    """A corrupt newest file (here step 10, skipped at resume) must not count among the files kept: with
    --keep_checkpoints 1 the run resumed from step 8 would otherwise delete step 8 and then each save it
    writes, leaving only the corrupt file."""
    for step in (8, 10):
        ckpt.save_resume({"step": step}, tmp_path, PREFIX, step, keep=5)
    newest = tmp_path / _name(10)
    newest.write_bytes(newest.read_bytes()[:100])
    state, path = ckpt.load_latest_resume(tmp_path, PREFIX, info=lambda msg: None)
    assert path.name == _name(8)
    ckpt.save_resume({"step": 9}, tmp_path, PREFIX, 9, keep=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == [_name(9), _name(10)]
    state, path = ckpt.load_latest_resume(tmp_path, PREFIX, info=lambda msg: None)
    assert path.name == _name(9) and state["step"] == 9  # the good file survives, and is what resume finds
    ckpt.save_resume({"step": 10}, tmp_path, PREFIX, 10, keep=1)  # the run's own step 10 replaces the corrupt one
    assert [p.name for p in tmp_path.iterdir()] == [_name(10)] and ckpt.read_resume(tmp_path / _name(10))["step"] == 10


def test_a_save_weight_with_glob_characters_is_a_name_not_a_pattern(tmp_path):
    """--save_weight 'exp[lr3e-6]': listing (resume, the fresh-run guard), keep-K and clean-up all see its files."""
    prefix = ckpt.resume_prefix("exp[lr3e-6]", 64, False)
    (tmp_path / f"{prefix}_step00000003.pth.dead.tmp").write_bytes(b"partial")
    (tmp_path / f"{prefix}_step00000002.dcp.tmp").mkdir()
    for step in (1, 2, 3):
        ckpt.save_resume({"step": step}, tmp_path, prefix, step, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{prefix}_step00000002.pth", f"{prefix}_step00000003.pth"]
    assert [p.name for p in ckpt.list_resume_files(tmp_path, prefix)] == [f"{prefix}_step00000003.pth",
                                                                          f"{prefix}_step00000002.pth"]
    assert ckpt.load_latest_resume(tmp_path, prefix)[0]["step"] == 3
    other = ckpt.resume_prefix("exp[lr3e-6]", 96, False)
    (tmp_path / f"{other}_step00000001.pth").write_bytes(b"")
    assert [p.name for p in ckpt.other_shape_resume_files(tmp_path, "exp[lr3e-6]", prefix)] == [f"{other}_step00000001.pth"]


def test_read_resume_rejects_foreign_and_truncated_files(tmp_path):
    torch.save({"actor": {}}, tmp_path / "foreign.pth")
    with pytest.raises(ckpt.ResumeError, match="not a minippo resume file"):
        ckpt.read_resume(tmp_path / "foreign.pth")
    torch.save({"format_version": ckpt.FORMAT_VERSION, "w": torch.zeros(1000)}, tmp_path / "ok.pth")
    data = (tmp_path / "ok.pth").read_bytes()
    (tmp_path / "cut.pth").write_bytes(data[:-200])
    with pytest.raises(ckpt.ResumeError, match="unreadable") as e:
        ckpt.read_resume(tmp_path / "cut.pth")
    assert not isinstance(e.value, ckpt.UnsafeResumeError) and "cut.pth" in str(e.value)


def test_check_compatible():
    saved = {"hidden_size": 64, "batch_size": 4, "seed": 1, "max_steps": 3, "save_interval": 1, "from_resume": 0,
             "learning_rate": 1e-4}
    assert ckpt.check_compatible(saved, dict(saved, from_resume=1)) == []
    changes = ckpt.check_compatible(saved, dict(saved, max_steps=9, learning_rate=5e-5, from_resume=1))
    assert changes == ["--learning_rate: 0.0001 -> 5e-05", "--max_steps: 3 -> 9"]
    with pytest.raises(ckpt.ResumeError) as e:
        ckpt.check_compatible(saved, dict(saved, batch_size=8, seed=2, max_steps=9), source="x.pth")
    msg = str(e.value)
    assert "--batch_size is 8 but x.pth was written with --batch_size 4" in msg
    assert "--seed is 2 but x.pth was written with --seed 1" in msg and "max_steps" not in msg
    assert "\n" not in msg
    # A flag the older file does not know about is not an error.
    assert ckpt.check_compatible({"seed": 1}, {"seed": 1, "kl_estimator": "k3"}) == []
