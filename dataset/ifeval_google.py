"""Google's own IFEval checker, as shipped in the PyPI package `if-verifiable` (instructions.py, and the loose
variants and evaluation harness of its common.py), for tests/test_ifeval_reference.py and scripts/judge_ifeval.py. Not a dependency of the
trainer: it runs in a venv of its own (docs/smollm2_ifeval.md), where `load()` finds it.

The package's top-level __init__ imports `datasets` for its data loaders (left out: `pip install --no-deps`); the
checker needs nltk, langdetect and immutabledict only, so `load()` imports `if_verifiable.ifeval` and
`if_verifiable.common` without running that __init__. NLTK data: none is loaded here. Two checkers load NLTK's
`punkt_tab` lazily, when they check a reply (`length_constraints:number_sentences` through
`nltk.data.load("nltk:tokenizers/punkt/english.pickle")`, which nltk 3.9+ serves from punkt_tab, and
`change_case:capital_word_frequency` through `nltk.word_tokenize`); offline there is none, and they raise
LookupError. `punkt_available()` says whether it is there. langdetect is seeded (0): unseeded, its answers vary.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# The instructions whose check loads NLTK's punkt_tab data.
NEEDS_PUNKT = ("length_constraints:number_sentences", "change_case:capital_word_frequency")


@dataclass
class Google:
    instructions: dict[str, Any]  # instruction id -> checker class (INSTRUCTION_DICT)
    loose_variants: Callable[[str], list[str]]  # IFEval's loose variants of a reply (the reply itself first)
    evaluate: Callable[..., Any]  # if_verifiable.common.evaluate_instructions (strips the reply first: see judge_ifeval)
    langdetect: Any


def load() -> Google | str:
    """Google's checker, or why it cannot be loaded (one line)."""
    if "if_verifiable" not in sys.modules:  # (a second load() finds the stand-in below, which has no spec)
        try:
            spec = importlib.util.find_spec("if_verifiable")
        except (ImportError, ValueError):
            spec = None
        if spec is None or not spec.submodule_search_locations:
            return "if_verifiable (Google's IFEval checker) is not installed"
        pkg = types.ModuleType("if_verifiable")  # stands in for the package, whose __init__ imports `datasets`
        pkg.__path__ = list(spec.submodule_search_locations)
        sys.modules["if_verifiable"] = pkg
    try:
        registry = importlib.import_module("if_verifiable.ifeval.instructions_registry")
        common = importlib.import_module("if_verifiable.common")
        langdetect = importlib.import_module("langdetect")
    except ImportError as e:
        return f"if_verifiable's IFEval checker cannot be imported ({e})"
    langdetect.DetectorFactory.seed = 0  # langdetect is random unless seeded
    return Google(instructions=registry.INSTRUCTION_DICT, loose_variants=common.get_loose_transformations,
                  evaluate=common.evaluate_instructions, langdetect=langdetect)


def punkt_available() -> bool:
    """Whether NLTK's punkt_tab data (English) is installed, which NEEDS_PUNKT's checkers load."""
    try:
        nltk_data = importlib.import_module("nltk.data")
        nltk_data.find("tokenizers/punkt_tab/english/")
    except (ImportError, LookupError):
        return False
    return True
