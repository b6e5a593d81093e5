"""Time embedding forward variants (threads a block, grid) at the workload shape (GPU host)."""
import numpy as np
import torch
import torch.nn.functional as F

from cukern import _arrays, _faults, _kernels
from tune_norm import bench

T, V, D = 65536, 128256, 4096
idx = torch.randint(0, V, (T,), device="cuda")
w = torch.randn(V, D, device="cuda", dtype=torch.bfloat16)
out = torch.empty(T, D, device="cuda", dtype=torch.bfloat16)
nbytes = 2 * T * D * 2
t_torch = bench(lambda: F.embedding(idx, w))
print(f"torch {t_torch:.3f} ms {nbytes / t_torch / 1e6:.0f} GB/s")
ia = _arrays.as_device_array(idx, "i", dtypes=("int64",))
wa, oa = (_arrays.as_device_array(a, n) for a, n in ((w, "w"), (out, "o")))
rec = np.uint64(_faults.record(0).data.ptr)
for threads in (128, 256, 512):
    fn = _kernels.function("embedding.cu", f"embedding_fwd<cuk_bf16, long long, 8, {threads}>", 0)
    res = _kernels.resident_blocks(fn, threads, 0)
    for grid in (res, 2 * res, T):
        def run():
            with _arrays.launch_context(wa):
                _kernels.launch(fn, grid, threads, (ia, np.int64(T), wa, np.int64(V), np.int32(D), oa, rec))
        ms = bench(run)
        print(f"threads {threads} grid {grid} regs {fn.num_regs}: {ms:.3f} ms {nbytes / ms / 1e6:.0f} GB/s  x{t_torch / ms:.2f}")
print("equal:", torch.equal(out, F.embedding(idx, w)))
