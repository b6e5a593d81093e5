"""Time embedding configurations at the workload shape (on a GPU).

    python3 tools/tune_embedding.py [--forward] [--backward]

Each embedding.Configs candidate is passed to the front as an object of its own; the shipped
CONFIGS is never changed. Device time (median) with GB/s over the byte floor and the speed-up
over torch in the same run.

Forward: threads a block for rows a block a token, and the row size up to which a warp takes a
token; 2*T*D*2 bytes. Backward: threads and vectors a thread of the sums kernel, the entries a
chunk and the table rows a unit zeroes at most; uniform and Zipf indices; (T + V)*D*2 bytes.
The shipped backward's plan is also timed step by step (the stream held busy first, so that a
step's time is the device's).
"""
import argparse
import dataclasses
import importlib

import numpy as np
import torch
import torch.nn.functional as F

from cukern import _arrays, _bench

emb = importlib.import_module("cukern.embedding")
FWD_CANDIDATES = [dataclasses.replace(emb.CONFIGS, fwd_threads=t, warp_row_bytes=r)
                  for t in (128, 256, 512) for r in (0, 4096, 8192)]
BWD_CANDIDATES = ([dataclasses.replace(emb.CONFIGS, bwd_shapes=(shape,), chunk=c, chunk_small=c)
                   for shape in ((128, 1), (256, 1), (512, 1), (128, 4)) for c in (64, 128)]
                  + [dataclasses.replace(emb.CONFIGS, zero_rows=z) for z in (128, 512)])


def forward():
    for T, V, D in ((65536, 128256, 4096), (65536, 128256, 2048), (65536, 50304, 1024)):
        idx = torch.randint(0, V, (T,), device="cuda")
        w = torch.randn(V, D, device="cuda", dtype=torch.bfloat16)
        nbytes = 2 * T * D * 2
        t_torch = _bench.time_cuda(lambda: F.embedding(idx, w), warmup=5, reps=30)
        print(f"\nT {T} V {V} D {D}: torch {t_torch:.3f} ms {nbytes / t_torch / 1e6:.0f} GB/s")
        expect = F.embedding(idx, w)
        for cfg in FWD_CANDIDATES:
            out = emb._embedding(idx, w, None, False, cfg)
            ms = _bench.time_cuda(lambda: emb._embedding(idx, w, None, False, cfg), warmup=5, reps=30)
            print(f"  threads {cfg.fwd_threads:4d} warp rows <= {cfg.warp_row_bytes:5d} B: {ms:.3f} ms "
                  f"{nbytes / ms / 1e6:5.0f} GB/s  x{t_torch / ms:.2f}  equal {torch.equal(out, expect)}")


def _indices(T, V, dist):
    if dist == "zipf":   # as the bench's Zipf case
        return torch.from_numpy((np.random.default_rng(0).zipf(1.2, T) % V).astype(np.int64)).cuda()
    return torch.randint(0, V, (T,), device="cuda")


def step_times(plan, arrays, reps=20) -> list:
    """ms of each step of ``plan`` on ``arrays`` (medians), the stream held busy first."""
    samples = [[] for _ in plan.steps]
    for r in range(reps + 3):
        bufs = list(arrays)
        for slot, fix in plan.fixes:
            bufs[slot] = fix(bufs[slot])
        first = bufs[plan.first]
        with _arrays.on_device(plan.device):
            for alloc in plan.allocs:
                bufs.append(alloc(bufs, first))
            ptrs = [0 if b is None else b.ptr for b in bufs]
            stream = _arrays.launch_stream(first)
            ev = [torch.cuda.Event(enable_timing=True) for _ in range(len(plan.steps) + 1)]
            torch.cuda._sleep(2_000_000)
            ev[0].record()
            for i, step in enumerate(plan.steps):
                step(bufs, ptrs, stream)
                ev[i + 1].record()
        torch.cuda.synchronize()
        if r >= 3:
            for i in range(len(plan.steps)):
                samples[i].append(ev[i].elapsed_time(ev[i + 1]))
    return [float(np.median(s)) for s in samples]


def backward():
    for T, V, D in ((65536, 128256, 4096), (65536, 128256, 2048), (65536, 50304, 1024), (16384, 50304, 768)):
        nbytes = (T + V) * D * 2
        for dist in ("uniform", "zipf"):
            idx = _indices(T, V, dist)
            dy = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
            expect = torch.ops.aten.embedding_dense_backward(dy, idx, V, -1, False)
            t_torch = _bench.time_cuda(lambda: torch.ops.aten.embedding_dense_backward(dy, idx, V, -1, False),
                                       warmup=3, reps=20)
            print(f"\nbackward T {T} V {V} D {D} {dist}: floor {nbytes / 4.255e9:.3f} ms at 4255 GB/s, "
                  f"torch {t_torch:.3f} ms")
            arrays = [_arrays.as_device_array(dy, "grad"), emb._indices(idx)]
            plan = emb._plan_backward(list(arrays), V, None, False, emb.CONFIGS)
            names = [getattr(getattr(s, "kernel", None), "instance", None) for s in plan.steps]
            times = step_times(plan, arrays)
            print("  shipped, step by step: " + ", ".join(
                f"{(n.name.split('<')[0] if n is not None else type(s).__name__)} {t * 1e3:.1f} us"
                for n, s, t in zip(names, plan.steps, times)) + f"; sum {sum(times):.3f} ms")
            for cfg in BWD_CANDIDATES:
                out = emb._embedding_backward(dy, idx, V, None, False, False, cfg)
                ms = _bench.time_cuda(lambda: emb._embedding_backward(dy, idx, V, None, False, False, cfg),
                                      warmup=3, reps=20)
                err = (out.float() - expect.float()).abs().max().item()
                threads, nv = cfg.bwd_shape(D, 8)
                print(f"  threads {threads:3d} x {nv}, chunk {cfg.chunk:3d}, zero rows {cfg.zero_rows}: {ms:.3f} ms "
                      f"{nbytes / ms / 1e6:5.0f} GB/s ({nbytes / ms / 4.255e9:5.1%} of 4255)  x{t_torch / ms:.2f}  "
                      f"max err {err:.2g}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--forward", action="store_true")
    ap.add_argument("--backward", action="store_true")
    a = ap.parse_args()
    if a.forward or not a.backward:
        forward()
    if a.backward or not a.forward:
        backward()


if __name__ == "__main__":
    main()
