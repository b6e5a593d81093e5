"""LayerNorm and RMSNorm over the last axis, forward and backward (kernels: cuda_src/norm.cu).

Shapes: ``x`` is (*, D); the norm is taken over D. ``weight`` and ``bias`` are (D,).
dtypes: float32, float16, bfloat16 — every array argument of one call has the same dtype;
statistics (mean, rstd) are float32 of shape x.shape[:-1]. Arithmetic is float32.

The family's Python side, a module a job:

* ``configs``: row and loop configurations, the shipped ``CONFIGS`` (read at each call: tools
  replace ``configs.CONFIGS``), the casting modes and the kernel instances;
* ``checks``: the argument checks the kernels' front and the references share;
* ``forward``: ``layer_norm`` and ``rms_norm`` and their launch plans;
* ``backward``: ``layer_norm_backward`` and ``rms_norm_backward`` and theirs;
* ``reference``: the NumPy references;
* ``bench``: the benchmark cases;
* ``torch``: the custom ops, the drop-ins' routes, the variants and the fused residual.

``FAMILY`` below registers the family.
"""
# ruff: noqa: F401 (the package re-exports its jobs' names that tools and tests reach)
from __future__ import annotations

from .._family import DropIn, Family, ModuleSpec
from .backward import _BWD, _backward, _plan_backward, layer_norm_backward, rms_norm_backward
from .bench import WORKLOAD, bench_cases, torch_bench_cases
from .configs import CASTING_MODES, Configs, LoopConfig, RowConfig, instances
from .forward import _FWD, _casting, _forward, _offset, _plan_forward, layer_norm, rms_norm
from .reference import (reference_layer_norm, reference_layer_norm_backward, reference_rms_norm,
                        reference_rms_norm_backward)
from .torch import TORCH_OPS, _init_variant, _module_forward, _route_layer_norm, _route_rms_norm, _torch_api

__all__ = ["layer_norm", "rms_norm", "layer_norm_backward", "rms_norm_backward"]

FAMILY = Family(
    name="norm",
    api=(layer_norm, layer_norm_backward, rms_norm, rms_norm_backward),
    references={"layer_norm": reference_layer_norm, "layer_norm_backward": reference_layer_norm_backward,
                "rms_norm": reference_rms_norm, "rms_norm_backward": reference_rms_norm_backward},
    instances=instances,
    bench=bench_cases,
    torch_bench=torch_bench_cases,
    torch_ops=TORCH_OPS,
    # Under torch.compile Inductor fuses the norms with the casts and residual adds around them;
    # a custom op blocks that fusion and measured slower in the demo (docs/torch.md).
    # Below 2**20 elements (4 MB of float32) a call waits for the host either way (docs/torch.md).
    dropins=(DropIn("layer_norm", _route_layer_norm, compile=False, probe=lambda f, x: f(x, (8,)), min_size=2**20),
             DropIn("rms_norm", _route_rms_norm, compile=False, probe=lambda f, x: f(x, (8,)), min_size=2**20)),
    modules=(ModuleSpec("LayerNorm", "LayerNorm", "layer_norm",
                        lambda m, x: (x, m.normalized_shape, m.weight, m.bias, m.eps),
                        options=(("offset", 0.0),), variant=_module_forward(False), init=_init_variant),
             ModuleSpec("RMSNorm", "RMSNorm", "rms_norm", lambda m, x: (x, m.normalized_shape, m.weight, m.eps),
                        options=(("offset", 0.0), ("casting_mode", "gemma")), variant=_module_forward(True),
                        init=_init_variant)),
    torch_api=_torch_api,
)
