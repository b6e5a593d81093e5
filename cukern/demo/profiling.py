"""Where the demo's training steps spend GPU time, by kernel category (``python -m cukern
profile``), with and without ``cukern.torch.patch()``."""
from __future__ import annotations

import contextlib
import re

import torch

from .options import Config
from .model import batch
from .training import _dist, build, patch_context



CATEGORIES = [
    # (cuDNN's attention backward has helper kernels: dot(dO, O) and the dQ conversion)
    ("attention", r"flash|fmha|attention|sdpa|_efficient_attention|mha|dot_do_o|convert_dq"),
    ("matrix multiply", r"gemm|cutlass|xmma|nvjet|cublas|matmul|splitK"),
    # (PyTorch's LayerNorm weight/bias gradient is GammaBetaBackward; GroupNorm's statistics
    # kernels are RowwiseMoments and ComputeFusedParams)
    ("normalization", r"layer_norm|rms_norm|group_norm|norm_fwd|norm_bwd|batch_norm|GammaBeta|RowwiseMoments|"
                      r"ComputeFusedParams|GroupNorm|LayerNorm|RMSNorm|partial_rows"),
    ("embedding", r"embedding|index_select|indexSelect|RadixSort|radix_sort"),
    ("communication", r"nccl"),
    # (PyTorch's loss: log_softmax forward and backward, then nll_loss)
    ("loss", r"cross_entropy|nll_loss|SoftMax|softmax|log_softmax"),
    # (cukern's rotary embedding and gated MLP product: PyTorch's run as elementwise kernels)
    ("elementwise", r"elementwise|vectorized|unrolled|reduce|fill|copy|Copy|cat|gelu|rope_apply|glu_fwd|glu_bwd|"
                    r"adam|Adam|foreach|multi_tensor|add|mul|where|arange|rand|Random|distribution"),
]


def category(kernel_name: str) -> str:
    for name, pattern in CATEGORIES:
        if re.search(pattern, kernel_name):
            return name
    return "other"


def profile_steps(cfg: Config, *, steps: int, batch_size: int, patched: bool, warmup: int = 3, ops=None,
                  ) -> tuple[dict, dict]:
    """GPU time a step over ``steps`` training steps (after ``warmup``): ({category: ms},
    {kernel name: ms})."""

    _, _, device = _dist()
    torch.manual_seed(0)
    model, loss_of, vocab = build(cfg, device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    gen = torch.Generator(device=device).manual_seed(0)
    ctx = patch_context(model, cfg, ops) if patched else contextlib.nullcontext()
    if patched:
        from cukern.torch import _native
        _native.wait()

    def step():
        tokens, targets = batch(gen, batch_size, cfg.seq, vocab, device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = loss_of(model, tokens, targets)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    with ctx:
        for _ in range(warmup):
            step()
        torch.cuda.synchronize(device)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                step()
            torch.cuda.synchronize(device)
    shares: dict[str, float] = {name: 0.0 for name, _ in CATEGORIES}
    shares["other"] = 0.0
    kernels: dict[str, float] = {}
    for e in prof.key_averages():
        if e.device_time_total > 0:
            ms = e.device_time_total / 1e3 / steps
            shares[category(e.key)] += ms
            kernels[e.key] = kernels.get(e.key, 0.0) + ms
    return shares, kernels


def format_top(kernels: dict, n: int, title: str) -> str:
    """The ``n`` kernels with the most GPU time a step, with their categories."""
    total = sum(kernels.values())
    lines = [f"{title}: the {n} largest kernels (ms a step, share, category)"]
    for name, ms in sorted(kernels.items(), key=lambda kv: -kv[1])[:n]:
        short = name if len(name) <= 90 else name[:87] + "..."
        lines.append(f"  {ms:8.2f} {ms / total * 100:5.1f}%  {category(name):15s} {short}")
    return "\n".join(lines)


def format_shares(before: dict, after: dict) -> str:
    tb, ta = sum(before.values()), sum(after.values())
    lines = [f"{'category':16s} {'PyTorch ms':>11s} {'share':>6s}   {'patched ms':>11s} {'share':>6s}"]
    for k in before:
        lines.append(f"{k:16s} {before[k]:11.2f} {before[k] / tb * 100:5.1f}%   "
                     f"{after[k]:11.2f} {after[k] / ta * 100:5.1f}%")
    lines.append(f"{'GPU time a step':16s} {tb:11.2f} {'':6s}   {ta:11.2f}   ({tb / ta:.2f}x)")
    return "\n".join(lines)


def chart(before: dict, after: dict, path: str) -> bool:
    """A stacked bar chart of the two profiles (False when matplotlib is missing)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 3.5))
    left = [0.0, 0.0]
    for k in before:
        vals = [before[k], after[k]]
        ax.barh(["PyTorch", "cukern.patch()"], vals, left=left, label=k)
        left = [a + b for a, b in zip(left, vals)]
    ax.set_xlabel("GPU time a training step (ms)")
    ax.legend(fontsize=7, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.2))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True
