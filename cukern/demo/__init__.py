"""The training demo: a GPT-2-style model (``model``), its training with and without
``cukern.torch.patch()`` (``train``) and the profile of its steps (``profile``), behind
``python -m cukern train-demo`` and ``python -m cukern profile``. An example of using
cukern with PyTorch, outside the package's core; it needs torch.

``options`` (the model's size and the command-line flags) imports no torch, so that the
command line can be built without it; the rest is imported on first use.
"""
from importlib import import_module

from .options import Config, add_model_args, config

_LAZY = {"GPT": "model", "Block": "model", "batch": "model", "params": "model", "train": "training",
         "deterministic": "training", "profile_steps": "profiling", "category": "profiling", "format_top": "profiling",
         "format_shares": "profiling", "chart": "profiling", "CATEGORIES": "profiling"}

__all__ = ["Config", "add_model_args", "config", *_LAZY]


def __getattr__(name):
    if name in _LAZY:
        return getattr(import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
