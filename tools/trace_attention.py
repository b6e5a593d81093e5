"""Where a Hopper attention block's time goes (on a GPU): attention_fwd_sm90 (or, with
--backward, attention_bwd_sm90) built with CUK_TRACE (cuda_src/common/trace.cuh), run once, and
its per-block clock stamps read back.

    python3 tools/trace_attention.py [B H S D] [--causal] [--backward [--deterministic]]
                                      (default 32 16 2048 128)

Prints, per computing warpgroup, the median microseconds of each phase of a block (entry to Q
landed; the first S = Q K^T; its softmax; a key tile of the loop, the last P V included; the
epilogue that writes O),
the whole block, and the gap between one block's end and the next block's start on the same SM.
The phases inside the loop need the config's OVERLAP form (the shipped d128 and d64-full ones).
--backward prints, per computing warpgroup, the median microseconds of each phase of a block's
middle step (Q and dO landed; S^T; its softmax and the dV issue; dP^T, dS^T and its stores; the
wait for dV; dK and the step before's dQ; dQ's store), the step, and the block over its steps;
--deterministic traces the ORDERED instance (dQ's adds in turns) with deterministic=True.
"""
import ctypes
import dataclasses
import sys

import numpy as np


def main():
    import cupy
    import torch

    from cukern import _driver, _kernels, _sources

    backward = "--backward" in sys.argv
    deterministic = backward and "--deterministic" in sys.argv
    traced = "attention_bwd_sm90.cu" if backward else "attention_fwd_sm90.cu"
    load = _sources.load_source
    _sources.load_source = lambda name: ("#define CUK_TRACE 1\n" + load(name)) if name == traced else load(name)
    import importlib
    attn = importlib.import_module("cukern.attention")

    args = [int(a) for a in sys.argv[1:] if a.isdigit()]
    B, H, S, D = args if len(args) == 4 else (32, 16, 2048, 128)
    causal = "--causal" in sys.argv
    q, k, v, do = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    if backward:
        cfg = attn.configs.CONFIGS.get("bwd_sm90", D)
        out, lse = attn.attention(q, k, v, causal=causal, return_lse=True)
        run = lambda: attn.attention_backward(do, q, k, v, out, lse, causal=causal,   # noqa: E731
                                              deterministic=deterministic)
        inst = cfg.instance("bfloat16", D, causal, deterministic, ordered=deterministic)
    else:
        # (a persistent config is traced in its one-block-a-work-tile form: the record is a block's)
        cfg = dataclasses.replace(attn.configs.CONFIGS.sm90_forward(D, causal), persistent=False)
        shipped = attn.configs.CONFIGS
        configs = shipped.replace("fwd_sm90_full" if not causal and D in dict(shipped.fwd_sm90_full) else "fwd_sm90",
                                  D, cfg)
        run = lambda: attn._attention(q, k, v, causal, None, True, configs)   # noqa: E731
        inst = cfg.instance("bfloat16", D, causal)
    for _ in range(10):
        run()
    trace = _trace_buffer(_kernels.kernel(inst, torch.cuda.current_device()), cupy, _driver)
    trace[:] = 0
    torch.cuda.synchronize()
    run()
    torch.cuda.synchronize()
    print(f"{torch.cuda.get_device_name()}: B{B} H{H} S{S} d{D}{' causal' if causal else ''}"
          f"{' backward' if backward else ''}{' deterministic' if deterministic else ''}, {cfg}")
    if backward:
        _report_backward(cupy.asnumpy(trace), B, H, S, cfg, causal)
    else:
        _report_forward(cupy.asnumpy(trace), B, H, S, cfg, causal)


def _trace_buffer(kern, cupy, _driver):
    """The traced module's cuk_trace array, as a cupy array over its device memory."""
    lib = _driver.library()
    mod, ptr, size = ctypes.c_void_p(), ctypes.c_uint64(), ctypes.c_size_t()
    _driver.check(lib.cuFuncGetModule(ctypes.byref(mod), ctypes.c_void_p(kern.ptr)), "cuFuncGetModule")
    _driver.check(lib.cuModuleGetGlobal_v2(ctypes.byref(ptr), ctypes.byref(size), mod, b"cuk_trace"),
                  "cuModuleGetGlobal")
    return cupy.ndarray((size.value // 8,), cupy.uint64,
                        cupy.cuda.MemoryPointer(cupy.cuda.UnownedMemory(ptr.value, size.value, None), 0))


def _clock(entry, sm, ns):
    """The SM clock (GHz; clock64 counts per SM) from consecutive blocks of one SM against the
    global timer, and the blocks' order by SM and start."""
    order = np.lexsort((ns, sm))
    same = sm[order][1:] == sm[order][:-1]
    ghz = np.median((np.diff(entry[order])[same]) / np.maximum(np.diff(ns[order])[same], 1))
    return ghz, order, same


def _report_backward(raw, B, H, S, cfg, causal):
    n = min(-(-S // cfg.block_keys) * B * H, raw.size // 32)
    t = raw.reshape(-1, 32)[:n].astype(np.int64)
    clk, sm, ns = t[:, :20].reshape(n, 2, 10), t[:, 30], t[:, 31]
    ghz, _, _ = _clock(clk[:, 0, 0], sm, ns)
    us = lambda c: c / ghz / 1e3   # noqa: E731
    # steps a block: query tiles that see its keys (causal: from the diagonal on)
    tiles = -(-S // cfg.block_rows)
    n0 = np.arange(n) % -(-S // cfg.block_keys) * cfg.block_keys
    steps = tiles - (n0 // cfg.block_rows if causal else 0)
    print(f"  {n} blocks traced, SM clock {ghz:.3f} GHz, {np.median(steps):.0f} steps a block (median)")
    names = ("Q, dO landed", "S^T", "softmax, dV issued", "dP^T, dS^T stored", "dV waited", "dK, dQ",
             "dQ stored")
    ph = np.diff(clk[:, :, 1:9], axis=2)
    for w in range(2):
        parts = ", ".join(f"{name} {np.median(us(ph[:, w, i])):.3f}" for i, name in enumerate(names))
        print(f"  warpgroup {w}, the middle step (median us): {parts}; the step {np.median(us(ph[:, w].sum(1))):.3f}")
        print(f"    block {np.median(us(clk[:, w, 9] - clk[:, w, 0])):.2f} us, "
              f"{np.median(us(clk[:, w, 9] - clk[:, w, 0]) / steps):.3f} us a step")
    _report_tail(ns, ns + us(clk[:, :, 9].max(axis=1) - clk[:, 0, 0]) * 1e3, sm)


def _report_tail(start, end, sm):
    """How full the SMs were over the launch: blocks' busy time against SMs x span, and the
    last part of the launch in which fewer blocks ran than at its start (the last wave's tail)."""
    span = end.max() - start.min()
    sms = np.unique(sm).size
    busy = (end - start).sum() / (sms * span)
    events = np.concatenate([np.stack([start, np.ones_like(start)], 1), np.stack([end, -np.ones_like(end)], 1)])
    events = events[np.argsort(events[:, 0], kind="stable")]
    running = np.cumsum(events[:, 1])
    full = running.max()
    last_full = events[np.nonzero(running == full)[0][-1], 0]
    print(f"  launch {span / 1e3:.1f} us on {sms} SMs, busy {100 * busy:.1f}%; the tail after the last moment "
          f"{full} blocks ran: {(end.max() - last_full) / 1e3:.1f} us ({100 * (end.max() - last_full) / span:.1f}%)")


def _report_forward(raw, B, H, S, cfg, causal):
    m_blocks = -(-S // cfg.block_rows)
    n = min(m_blocks * B * H, raw.size // 16)
    t = raw.reshape(-1, 16)[:n].astype(np.int64)
    clk, sm, ns = t[:, :12].reshape(n, 2, 6), t[:, 14], t[:, 15]
    ghz, order, same = _clock(clk[:, 0, 0], sm, ns)
    us = lambda c: c / ghz / 1e3   # noqa: E731
    keys = -(-S // cfg.bn)
    if causal:   # (block x runs query block m_blocks - 1 - x: the longest first)
        mb = m_blocks - 1 - np.arange(n) % m_blocks
        tiles = np.minimum(S - 1, (mb + 1) * cfg.block_rows - 1) // cfg.bn + 1
    else:
        tiles = np.full(n, keys)
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
