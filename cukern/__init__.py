"""cukern: hand-written CUDA kernels for transformer training, compiled at run time by NVRTC.

Array in, array out: CuPy arrays in give CuPy arrays out; torch CUDA tensors in give torch
tensors out (zero copy). NumPy references of every op are in ``cukern.reference``; PyTorch
integration (autograd, torch.compile, drop-ins, ``patch()``) in ``cukern.torch``.

The array functions are those of the kernel families listed in ``cukern._registry``.
"""
from ._faults import check_errors
from ._kernels import CompileError
from ._registry import families as _families
from ._version import __version__  # noqa: F401 (the package's version)

for _family in _families():
    for _fn in _family.api:
        globals()[_fn.__name__] = _fn

__all__ = [fn.__name__ for f in _families() for fn in f.api] + ["check_errors", "CompileError"]
del _family, _fn
