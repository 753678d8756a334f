import os
import sys
from pathlib import Path

# Nothing in the suite may reach the network or prompt for a login.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("SWANLAB_MODE", "disabled")

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def pytest_collection_modifyitems(config, items) -> None:
    """`gpu`-marked tests skip where CUDA is not available, so the suite passes on a CPU and
    `python -m pytest -m gpu` runs them on a GPU machine."""
    import pytest
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)
