"""Time the cross-entropy training form's kernels at several vocabularies (on a GPU).

    python3 tools/tune_cross_entropy.py [--tokens 16384] [--vocab 128256 32000 50304] [--dtype bfloat16]

For each vocabulary: the two-pass row kernel (v1) and, on sm_90, the cluster kernel (v2) with
each number of vectors a thread that holds the row (clusters of 2 to 16 CTAs of 128, 256 and
512 threads, the part in registers or staged in shared memory; one cluster a row, and the
persistent grid), each passed in a Configs object of
its own (the shipped CONFIGS is never changed); then PyTorch eager, torch.compile and Liger-Kernel
(when installed) on the same logits. Prints ms and the share of the copy bandwidth measured in
the same run over the byte floor (read the logits once, write the gradient once: 4·T·V bytes
in bf16), and checks each variant's loss and gradient against the first one's.
"""
import argparse
import importlib

import torch
import torch.nn.functional as F

from cukern import _arrays, _bench, _kernels

ce = importlib.import_module("cukern.cross_entropy")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--vocab", type=int, nargs="+", default=[128256, 32000, 50304])
    p.add_argument("--dtype", default="bfloat16")
    a = p.parse_args()
    copy = _bench.copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}  copy {copy:.0f} GB/s  tokens {a.tokens} {a.dtype}")
    dt = getattr(torch, a.dtype)
    sm90 = _kernels.compute_capability(torch.cuda.current_device()) >= (9, 0)
    for v in a.vocab:
        measure(a.tokens, v, dt, a.dtype, copy, sm90)


def measure(tokens: int, v: int, dt, dtype: str, copy: float, sm90: bool) -> None:
    opts = ce._options(-100, 0.0, 0.0, None, "mean")
    x = torch.randn(tokens, v, device="cuda", dtype=dt) * 4
    t = torch.randint(0, v, (tokens,), device="cuda")
    floor = 2 * x.element_size() * x.numel()
    vec = 16 // x.element_size()
    variants = [("v1 two-pass", ce.Configs(use_cluster=False))]
    if sm90:   # a cluster a row (2 to 16 CTAs; 128, 256 and 512 threads; the part in registers or
        # staged in shared memory), then the persistent grid
        for cluster in (2, 4, 8, 16):
            for threads in (128, 256, 512):
                for stage in (((), (threads,)) if threads <= 256 else ((),)):   # (staged: at most 32 KB)
                    base = dict(clusters=(cluster,), cluster_threads=(threads,), use_cluster=True, cluster_min=8192,
                                cluster_stage=stage)
                    shape = ce.Configs(**base).cluster_vectors(v, vec)   # and twice the vectors (fewer registers spare)
                    least = shape[2] if shape else None
                    variants += [(f"v2 cluster {cluster}: {threads}x{nv}{' staged' if stage else ''}",
                                  ce.Configs(**base, cluster_nv=(nv,)))
                                 for nv in ((least, 2 * least) if least and least < 8 else (least,) if least else ())]
        shape = ce.Configs().cluster_vectors(v, vec)
        if shape:
            variants.append((f"v2 persistent {shape[0]}: {shape[1]}x{shape[2]}",
                             ce.Configs(use_cluster=True, cluster_min=8192, clusters=(shape[0],),
                                        cluster_threads=(shape[1],), cluster_nv=(shape[2],), cluster_persistent=True)))

    def line(name, ms, note=""):
        print(f"V {v:7d} {name:26s} {ms:7.3f} ms  {floor / ms / 1e6 / copy * 100:5.1f}% of copy{note}", flush=True)

    first = None
    for name, cfg in variants:
        def run(cfg=cfg):
            arrays = [_arrays.as_device_array(x, "logits"), _arrays.as_device_array(t, "target", ("int64",))]
            out = ce._run(ce.TRAIN, arrays, opts, ce.Flags(loss_dtype=dtype), cfg)
            return out("loss"), out("dlogits")
        got = run()
        note = ""
        if first is None:
            first = got
        else:
            err = float((got[1].float() - first[1].float()).norm() / first[1].float().norm())
            note = f"  loss {float(got[0]):.6f} vs {float(first[0]):.6f}, dlogits rel. diff {err:.1e}"
        line(name, _bench.time_cuda(run, warmup=5, reps=30), note)
    xl = x.detach().requires_grad_(True)
    compiled = torch.compile(lambda z: F.cross_entropy(z, t))
    peers = {"torch eager": lambda: torch.autograd.grad(F.cross_entropy(xl, t), xl),
             "torch.compile": lambda: torch.autograd.grad(compiled(xl), xl)}
    try:
        from liger_kernel.transformers.functional import liger_cross_entropy
        peers["Liger"] = lambda: torch.autograd.grad(liger_cross_entropy(xl, t), xl)
    except ImportError:
        pass
    for name, fn in peers.items():
        line(name, _bench.time_cuda(fn, warmup=5, reps=30))

if __name__ == "__main__":
    main()
