"""The benchmark cases' declarations, which every family imports to declare its cases: a leaf
(it imports nothing of cukern), so that the families stay below ``_bench``, which discovers
and runs their cases (and imports ``cukern.torch`` to do so). torch is imported only inside
the functions that make inputs."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

__all__ = ["Case", "TorchCase", "elements_bytes", "generator", "randn", "ITEMSIZE", "SHORT_DTYPE"]

ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}
SHORT_DTYPE = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}


def _shape_label(shape) -> str:
    return "x".join(str(n) for n in shape)


@dataclass(frozen=True)
class Case:
    """One benchmark: cukern and torch doing the same work on the same inputs.

    ``make(seed)`` builds one input set (a dict of random torch CUDA tensors); ``cukern_fn``
    and ``torch_fn`` take that dict and return the output tensor or a tuple of outputs in the
    same order (compared once, outside the timing). ``nbytes`` is the floor of bytes that must
    move; ``flops`` is set for FLOP-bound cases, which are then reported in TFLOP/s against the
    matrix rate instead of GB/s against the copy bandwidth. ``compares`` False: the two draw
    different random numbers (dropout), so their outputs are not compared.
    """
    name: str
    family: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    make: Callable[[int], dict]
    cukern_fn: Callable[[dict], Any]
    torch_fn: Callable[[dict], Any]
    flops: int | None = None
    compares: bool = True

    shape_label = property(lambda self: _shape_label(self.shape))


@dataclass(frozen=True)
class TorchCase:
    """One op as a PyTorch user runs it: ``forward(F, t)`` calls the op through ``F`` — the
    namespace of ``torch.nn.functional`` or of ``cukern.torch`` (the drop-ins) — on the autograd
    leaves ``t["leaves"]`` of an input set ``make(seed)``; with ``backward`` the step is the
    forward and ``torch.autograd.grad`` of it with ``t["dy"]``, else the forward under
    ``torch.no_grad``. ``array(t)`` does the same work through the array API; ``liger(t)``, if
    given, the forward through Liger-Kernel (timed when liger-kernel is installed); ``fa4(t)``,
    if given, through FlashAttention-4 (timed when ``flash_attn.cute`` imports); ``quack(t)``, if
    given, through quack (timed when ``quack`` imports). A peer that raises on its first call is
    left out of the row, with its error in the record."""
    name: str
    family: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    make: Callable[[int], dict]
    forward: Callable[[Any, dict], Any]
    array: Callable[[dict], Any]
    liger: Callable[[dict], Any] | None = None
    backward: bool = True
    # Liger's function writes into its inputs: it takes leaves of its own, t["liger_leaves"]
    liger_leaves: bool = False
    flops: int | None = None
    fa4: Callable[[dict], Any] | None = None
    quack: Callable[[dict], Any] | None = None
    # False: the implementations draw different random masks (dropout), outputs not compared
    compares: bool = True

    shape_label = property(lambda self: _shape_label(self.shape))


def elements_bytes(shape: Sequence[int], dtype: str, passes: int | float = 1) -> int:
    """Bytes of ``passes`` full reads or writes of an array of ``shape`` and ``dtype``."""
    return int(passes * math.prod(shape) * ITEMSIZE[dtype])


def generator(seed: int):
    import torch

    gen = torch.Generator(device="cuda")
    gen.manual_seed(1234 + seed)
    return gen


def randn(shape, dtype: str, gen):
    import torch

    return torch.randn(shape, dtype=getattr(torch, dtype), device="cuda", generator=gen)


# ---- pure arithmetic (no GPU) ----------------------------------------------------------------
