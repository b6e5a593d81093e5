"""Cross-entropy of logits against integer targets, forward and backward, and the training form
that reads the logits once for both (kernels: cuda_src/cross_entropy.cu).

Shapes: ``logits`` (*, V), the classes on the last axis; ``target`` (*), int32 or int64.
dtypes: logits float32, float16 or bfloat16; arithmetic in float32; the loss in the logits'
dtype (as PyTorch's), the log-sum-exp float32.

Options (every function): ``ignore_index`` (rows with that target get loss 0 and no gradient),
``label_smoothing`` (PyTorch's), ``z_loss`` (adds z_loss · lse² a row, PaLM), ``softcap``
(the softmax sees c · tanh(x / c), Gemma 2; None or 0: none), ``reduction`` "mean" (over the rows not
ignored; NaN when all are, as PyTorch's), "sum" or "none".

A target outside [0, V) other than ignore_index is recorded on the device, its row ignored, and
raised as ``IndexError`` by ``cukern.check_errors()``: no host sync on the hot path.

The family's Python side, a module a job:

* ``configs``: the row and cluster kernels' configurations, the shipped ``CONFIGS`` (read at
  each call: tools and tests replace ``configs.CONFIGS``) and the kernel instances;
* ``checks``: the options and the argument checks the fronts and the references share;
* ``loss``: ``cross_entropy``, ``cross_entropy_forward_backward`` and ``cross_entropy_backward``;
* ``linear``: ``linear_cross_entropy`` and its forward-backward, chunk by chunk;
* ``upstream``: the upstream gradient applied to a kept gradient (the PyTorch backward's);
* ``reference``: the NumPy references;
* ``bench``: the benchmark cases;
* ``torch``: the custom ops, the drop-in's route and ``cukern.torch.linear_cross_entropy``.

``FAMILY`` below registers the family. ``cukern.cross_entropy`` is the function (the package
exports it); reach a job with ``from cukern.cross_entropy import linear``, or the package with
``importlib.import_module("cukern.cross_entropy")``.
"""
# ruff: noqa: F401 (the package re-exports its jobs' names that tools and tests reach)
from __future__ import annotations

from .. import _arrays, _faults
from .._family import DropIn, Family
from .bench import bench_cases, torch_bench_cases
from .checks import Flags, Options, _options
from .configs import TRAIN, Configs, instances
from .linear import CHUNK_BYTES, chunk_rows, linear_cross_entropy, linear_cross_entropy_forward_backward
from .loss import _PLANS, _backward, _run, cross_entropy, cross_entropy_backward, cross_entropy_forward_backward
from .reference import (
                        reference_cross_entropy,
                        reference_cross_entropy_backward,
                        reference_cross_entropy_forward_backward,
                        reference_linear_cross_entropy,
                        reference_linear_cross_entropy_forward_backward,
)
from .torch import TORCH_OPS, _probe, _route, _torch_api

__all__ = ["cross_entropy", "cross_entropy_backward", "cross_entropy_forward_backward", "linear_cross_entropy",
           "linear_cross_entropy_forward_backward", "chunk_rows"]

FAMILY = Family(
    name="cross_entropy",
    api=(cross_entropy, cross_entropy_backward, cross_entropy_forward_backward, linear_cross_entropy,
         linear_cross_entropy_forward_backward),
    references={"cross_entropy": reference_cross_entropy,
                "cross_entropy_backward": reference_cross_entropy_backward,
                "cross_entropy_forward_backward": reference_cross_entropy_forward_backward,
                "linear_cross_entropy": reference_linear_cross_entropy,
                "linear_cross_entropy_forward_backward": reference_linear_cross_entropy_forward_backward},
    instances=instances,
    bench=bench_cases,
    torch_bench=torch_bench_cases,
    torch_ops=TORCH_OPS,
    dropins=(DropIn("cross_entropy", _route, compile=False, probe=_probe, min_size=2**20),),   # (logit elements)
    torch_api=_torch_api,
)
