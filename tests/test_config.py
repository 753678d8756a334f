"""trainer/config.py: the typed config, one flat frozen dataclass built from the documented groups."""

from __future__ import annotations

import dataclasses
import re

import pytest

from trainer import config as config_mod
from trainer.run import cli as C


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
