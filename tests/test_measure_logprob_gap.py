"""benchmarks/measure_logprob_gap.py: the LoRA rows (perturbed adapters) on a tiny random model."""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch

from tests.helpers import ROOT, build_update_world


def _script():
    spec = importlib.util.spec_from_file_location("measure_logprob_gap", ROOT / "benchmarks" / "measure_logprob_gap.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _lora_b(actor: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in actor.named_parameters() if "lora_B" in n}


def test_perturb_adapters_gives_nonzero_seeded_adapters_of_the_stated_size():
    mod = _script()
    world = build_update_world(["--lora_r", "4", "--lora_alpha", "8"])
    actor = world.actor
    assert all(b.abs().max() == 0 for b in _lora_b(actor).values())  # peft's init: the adapters do nothing yet
    info = mod.perturb_adapters(actor, 0.05, seed=0)
    first = _lora_b(actor)
    assert info["layers"] == len(first) == 2 * 7  # 2 layers x (q, k, v, o, gate, up, down)
    assert all(b.abs().min() > 0 for b in first.values())
    assert info["rel_norm"] == pytest.approx(0.05, rel=1e-4)
    for m in actor.modules():  # every layer's adapter is --lora_delta of its own base weight
        if hasattr(m, "lora_B") and hasattr(m, "base_layer"):
            rel = m.get_delta_weight("default").norm() / m.base_layer.weight.norm()
            assert rel.item() == pytest.approx(0.05, rel=1e-4)
    mod.perturb_adapters(actor, 0.05, seed=0)
    assert all(torch.equal(first[n], b) for n, b in _lora_b(actor).items())  # the seed fixes the adapters
    mod.perturb_adapters(actor, 0.05, seed=1)
    assert not any(torch.equal(first[n], b) for n, b in _lora_b(actor).items())
    with pytest.raises(ValueError, match="no LoRA layers"):
        mod.perturb_adapters(build_update_world().actor, 0.05, seed=0)


def test_main_prints_lora_rows_with_finite_figures(capsys, monkeypatch):
    mod = _script()
    monkeypatch.chdir(ROOT)  # main() moves to the repository root; the test's cwd is restored afterwards
    threads = torch.get_num_threads()
    try:
        mod.main(["--sizes", "64x2:none", "--dtypes", "bfloat16", "--lora_r", "0,4", "--seeds", "0",
                  "--batch_size", "4", "--gen_len", "8"])
    finally:
        torch.set_num_threads(threads)
    lines = capsys.readouterr().out.strip().splitlines()
    header = lines[0].split()
    assert header[:4] == ["size", "dtype", "lora", "seed"] and header[4:] == list(mod.COLUMNS)
    rows = {(f[2], f[3]): dict(zip(mod.COLUMNS, map(float, f[4:]))) for f in (l.split() for l in lines[1:])}
    assert set(rows) == {("0", "0"), ("0", "mean"), ("4", "0"), ("4", "mean")}
    for r in rows.values():
        assert all(math.isfinite(v) for v in r.values()) and r["tok"] > 0
        assert 0.9 < r["A_ratio"] < 1.1 and r["move"] > 0
    # The sampler applies the adapters as peft's forward does (x W + s (x A) B), so LoRA adds no gap of its
    # own: nothing near the clip edge (log 1.2 = 0.18), whatever the rounding of this tiny model.
    assert rows[("4", "0")]["gap_max"] < 0.05 and rows[("4", "0")]["A_clipfrac"] == 0


def test_perturbed_adapters_are_not_zero():
    from tests.helpers import build_update_world

    mod = _script()
    w = build_update_world(["--lora_r", "4", "--lora_alpha", "8"])
    info = mod.perturb_adapters(w.actor, 0.05, seed=0)
    assert info["layers"] > 0 and info["rel_norm"] == pytest.approx(0.05, rel=0.2)
    assert all(p.abs().sum() > 0 for n, p in w.actor.named_parameters() if "lora_B" in n)


def test_bad_sizes_entry_is_one_line():
    mod = _script()
    with pytest.raises(SystemExit) as e:
        mod.main(["--sizes", "512"])
    assert str(e.value.code).startswith("error: --sizes entry '512'") and "\n" not in str(e.value.code)
