"""Time embedding forward configurations at the workload shape (on a GPU).

    python3 tools/tune_embedding.py

Each embedding.Configs candidate (threads a block for rows a block a token, and the row size
up to which a warp takes a token) is passed to the front as an object of its own; the shipped
CONFIGS is never changed. Device time (median) with GB/s on 2*T*D*2 bytes and the speed-up
over torch's F.embedding in the same run.
"""
import dataclasses
import importlib

import torch
import torch.nn.functional as F

from cukern import _bench

emb = importlib.import_module("cukern.embedding")
CANDIDATES = [dataclasses.replace(emb.CONFIGS, fwd_threads=t, warp_row_bytes=r)
              for t in (128, 256, 512) for r in (0, 4096, 8192)]


def main():
    for T, V, D in ((65536, 128256, 4096), (65536, 128256, 2048), (65536, 50304, 1024)):
        idx = torch.randint(0, V, (T,), device="cuda")
        w = torch.randn(V, D, device="cuda", dtype=torch.bfloat16)
        nbytes = 2 * T * D * 2
        t_torch = _bench.time_cuda(lambda: F.embedding(idx, w), warmup=5, reps=30)
        print(f"\nT {T} V {V} D {D}: torch {t_torch:.3f} ms {nbytes / t_torch / 1e6:.0f} GB/s")
        expect = F.embedding(idx, w)
        for cfg in CANDIDATES:
            out = emb._embedding(idx, w, None, False, cfg)
            ms = _bench.time_cuda(lambda: emb._embedding(idx, w, None, False, cfg), warmup=5, reps=30)
            print(f"  threads {cfg.fwd_threads:4d} warp rows <= {cfg.warp_row_bytes:5d} B: {ms:.3f} ms "
                  f"{nbytes / ms / 1e6:5.0f} GB/s  x{t_torch / ms:.2f}  equal {torch.equal(out, expect)}")


if __name__ == "__main__":
    main()
