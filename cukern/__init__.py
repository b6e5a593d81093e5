"""cukern: hand-written CUDA kernels for transformer training, compiled at run time by NVRTC.

Array in, array out: CuPy arrays in give CuPy arrays out; torch CUDA tensors in give torch
tensors out (zero copy). NumPy references of every op are in ``cukern.reference``.
"""
from ._faults import check_errors
from .attention import attention, attention_backward
from ._kernels import CompileError
from .embedding import embedding, embedding_backward
from .group_norm import group_norm, group_norm_backward
from .norm import layer_norm, layer_norm_backward, rms_norm, rms_norm_backward

__version__ = "0.1.0"

__all__ = ["layer_norm", "layer_norm_backward", "rms_norm", "rms_norm_backward", "group_norm",
           "group_norm_backward", "embedding", "embedding_backward", "attention", "attention_backward",
           "check_errors", "CompileError"]
