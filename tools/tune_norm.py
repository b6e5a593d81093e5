"""Time norm kernel configurations at the workload shape against torch, in one process.

Usage on the GPU host: python3 tools/tune_norm.py [--rows 65536] [--cols 4096]
Prints one line per variant: ms, GB/s on the byte floor, % of the measured copy, and the
speed-up over torch. Variants are template instances of cuda_src/norm.cu picked by hand,
so configurations outside cukern.norm's tables can be tried without editing them.
"""
import argparse

import numpy as np
import torch
import torch.nn.functional as F

import cukern
from cukern import _arrays, _kernels, norm


def bench(fn, reps=50, warmup=10):
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


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=65536)
    p.add_argument("--cols", type=int, default=4096)
    args = p.parse_args()
    N, D = args.rows, args.cols
    dev = torch.device("cuda")
    src = torch.empty(2**29, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    copy_ms = bench(lambda: dst.copy_(src))
    copy_gbps = 2 * src.numel() / copy_ms / 1e6
    print(f"{torch.cuda.get_device_name()}  copy {copy_gbps:.0f} GB/s")
    del src, dst

    x = torch.randn(N, D, device=dev, dtype=torch.bfloat16)
    r = torch.randn_like(x)
    dy = torch.randn_like(x)
    w = torch.randn(D, device=dev, dtype=torch.bfloat16)
    b = torch.randn(D, device=dev, dtype=torch.bfloat16)
    nd2 = N * D * 2

    def line(name, ms, nbytes, torch_ms):
        gbps = nbytes / ms / 1e6
        print(f"{name:60s} {ms:7.3f} ms {gbps:6.0f} GB/s {100 * gbps / copy_gbps:5.1f}%  x{torch_ms / ms:.2f}")

    t_ln = bench(lambda: F.layer_norm(x, (D,), w, b))
    t_rms = bench(lambda: F.rms_norm(x, (D,), w, 1e-6))
    line("torch layer_norm fwd", t_ln, 2 * nd2, t_ln)
    line("torch rms_norm fwd", t_rms, 2 * nd2, t_rms)

    xa = _arrays.as_device_array(x, "x")
    y = torch.empty_like(x)
    ya = _arrays.as_device_array(y, "y")
    wa, ba = _arrays.as_device_array(w, "w"), _arrays.as_device_array(b, "b")
    mean = torch.empty(N, device=dev)
    rstd = torch.empty(N, device=dev)
    ma, sa = _arrays.as_device_array(mean, "m"), _arrays.as_device_array(rstd, "s")
    for rms in (False, True):
        for nv, g, t in [(4, 128, 128), (2, 256, 256), (1, 512, 512), (4, 256, 256)]:
            inst = f"norm_fwd<cuk_bf16, {'true' if rms else 'false'}, 8, {nv}, {g}, {t}>"
            fn = _kernels.function("norm.cu", inst, 0)
            for grid_kind in ("persistent", "all rows"):
                grid = _kernels.resident_blocks(fn, t, 0) if grid_kind == "persistent" else N // (t // g)
                grid = min(grid, N // (t // g))

                def run():
                    with _arrays.launch_context(xa):
                        _kernels.launch(fn, grid, t, (xa, np.int64(D), None, np.int64(0), wa,
                                                      None if rms else ba, ya, None, None if rms else ma,
                                                      sa, np.int64(N), np.int32(D), np.float32(1e-5)))
                ms = bench(run)
                line(f"{inst} {grid_kind} ({grid})", ms, 2 * nd2, t_rms if rms else t_ln)

    # the public API, as the user sees it
    line("cukern.layer_norm", bench(lambda: cukern.layer_norm(x, w, b)), 2 * nd2, t_ln)
    line("cukern.rms_norm", bench(lambda: cukern.rms_norm(x, w)), 2 * nd2, t_rms)

    # residual
    t_lnr = bench(lambda: F.layer_norm(x + r, (D,), w, b))
    t_rmsr = bench(lambda: F.rms_norm(x + r, (D,), w, 1e-6))
    line("cukern.layer_norm +residual", bench(lambda: cukern.layer_norm(x, w, b, residual=r)), 4 * nd2, t_lnr)
    line("cukern.rms_norm +residual", bench(lambda: cukern.rms_norm(x, w, residual=r)), 4 * nd2, t_rmsr)

    # forward + backward
    xg = x.detach().requires_grad_()
    wg, bg = w.detach().requires_grad_(), b.detach().requires_grad_()

    def torch_ln_fb():
        yy = F.layer_norm(xg, (D,), wg, bg)
        torch.autograd.grad(yy, (xg, wg, bg), dy)

    def torch_rms_fb():
        yy = F.rms_norm(xg, (D,), wg, 1e-6)
        torch.autograd.grad(yy, (xg, wg), dy)

    def ck_ln_fb():
        _, m, s = cukern.layer_norm(x, w, b, return_stats=True)
        cukern.layer_norm_backward(dy, x, w, m, s)

    def ck_rms_fb():
        _, s = cukern.rms_norm(x, w, return_stats=True)
        cukern.rms_norm_backward(dy, x, w, s)

    t_lnfb, t_rmsfb = bench(torch_ln_fb), bench(torch_rms_fb)
    line("torch layer_norm fwd+bwd", t_lnfb, 5 * nd2, t_lnfb)
    line("torch rms_norm fwd+bwd", t_rmsfb, 5 * nd2, t_rmsfb)
    line("cukern layer_norm fwd+bwd", bench(ck_ln_fb), 5 * nd2, t_lnfb)
    line("cukern rms_norm fwd+bwd", bench(ck_rms_fb), 5 * nd2, t_rmsfb)

    _, m, s = cukern.layer_norm(x, w, b, return_stats=True)
    dxo = torch.empty_like(x)
    da, dxa = _arrays.as_device_array(dy, "dy"), _arrays.as_device_array(dxo, "dx")
    ma, sa = _arrays.as_device_array(m, "m"), _arrays.as_device_array(s, "s")
    for rms in (False, True):
        for nv, g, t in [(4, 128, 128), (2, 256, 256), (1, 512, 512)]:
            inst = f"norm_bwd<cuk_bf16, {'true' if rms else 'false'}, 8, {nv}, {g}, {t}>"
            fn = _kernels.function("norm.cu", inst, 0)
            grid = _kernels.resident_blocks(fn, t, 0)
            parts = torch.empty(grid * (t // g), D, device=dev)
            parts2 = torch.empty_like(parts)
            pa, pa2 = _arrays.as_device_array(parts, "p"), _arrays.as_device_array(parts2, "p2")

            def run():
                with _arrays.launch_context(xa):
                    _kernels.launch(fn, grid, t, (da, np.int64(D), xa, np.int64(D), wa, ma, sa, None,
                                                  np.int64(0), dxa, pa, None if rms else pa2,
                                                  np.int64(N), np.int32(D)))
            ms = bench(run)
            line(f"{inst} grid {grid}", ms, 3 * nd2, (t_rmsfb - t_rms) if rms else (t_lnfb - t_ln))


if __name__ == "__main__":
    main()
