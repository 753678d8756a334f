"""trainer/config.py: the typed config, one flat frozen dataclass built from the documented groups."""

from __future__ import annotations

import dataclasses
import re

import pytest

from trainer import config as config_mod
from trainer import sections
from trainer.run import cli as C
from trainer.runtime import DistInfo


def test_each_field_has_a_docstring_and_names_are_unique():
    seen = set()
    for cls, _ in config_mod.GROUPS.values():
        docs = C.field_docs(cls)
        for f in dataclasses.fields(cls):
            assert docs.get(f.name), f"{cls.__name__}.{f.name} has no docstring"
            assert f.name not in seen
            seen.add(f.name)


def test_help_says_what_flags_do_without_figures():
    """Help strings say what a flag does and when to use it; measurements live in docs/."""
    for cls, _ in config_mod.GROUPS.values():
        for name, doc in C.field_docs(cls).items():
            assert not re.search(r"\b\d+(\.\d+)?\s*(s|ms|MB|GB)\b|\d\s*->\s*\d", doc), f"--{name}: {doc}"


def test_settings_are_attributes_of_one_flat_frozen_dataclass():
    cfg = C.parse_args(["--clip_epsilon", "0.1", "--use_wandb"])
    assert cfg.clip_epsilon == 0.1 and cfg.use_wandb == 1
    assert "clip_epsilon" in {f.name for f in dataclasses.fields(cfg)}  # a field, not a lookup a type checker cannot see
    assert not hasattr(config_mod.Config, "__getattr__")
    for cls, _ in config_mod.GROUPS.values():
        assert isinstance(cfg, cls)  # every group is a base: its fields are the config's own
    # The flat field order is the groups' order (what run.json and --help list).
    group_order = [f.name for cls, _ in config_mod.GROUPS.values() for f in dataclasses.fields(cls)]
    assert [f.name for f in dataclasses.fields(cfg)] == [*group_order, "config", "resolved"]
    other = cfg.replace(clip_epsilon=0.3)
    assert other.clip_epsilon == 0.3 and cfg.clip_epsilon == 0.1
    with pytest.raises(AttributeError):
        cfg.no_such_setting
    with pytest.raises(AttributeError, match="no setting 'clip_epslon'"):
        cfg.replace(clip_epslon=0.3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.clip_epsilon = 1.0  # type: ignore[misc]


def test_each_section_carries_its_flags_under_their_own_names():
    """cfg.loss / estimator / optim / sampling / update hold the flags' values under the flags' names (a loss written
    against the whole config reads the same names off its section); only the component's name, the nested sections
    and two derived values are not settings of their own."""
    raw = C.parse_args(["--advantage_estimator", "grpo", "--num_generations", "4", "--policy_loss", "gspo",
                        "--clip_epsilon", "0.1", "--gamma", "1", "--learning_rate", "3e-5", "--top_k", "5",
                        "--greedy", "1", "--entropy_coef", "0.01", "--mini_batch_size", "0"])
    assert raw.loss.clip_epsilon_high == 0.1  # not given: the symmetric clip, as resolve fills it in
    cfg = C.resolve(raw, DistInfo())
    built = {sections.PolicyLossConfig: cfg.loss, sections.EstimatorConfig: cfg.estimator, sections.OptimConfig: cfg.optim,
             sections.SamplingConfig: cfg.sampling, sections.UpdateConfig: cfg.update}
    not_settings = {"name", "loss", "optim", "sample_temperature", "train_attn"}
    for cls, section in built.items():
        assert type(section) is cls and dataclasses.is_dataclass(section)
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(section, dataclasses.fields(section)[0].name, None)
        for f in dataclasses.fields(section):
            if f.name not in not_settings:
                assert f.name in config_mod.SETTINGS, f"{cls.__name__}.{f.name} is no flag"
                assert getattr(section, f.name) == getattr(cfg, f.name), f"{cls.__name__}.{f.name}"
    assert (cfg.loss.name, cfg.estimator.name) == ("gspo", "grpo")
    assert (cfg.loss.loss_agg_mode, cfg.loss.clip_epsilon_high, cfg.estimator.num_generations) == ("seq_mean_token_mean", 0.1, 4)
    assert cfg.update.loss == cfg.loss and cfg.update.optim == cfg.optim and cfg.update.mini_batch_size == cfg.rows == 128
    assert cfg.sampling.sample_temperature == cfg.update.sample_temperature == cfg.sample_temperature == 1.0  # --greedy
    assert cfg.update.train_attn == cfg.train_attn
