"""trainer/run/hardware.py: what "auto" means on this machine (dtype, bf16 detection, the frozen models' precision)."""

from __future__ import annotations

import torch

import train_ppo as T
from tests.helpers import UPDATE_BASE_FLAGS, build_update_world, fake_cuda
from trainer.run import hardware as H
from trainer.run import setup as S
from trainer.runtime import DTYPES


def _args(*flags: str):
    return T.parse_args([*UPDATE_BASE_FLAGS, *flags])


@fake_cuda(1, capability=(8, 0))
def test_precision_rules_have_one_home():
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert H.resolve_precision(_args(), cpu) == ("float32", torch.float32)
    assert H.resolve_precision(_args(), cuda) == ("bfloat16", torch.bfloat16)
    assert H.resolve_precision(_args("--dtype", "bfloat16"), cpu) == ("bfloat16", torch.float32)  # -1: CUDA only
    assert H.resolve_precision(_args("--dtype", "bfloat16", "--frozen_low_precision", "1"), cpu) == ("bfloat16", torch.bfloat16)
    assert H.resolve_precision(_args("--frozen_low_precision", "0"), cuda) == ("bfloat16", torch.float32)


def test_cpu_native_bf16_reads_the_cpu_flags(tmp_path, monkeypatch):
    info = tmp_path / "cpuinfo"
    for flags, native in (("fpu avx2 avx512f avx512_bf16", True), ("fpu amx_bf16 amx_tile", True),
                          ("fpu avx2 avx512f avx512_vnni", False)):
        info.write_text(f"processor\t: 0\nflags\t\t: {flags}\n\nprocessor\t: 1\nflags\t\t: {flags}\n")
        assert H.cpu_native_bf16(info) is native, flags
    # No flags to read (not Linux): torch's own capability checks decide.
    for avx512_bf16, amx in ((True, False), (False, True), (False, False)):
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda v=avx512_bf16: v)
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda v=amx: v)
        assert H.cpu_native_bf16(tmp_path / "missing") is (avx512_bf16 or amx)


def test_bf16_on_a_cpu_needs_native_flags_and_a_measured_gain(monkeypatch):
    """Native bf16 in the flags is not enough: a Xeon with AVX512-BF16 and no AMX multiplies bf16 at about half its
    fp32 rate. Without the flags nothing is measured (emulated bf16 is always the slower)."""
    measured = []

    def speedup(threads, value):
        measured.append(threads)
        return value

    for native, ratio, want in ((True, 0.55, False), (True, 1.19, False), (True, 1.2, True), (True, 5.0, True),
                                (False, 5.0, False)):
        measured.clear()
        monkeypatch.setattr(H, "cpu_native_bf16", lambda native=native: native)
        monkeypatch.setattr(H, "cpu_bf16_speedup", lambda threads, ratio=ratio: speedup(threads, ratio))
        assert H.cpu_bf16_faster(3) is want, (native, ratio)
        assert measured == ([3] if native else [])  # at the run's thread count; never without the flags
    # --dtype auto asks at the run's --num_threads, and only for a model large enough to gain
    monkeypatch.setattr(H, "cpu_native_bf16", lambda: True)
    monkeypatch.setattr(H, "cpu_bf16_speedup", lambda threads: speedup(threads, 2.0))
    measured.clear()
    big = H.policy_layer_params(_args("--hidden_size", "768", "--num_hidden_layers", "16"))
    assert H.resolve_precision(_args("--num_threads", "1"), torch.device("cpu"), big) == ("bfloat16", torch.bfloat16)
    assert H.resolve_precision(_args(), torch.device("cpu"), H.BF16_CPU_MIN_LAYER_PARAMS - 1)[0] == "float32"
    assert measured == [1]


def test_cpu_bf16_speedup_measures_this_cpu_once():
    threads = torch.get_num_threads()
    H.cpu_bf16_speedup.cache_clear()
    ratio = H.cpu_bf16_speedup(1)
    assert 0 < ratio < 1000 and ratio == ratio  # a real timing ratio, finite
    assert torch.get_num_threads() == threads  # the probe's thread count does not leak into the run
    assert H.cpu_bf16_speedup(1) == ratio and H.cpu_bf16_speedup.cache_info().hits == 1


@fake_cuda(1, capability=(8, 0))
def test_auto_precision_picks_bf16_on_a_cpu_only_for_large_models_where_bf16_is_faster(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    demo, big = H.policy_layer_params(T.parse_args([])), H.policy_layer_params(_args("--hidden_size", "768", "--num_hidden_layers", "16"))
    assert demo < H.BF16_CPU_MIN_LAYER_PARAMS <= big
    for native in (True, False):
        monkeypatch.setattr(H, "cpu_bf16_faster", lambda threads=None, native=native: native)
        # The demo's 128x4 model keeps fp32 everywhere: its output stays byte-identical.
        assert H.resolve_precision(_args(), cpu, demo) == ("float32", torch.float32)
        want = ("bfloat16", torch.bfloat16) if native else ("float32", torch.float32)
        assert H.resolve_precision(_args(), cpu, big) == want  # --frozen_low_precision -1 follows the same rule
        # An explicit --dtype wins; the frozen models follow the rule unless the flag says otherwise.
        assert H.resolve_precision(_args("--dtype", "float32"), cpu, big) == ("float32", torch.float32)
        assert H.resolve_precision(_args("--dtype", "bfloat16"), cpu, big) == ("bfloat16", want[1])
        assert H.resolve_precision(_args("--frozen_low_precision", "0"), cpu, big) == (want[0], torch.float32)
        assert H.resolve_precision(_args(), cpu, None) == ("float32", torch.float32)  # size unknown
        assert H.resolve_precision(_args(), cuda, demo) == ("bfloat16", torch.bfloat16)  # CUDA: always


def test_auto_precision_sizes_the_model_from_its_config(tmp_path, monkeypatch):
    """The rule reads the actor's size before loading it: an --actor_path's config.json, or the shape flags."""
    from tests.tiny_hf import save_tiny_causal_lm

    m, _ = save_tiny_causal_lm(tmp_path / "hf", hidden=32, layers=2)
    n = sum(p.numel() for name, p in m.named_parameters() if ".layers." in name and p.dim() == 2)
    assert H.policy_layer_params(_args("--actor_path", str(tmp_path / "hf"))) == n
    assert H.policy_layer_params(_args("--actor_path", str(tmp_path / "nowhere"))) is None
    # 512x8 MiniMind: 8 x (q,o 512x512; k,v 256x512; gate/up/down 1664x512)
    assert H.policy_layer_params(_args("--hidden_size", "512", "--num_hidden_layers", "8")) == 8 * 512 * (2 * 512 + 2 * 256 + 3 * 1664)
    monkeypatch.setattr(H, "cpu_bf16_faster", lambda threads=None: True)
    monkeypatch.setattr(H, "BF16_CPU_MIN_LAYER_PARAMS", n)  # the tiny model counts as large
    world = build_update_world(["--actor_path", str(tmp_path / "hf"), "--dtype", "auto"])
    cfg = world.cfg
    assert cfg.dtype == "bfloat16" and cfg.flat()["dtype"] == "bfloat16" and cfg.frozen_dtype == torch.bfloat16
    assert {p.dtype for p in world.models.ref.parameters()} == {torch.bfloat16}


def test_auto_precision_on_gpus_follows_native_bf16():
    """bf16 from compute capability 8.0 (A100, H100); fp16 with the loss scaler on V100/T4 (7.x), whose
    bf16 is emulated; fp32 before. The frozen models follow (--frozen_low_precision -1)."""
    cuda = torch.device("cuda", 0)
    for cap, want in (((9, 0), "bfloat16"), ((8, 0), "bfloat16"), ((7, 5), "float16"), ((7, 0), "float16"), ((6, 1), "float32")):
        with fake_cuda(1, capability=cap):
            assert H.resolve_precision(_args(), cuda) == (want, DTYPES[want]), cap
            assert H.resolve_precision(_args("--dtype", "float32"), cuda) == ("float32", torch.float32)
    with fake_cuda(1, capability=(7, 0)):
        world = build_update_world()  # the scaler is what fp16 turns on (built on the CPU here)
        optim = S.build_optim(world.args, world.models, 5, torch.float16, cuda)
        assert optim.scaler.is_enabled()
