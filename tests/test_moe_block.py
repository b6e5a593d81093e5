"""The MoE block as one call (cukern/moe/block.py): argument checks without a GPU, and on the GPU
the forward and every gradient against the float64 reference (cukern/moe/reference.py) on the
same rounded inputs, CuPy and torch, both 16-bit dtypes, the three activations, with logits
whose choice of experts no rounding can change."""
from __future__ import annotations

import numpy as np
import pytest

from cukern.moe import block
from cukern.moe import reference as R

from arrays import np_dtype, to_device, to_host, torch

gpu = pytest.mark.gpu
FRAMEWORKS = ["cupy"] + (["torch"] if torch is not None else [])


def bad_input_cases(xp):
    """(call, exception, message pattern) of the block's bad arguments (tests/test_moe.py gathers them)."""
    f16 = np.float16
    x, rw = xp.ones((4, 16), f16), xp.ones((8, 16), f16)
    wgu, wd = xp.ones((8, 32, 16), f16), xp.ones((8, 16, 16), f16)
    f = block.moe_forward
    cases = [
        (lambda: f(x[None], rw, wgu, wd, 2), ValueError, r"^x: expected \(tokens, hidden\)"),
        (lambda: f(x, rw[:, :8], wgu, wd, 2), ValueError, r"^router_w: shape \(8, 8\); expected \(experts, 16\)"),
        (lambda: f(x, rw, wgu[:4], wd, 2), ValueError, r"^w_gate_up: shape \(4, 32, 16\); expected \(8, "),
        (lambda: f(x, rw, xp.ones((8, 31, 16), f16), wd, 2), ValueError, "^w_gate_up: shape"),
        (lambda: f(x, rw, wgu, xp.ones((8, 16, 8), f16), 2), ValueError, r"^w_down: shape \(8, 16, 8\); expected"),
        (lambda: f(x, rw.astype(np.float32), wgu, wd, 2), ValueError, "^router_w: dtype float32, expected x's"),
        (lambda: f(x, rw, wgu, wd, 2, act="relu"), ValueError, "^act: expected one of"),
    ]
    return cases


@pytest.mark.parametrize("act", block.ACTS)
def test_the_composition_is_the_references_block_on_the_cpu(monkeypatch, act):
    """The block's wiring (which halves, orders and saved values each step gets), with every
    kernel call replaced by its float64 NumPy counterpart: forward and every gradient equal the
    reference block's (itself checked against transformers' Mixtral block in test_moe.py)."""
    k = 2

    def permute(x, ex, e):
        xp, order, off = R.permute(x, ex, e)
        row_of = np.empty_like(order)
        row_of[order] = np.arange(order.size)
        return xp, order, row_of, off, np.diff(off)

    def order_of(row_of):
        order = np.empty_like(row_of)
        order[row_of] = np.arange(row_of.size)
        return order

    def unpermute_backward(dout, y, row_of, w):
        t = w.shape[0]
        rows = row_of.reshape(t, k)
        dy = np.empty_like(y)
        dy[rows] = dout[:, None, :] * w[:, :, None]
        return dy, np.einsum("th,tjh->tj", dout, y[rows])

    def gate(act, g, u):
        return R._act(g, act)[0] * u

    def gate_backward(act, dz, g, u):
        a, da = R._act(g, act)
        return dz * u * da, dz * a

    fakes = {"moe_router": lambda lg, top_k, **kw: R.router(lg, top_k, **kw), "moe_permute": permute,
             "moe_grouped_mm": R.grouped_matmul, "moe_grouped_mm_backward": R.grouped_matmul_backward,
             "moe_unpermute": lambda y, row_of, w: R.unpermute(y, order_of(row_of), w),
             "moe_unpermute_backward": unpermute_backward,
             "moe_permute_backward": lambda dxp, row_of, top_k: dxp[row_of.reshape(-1, top_k)].sum(1),
             "moe_router_backward": lambda dw, lg, ex, **kw: R.router_backward(dw, lg, ex, **kw),
             "_gate": gate, "_gate_backward": gate_backward,
             "_cat_columns": lambda a, b: np.concatenate([a, b], axis=1), "_contiguous": np.ascontiguousarray}
    for name, fn in fakes.items():
        monkeypatch.setattr(block, name, fn)
    monkeypatch.setattr(block, "_check", lambda *a: (a[0].shape[1], a[1].shape[0], a[3].shape[2]))
    rng = np.random.default_rng(3)
    t, h, e, i = 23, 12, 5, 7
    x, rw = rng.standard_normal((t, h)), rng.standard_normal((e, h))
    wgu, wd = rng.standard_normal((e, 2 * i, h)), rng.standard_normal((e, h, i))
    dout, extra = rng.standard_normal((t, h)), rng.standard_normal((t, e))
    out, saved = block.moe_forward(x, rw, wgu, wd, k, act=act, scale=1.5)
    np.testing.assert_allclose(out, R.moe(x, rw, wgu, wd, k, act=act, scale=1.5), rtol=1e-12, atol=1e-12)
    got = block.moe_backward(dout, x, rw, wgu, wd, saved, dlogits_extra=extra)
    want = R.moe_backward(dout, x, rw, wgu, wd, k, act=act, scale=1.5, dlogits_extra=extra)
    for g, w_, name in zip(got, want, ("dx", "drouter_w", "dw_gate_up", "dw_down")):
        np.testing.assert_allclose(g, w_, rtol=1e-10, atol=1e-12, err_msg=name)


def _inputs(rng, t, h, e, i, dtype):
    """x whose first E columns are distinct per token (a permutation, exactly representable) and a
    router weight [I_E | 0]: the logits are those columns exactly in any precision, so the kernels
    and the float64 reference choose the same experts."""
    x = rng.standard_normal((t, h)) * 0.5
    x[:, :e] = np.stack([rng.permutation(e) for _ in range(t)]) * (4.0 / e) - 2.0
    rw = np.zeros((e, h))
    rw[:, :e] = np.eye(e)
    wgu = rng.standard_normal((e, 2 * i, h)) / np.sqrt(h)
    wd = rng.standard_normal((e, h, i)) / np.sqrt(i)
    return [a.astype(np_dtype(dtype)) for a in (x, rw, wgu, wd)]


@gpu
@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("act", block.ACTS)
@pytest.mark.parametrize("t, h, e, i, k", [(1, 16, 8, 8, 1), (300, 64, 8, 40, 2), (700, 128, 64, 32, 8)])
def test_block_matches_the_reference_forward_and_backward(framework, dtype, act, t, h, e, i, k):
    rng = np.random.default_rng(t + e + k)
    host = _inputs(rng, t, h, e, i, dtype)
    dout = rng.standard_normal((t, h)).astype(np_dtype(dtype))
    dev = [to_device(a, framework) for a in host]
    out, saved = block.moe_forward(*dev, k, act=act)
    want = R.moe(*host, k, act=act)
    # (each of h, z and y is rounded to the 16-bit dtype once: a few of its roundings)
    tol = {"float16": 4e-3, "bfloat16": 3e-2}[dtype]

    def close(got, want, name):
        got = to_host(got)
        assert not np.isnan(got).any(), name
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol * np.abs(want).max(), err_msg=name)

    close(out, want, "out")
    grads = block.moe_backward(to_device(dout, framework), *dev, saved)
    refs = R.moe_backward(dout, *host, k, act=act)
    if k == 1:
        # one renormalized expert weighs exactly 1: no gradient reaches the router (the kernels
        # give exact zeros; the float64 reference, rounding residue far below any tolerance)
        assert not to_host(grads[1]).any(), "drouter_w"
        assert np.abs(refs[1]).max() < 1e-12 * np.abs(refs[0]).max()
        grads, refs = grads[:1] + grads[2:], refs[:1] + refs[2:]
    for got, ref, name in zip(grads, refs, ("dx", "dw_gate_up", "dw_down") if k == 1 else
                              ("dx", "drouter_w", "dw_gate_up", "dw_down")):
        close(got, ref, name)


def _kernel_fakes(k: int) -> dict:
    """cukern.moe.torch's kernel calls as float64 NumPy counterparts (the references'), for the
    torch ops' CPU tests; ``k`` experts a token."""
    np_ = lambda t: t.detach().numpy()   # noqa: E731
    tt = torch.from_numpy

    def permute(x, ex, e):
        xp, order, off = R.permute(np_(x), np_(ex), e)
        row_of = np.empty_like(order)
        row_of[order] = np.arange(order.size)
        return tt(xp), tt(order), tt(row_of), tt(off), None

    def unpermute(y, row_of, w):
        order = np.empty_like(np_(row_of))
        order[np_(row_of)] = np.arange(order.size)
        return tt(R.unpermute(np_(y), order, np_(w)))

    def unpermute_backward(dout, y, row_of, w):
        rows = np_(row_of).reshape(-1, k)
        dy = np.empty_like(np_(y))
        dy[rows] = np_(dout)[:, None, :] * np_(w)[:, :, None]
        return tt(dy), tt(np.einsum("th,tjh->tj", np_(dout), np_(y)[rows]))

    def grouped_mm(a, b, off, b_layout="nk"):
        b = np_(b) if b_layout == "nk" else np_(b).transpose(0, 2, 1)
        return tt(R.grouped_matmul(np_(a), b, np_(off)))

    def grouped_mm_backward(d, a, b, off, b_layout="nk"):
        b = np_(b) if b_layout == "nk" else np_(b).transpose(0, 2, 1)
        da, db = R.grouped_matmul_backward(np_(d), np_(a), b, np_(off))
        return tt(da), tt(db if b_layout == "nk" else np.ascontiguousarray(db.transpose(0, 2, 1)))

    def gate(act, g, u):
        return tt(R._act(np_(g), act)[0] * np_(u))

    def gate_backward(act, dz, g, u):
        a, da = R._act(np_(g), act)
        return tt(np_(dz) * np_(u) * da), tt(np_(dz) * a)

    return {"moe_permute": permute, "moe_unpermute": unpermute, "moe_unpermute_backward": unpermute_backward,
             "moe_grouped_mm": grouped_mm, "moe_grouped_mm_backward": grouped_mm_backward,
             "moe_biased_glu": lambda h, b, off, a, lim: tt(R.biased_glu(np_(h), np_(b), np_(off), a, lim)),
             "moe_biased_glu_backward": lambda dz, h, b, off, a, lim: tuple(map(tt, R.biased_glu_backward(
                 np_(dz), np_(h), np_(b), np_(off), a, lim))),
             "moe_group_bias": lambda y, b, off: tt(R.group_bias(np_(y), np_(b), np_(off))),
             "moe_permute_backward": lambda dxp, row_of, top_k: tt(np_(dxp)[np_(row_of).reshape(-1, top_k)].sum(1)),
             "_gate": gate, "_gate_backward": gate_backward}


def _use_kernel_fakes(monkeypatch, k: int) -> None:
    """The fakes in place of the kernel calls of the ops (cukern.moe.torch) and of the experts'
    part they share with the block (cukern.moe.block)."""
    from cukern.moe import torch as moe_torch

    for name, fn in _kernel_fakes(k).items():
        for module in (moe_torch, block):
            if hasattr(module, name):
                monkeypatch.setattr(module, name, fn)


@pytest.mark.parametrize("path, act", [("eager", "silu"), ("custom op", "gelu"), ("compiled", "gelu_tanh")])
def test_the_torch_experts_op_is_the_experts_reference_on_the_cpu(monkeypatch, path, act):
    """cukern.torch.moe_experts (what patch(model) routes transformers' experts to) on its eager
    autograd Function, on its custom op, and under torch.compile (the custom op's shapes traced,
    aot_eager), its kernels replaced by float64 NumPy counterparts: the output and the gradients
    of x, the weights and both projections equal autograd's through the experts' PyTorch
    reference."""
    if torch is None:
        pytest.skip("needs torch")
    import cukern.torch as ct
    from cukern.torch import _recognize_experts
    from cukern.torch._ops import OPS

    k = 2
    _use_kernel_fakes(monkeypatch, k)
    g = torch.Generator().manual_seed(0)
    t, h, e, i = 11, 8, 5, 6
    x = torch.randn(t, h, generator=g, dtype=torch.float64)
    idx = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    # (float32 weights, as transformers' routers give them: the op must copy them, not pass them on)
    w = torch.rand(t, k, generator=g, dtype=torch.float32)
    gu = torch.randn(e, 2 * i, h, generator=g, dtype=torch.float64)
    dn = torch.randn(e, h, i, generator=g, dtype=torch.float64)
    dout = torch.randn(t, h, generator=g, dtype=torch.float64)
    leaves = [v.clone().requires_grad_(True) for v in (x, w, gu, dn)]
    want = _recognize_experts.experts_reference(act, leaves[0], idx, leaves[1], leaves[2], leaves[3])
    want_grads = torch.autograd.grad(want, leaves, dout)
    mine = [v.clone().requires_grad_(True) for v in (x, w, gu, dn)]
    if path == "eager":
        got = ct.moe_experts(mine[0], idx, mine[1], mine[2], mine[3], act)
    elif path == "custom op":
        got = OPS["moe_experts"].compiled(mine[0], idx, mine[1], mine[2], mine[3], block.ACTS.index(act))
    else:
        torch._dynamo.reset()
        got = torch.compile(ct.moe_experts, backend="aot_eager", fullgraph=True)(mine[0], idx, mine[1], mine[2],
                                                                                mine[3], act)
    # (the weights are taken in float32, as the combine kernel reads them)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    if path == "eager":   # (no gradient wanted: the output alone, a tensor as with one)
        with torch.no_grad():
            plain = ct.moe_experts(x, idx, w, gu, dn, act)
        assert isinstance(plain, torch.Tensor)
        torch.testing.assert_close(plain, want.detach(), rtol=1e-6, atol=1e-6)
    for a, b_, name in zip(torch.autograd.grad(got, mine, dout), want_grads, ("x", "weights", "gate_up", "down")):
        torch.testing.assert_close(a, b_, rtol=1e-6, atol=1e-6, msg=f"{act}: d {name}")


@pytest.mark.parametrize("path", ["eager", "custom op", "compiled"])
def test_the_torch_biased_experts_op_is_gpt_osss_experts_on_the_cpu(monkeypatch, path):
    """cukern.torch.moe_experts_biased (GPT-OSS's experts: weights held (E, in, out), gate and
    up interleaved, biases, the clamped gate) on its three paths, the kernels replaced by
    float64 NumPy counterparts: the output and the gradients of x, the weights and all four
    parameters equal autograd's through the PyTorch reference, with gate inputs on both sides of
    the clamps (and an expert no token chose: zero gradients for its weights and biases)."""
    if torch is None:
        pytest.skip("needs torch")
    import cukern.torch as ct
    from cukern.torch import _recognize_experts
    from cukern.torch._ops import OPS

    k = 2
    _use_kernel_fakes(monkeypatch, k)
    g = torch.Generator().manual_seed(1)
    t, h, e, i, alpha, limit = 13, 8, 6, 6, 1.702, 2.0
    x = torch.randn(t, h, generator=g, dtype=torch.float64)
    idx = torch.stack([torch.randperm(e - 1, generator=g)[:k] for _ in range(t)])   # (expert e - 1: no token)
    w = torch.rand(t, k, generator=g, dtype=torch.float32)
    params = [torch.randn(e, h, 2 * i, generator=g, dtype=torch.float64), torch.randn(e, 2 * i, generator=g,
                                                                                       dtype=torch.float64),
              torch.randn(e, i, h, generator=g, dtype=torch.float64), torch.randn(e, h, generator=g,
                                                                                  dtype=torch.float64)]
    dout = torch.randn(t, h, generator=g, dtype=torch.float64)
    leaves = [v.clone().requires_grad_(True) for v in (x, w, *params)]
    want = _recognize_experts.biased_experts_reference(alpha, limit, leaves[0], idx, *leaves[1:])
    hid = torch.einsum("th,tkho->tko", x, params[0][idx]) + params[1][idx]
    assert (hid[..., 0::2] > limit).any() and (hid[..., 1::2].abs() > limit).any() and (hid.abs() < limit).any()
    want_grads = torch.autograd.grad(want, leaves, dout)
    mine = [v.clone().requires_grad_(True) for v in (x, w, *params)]
    args = (mine[0], idx, *mine[1:], alpha, limit)
    if path == "eager":
        got = ct.moe_experts_biased(*args)
    elif path == "custom op":
        got = OPS["moe_experts_biased"].compiled(*args)
    else:
        torch._dynamo.reset()
        got = torch.compile(ct.moe_experts_biased, backend="aot_eager", fullgraph=True)(*args)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    names = ("x", "weights", "gate_up", "gate_up bias", "down", "down bias")
    grads = torch.autograd.grad(got, mine, dout)
    for a, b_, name in zip(grads, want_grads, names):
        torch.testing.assert_close(a, b_, rtol=1e-6, atol=1e-6, msg=f"d {name}")
    for a, name in zip(grads[2:], names[2:]):
        assert not a[e - 1].any() and a[:e - 1].abs().sum() > 0, name


def test_the_torch_biased_experts_name_a_bad_argument_without_a_gpu():
    """cukern.torch.moe_experts_biased checks its arguments together before any kernel: each
    mismatch is a ValueError naming the argument."""
    if torch is None:
        pytest.skip("needs torch")
    import cukern.torch as ct

    t, h, e, i, k = 5, 16, 4, 8, 2
    bf = torch.bfloat16
    good = dict(x=torch.ones(t, h, dtype=bf), top_k_index=torch.zeros(t, k, dtype=torch.int64),
                top_k_weights=torch.ones(t, k), w_gate_up=torch.ones(e, h, 2 * i, dtype=bf),
                b_gate_up=torch.ones(e, 2 * i), w_down=torch.ones(e, i, h, dtype=bf), b_down=torch.ones(e, h))
    bad = [("x", torch.ones(1, t, h, dtype=bf), r"^x: expected \(tokens, hidden\)"),
           ("top_k_index", torch.zeros(t + 1, k, dtype=torch.int64), r"^top_k_index: shape \(6, 2\); expected \(5, "),
           ("top_k_weights", torch.ones(t, k + 1), r"^top_k_weights: shape \(5, 3\); expected top_k_index's"),
           ("w_gate_up", torch.ones(e, h + 8, 2 * i, dtype=bf), r"^w_gate_up: shape \(4, 24, 16\); expected"),
           ("w_gate_up", torch.ones(e, h, 2 * i + 1, dtype=bf), "^w_gate_up: shape"),
           ("b_gate_up", torch.ones(e, i), r"^b_gate_up: shape \(4, 8\); expected \(4, 16\)"),
           ("w_down", torch.ones(e, h, i, dtype=bf), r"^w_down: shape \(4, 16, 8\); expected \(4, 8, 16\)"),
           ("b_down", torch.ones(e + 1, h), r"^b_down: shape \(5, 16\); expected \(4, 16\)"),
           ("w_down", torch.ones(e, i, h, dtype=torch.float16), "^w_down: dtype torch.float16, expected x's"),
           ("b_down", torch.ones(e, h, dtype=torch.float16), "^b_down: dtype torch.float16, expected float32")]
    for name, value, pattern in bad:
        with pytest.raises(ValueError, match=pattern):
            ct.moe_experts_biased(**{**good, name: value})
    for name, value in (("alpha", 0.0), ("limit", float("inf")), ("alpha", True)):
        with pytest.raises(ValueError, match=f"^{name}: must be a positive finite number"):
            ct.moe_experts_biased(**good, **{name: value})


def test_dlogits_extra_of_another_dtype_or_shape_is_named():
    saved = block.MoESaved(np.zeros((3, 4), np.float16), *([None] * 7), 2, "silu", "softmax", True, 1.0)
    saved.h = np.zeros((6, 8), np.float16)
    for extra in (np.zeros((3, 4), np.float32), np.zeros((3, 5), np.float16)):
        with pytest.raises(ValueError, match=r"^dlogits_extra: shape \(3, [45]\) float(32|16); expected \(3, 4\)"):
            block.moe_backward(np.zeros((3, 8), np.float16), None, None, None, None, saved, dlogits_extra=extra)


@gpu
@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_a_second_backward_of_the_block_is_the_first_and_leaves_its_inputs(framework):
    """moe_backward only reads what moe_forward saved: called twice on the same saved values it
    gives the same gradients bit for bit (no atomics in any of its kernels), and leaves the
    upstream gradient and every saved array as they were."""
    rng = np.random.default_rng(5)
    host = _inputs(rng, 300, 64, 8, 40, "bfloat16")
    dev = [to_device(a, framework) for a in host]
    dout = to_device(rng.standard_normal((300, 64)).astype(np_dtype("bfloat16")), framework)
    out, saved = block.moe_forward(*dev, 2)
    fields = ("logits", "weights", "experts", "x_perm", "row_of", "offsets", "h", "y")
    before = {n: to_host(getattr(saved, n)).copy() for n in fields}
    dout_before = to_host(dout).copy()
    first = [to_host(g).copy() for g in block.moe_backward(dout, *dev, saved)]
    second = [to_host(g) for g in block.moe_backward(dout, *dev, saved)]
    for a, b_, name in zip(first, second, ("dx", "drouter_w", "dw_gate_up", "dw_down")):
        assert not np.isnan(a).any(), name
        np.testing.assert_array_equal(a.view(np.uint16), b_.view(np.uint16), err_msg=name)
    np.testing.assert_array_equal(to_host(dout).view(np.uint16), dout_before.view(np.uint16))
    for n in fields:
        np.testing.assert_array_equal(to_host(getattr(saved, n)), before[n], err_msg=n)


@gpu
@pytest.mark.skipif(torch is None or not torch.cuda.is_available(), reason="needs a CUDA build of torch")
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_a_second_backward_through_the_torch_experts_gives_twice_the_gradient(dtype):
    """backward(retain_graph=True) twice gives exactly twice the first gradients and a third,
    freeing pass the same again; the upstream gradient is left as it was."""
    g = torch.Generator(device="cuda").manual_seed(3)
    dt = getattr(torch, dtype)
    t, h, e, i, k = 300, 64, 8, 40, 2
    idx = torch.stack([torch.randperm(e, device="cuda", generator=g)[:k] for _ in range(t)])
    leaves = [(torch.randn(shape, device="cuda", generator=g) * s).to(d).requires_grad_(True)
              for shape, s, d in (((t, h), 1.0, dt), ((t, k), 1.0, torch.float32), ((e, 2 * i, h), h ** -0.5, dt),
                                  ((e, h, i), i ** -0.5, dt))]
    dout = torch.randn(t, h, device="cuda", generator=g).to(dt)
    dout_before = dout.clone()
    import cukern.torch as ct

    out = ct.moe_experts(*leaves[:1], idx, *leaves[1:], "silu")
    once = torch.autograd.grad(out, leaves, dout, retain_graph=True)
    again = torch.autograd.grad(out, leaves, dout, retain_graph=True)
    out.backward(dout, retain_graph=True)
    out.backward(dout, retain_graph=True)
    twice = [v.grad.clone() for v in leaves]
    out.backward(dout)
    names = ("x", "weights", "gate_up", "down")
    for a, b_, name in zip(once, again, names):
        assert torch.isfinite(a).all() and a.abs().sum() > 0, name
        assert torch.equal(a, b_), name
    for a, two, v, name in zip(once, twice, leaves, names):
        assert torch.equal(two, a + a), name
        assert torch.equal(v.grad, a + a + a), name
    assert torch.equal(dout, dout_before)


@gpu
@pytest.mark.skipif(torch is None or not torch.cuda.is_available(), reason="needs a CUDA build of torch")
def test_the_torch_experts_keep_and_hold_no_more_than_they_need():
    """Between the forward and the backward the experts keep x_perm, h, y and the routing's
    small arrays (the gate's output is computed again from h), and the backward's peak is its
    last product's: what the forward kept, dh, both weight gradients and dx_perm (each earlier
    intermediate let go once used). Counted in bytes of the caching allocator."""
    import cukern.torch as ct

    g = torch.Generator(device="cuda").manual_seed(5)
    t, h, e, i, k = 512, 256, 4, 512, 2
    p = t * k
    idx = torch.stack([torch.randperm(e, device="cuda", generator=g)[:k] for _ in range(t)])
    leaves = [(torch.randn(shape, device="cuda", generator=g) * s).to(d).requires_grad_(True)
              for shape, s, d in (((t, h), 1.0, torch.bfloat16), ((t, k), 1.0, torch.float32),
                                  ((e, 2 * i, h), h ** -0.5, torch.bfloat16), ((e, h, i), i ** -0.5, torch.bfloat16))]
    dout = torch.randn(t, h, device="cuda", generator=g).to(torch.bfloat16)
    ct.moe_experts(*leaves[:1], idx, *leaves[1:], "silu").backward(dout)   # (kernels loaded, workspaces made)
    for v in leaves:
        v.grad = None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    out = ct.moe_experts(*leaves[:1], idx, *leaves[1:], "silu")
    kept = torch.cuda.memory_allocated() - base
    small = 64 * 1024   # (row_of, offsets, the float32 weights and allocator rounding)
    two = 2   # bytes an element, bf16
    # out, x_perm, h and y
    assert kept <= two * (t * h + p * h + p * 2 * i + p * h) + small, kept
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    out.backward(dout)
    peak = torch.cuda.max_memory_allocated() - start
    # dh, dw_gate_up, dw_down, dx_perm, dx: the last product's working set
    assert peak <= two * (p * 2 * i + e * 2 * i * h + e * h * i + p * h + t * h) + small, peak


@gpu
@pytest.mark.skipif(torch is None or not torch.cuda.is_available(), reason="needs a CUDA build of torch")
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("t, h, e, i, k", [(300, 128, 8, 128, 2), (37, 24, 5, 16, 3)])
def test_the_torch_biased_experts_match_pytorch_and_a_second_backward_gives_twice(dtype, t, h, e, i, k):
    """cukern.torch.moe_experts_biased on the GPU (the first shape's products on the Hopper
    kernels there, the second's on mma.sync) against GPT-OSS's experts in float32 PyTorch ops
    on the same rounded inputs, gate inputs on both sides of the limit; float32 biases (as a
    model under autocast holds them). The reference rounds where the kernels round (the products'
    outputs, the gate's, the experts' outputs), as autocast rounds a product's output: a gate
    input within a rounding of the limit is then on the same side of it in both.
    backward(retain_graph=True) twice gives exactly twice the first gradients."""
    import cukern.torch as ct

    g = torch.Generator(device="cuda").manual_seed(7)
    dt = getattr(torch, dtype)
    idx = torch.stack([torch.randperm(e, device="cuda", generator=g)[:k] for _ in range(t)])
    rnd = lambda shape, s, d: (torch.randn(shape, device="cuda", generator=g) * s).to(d)   # noqa: E731
    leaves = [rnd((t, h), 1.0, dt), torch.rand(t, k, device="cuda", generator=g), rnd((e, h, 2 * i), 5 * h ** -0.5, dt),
              rnd((e, 2 * i), 1.0, torch.float32), rnd((e, i, h), i ** -0.5, dt), rnd((e, h), 0.3, torch.float32)]
    leaves = [v.requires_grad_(True) for v in leaves]
    dout = rnd((t, h), 1.0, dt)
    out = ct.moe_experts_biased(leaves[0], idx, *leaves[1:], 1.702, 7.0)
    assert out.dtype == dt and out.shape == (t, h)
    ref_leaves = [v.detach().float().requires_grad_(True) for v in leaves]
    rx, rw, rgu, rbgu, rdn, rbdn = ref_leaves
    rounded = lambda v: v.to(dt).float()   # noqa: E731 - (its gradient passes unchanged)
    hid = rounded(torch.einsum("th,tkho->tko", rx, rgu[idx])) + rbgu[idx]
    gate, up = hid[..., 0::2].clamp(max=7.0), hid[..., 1::2].clamp(-7.0, 7.0)
    z = rounded((up + 1) * gate * torch.sigmoid(1.702 * gate))
    y = rounded(rounded(torch.einsum("tki,tkih->tkh", z, rdn[idx])) + rbdn[idx])
    want = (y * rw[..., None]).sum(1)
    assert (hid[..., 0::2] > 7).any() and (hid[..., 1::2] < -7).any()
    want_grads = torch.autograd.grad(want, ref_leaves, dout.float())
    tol = 2e-2 if dtype == "bfloat16" else 4e-3

    def close(a, b, name):
        assert torch.isfinite(a).all(), name
        err = (a.float() - b).abs().max().item() / max(b.abs().max().item(), 1e-6)
        assert err <= tol, (name, err)

    close(out, want.detach(), "out")
    once = torch.autograd.grad(out, leaves, dout, retain_graph=True)
    names = ("x", "weights", "gate_up", "gate_up bias", "down", "down bias")
    for a, b_, v, name in zip(once, want_grads, leaves, names):
        assert a.dtype == v.dtype and a.shape == v.shape, name
        close(a, b_, f"d {name}")
    out.backward(dout, retain_graph=True)
    out.backward(dout)
    for a, v, name in zip(once, leaves, names):
        assert torch.equal(v.grad, a + a), name


def _block_stand_ins(monkeypatch):
    """cukern.torch.moe_block's array block replaced by tests/test_moe.py's PyTorch CPU stand-ins."""
    if torch is None:
        pytest.skip("needs torch")
    import test_moe
    from torch_helpers import in_fresh_thread

    from cukern.moe import torch as moe_torch
    from cukern.moe.reference import SCORES

    fwd, bwd = test_moe.torch_stand_ins()["moe_block"]

    def moe_forward(x, rw, gu, dn, top_k, *, act, score, renormalize, selection_bias, scale):
        out, logits, *rest = fwd(x, rw, gu, dn, selection_bias, top_k, block.ACTS.index(act), SCORES.index(score),
                                 renormalize, scale)
        return out, block.MoESaved(logits, *rest, top_k, act, score, renormalize, scale)

    def moe_backward(dout, x, rw, gu, dn, s, dlogits_extra=None):
        # (the stand-in differentiates with autograd, which a custom op's backward runs below:
        # on a thread of its own, whose dispatch state is the default one)
        return in_fresh_thread(lambda: bwd(dout, dlogits_extra, x, rw, gu, dn, s.logits, s.weights, s.experts,
                                           s.x_perm, s.row_of, s.offsets, s.h, s.y, s.top_k,
                                           block.ACTS.index(s.act), SCORES.index(s.score), s.renormalize, s.scale))

    monkeypatch.setattr(moe_torch, "moe_forward", moe_forward)
    monkeypatch.setattr(moe_torch, "moe_backward", moe_backward)


@pytest.mark.parametrize("path", ["eager", "custom op", "compiled"])
def test_the_torch_block_op_is_pytorchs_block_on_the_cpu(monkeypatch, path):
    """cukern.torch.moe_block on its eager autograd Function, its custom op and under
    torch.compile (the custom op's shapes traced, aot_eager, one graph), with the block's array
    functions replaced by PyTorch CPU stand-ins (tests/test_moe.py's): the output, the logits and
    the gradients of x, the router and both projections, an upstream gradient reaching the
    logits too, equal the block written in PyTorch's ops."""
    _block_stand_ins(monkeypatch)
    import test_moe

    import cukern.torch as ct
    from cukern.torch._ops import OPS

    g = torch.Generator().manual_seed(4)
    t, h, e, i, k = 13, 16, 6, 8, 2
    base = [torch.randn(t, h, generator=g), torch.randn(e, h, generator=g), torch.randn(e, 2 * i, h, generator=g) / 4,
            torch.randn(e, h, i, generator=g) / 3]
    dout, dlogits = torch.randn(t, h, generator=g), torch.randn(t, e, generator=g)
    want_leaves = [v.clone().requires_grad_(True) for v in base]
    w_out, w_logits, _, _ = test_moe.torch_block(*want_leaves, None, k, 1, 0, True, 2.0)
    want = torch.autograd.grad((w_out, w_logits), want_leaves, (dout, dlogits))
    mine = [v.clone().requires_grad_(True) for v in base]
    if path == "eager":
        out, logits = ct.moe_block(*mine, k, act="gelu", scale=2.0)
    elif path == "custom op":
        out, logits = OPS["moe_block"].compiled(*mine, None, k, 1, 0, True, 2.0)
    else:
        torch._dynamo.reset()
        out, logits = torch.compile(lambda *a: ct.moe_block(*a, k, act="gelu", scale=2.0), backend="aot_eager",
                                    fullgraph=True)(*mine)
    torch.testing.assert_close(out, w_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits, w_logits)
    for a, b_, name in zip(torch.autograd.grad((out, logits), mine, (dout, dlogits)), want,
                           ("x", "router_w", "w_gate_up", "w_down")):
        torch.testing.assert_close(a, b_, rtol=1e-5, atol=1e-5, msg=name)


def test_the_torch_block_casts_to_autocasts_dtype_under_autocast_on_the_cpu(monkeypatch):
    """Under CUDA autocast (its state faked here: no GPU), cukern.torch.moe_block casts x and the
    float32 weights to autocast's dtype, as autocast's F.linear does: the stand-in block sees
    bfloat16, the outputs are bfloat16, and the float32 leaves get float32 gradients, those of
    the block's computed on the bfloat16 casts. Without autocast nothing is cast."""
    _block_stand_ins(monkeypatch)
    import test_moe

    import cukern.torch as ct

    g = torch.Generator().manual_seed(6)
    t, h, e, i, k = 13, 16, 6, 8, 2
    base = [torch.randn(t, h, generator=g), torch.randn(e, h, generator=g), torch.randn(e, 2 * i, h, generator=g) / 4,
            torch.randn(e, h, i, generator=g) / 3]
    dout = torch.randn(t, h, generator=g)
    cast = [v.to(torch.bfloat16).requires_grad_(True) for v in base]
    w_out, w_logits, _, _ = test_moe.torch_block(*cast, None, k, 0, 0, True, 1.0)
    want = torch.autograd.grad(w_out, cast, dout.to(torch.bfloat16))
    monkeypatch.setattr(torch, "is_autocast_enabled", lambda *a: a == ("cuda",))
    monkeypatch.setattr(torch, "get_autocast_dtype", lambda *a: torch.bfloat16)
    mine = [v.clone().requires_grad_(True) for v in base]
    out, logits = ct.moe_block(*mine, k)
    assert out.dtype == logits.dtype == torch.bfloat16
    torch.testing.assert_close(out, w_out)
    torch.testing.assert_close(logits, w_logits)
    grads = torch.autograd.grad(out, mine, dout.to(torch.bfloat16))
    for a, b_, name in zip(grads, want, ("x", "router_w", "w_gate_up", "w_down")):
        assert a.dtype == torch.float32, name
        torch.testing.assert_close(a, b_.float(), msg=name)
    monkeypatch.setattr(torch, "is_autocast_enabled", lambda *a: False)
    assert ct.moe_block(*mine, k)[0].dtype == torch.float32


@gpu
@pytest.mark.skipif(torch is None or not torch.cuda.is_available(), reason="needs a CUDA build of torch")
def test_the_torch_block_is_captured_in_a_cuda_graph_and_replays_new_inputs():
    """cukern.torch.moe_block's forward and backward captured by torch.cuda.graph (a host
    synchronization inside would fail the capture), then replayed with new values in the static
    inputs: the outputs and all four gradients are the eager call's on those values, and not the
    captured ones. The logits are exact (x's first E columns a permutation, router_w = [I | 0]),
    so no rounding difference between the two runs' router products can reorder the experts."""
    import cukern.torch as ct

    g = torch.Generator(device="cuda").manual_seed(5)
    dt = torch.bfloat16
    t, h, e, i, k = 384, 128, 8, 128, 2

    def draw():
        x = torch.randn(t, h, device="cuda", generator=g)
        x[:, :e] = torch.stack([torch.randperm(e, device="cuda", generator=g) for _ in range(t)]) * (4.0 / e) - 2.0
        rw = torch.zeros(e, h, device="cuda")
        rw[:, :e] = torch.eye(e, device="cuda")
        gu = torch.randn(e, 2 * i, h, device="cuda", generator=g) * h ** -0.5
        dn = torch.randn(e, h, i, device="cuda", generator=g) * i ** -0.5
        return [v.to(dt) for v in (x, rw, gu, dn)], torch.randn(t, h, device="cuda", generator=g).to(dt)

    first, first_dout = draw()
    leaves = [v.clone().requires_grad_(True) for v in first]
    dout = first_dout.clone()

    def step():
        out, logits = ct.moe_block(*leaves, k)
        return (out, logits, *torch.autograd.grad(out, leaves, dout))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):   # (warm-up outside the capture: plans built, kernels loaded)
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    new, new_dout = draw()
    with torch.no_grad():
        for v, n in zip(leaves, new):
            v.copy_(n)
        dout.copy_(new_dout)
    graph.replay()
    torch.cuda.synchronize()

    def eager(values, upstream):
        ref = [v.clone().requires_grad_(True) for v in values]
        out, logits = ct.moe_block(*ref, k)
        return (out, logits, *torch.autograd.grad(out, ref, upstream))

    want, old = eager(new, new_dout), eager(first, first_dout)
    names = ("out", "logits", "dx", "drouter_w", "dgate_up", "ddown")
    for got, w, o, name in zip(captured, want, old, names):
        assert torch.isfinite(got).all(), name
        scale = w.float().abs().max().item()
        torch.testing.assert_close(got.float(), w.float(), rtol=2e-2, atol=2e-2 * scale, msg=name)
        if name != "drouter_w":   # (x's first columns change, but the router's gradient may be tiny)
            assert (got.float() - o.float()).abs().max().item() > 0.1 * scale, f"{name}: the captured values"


@gpu
@pytest.mark.skipif(torch is None or not torch.cuda.is_available(), reason="needs a CUDA build of torch")
def test_the_torch_block_under_autocast_is_the_block_on_autocasts_dtype():
    """float32 parameters and input under torch.autocast(bfloat16): the block's outputs are its
    outputs on the bfloat16 casts, bit for bit, and the float32 leaves get those gradients in
    float32."""
    import cukern.torch as ct

    g = torch.Generator(device="cuda").manual_seed(9)
    t, h, e, i, k = 300, 64, 8, 64, 2
    base = [torch.randn(t, h, device="cuda", generator=g), torch.randn(e, h, device="cuda", generator=g) / 8,
            torch.randn(e, 2 * i, h, device="cuda", generator=g) / 8,
            torch.randn(e, h, i, device="cuda", generator=g) / 8]
    dout = torch.randn(t, h, device="cuda", generator=g).to(torch.bfloat16)
    mine = [v.clone().requires_grad_(True) for v in base]
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out, logits = ct.moe_block(*mine, k)
    cast = [v.to(torch.bfloat16).requires_grad_(True) for v in base]
    want_out, want_logits = ct.moe_block(*cast, k)
    assert out.dtype == torch.bfloat16 and torch.equal(out, want_out) and torch.equal(logits, want_logits)
    for a, b_ in zip(torch.autograd.grad(out, mine, dout), torch.autograd.grad(want_out, cast, dout)):
        assert a.dtype == torch.float32 and torch.equal(a, b_.float())
