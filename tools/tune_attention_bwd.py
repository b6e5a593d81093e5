"""Time attention backward configurations against torch's SDPA backends (on a GPU).

    python3 tools/tune_attention_bwd.py [--quick] [--default]

--quick skips the S8192 case; --default times only the shipped configuration.

For each head dim, each backward block shape of CANDIDATES (attention.BwdConfig: queries a step,
keys a block, warps, warp layouts; on sm_90 also attention.Sm90BwdConfig: query rows a step of
the Hopper kernel and its Q/dO ring) is passed to the fronts in a Configs object of its own (the shipped CONFIGS
is never changed; the sm_80 candidates run with the Hopper backward off) and the forward +
backward is timed (device time, median) with deterministic=False and True, at the bench
shapes; printed in TFLOP/s (FlashAttention's count: 3.5x the forward's FLOPs) with the ratio to
FLASH_ATTENTION (FlashAttention-2) and CUDNN_ATTENTION in the same run.
"""
import dataclasses
import importlib
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from cukern import _bench

attn = importlib.import_module("cukern.attention")
C = attn.BwdConfig
CANDIDATES = {64: [C(128, 128, 8, 4, 4, 4), C(64, 128, 8, 2, 4, 4), C(128, 64, 8, 4, 2, 4)],
              128: [C(64, 128, 8, 2, 4, 2), C(64, 64, 4, 2, 2, 2), C(64, 128, 8, 4, 4, 2)]}
S90 = attn.Sm90BwdConfig
SM90_CANDIDATES = {64: [S90(64), S90(128), S90(128, producer=True)], 128: [S90(64), S90(64, 3), S90(64, producer=True)]}
SHAPES = [(32, 16, 2048, 128, False), (32, 16, 2048, 128, True), (4, 32, 8192, 128, True),
          (16, 32, 2048, 64, True)]


def main():
    quick = "--quick" in sys.argv
    print(torch.cuda.get_device_name())
    for B, H, S, D, causal in SHAPES[:2] + SHAPES[3:] if quick else SHAPES:
        q, k, v, do = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
        flops = 3.5 * 4 * B * H * S * S * D / (2 if causal else 1)
        ref = {}
        for name, be in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
            qt, kt, vt = (a.detach().transpose(1, 2).requires_grad_(True) for a in (q, k, v))

            def run(be=be, qt=qt, kt=kt, vt=vt):
                with sdpa_kernel(be):
                    o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
                return torch.autograd.grad(o, (qt, kt, vt), do.transpose(1, 2))
            ref[name] = _bench.time_cuda(run, warmup=3, reps=10)
        expect = [g.transpose(1, 2).float() for g in run()]
        print(f"\nB{B} H{H} S{S} d{D}{' causal' if causal else ''} fwd+bwd: flash "
              f"{flops / ref['flash'] / 1e9:.0f} TFLOP/s, cudnn {flops / ref['cudnn'] / 1e9:.0f} TFLOP/s")
        hopper = torch.cuda.get_device_capability() == (9, 0) and D in SM90_CANDIDATES
        if "--default" in sys.argv:
            cands = [attn.configs.CONFIGS.get("bwd_sm90" if hopper else "bwd", D)]
        else:
            cands = CANDIDATES[D] + (SM90_CANDIDATES[D] if hopper else [])
        for cfg in cands:
            configs = (dataclasses.replace(attn.configs.CONFIGS, bwd_sm90=((D, cfg),)) if isinstance(cfg, S90) else
                       dataclasses.replace(attn.configs.CONFIGS.replace("bwd", D, cfg), use_sm90_bwd=False))
            for det in (False, True):
                def ours(det=det, configs=configs):
                    out, lse = attn._attention(q, k, v, causal, None, True, configs)
                    return attn._attention_backward(do, q, k, v, out, lse, causal, None, det, configs)
                try:
                    errs = [((g.float() - e).norm() / e.norm()).item() for g, e in zip(ours(), expect)]
                    ms = _bench.time_cuda(ours, warmup=3, reps=10)
                    print(f"  {cfg} det={det!s:5}: {flops / ms / 1e9:5.0f} TFLOP/s  {ref['flash'] / ms:4.2f}x flash  "
                          f"{ref['cudnn'] / ms:4.2f}x cudnn  (rel. err dq dk dv {' '.join(f'{e:.1e}' for e in errs)})")
                except Exception as e:  # noqa: BLE001
                    print(f"  {cfg} det={det}: failed: {type(e).__name__}: {str(e)[:160]}")


if __name__ == "__main__":
    main()
