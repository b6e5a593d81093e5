"""Cross-entropy's benchmark cases: the loss, linear cross-entropy, and the PyTorch path."""
from __future__ import annotations

import functools

from .._bench_cases import Case, TorchCase, elements_bytes, generator, randn
from .linear import linear_cross_entropy_forward_backward
from .loss import cross_entropy, cross_entropy_forward_backward

# ---- benchmark cases ----------------------------------------------------------------------------

# (tokens, vocabulary): LLaMA-3's vocabulary, a batch of 8 x 2048 tokens.
WORKLOAD = {"full": (16384, 128256), "quick": (4096, 32000), "dtype": "bfloat16"}


def _inputs(T, V, dtype, seed, *, grad=False) -> dict:
    import torch

    gen = generator(seed)
    t = {"x": randn((T, V), dtype, gen) * 4, "target": torch.randint(0, V, (T,), device="cuda", generator=gen)}
    t["target"][::97] = -100   # a few ignored rows, as padding gives
    if grad:
        t["dy"] = torch.ones((), device="cuda", dtype=t["x"].dtype)
        t["leaves"] = (t["x"].detach().requires_grad_(True),)
    return t


def _fwd(t):
    return cross_entropy(t["x"], t["target"])


def _torch_fwd(t):
    import torch.nn.functional as F

    return F.cross_entropy(t["x"], t["target"])


def _train(t):
    return cross_entropy_forward_backward(t["x"], t["target"])


def _torch_train(t, upcast=False):
    import torch
    import torch.nn.functional as F

    x = t["leaves"][0]
    loss = F.cross_entropy(x.float() if upcast else x, t["target"])
    return loss.detach().to(x.dtype), *torch.autograd.grad(loss, t["leaves"])


def _forward_on(F, t):
    if F is None:
        import torch.nn.functional as F
    return F.cross_entropy(t["leaves"][0], t["target"])


def bench_cases(quick: bool) -> list:
    """T rows of V logits. fwd: read the logits (2·T·V bytes in bf16); fwd+bwd (the training
    form): read the logits, write the gradient (4·T·V): the byte floor of a fused loss."""
    (T, V), dt = WORKLOAD["quick" if quick else "full"], WORKLOAD["dtype"]
    (lt, lv, lh), ldt = LINEAR_WORKLOAD["quick" if quick else "full"], LINEAR_WORKLOAD["dtype"]
    make = functools.partial(_inputs, T, V, dt)
    one, two = elements_bytes((T, V), dt), elements_bytes((T, V), dt, 2)
    return [
        Case("cross_entropy fwd", "cross_entropy", (T, V), dt, one, make, _fwd, _torch_fwd),
        Case("cross_entropy fwd+bwd", "cross_entropy", (T, V), dt, two, functools.partial(make, grad=True),
                    _train, _torch_train),
        Case("cross_entropy fwd+bwd vs fp32 upcast", "cross_entropy", (T, V), dt, two,
                    functools.partial(make, grad=True), _train, functools.partial(_torch_train, upcast=True)),
        Case("linear_cross_entropy fwd+bwd", "cross_entropy", (lt, lv, lh), ldt,
                    elements_bytes((lt, lv), ldt, 2), functools.partial(_linear_bench_inputs, lt, lv, lh, ldt),
                    _linear_train, _linear_torch_train, flops=6 * lt * lv * lh),
    ]


def _liger(t):
    from liger_kernel.transformers.functional import liger_cross_entropy

    return liger_cross_entropy(t["leaves"][0], t["target"])


def _quack(t):
    from quack import cross_entropy as quack_cross_entropy

    return quack_cross_entropy(t["leaves"][0], t["target"])


# (tokens, vocabulary, hidden size) of the linear cross-entropy: LLaMA-3-8B's head
LINEAR_WORKLOAD = {"full": (16384, 128256, 4096), "quick": (4096, 32000, 1024), "dtype": "bfloat16"}


def _linear_bench_inputs(T, V, H, dtype, seed) -> dict:
    import torch

    gen = generator(seed)
    t = {"h": randn((T, H), dtype, gen), "w": randn((V, H), dtype, gen) * 0.02,
         "target": torch.randint(0, V, (T,), device="cuda", generator=gen)}
    t["leaves"] = (t["h"].detach().requires_grad_(True), t["w"].detach().requires_grad_(True))
    t["dy"] = torch.ones((), device="cuda", dtype=t["h"].dtype)
    return t


def _linear_train(t):
    return linear_cross_entropy_forward_backward(t["h"], t["w"], t["target"])[:3]


def _linear_forward_on(F, t):
    h, w = t["leaves"]
    if F is not None and hasattr(F, "linear_cross_entropy"):
        return F.linear_cross_entropy(h, w, t["target"])
    import torch.nn.functional as TF

    return TF.cross_entropy(TF.linear(h, w), t["target"])


def _linear_torch_train(t):
    import torch

    loss = _linear_forward_on(None, t)
    return (loss.detach(), *torch.autograd.grad(loss, t["leaves"]))


def _linear_liger(t):
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    h, w = t["leaves"]
    return liger_fused_linear_cross_entropy(h, w, t["target"])


def torch_bench_cases(quick: bool) -> list:
    (T, V), dt = WORKLOAD["quick" if quick else "full"], WORKLOAD["dtype"]
    (lt, lv, lh), ldt = LINEAR_WORKLOAD["quick" if quick else "full"], LINEAR_WORKLOAD["dtype"]
    return [TorchCase("cross_entropy fwd+bwd", "cross_entropy", (T, V), dt,
                             elements_bytes((T, V), dt, 2), functools.partial(_inputs, T, V, dt, grad=True),
                             _forward_on, _train, liger=_liger, quack=_quack),
            TorchCase("linear_cross_entropy fwd+bwd", "cross_entropy", (lt, lv, lh), ldt,
                             elements_bytes((lt, lv), ldt, 2),
                             functools.partial(_linear_bench_inputs, lt, lv, lh, ldt), _linear_forward_on,
                             _linear_train, liger=_linear_liger, flops=6 * lt * lv * lh)]
