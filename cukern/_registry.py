"""The kernel families cukern has: adding a family adds its name here, and nothing else
outside its own files (``cuda_src/<name>.cu``, ``cukern/<name>.py`` or the package
``cukern/<name>/``, ``tests/test_<name>.py``,
``docs/<name>.md``). Exports, references, the compile check, the bench, asv and
``cukern.torch`` all read this list."""
from __future__ import annotations

import functools
import importlib

FAMILIES = ("norm", "group_norm", "embedding", "attention", "cross_entropy", "swiglu", "rope", "moe")

# Modules with kernels that several families launch (compiled and checked like a family's).
SHARED_KERNELS = ("_partials", "_hopper", "_fp8")


@functools.lru_cache(maxsize=None)
def families() -> tuple:
    """Every family's ``FAMILY`` declaration (cukern._family.Family), in the order above."""
    # (relative to this package, so that a copy under another name, e.g. a baseline that a
    # benchmark imports beside the working tree, runs its own families)
    return tuple(importlib.import_module(f".{name}", __package__).FAMILY for name in FAMILIES)


def kernel_modules() -> tuple:
    """(name, instances function) of every module that declares kernels: families and shared."""
    shared = tuple((name, importlib.import_module(f".{name}", __package__).instances) for name in SHARED_KERNELS)
    return tuple((f.name, f.instances) for f in families()) + shared
