"""Where a Hopper forward block's time goes (GPU host): attention_fwd_sm90 built with CUK_TRACE
(cuda_src/common/trace.cuh), run once, and its per-block clock stamps read back.

    python3 tools/trace_attention.py [B H S D] [--causal]     (default 32 16 2048 128)

Prints, per computing warpgroup, the median microseconds of each phase of a block (entry to Q
landed; the first S = Q K^T; its softmax; a key tile of the loop, the last P V included; the
epilogue that writes O),
the whole block, and the gap between one block's end and the next block's start on the same SM.
The phases inside the loop need the config's OVERLAP form (the shipped d128 and d64-full ones).
"""
import ctypes
import sys

import numpy as np


def main():
    import cupy
    import torch

    from cukern import _driver, _kernels

    load = _kernels.load_source
    _kernels.load_source = lambda name: ("#define CUK_TRACE 1\n" + load(name)) if name == "attention_fwd_sm90.cu" \
        else load(name)
    import importlib
    attn = importlib.import_module("cukern.attention")

    args = [int(a) for a in sys.argv[1:] if a.isdigit()]
    B, H, S, D = args if len(args) == 4 else (32, 16, 2048, 128)
    causal = "--causal" in sys.argv
    cfg = attn.CONFIGS.sm90_forward(D, causal)
    q, k, v = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    for _ in range(10):
        attn.attention(q, k, v, causal=causal, return_lse=True)
    kern = _kernels.kernel(cfg.instance("bfloat16", D, causal), torch.cuda.current_device())
    lib = _driver.library()
    mod, ptr, size = ctypes.c_void_p(), ctypes.c_uint64(), ctypes.c_size_t()
    _driver.check(lib.cuFuncGetModule(ctypes.byref(mod), ctypes.c_void_p(kern.ptr)), "cuFuncGetModule")
    _driver.check(lib.cuModuleGetGlobal_v2(ctypes.byref(ptr), ctypes.byref(size), mod, b"cuk_trace"),
                  "cuModuleGetGlobal")
    trace = cupy.ndarray((size.value // 8,), cupy.uint64,
                         cupy.cuda.MemoryPointer(cupy.cuda.UnownedMemory(ptr.value, size.value, None), 0))
    trace[:] = 0
    torch.cuda.synchronize()
    attn.attention(q, k, v, causal=causal, return_lse=True)
    torch.cuda.synchronize()
    m_blocks = -(-S // cfg.block_rows)
    n = min(m_blocks * B * H, size.value // 128)
    t = cupy.asnumpy(trace).reshape(-1, 16)[:n].astype(np.int64)
    clk, sm, ns = t[:, :12].reshape(n, 2, 6), t[:, 14], t[:, 15]
    # clock64 counts per SM: its rate from consecutive blocks of one SM against the global timer
    order = np.lexsort((ns, sm))
    same = sm[order][1:] == sm[order][:-1]
    ghz = np.median((np.diff(clk[order, 0, 0])[same]) / np.maximum(np.diff(ns[order])[same], 1))
    us = lambda c: c / ghz / 1e3   # noqa: E731
    keys = -(-S // cfg.bn)
    if causal:   # (block x runs query block m_blocks - 1 - x: the longest first)
        mb = m_blocks - 1 - np.arange(n) % m_blocks
        tiles = np.minimum(S - 1, (mb + 1) * cfg.block_rows - 1) // cfg.bn + 1
    else:
        tiles = np.full(n, keys)
    print(f"{torch.cuda.get_device_name()}: B{B} H{H} S{S} d{D}{' causal' if causal else ''}, {cfg}")
    print(f"  {n} blocks traced, SM clock {ghz:.3f} GHz")
    ph = np.diff(clk, axis=2)
    for w in range(2):
        print(f"  warpgroup {w} (median us): entry to Q {np.median(us(ph[:, w, 0])):.2f}, first S "
              f"{np.median(us(ph[:, w, 1])):.2f}, its softmax {np.median(us(ph[:, w, 2])):.2f}, a loop tile "
              f"{np.median(us(ph[:, w, 3]) / np.maximum(tiles - 1, 1)):.3f}, epilogue (O written) "
              f"{np.median(us(ph[:, w, 4])):.2f}; block {np.median(us(clk[:, w, 5] - clk[:, w, 0])):.2f}")
    end = ns + us(clk[:, :, 5].max(axis=1) - clk[:, 0, 0]) * 1e3
    gaps = (ns[order][1:] - end[order][:-1])[same] / 1e3
    print(f"  gap from a block's end to the next one's start on its SM: median {np.median(gaps):.2f} us "
          f"(p10 {np.percentile(gaps, 10):.2f}, p90 {np.percentile(gaps, 90):.2f})")


if __name__ == "__main__":
    main()
