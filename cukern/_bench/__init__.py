"""The benchmark mechanism shared by ``python -m cukern bench`` and the asv suite (asv_bench/).

Every case times cukern against the PyTorch equivalent in one process, on torch tensors (cukern
takes them zero-copy), with CUDA events on torch's current stream: the median of many runs
after warm-up, taken in blocks that alternate between the two (a clock drift falls on both).
Each result is also given as a ratio to a ceiling measured in the same run: the device's
device-to-device copy bandwidth for memory-bound ops (bytes read + written), the bf16
matrix-product rate for FLOP-bound ones. Absolute times move between machines and runs; ratios
taken in one run hold.

Two kinds of case, both declared by the families (``bench`` and ``torch_bench`` of each
``FAMILY``) and discovered here:

* :class:`Case`: the array API against PyTorch's op (``python -m cukern bench``);
* :class:`TorchCase`: the op as a PyTorch user runs it, through ``cukern.torch`` with
  autograd, against PyTorch eager, ``torch.compile`` and Liger-Kernel when it is installed,
  with the array API's time for the same work and the host time a call
  (``python -m cukern bench --torch``).

A module a job: ``run`` (the cases the families declare, run against their peers), ``timing``
(CUDA events, input sets, the ceilings), ``results`` (a case's figures and the tables),
``environment`` (what is installed and found), ``asv`` (the asv suite's side); the cases
themselves are declared with ``cukern._bench_cases``. torch and CuPy are imported only inside
the functions that run on the GPU, so ``import cukern`` (and ``import cukern._bench``) never
imports them.
"""
# ruff: noqa: F401 (the package's names, from the modules of its jobs)
from __future__ import annotations

from .._bench_cases import Case, TorchCase
from .asv import ASV_TIMEOUT, ASV_VERSION, asv_benchmarks, asv_results
from .environment import device_info, fa4_version, liger_version, quack_version, unavailable_reason, versions
from .results import (
                      AGREE,
                      L2_FACTOR,
                      MAX_INPUT_SETS,
                      error_result,
                      format_table,
                      format_torch_table,
                      gbps,
                      input_set_count,
                      summarize,
                      tflops,
)
from .run import (
                      TORCH_IMPLS,
                      cases,
                      peak_mib,
                      relative_error,
                      run_case,
                      run_cases,
                      run_torch_case,
                      run_torch_cases,
                      slug,
                      torch_cases,
                      torch_impls,
)
from .timing import (
                      Timing,
                      copy_bandwidth,
                      host_us,
                      l2_bytes,
                      matmul_rate,
                      time_cuda,
                      time_cuda_detail,
                      time_cuda_interleaved,
)

__all__ = ["Case", "TorchCase", "Timing", "cases", "torch_cases", "time_cuda", "time_cuda_detail",
           "time_cuda_interleaved", "host_us",
           "copy_bandwidth", "matmul_rate", "run_cases", "run_case", "run_torch_cases", "summarize",
           "format_table", "format_torch_table", "unavailable_reason", "fa4_version", "quack_version", "asv_results",
           "asv_benchmarks"]
