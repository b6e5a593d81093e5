"""Time attention forward configurations against torch's SDPA backends (on a GPU).

    python3 tools/tune_attention.py [HEAD_DIM ...] [--sm90-only]

For each head dim, each attention.FwdConfig of CANDIDATES is passed to the front in a Configs
object of its own (the shipped CONFIGS is never changed) and timed (device time, median) at the bench shapes,
printed in TFLOP/s with the ratio to the FLASH_ATTENTION (FlashAttention-2) and
CUDNN_ATTENTION backends measured in the same run. On an sm_90 GPU the Hopper forward
(attention_fwd_sm90, TMA + wgmma) follows, at each of its key-tile sizes, forced on.
"""
import dataclasses
import importlib
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from cukern import _bench

attn = importlib.import_module("cukern.attention")
C = attn.FwdConfig   # (warps, m-tiles a warp, keys a staged tile, keys a compute sub-tile, Q in registers)
CANDIDATES = {64: [C(4, 2, 64, 64, True), C(4, 2, 128, 64, True), C(4, 2, 64, 32, True)],
              128: [C(4, 2, 64, 32, False), C(4, 2, 32, 32, False), C(4, 2, 128, 32, False), C(4, 2, 64, 64, False)]}
S90 = attn.Sm90FwdConfig   # (keys a tile, stages, producer warpgroup, pingpong)
SM90_CANDIDATES = {64: [S90(64, 2), S90(64, 3), S90(64, 2, True)],
                   128: [S90(128, 3, True, True, True, persistent=True),
                         S90(128, 3, True, False, True, persistent=True), S90(128, 2, True, True, True),
                         S90(128, 3, True, True, True), S90(128, 2, True, False, True)],
                   192: [S90(128, 2, True, True), S90(128, 2, True, True, True), S90(128, 2, True, False, True),
                         S90(64, 3, True, True, True), S90(64, 4, True, True, True), S90(80, 3, True, True, True),
                         S90(80, 2, True, True, True)],
                   256: [S90(64, 2, True, True), S90(64, 2, True, True, True), S90(64, 2, True, False, True),
                         S90(80, 2, True, True, True), S90(80, 2, True, False, True)]}
# (B, H, S, D, causal[, Dv]): Dv, v's head size, D unless given (MLA: 192 and 128)
SHAPES = [(32, 16, 2048, 128, False), (32, 16, 2048, 128, True), (16, 32, 2048, 64, True),
          (16, 32, 2048, 64, False), (16, 16, 2048, 256, False), (16, 16, 2048, 256, True),
          (4, 16, 4096, 192, True, 128), (8, 16, 2048, 192, False, 128)]


def main():
    print(torch.cuda.get_device_name())
    dims = {int(a) for a in sys.argv[1:] if a.isdigit()}   # (head dims to time; all when none are given)
    sm90_only = "--sm90-only" in sys.argv
    for B, H, S, D, causal, *dv in SHAPES:
        if dims and D not in dims:
            continue
        DV = dv[0] if dv else D
        q, k = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        v = torch.randn(B, S, H, DV, device="cuda", dtype=torch.bfloat16)
        flops = 2 * B * H * S * S * (D + DV) / (2 if causal else 1)
        ref = {}
        for name, be in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
            def run(be=be):
                with sdpa_kernel(be):
                    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                          v.transpose(1, 2), is_causal=causal)
            try:
                ref[name] = _bench.time_cuda(run, warmup=3, reps=10)
            except RuntimeError:   # (flash takes no Dv of its own)
                ref[name] = float("nan")
        expect = run().transpose(1, 2).float()
        print(f"\nB{B} H{H} S{S} d{D}{f'/{DV}' if DV != D else ''}{' causal' if causal else ''}: "
              f"flash {flops / ref['flash'] / 1e9:.0f} "
              f"TFLOP/s, cudnn {flops / ref['cudnn'] / 1e9:.0f} TFLOP/s")
        candidates = [(cfg, dataclasses.replace(attn.configs.CONFIGS.replace("fwd", D, cfg), use_sm90=False))
                      for cfg in CANDIDATES.get(D, [attn.configs.CONFIGS.get("fwd", D)]) if not sm90_only]
        if torch.cuda.get_device_capability() == (9, 0):
            candidates += [(cfg, dataclasses.replace(attn.configs.CONFIGS, use_sm90=True, fwd_sm90=((D, cfg),),
                                                     fwd_sm90_full=()))
                           for cfg in SM90_CANDIDATES.get(D, [])]
        for cfg, configs in candidates:
            try:
                out = attn._attention(q, k, v, causal, None, False, configs)
                err = ((out.float() - expect).norm() / expect.norm()).item()
                ms = _bench.time_cuda(lambda: attn._attention(q, k, v, causal, None, False, configs), warmup=3, reps=10)
                print(f"  {cfg}: {flops / ms / 1e9:5.0f} TFLOP/s  {ref['flash'] / ms:4.2f}x flash  "
                      f"{ref['cudnn'] / ms:4.2f}x cudnn  (rel. err {err:.1e})")
            except Exception as e:  # noqa: BLE001
                print(f"  {cfg}: failed: {type(e).__name__}: {str(e)[:160]}")


if __name__ == "__main__":
    main()
