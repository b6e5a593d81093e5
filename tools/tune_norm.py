"""Time norm kernel instances at one shape against torch, in one process (GPU host).

    python3 tools/tune_norm.py CANDIDATES.txt [--rows 65536] [--cols 4096]

CANDIDATES.txt lists template instances of cuda_src/norm.cu (norm_fwd<...> / norm_bwd<...>,
bf16), one a line, e.g. produced from a no-spill sweep with cukern._nvrtc on the CPU. They are
compiled first in parallel processes (CuPy's disk cache keeps them), then each is timed with
CUDA events on a persistent grid and printed with GB/s on the byte floor, % of the copy
bandwidth measured in the same run, and the speed-up over torch's kernel for the same step.
"""
import argparse
import multiprocessing as mp
import re

import numpy as np
import torch
import torch.nn.functional as F

import cukern
from cukern import _arrays, _kernels


def bench(fn, reps=40, warmup=8):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return float(np.median(times))


def _compile(inst):
    _kernels.function("norm.cu", inst, 0)
    return inst


def main():
    p = argparse.ArgumentParser()
    p.add_argument("candidates")
    p.add_argument("--rows", type=int, default=65536)
    p.add_argument("--cols", type=int, default=4096)
    args = p.parse_args()
    cands = [ln.strip() for ln in open(args.candidates) if ln.strip()]
    with mp.get_context("spawn").Pool(12) as pool:
        pool.map(_compile, cands)

    N, D = args.rows, args.cols
    dev = torch.device("cuda")
    src = torch.empty(2**30, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    copy_ms = bench(lambda: dst.copy_(src))
    copy_gbps = 2 * src.numel() / copy_ms / 1e6
    print(f"{torch.cuda.get_device_name()}  copy {copy_gbps:.0f} GB/s")
    del src, dst

    x = torch.randn(N, D, device=dev, dtype=torch.bfloat16)
    r, dy = torch.randn_like(x), torch.randn_like(x)
    w = torch.randn(D, device=dev, dtype=torch.bfloat16)
    b = torch.randn(D, device=dev, dtype=torch.bfloat16)
    nd2 = N * D * 2

    def line(name, ms, nbytes, ref_ms):
        gbps = nbytes / ms / 1e6
        print(f"{name:58s} {ms:7.3f} ms {gbps:6.0f} GB/s {100 * gbps / copy_gbps:5.1f}%  x{ref_ms / ms:.2f}",
              flush=True)

    xg, wg, bg = (t.detach().requires_grad_() for t in (x, w, b))
    t_fwd = {False: bench(lambda: F.layer_norm(x, (D,), w, b)),
             True: bench(lambda: F.rms_norm(x, (D,), w, 1e-6))}
    t_fb = {False: bench(lambda: torch.autograd.grad(F.layer_norm(xg, (D,), wg, bg), (xg, wg, bg), dy)),
            True: bench(lambda: torch.autograd.grad(F.rms_norm(xg, (D,), wg, 1e-6), (xg, wg), dy))}
    t_res = {False: bench(lambda: F.layer_norm(x + r, (D,), w, b)),
             True: bench(lambda: F.rms_norm(x + r, (D,), w, 1e-6))}
    for rms in (False, True):
        k = "rms_norm" if rms else "layer_norm"
        line(f"torch {k} fwd", t_fwd[rms], 2 * nd2, t_fwd[rms])
        line(f"torch {k} fwd+bwd", t_fb[rms], 5 * nd2, t_fb[rms])
        line(f"torch {k} add+norm", t_res[rms], 4 * nd2, t_res[rms])

    A = lambda t, n: _arrays.as_device_array(t, n)  # noqa: E731
    xa, wa, ba, da = A(x, "x"), A(w, "w"), A(b, "b"), A(dy, "dy")
    y = A(torch.empty_like(x), "y")
    mean, rstd = A(torch.empty(N, device=dev), "m"), A(torch.empty(N, device=dev), "s")
    pat = re.compile(r"norm_(fwd|bwd)<cuk_bf16, (true|false), 8, (\d+), (\d+), (\d+), (\d+), (\d+)>")
    for inst in cands:
        kind, rmss, nv, g, t, rr, minb = pat.match(inst).groups()
        rms, g, t, rr = rmss == "true", int(g), int(t), int(rr)
        fn = _kernels.function("norm.cu", inst, 0)
        grid = min(_kernels.resident_blocks(fn, t, 0), -(-N // (t // g * rr)))
        if kind == "fwd":
            argv = (xa, np.int64(D), None, np.int64(0), wa, None if rms else ba, y, None,
                    None if rms else mean, rstd, np.int64(N), np.int32(D), np.float32(1e-5))
            ref, nbytes = t_fwd[rms], 2 * nd2
        else:
            parts = [A(torch.empty(grid * (t // g), D, device=dev), "p") for _ in range(2)]
            argv = (da, np.int64(D), xa, np.int64(D), wa, mean, rstd, None, np.int64(0), y,
                    parts[0], None if rms else parts[1], np.int64(N), np.int32(D))
            ref, nbytes = t_fb[rms] - t_fwd[rms], 3 * nd2

        def run():
            with _arrays.launch_context(xa):
                _kernels.launch(fn, grid, t, argv)
        line(f"{inst} {fn.num_regs}r g{grid}", bench(run), nbytes, ref)

    # the public API, as a user calls it
    for rms in (False, True):
        k = "rms_norm" if rms else "layer_norm"
        if rms:
            fwd = lambda: cukern.rms_norm(x, w)  # noqa: E731
            res = lambda: cukern.rms_norm(x, w, residual=r)  # noqa: E731

            def fb():
                _, s = cukern.rms_norm(x, w, return_stats=True)
                cukern.rms_norm_backward(dy, x, w, s)
        else:
            fwd = lambda: cukern.layer_norm(x, w, b)  # noqa: E731
            res = lambda: cukern.layer_norm(x, w, b, residual=r)  # noqa: E731

            def fb():
                _, m, s = cukern.layer_norm(x, w, b, return_stats=True)
                cukern.layer_norm_backward(dy, x, w, m, s)
        line(f"cukern.{k} fwd", bench(fwd), 2 * nd2, t_fwd[rms])
        line(f"cukern.{k} fwd+bwd", bench(fb), 5 * nd2, t_fb[rms])
        line(f"cukern.{k} +residual", bench(res), 4 * nd2, t_res[rms])


if __name__ == "__main__":
    main()
