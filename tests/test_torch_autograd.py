"""Every cukern.torch op under autograd as PyTorch's own ops behave there, from the registry
(``cukern.torch._ops.OPS``, with the samples each family's test module declares in
``opcheck_samples()``), so a new family is held to it too:

* a backward leaves every tensor it is given as it was: the saved tensors (autograd may use
  them again) and the upstream gradients;
* ``backward(retain_graph=True)`` twice gives exactly twice the first gradients, and a third
  pass that frees the graph (where a backward may reuse the buffers its forward made) adds the
  same again; ``torch.autograd.grad`` twice gives the same gradients; on the eager path, the
  native (C++ replay) path and through the custom op;
* an upstream gradient other than 1 (3, not a power of two) is applied before the gradient is
  rounded: the error against float64 is no worse than PyTorch's own ops' in that dtype.

PyTorch's own computation of each op (``TORCH_OWN``) is checked against its wiring calls on the
CPU, so that the comparison compares like with like.
"""
from __future__ import annotations

import importlib

import pytest

torch = pytest.importorskip("torch")

from conftest import gpu_unavailable_reason  # noqa: E402
from torch_helpers import family_tables  # noqa: E402

F = torch.nn.functional
M = importlib.import_module("cukern._attention_mask")
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available() or gpu_unavailable_reason() is not None,
                                reason="needs a CUDA build of torch and a GPU")


# ---- PyTorch's own computation of each op, on the op's arguments -------------------------------
# Each returns the op's differentiated visible outputs, computed as a PyTorch user would in the
# inputs' dtype (in float64 for float64 inputs: the reference).

def _norm_weight(w, off):
    return None if w is None else (w + off if off else w)


def _layer_norm(x, w, b, eps, off):
    return (F.layer_norm(x, x.shape[-1:], _norm_weight(w, off), b, eps),)


def _rms_norm(x, w, eps, off, casting):
    # casting 0 (Gemma's): float32 throughout, rounded once; 1 (LLaMA's): the normalized x
    # rounded before the weight; 2: the input's dtype throughout
    if casting == 2 or x.dtype == torch.float64:
        return (F.rms_norm(x, x.shape[-1:], _norm_weight(w, off), eps),)
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if w is None:
        return (y.to(x.dtype),)
    if casting == 1:
        return (y.to(x.dtype) * _norm_weight(w, off),)
    return ((y * (w.float() + off)).to(x.dtype),)


def _sdpa_like(q, k, v, causal, scale, wl, wr, cap):
    """(B, Sq, H, d) attention: PyTorch's SDPA where it computes the same thing, else the eager
    composite Hugging Face's models run (scores in the inputs' dtype, the softmax in float32)."""
    b, sq, h, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    mask = M.mask_of(causal, (wl, wr), cap, sq, sk)
    qt, kt, vt = (a.transpose(1, 2) for a in (q, k, v))
    if not mask.softcap and mask.left < 0 and (mask.right < 0 or (mask.right == 0 and sq == sk)):
        return F.scaled_dot_product_attention(qt, kt, vt, is_causal=mask.right == 0, scale=scale,
                                              enable_gqa=h != hkv).transpose(1, 2)
    kt, vt = (a.repeat_interleave(h // hkv, dim=1) for a in (kt, vt))
    s = (qt @ kt.transpose(-1, -2) * scale).to(torch.float64 if q.dtype == torch.float64 else torch.float32)
    if mask.softcap:
        s = mask.softcap * torch.tanh(s / mask.softcap)
    keep = torch.as_tensor(M.visible(mask, sq, sk), device=q.device)
    p = torch.softmax(s.masked_fill(~keep, float("-inf")), dim=-1).nan_to_num(0.0)
    return (p.to(q.dtype) @ vt).transpose(1, 2)


def _attention(q, k, v, causal, scale, wl, wr, cap, det):
    return (_sdpa_like(q, k, v, causal, scale, wl, wr, cap),)


def _sink_like(q, k, v, sinks, causal, scale, wl, wr, cap):
    """(B, Sq, H, d) attention with sinks, as GPT-OSS's eager code: the sink a column of the
    (masked, capped) scores in the softmax, dropped after."""
    b, sq, h, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    mask = M.mask_of(causal, (wl, wr), cap, sq, sk)
    qt, kt, vt = (a.transpose(1, 2) for a in (q, k, v))
    kt, vt = (a.repeat_interleave(h // hkv, dim=1) for a in (kt, vt))
    s = (qt @ kt.transpose(-1, -2) * scale).to(torch.float64 if q.dtype == torch.float64 else torch.float32)
    if mask.softcap:
        s = mask.softcap * torch.tanh(s / mask.softcap)
    keep = torch.as_tensor(M.visible(mask, sq, sk), device=q.device)
    col = sinks.to(s.dtype).reshape(1, -1, 1, 1).expand(b, -1, sq, 1)
    p = torch.softmax(torch.cat([s.masked_fill(~keep, float("-inf")), col], dim=-1), dim=-1)[..., :-1]
    return (p.to(q.dtype) @ vt).transpose(1, 2)


def _attention_sink(q, k, v, sinks, causal, scale, wl, wr, cap, det):
    return (_sink_like(q, k, v, sinks, causal, scale, wl, wr, cap),)


def _attention_dropout(q, k, v, rng, causal, scale, wl, wr, cap, p, det, keep=None):
    """The weights dropped by the mask the kernels draw (the NumPy reference's), the kept scaled
    (``keep``: that mask, where the caller cut it from a larger one)."""
    from cukern.attention.reference import dropout_keep_mask

    b, sq, h, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    mask = M.mask_of(causal, (wl, wr), cap, sq, sk)
    qt, kt, vt = (a.transpose(1, 2) for a in (q, k, v))
    kt, vt = (a.repeat_interleave(h // hkv, dim=1) for a in (kt, vt))
    s = (qt @ kt.transpose(-1, -2) * scale).masked_fill(~torch.as_tensor(M.visible(mask, sq, sk), device=q.device),
                                                        float("-inf"))
    if keep is None:
        keep = dropout_keep_mask(p, int(rng[0]) % 2**64, int(rng[1]) % 2**32, b, h, sq, sk)
    keep = torch.as_tensor(keep, device=q.device)
    w = torch.where(keep, torch.softmax(s, dim=-1) / (1 - p), torch.zeros((), device=q.device, dtype=s.dtype))
    return ((w @ vt).transpose(1, 2),)


def _attention_varlen_dropout(q, k, v, cu_q, cu_k, rng, max_q, max_k, causal, scale, wl, wr, cap, p, det):
    """Each document as ``_attention_dropout``, its weights drawn at its tokens' places in the
    pack (batch 0)."""
    from cukern.attention.reference import dropout_keep_mask

    keep = dropout_keep_mask(p, int(rng[0]) % 2**64, int(rng[1]) % 2**32, 1, q.shape[1], q.shape[0], k.shape[0])
    return _documents(q, cu_q, cu_k, lambda q0, q1, k0, k1: _attention_dropout(
        q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], rng, causal, scale, wl, wr, cap, p, det,
        keep[:, :, q0:q1, k0:k1])[0][0])


def _attention_varlen_sink(q, k, v, cu_q, cu_k, sinks, max_q, max_k, causal, scale, wl, wr, cap, det):
    out = []
    for d in range(cu_q.shape[0] - 1):
        q0, q1, k0, k1 = int(cu_q[d]), int(cu_q[d + 1]), int(cu_k[d]), int(cu_k[d + 1])
        out.append(_sink_like(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], sinks, causal, scale, wl, wr, cap)[0])
    return (torch.cat(out) if out else q * 0,)


def _documents(q, cu_q, cu_k, one):
    """``one(q0, q1, k0, k1)``, a document's (q1 - q0, H, Dv) output, over the packed documents,
    in order (zeros for a document without keys)."""
    out = []
    for d in range(cu_q.shape[0] - 1):
        q0, q1, k0, k1 = int(cu_q[d]), int(cu_q[d + 1]), int(cu_k[d]), int(cu_k[d + 1])
        if q1 == q0:
            continue
        out.append(q[q0:q1] * 0 if k1 == k0 else one(q0, q1, k0, k1))
    return (torch.cat(out) if out else q * 0,)


def _attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, wl, wr, cap, det):
    return _documents(q, cu_q, cu_k, lambda q0, q1, k0, k1: _sdpa_like(
        q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], causal, scale, wl, wr, cap)[0])


def _loss(z, t, ignore, smoothing, z_loss, cap, reduction):
    if cap:
        z = cap * torch.tanh(z / cap)
    loss = F.cross_entropy(z, t, ignore_index=ignore, label_smoothing=smoothing, reduction=reduction)
    if z_loss:
        keep = (t != ignore).to(z.dtype)
        zl = z_loss * torch.logsumexp(z, dim=-1) ** 2 * keep
        loss = loss + {"none": zl, "sum": zl.sum(), "mean": zl.sum() / keep.sum()}[reduction]
    return loss


def _cross_entropy(x, t, ignore, smoothing, z_loss, cap, reduction, f32):
    return (_loss(x.float() if f32 and x.dtype != torch.float64 else x, t, ignore, smoothing, z_loss, cap, reduction),)


def _linear_cross_entropy(h, w, t, b, ignore, smoothing, z_loss, cap, reduction, f32):
    z = F.linear(h, w, b)
    return (_loss(z.float() if f32 and z.dtype != torch.float64 else z, t, ignore, smoothing, z_loss, cap, reduction),)


def _glu(gate, up, act):
    a = F.silu(gate) if act == 0 else F.gelu(gate, approximate="none" if act == 1 else "tanh")
    return (a * up,)


def _rope(q, k, cos, sin, interleaved):
    c, s = (a if a.dim() == 3 else a[None] for a in (cos, sin))
    c, s = c[:, None], s[:, None]

    def rotate(x):
        if interleaved:
            return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)
        half = x.shape[-1] // 2
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    return tuple(x * c + rotate(x) * s for x in (q, k))


def _moe_experts(x, idx, w, gu, dn, act):
    from cukern.moe.block import ACTS
    from cukern.torch import _recognize_experts

    return (_recognize_experts.experts_reference(ACTS[act], x, idx, w, gu, dn),)


def _moe_experts_biased(x, idx, w, gu, bgu, dn, bdn, alpha, limit):
    from cukern.torch import _recognize_experts

    return (_recognize_experts.biased_experts_reference(alpha, limit, x, idx, w, gu, bgu, dn, bdn),)


TORCH_OWN = {
    "layer_norm": _layer_norm,
    "rms_norm": _rms_norm,
    "layer_norm_residual": lambda x, r, w, b, eps, off: (_layer_norm(x + r, w, b, eps, off)[0], x + r),
    "rms_norm_residual": lambda x, r, w, eps, off, c: (_rms_norm(x + r, w, eps, off, c)[0], x + r),
    "group_norm": lambda x, g, w, b, eps: (F.group_norm(x, g, w, b, eps),),
    "embedding": lambda i, w, p, s: (F.embedding(i, w, padding_idx=p, scale_grad_by_freq=s),),
    "attention": _attention,
    "attention_lse": _attention,   # (the lse is visible, not differentiated)
    "attention_varlen": _attention_varlen,
    "attention_sink": _attention_sink,
    "attention_sink_lse": _attention_sink,
    "attention_varlen_sink": _attention_varlen_sink,
    "attention_dropout": _attention_dropout,
    "attention_varlen_dropout": _attention_varlen_dropout,
    "cross_entropy": _cross_entropy,
    "linear_cross_entropy": _linear_cross_entropy,
    "glu": _glu,
    "rope": _rope,
    "moe_experts": _moe_experts,
    "moe_experts_biased": _moe_experts_biased,
    "moe_block": lambda *a: __import__("test_moe").torch_block(*a)[:2],
}


def test_every_op_has_pytorchs_own_computation_here():
    from cukern.torch._ops import OPS

    assert set(TORCH_OWN) == set(OPS), "a new op needs its PyTorch computation in TORCH_OWN"


@pytest.mark.parametrize("which", ["x", "both"])
def test_pytorchs_own_computations_match_the_wiring_references(which):
    """On the CPU, in float32: each TORCH_OWN entry computes what the family's wiring call says
    the op computes (its PyTorch reference), forward and backward."""
    g = torch.Generator().manual_seed(0)
    calls = [c for table in family_tables("torch_wiring_calls", which, g) for c in table]
    assert {c[0] for c in calls} >= set(TORCH_OWN) - {"attention_lse", "attention_sink_lse"}
    for name, args, ref, inputs in calls:
        got, expect = TORCH_OWN[name](*args)[0], ref()
        expect = expect[0] if isinstance(expect, tuple) else expect
        torch.testing.assert_close(got, expect, msg=name)
        live = [t for t in inputs if t.requires_grad]
        if live:
            dy = torch.randn(got.shape, generator=g)
            for a, e in zip(torch.autograd.grad(got, live, dy), torch.autograd.grad(expect, live, dy)):
                torch.testing.assert_close(a, e, msg=name)


@pytest.mark.parametrize("window, softcap, causal", [((16, -1), 5.0, True), ((3, 2), 0.0, False),
                                                     ((-1, -1), 2.0, False)])
def test_pytorchs_own_attention_with_windows_and_softcap_matches_the_reference(window, softcap, causal):
    """The eager composite TORCH_OWN runs where SDPA has no equivalent (windows, the softcap; GQA;
    packed documents, an empty one among them), in float64 on the CPU, against the NumPy
    reference."""
    import numpy as np

    from cukern import reference as ref

    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(s, generator=g, dtype=torch.float64) for s in ((2, 40, 4, 16), (2, 40, 2, 16),
                                                                           (2, 40, 2, 16)))
    got = _attention(q, k, v, causal, 0.25, *window, softcap, -1)[0]
    expect = ref.attention(q.numpy(), k.numpy(), v.numpy(), causal=causal, softmax_scale=0.25, window=window,
                           softcap=softcap)
    np.testing.assert_allclose(got.numpy(), expect, rtol=1e-10, atol=1e-12)
    cu = torch.tensor([0, 17, 17, 40], dtype=torch.int32)
    got = _attention_varlen(q[0], k[0], v[0], cu, cu, 23, 23, causal, 0.25, *window, softcap, -1)[0]
    expect = ref.attention_varlen(q[0].numpy(), k[0].numpy(), v[0].numpy(), cu.numpy(), cu.numpy(), 23, 23,
                                  causal=causal, softmax_scale=0.25, window=window, softcap=softcap)
    np.testing.assert_allclose(got.numpy(), expect, rtol=1e-10, atol=1e-12)


# ---- the samples, run three ways ---------------------------------------------------------------

def _name(op) -> str:
    return op._schema.name.split("::")[1]


def _leaves(args) -> list:
    return [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]


def _upstream(outs, n: int) -> list:
    """3 for every element of the first n outputs: an upstream gradient that is not 1 and not a
    power of two."""
    return [torch.full_like(o, 3.0) for o in outs[:n]]


def _bits(t) -> torch.Tensor:
    return t.detach().contiguous().view(-1).view(torch.uint8) if t.numel() else t.detach().reshape(-1)


def _same_bits(a, b) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(_bits(a), _bits(b))


def _n_differentiated(name, args) -> int:
    from cukern.torch._ops import OPS

    return 1 if name == "attention_lse" else OPS[name].visible


def _check_twice(name, call, args, deterministic: bool):
    """One sample through ``call`` (the eager op or the custom op): the saved tensors and the
    upstream gradients unchanged by a retained backward, two retained passes twice the first,
    a freeing third pass the same again, autograd.grad twice the same."""
    leaves = _leaves(args)
    saved = []

    def pack(t):
        saved.append((t, t.detach().clone()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        outs = call(*args)
    outs = outs if isinstance(outs, tuple) else (outs,)
    n = _n_differentiated(name, args)
    ups = _upstream(outs, n)
    kept_ups = [u.clone() for u in ups]
    first = torch.autograd.grad(outs[:n], leaves, ups, retain_graph=True, allow_unused=True)
    again = torch.autograd.grad(outs[:n], leaves, ups, retain_graph=True, allow_unused=True)
    for t, copy in saved:
        assert _same_bits(t, copy), f"{name}: a retained backward changed a saved tensor"
    assert all(_same_bits(u, k) for u, k in zip(ups, kept_ups)), f"{name}: the upstream gradient changed"
    same = _same_bits if deterministic else (lambda a, b: torch.allclose(a.float(), b.float(), rtol=1e-2, atol=1e-3))
    for a, b in zip(first, again):
        assert (a is None) == (b is None) and (a is None or same(a, b)), f"{name}: autograd.grad twice differs"
    for leaf in leaves:
        if not leaf.is_leaf:   # (a view of a leaf, as the samples pass some)
            leaf.retain_grad()
        leaf.grad = None
    torch.autograd.backward(outs[:n], ups, retain_graph=True)
    torch.autograd.backward(outs[:n], ups, retain_graph=True)
    twice = [None if leaf.grad is None else leaf.grad.clone() for leaf in leaves]
    torch.autograd.backward(outs[:n], ups)   # (the graph freed: the donating backward where there is one)
    for leaf, g, g2 in zip(leaves, first, twice):
        if g is None:
            assert g2 is None
            continue
        assert same(g2, g * 2), f"{name}: two retained backward passes did not give twice the gradient"
        assert same(leaf.grad, g * 3), f"{name}: the pass that frees the graph gave another gradient"
        leaf.grad = None
    return first


@gpu
@needs_cuda
def test_every_op_has_samples():
    from cukern.torch._ops import OPS

    assert {_name(op) for table in family_tables("opcheck_samples") for op, _ in table} == set(OPS)


@gpu
@needs_cuda
@pytest.mark.parametrize("deterministic", [True, False])
def test_a_second_backward_gives_twice_the_gradient_on_every_path(deterministic):
    """Eager (the first call of a signature records, the second replays from C++ where the op
    is native) and through the custom op, on every sample of every op."""
    from cukern.torch._ops import OPS

    old = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(deterministic)
    try:
        for op, args in (s for table in family_tables("opcheck_samples") for s in table):
            name = _name(op)
            bits = OPS[name].spec.name not in ("attention", "attention_lse", "attention_varlen") or deterministic
            runs = [_check_twice(name, OPS[name], args, bits) for _ in range(3)]   # record, replay, replay
            runs.append(_check_twice(name, OPS[name].compiled, args, bits))
            if bits:   # the same bits on every path
                for run in runs[1:]:
                    assert all((a is None and b is None) or _same_bits(a, b) for a, b in zip(runs[0], run)), name
    finally:
        torch.use_deterministic_algorithms(old)


def _rel(a, ref) -> float:
    a, ref = a.double(), ref.double()
    return float((a - ref).norm() / ref.norm().clamp_min(1e-300))


# the error allowed: RATIO times PyTorch's own plus FLOOR, the rounding noise of the samples'
# few elements (a bf16 gradient rounded twice errs by about 4x PyTorch's, far above either)
RATIO = 1.25
FLOOR = {torch.float32: 2.0**-20, torch.float16: 2.0**-13, torch.bfloat16: 2.0**-10}


def _up64(args):
    return tuple(a.detach().double().requires_grad_(a.requires_grad)
                 if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args)


@gpu
@needs_cuda
def test_an_upstream_gradient_other_than_one_is_rounded_once():
    """Every sample with an upstream gradient of 3: each input gradient's relative error against
    float64 (PyTorch's own computation on the same rounded inputs) is no worse than that of
    PyTorch's own computation in the inputs' dtype (within RATIO, plus the dtype's FLOOR)."""
    from cukern.torch._ops import OPS

    torch.use_deterministic_algorithms(True)
    worse = []
    try:
        for op, args in (s for table in family_tables("opcheck_samples") for s in table):
            name = _name(op)
            leaves = _leaves(args)
            n = _n_differentiated(name, args)
            outs = OPS[name](*args)
            outs = outs if isinstance(outs, tuple) else (outs,)
            ours = torch.autograd.grad(outs[:n], leaves, _upstream(outs, n), allow_unused=True)
            own = TORCH_OWN[name](*args)
            theirs = torch.autograd.grad(own, leaves, _upstream(own, n), allow_unused=True)
            args64 = _up64(args)
            ref_out = TORCH_OWN[name](*args64)
            ref = torch.autograd.grad(ref_out, _leaves(args64), _upstream(ref_out, n), allow_unused=True)
            for leaf, a, t, r in zip(leaves, ours, theirs, ref):
                if r is None or r.abs().max() == 0:
                    continue
                ea, et = _rel(a, r), _rel(t, r)
                if ea > RATIO * et + FLOOR[leaf.dtype]:
                    worse.append(f"{name} {tuple(leaf.shape)} {leaf.dtype}: error {ea:.3g} against float64, "
                                 f"PyTorch's own {et:.3g}")
    finally:
        torch.use_deterministic_algorithms(False)
    assert not worse, "\n".join(worse)
