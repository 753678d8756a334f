"""MiniMind models on transformers: config, causal LM, critic, weight IO, loader, sampling.

Importing this package registers the `minimind` model type with transformers' Auto classes.
"""

from .config import MiniMindConfig
from .critic import CriticModel
from .modeling import MiniMindForCausalLM

__all__ = ["MiniMindConfig", "MiniMindForCausalLM", "CriticModel"]
