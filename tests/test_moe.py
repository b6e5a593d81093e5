"""The mixture-of-experts references (cukern/moe/reference.py), on the CPU in float64: the
router against PyTorch (softmax and sigmoid top-k, ties, renormalization, a selection bias), its
backward and the auxiliary losses' against autograd (the load-balancing loss against
transformers' own), the permutation's order, and the whole block against transformers'
Mixtral block, forward and every gradient."""
from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from cukern.moe import reference as R

torch = pytest.importorskip("torch")


def _logits(rng, t, e):
    return rng.standard_normal((t, e)) * 2


@pytest.mark.parametrize("score, renormalize, biased", [("softmax", True, False), ("softmax", False, False),
                                                        ("sigmoid", True, True), ("sigmoid", False, False)])
def test_router_matches_pytorch_and_its_backward_autograd(score, renormalize, biased):
    rng = np.random.default_rng(0)
    t, e, k = 37, 8, 3
    lg = _logits(rng, t, e)
    bias = rng.standard_normal(e) if biased else None
    w, ex, counts = R.router(lg, k, score=score, renormalize=renormalize, selection_bias=bias, scale=1.5)
    lt = torch.tensor(lg, requires_grad=True)
    s = torch.softmax(lt, -1) if score == "softmax" else torch.sigmoid(lt)
    sel = s if bias is None else s + torch.tensor(bias)
    idx = torch.topk(sel.detach(), k, dim=-1).indices
    tw = s.gather(-1, idx)
    if renormalize:
        tw = tw / tw.sum(-1, keepdim=True)
    tw = tw * 1.5
    np.testing.assert_array_equal(ex, idx.numpy())
    np.testing.assert_allclose(w, tw.detach().numpy(), rtol=1e-13)
    np.testing.assert_array_equal(counts, np.bincount(ex.ravel(), minlength=e))
    assert ex.dtype == np.int32 and counts.sum() == t * k
    dw = rng.standard_normal(w.shape)
    tw.backward(torch.tensor(dw))
    got = R.router_backward(dw, lg, ex, score=score, renormalize=renormalize, scale=1.5)
    np.testing.assert_allclose(got, lt.grad.numpy(), rtol=1e-11, atol=1e-13)


def test_ties_choose_the_lower_expert_first():
    lg = np.zeros((2, 5))
    lg[1, [1, 3]] = 1.0
    _, ex, _ = R.router(lg, 2)
    assert ex.tolist() == [[0, 1], [1, 3]]


def test_the_auxiliary_losses_match_transformers_and_autograd():
    rng = np.random.default_rng(1)
    t, e, k = 50, 6, 2
    lg = _logits(rng, t, e)
    _, ex, _ = R.router(lg, k)
    lt = torch.tensor(lg, requires_grad=True)
    if importlib.util.find_spec("transformers") is not None:
        from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

        want = load_balancing_loss_func((lt.detach(),), e, k)   # (its sums are float32)
        assert R.load_balancing_loss(lg, ex, e) == pytest.approx(float(want), rel=1e-6)
    p = torch.softmax(lt, -1)
    hit = torch.nn.functional.one_hot(torch.tensor(ex, dtype=torch.int64), e).double()
    lb = e * (hit.mean(0) * p.mean(0)[None]).sum()
    z = (torch.logsumexp(lt, -1) ** 2).mean()
    assert R.load_balancing_loss(lg, ex, e) == pytest.approx(lb.item(), rel=1e-12)
    assert R.router_z_loss(lg) == pytest.approx(z.item(), rel=1e-12)
    (0.7 * lb + 0.3 * z).backward()
    got = R.load_balancing_loss_backward(0.7, lg, ex, e) + R.router_z_loss_backward(0.3, lg)
    np.testing.assert_allclose(got, lt.grad.numpy(), rtol=1e-11, atol=1e-14)


def test_permute_groups_pairs_by_expert_stably_and_unpermute_combines():
    rng = np.random.default_rng(2)
    t, e, k, h = 11, 4, 2, 3
    x = rng.standard_normal((t, h))
    w, ex, counts = R.router(_logits(rng, t, e), k)
    xp, order, off = R.permute(x, ex, e)
    assert off.tolist() == [0, *np.cumsum(counts).tolist()]
    flat = ex.reshape(-1)[order]
    assert (np.diff(flat) >= 0).all()                      # grouped by expert
    for g in range(e):                                      # token order within an expert
        assert (np.diff(order[off[g]:off[g + 1]]) > 0).all()
    np.testing.assert_array_equal(xp, x[order // k])
    np.testing.assert_allclose(R.unpermute(xp, order, w), x * w.sum(1, keepdims=True), rtol=1e-13)


def bad_input_cases(xp):
    """(call, exception, message pattern) of the family's bad arguments: the routing's, the
    grouped products' and the block's (tests/test_bad_inputs.py runs them, with and without a
    GPU)."""
    import test_moe_biased_glu
    import test_moe_block
    import test_moe_grouped_mm
    import test_moe_routing

    return (test_moe_routing.bad_input_cases(xp) + test_moe_grouped_mm.bad_input_cases(xp)
            + test_moe_block.bad_input_cases(xp) + test_moe_biased_glu.bad_input_cases(xp))


def _experts_args(g, t=9, h=16, e=5, i=8, k=2, device="cpu", dtype=torch.float32):
    """(x, top_k_index, top_k_weights, w_gate_up, w_down) of transformers' fused experts: each
    token's k experts distinct."""
    idx = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).to(device)
    x = torch.randn(t, h, generator=g).to(device, dtype)
    w = torch.rand(t, k, generator=g).to(device)
    gu = (torch.randn(e, 2 * i, h, generator=g) * h ** -0.5).to(device, dtype)
    dn = (torch.randn(e, h, i, generator=g) * i ** -0.5).to(device, dtype)
    return x, idx, w, gu, dn


def _experts_by_token(x, idx, w, gu, dn):
    """transformers' fused experts (SiLU) token by token and expert by expert: the wiring tests'
    reference, written apart from the batched forms the ops' PyTorch computations use."""
    i = gu.shape[1] // 2
    rows = []
    for t in range(x.shape[0]):
        acc = 0
        for j in range(idx.shape[1]):
            e = int(idx[t, j])
            hid = gu[e] @ x[t]
            acc = acc + w[t, j] * (dn[e] @ (torch.nn.functional.silu(hid[:i]) * hid[i:]))
        rows.append(acc)
    return torch.stack(rows).to(x.dtype)


def _biased_args(g, t=9, h=16, e=5, i=8, k=2, device="cpu", dtype=torch.float32, scale=3.0):
    """(x, top_k_index, top_k_weights, w_gate_up (E, H, 2I), b_gate_up, w_down (E, I, H), b_down)
    of GPT-OSS's experts; ``scale`` sets the gate's inputs' size (3: some past a limit of 7...)."""
    x, idx, w, _, _ = _experts_args(g, t, h, e, i, k, device, dtype)
    gu = (torch.randn(e, h, 2 * i, generator=g) * scale * h ** -0.5).to(device, dtype)
    bgu = torch.randn(e, 2 * i, generator=g).to(device)
    dn = (torch.randn(e, i, h, generator=g) * i ** -0.5).to(device, dtype)
    bdn = torch.randn(e, h, generator=g).to(device)
    return x, idx, w, gu, bgu, dn, bdn


def _biased_by_token(x, idx, w, gu, bgu, dn, bdn, alpha=1.702, limit=7.0):
    """GPT-OSS's experts token by token, as its modeling code writes the gate."""
    rows = []
    for t in range(x.shape[0]):
        acc = 0
        for j in range(idx.shape[1]):
            e = int(idx[t, j])
            hid = x[t] @ gu[e] + bgu[e]
            gate, up = hid[::2].clamp(min=None, max=limit), hid[1::2].clamp(min=-limit, max=limit)
            acc = acc + w[t, j] * ((up + 1) * (gate * torch.sigmoid(gate * alpha)) @ dn[e] + bdn[e])
        rows.append(acc)
    return torch.stack(rows).to(x.dtype)


def _block_by_token(x, rw, gu, dn, top_k):
    """The block (softmax, renormalized) by ``_experts_by_token``, the router token by token."""
    p = torch.softmax(x @ rw.T, -1)
    idx = torch.stack([torch.argsort(-p[t].detach(), stable=True)[:top_k] for t in range(x.shape[0])])
    w = p.gather(1, idx)
    return _experts_by_token(x, idx, w / w.sum(-1, keepdim=True), gu, dn)


def torch_wiring_calls(which: str, g) -> list:
    """(op, its arguments, PyTorch's same computation, the inputs that may need gradients)."""
    x, idx, w, gu, dn = _experts_args(g)
    x.requires_grad_(which in ("x", "both"))
    gu.requires_grad_(which in ("w", "both"))
    rw = torch.randn(5, 16, generator=g)
    block = (x, rw, gu, dn, None, 2, 0, 0, True, 1.0)
    bx, bidx, bw, bgu, bbgu, bdn, bbdn = _biased_args(g)
    bx.requires_grad_(which in ("x", "both"))
    for v in (bgu, bbgu, bdn, bbdn):
        v.requires_grad_(which in ("w", "both"))
    biased = (bx, bidx, bw, bgu, bbgu, bdn, bbdn, 1.702, 7.0)
    return [("moe_experts", (x, idx, w, gu, dn, 0), lambda: _experts_by_token(x, idx, w, gu, dn), (x, gu)),
            ("moe_experts_biased", biased, lambda: _biased_by_token(*biased[:7]), (bx, bgu, bbgu, bdn, bbdn)),
            ("moe_block", block, lambda: _block_by_token(x, rw, gu, dn, 2), (x, gu))]


def torch_block(x, router_w, w_gate_up, w_down, selection_bias, top_k, act, score, renormalize, scale, experts=None):
    """The MoE block in PyTorch's ops as a user writes it (transformers' router and fused
    experts): (out, logits, weights, experts); ``experts`` given: that choice held fixed."""
    from cukern.moe.block import ACTS
    from cukern.torch import _recognize_experts

    logits = x @ router_w.T
    s = torch.softmax(logits.float(), -1) if score == 0 else torch.sigmoid(logits.float())
    if experts is None:
        choice = s if selection_bias is None else s + selection_bias
        experts = torch.topk(choice, top_k, dim=-1).indices
    w = s.gather(1, experts.long())
    if renormalize:
        w = w / w.sum(-1, keepdim=True)
    w = w * scale
    return (_recognize_experts.experts_reference(ACTS[act], x, experts.long(), w, w_gate_up, w_down), logits, w,
            experts)


def torch_stand_ins() -> dict:
    """op -> (forward, backward) computed by PyTorch on the CPU (the op's wiring is tested)."""
    from torch_helpers import recompute

    from cukern.moe.block import ACTS
    from cukern.torch._recognize import GATED_ACTS

    def products(rows, w, offsets):
        ends = offsets.tolist()
        return torch.cat([rows[lo:hi] @ w[e].T for e, (lo, hi) in enumerate(zip(ends, ends[1:]))])

    def experts(x_perm, weights, gu, dn, row_of, offsets, act, k):
        h = products(x_perm, gu, offsets)
        i = h.shape[1] // 2
        z = GATED_ACTS[ACTS[act]][2](h[:, :i]) * h[:, i:]
        y = products(z, dn, offsets)
        t = weights.shape[0]
        return h, y, (y[row_of.long()].reshape(t, k, -1) * weights[..., None]).sum(1).to(x_perm.dtype)

    def fwd(x, idx, w, gu, dn, act):
        e, k = gu.shape[0], idx.shape[1]
        flat = idx.reshape(-1)
        order = torch.argsort(flat, stable=True)
        row_of = torch.empty_like(order)
        row_of[order] = torch.arange(order.numel())
        offsets = torch.cat([flat.new_zeros(1), torch.bincount(flat, minlength=e).cumsum(0)]).int()
        x_perm, weights = x[order // k], w.to(torch.float32, copy=True)
        h, y, out = experts(x_perm, weights, gu, dn, row_of, offsets, act, k)
        return out, x_perm, row_of.int(), offsets, h, y, weights

    def bwd(dout, x_perm, row_of, offsets, h, y, weights, gu, dn, act, k):
        dx_perm, dw, dgu, ddn = recompute(lambda xp, w, g, d: experts(xp, w, g, d, row_of, offsets, act, k)[2],
                                          (x_perm, weights, gu, dn), dout)
        return dx_perm[row_of.long()].reshape(weights.shape[0], k, -1).sum(1), dw, dgu, ddn

    def biased(x_perm, weights, gu, bgu, dn, bdn, row_of, offsets, alpha, limit, k):
        ends = offsets.tolist()
        groups = list(enumerate(zip(ends, ends[1:])))
        h = torch.cat([x_perm[lo:hi] @ gu[e] for e, (lo, hi) in groups])
        hb = h + torch.cat([bgu[e].expand(hi - lo, -1) for e, (lo, hi) in groups])
        g, u = hb[:, 0::2].clamp(max=limit), hb[:, 1::2].clamp(-limit, limit)
        z = (u + 1) * g * torch.sigmoid(alpha * g)
        y = torch.cat([z[lo:hi] @ dn[e] + bdn[e] for e, (lo, hi) in groups])
        t = weights.shape[0]
        return h, y, (y[row_of.long()].reshape(t, k, -1) * weights[..., None]).sum(1).to(x_perm.dtype)

    def biased_fwd(x, idx, w, gu, bgu, dn, bdn, alpha, limit):
        _, x_perm, row_of, offsets, _, _, weights = fwd(x, idx, w, gu.transpose(1, 2), dn.transpose(1, 2), 0)
        h, y, out = biased(x_perm, weights, gu, bgu, dn, bdn, row_of, offsets, alpha, limit, idx.shape[1])
        return out, x_perm, row_of, offsets, h, y, weights

    def biased_bwd(dout, x_perm, row_of, offsets, h, y, weights, gu, bgu, dn, bdn, alpha, limit, k):
        dx_perm, dw, dgu, dbgu, ddn, dbdn = recompute(
            lambda xp, w, *p: biased(xp, w, *p, row_of, offsets, alpha, limit, k)[2],
            (x_perm, weights, gu, bgu, dn, bdn), dout)
        return dx_perm[row_of.long()].reshape(weights.shape[0], k, -1).sum(1), dw, dgu, dbgu, ddn, dbdn

    def block_fwd(x, rw, gu, dn, sb, top_k, act, score, renorm, scale):
        out, logits, w, ex = torch_block(x, rw, gu, dn, sb, top_k, act, score, renorm, scale)
        _, x_perm, row_of, offsets, h, y, weights = fwd(x, ex, w, gu, dn, act)
        return out, logits, weights, ex.int(), x_perm, row_of, offsets, h, y

    def block_bwd(dout, dlogits, x, rw, gu, dn, logits, weights, ex, x_perm, row_of, offsets, h, y, top_k, act,
                  score, renorm, scale):
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_(True) for t in (x, rw, gu, dn)]
            out, lg, _, _ = torch_block(*leaves, None, top_k, act, score, renorm, scale, experts=ex)
            if dlogits is None:
                return torch.autograd.grad(out, leaves, dout)
            return torch.autograd.grad((out, lg), leaves, (dout, dlogits))

    return {"moe_experts": (fwd, bwd), "moe_experts_biased": (biased_fwd, biased_bwd),
            "moe_block": (block_fwd, block_bwd)}


def opcheck_samples() -> list:
    ops = torch.ops.cukern
    g = torch.Generator().manual_seed(0)
    out = []
    for act, (t, h, e, i, k) in enumerate([(37, 24, 8, 16, 2), (5, 16, 3, 8, 3), (64, 32, 40, 24, 4)]):
        x, idx, w, gu, dn = _experts_args(g, t, h, e, i, k, "cuda", torch.bfloat16)
        out.append((ops.moe_experts.default, (x.requires_grad_(True), idx, w.requires_grad_(True),
                                               gu.requires_grad_(True), dn.requires_grad_(True), act)))
    for t, h, e, i, k in [(37, 24, 8, 16, 2), (64, 32, 40, 24, 4)]:
        # (gate inputs of unit size: no rounding moves one across a clamp's limit here; the
        # clamps are tested against a reference rounded as the kernels round in test_moe_block.py)
        x, idx, w, gu, bgu, dn, bdn = _biased_args(g, t, h, e, i, k, "cuda", torch.bfloat16, scale=1.0)
        out.append((ops.moe_experts_biased.default, (x.requires_grad_(True), idx, w.requires_grad_(True),
                                                      gu.requires_grad_(True), bgu.requires_grad_(True),
                                                      dn.requires_grad_(True), bdn.requires_grad_(True), 1.702, 7.0)))
    # (the block: logits that no rounding reorders, x's first E columns a permutation and
    # router_w = [I | 0], as tests/test_moe_block.py makes them)
    for act, (t, h, e, i, k, score) in enumerate([(37, 24, 8, 16, 2, 0), (20, 16, 4, 8, 1, 1)]):
        x = torch.randn(t, h, generator=g) * 0.5
        x[:, :e] = torch.stack([torch.randperm(e, generator=g) for _ in range(t)]) * (4.0 / e) - 2.0
        rw = torch.zeros(e, h)
        rw[:, :e] = torch.eye(e)
        gu = torch.randn(e, 2 * i, h, generator=g) * h ** -0.5
        dn = torch.randn(e, h, i, generator=g) * i ** -0.5
        leaves = [a.to("cuda", torch.bfloat16).requires_grad_(True) for a in (x, rw, gu, dn)]
        out.append((ops.moe_block.default, (*leaves, None, k, act, score, True, 1.0)))
    return out


def test_the_references_bad_arguments_are_named():
    with pytest.raises(ValueError, match=r"^top_k: must be an int in \[1, 4\]"):
        R.router(np.zeros((3, 4)), 5)
    with pytest.raises(ValueError, match="^top_k: "):
        R.router(np.zeros((3, 4)), True)
    with pytest.raises(ValueError, match="^score: expected one of"):
        R.router(np.zeros((3, 4)), 1, score="relu")
    with pytest.raises(ValueError, match=r"^logits: expected \(tokens, experts\)"):
        R.router(np.zeros(4), 1)
    with pytest.raises(ValueError, match="^act: expected one of"):
        R.moe(np.ones((2, 4)), np.ones((3, 4)), np.ones((3, 6, 4)), np.ones((3, 4, 3)), 1, act="relu")


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers is not installed")
@pytest.mark.parametrize("act", ["silu", "gelu", "gelu_tanh"])
def test_the_block_is_transformers_mixtral_block_forward_and_backward(act):
    """transformers' Mixtral block (its Python loop over experts) in float64 (its router's softmax
    in float32) against ``moe`` and ``moe_backward``: the output and the gradients of the tokens,
    the router and both expert weights, with the load-balancing and z-losses' gradients added
    through the logits."""
    import transformers
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    act_name = {"silu": "silu", "gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh"}[act]
    cfg = transformers.MixtralConfig(hidden_size=16, intermediate_size=12, num_local_experts=6, num_experts_per_tok=2,
                                     hidden_act=act_name)
    torch.manual_seed(0)
    block = MixtralSparseMoeBlock(cfg).double()
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.5)
    x = torch.randn(2, 9, 16, dtype=torch.float64, requires_grad=True)
    out = block(x)
    rw, wgu, wd = (p.detach().numpy() for p in (block.gate.weight, block.experts.gate_up_proj,
                                                block.experts.down_proj))
    xn = x.detach().numpy().reshape(-1, 16)
    got, logits = R.moe(xn, rw, wgu, wd, 2, act=act, return_logits=True)
    # (transformers' router takes its softmax in float32: its weights carry float32's rounding)
    np.testing.assert_allclose(got, out.detach().numpy().reshape(-1, 16), rtol=2e-5, atol=2e-6)
    dout = np.random.default_rng(3).standard_normal(got.shape)
    lt = torch.tensor(logits)
    _, ex, _ = R.router(logits, 2)
    extra = R.load_balancing_loss_backward(0.01, logits, ex, 6) + R.router_z_loss_backward(0.001, logits)
    # (the losses through the block's own logits: the same gradient reaches x and the router)
    own_logits = torch.nn.functional.linear(x.reshape(-1, 16), block.gate.weight)
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func
    aux = 0.01 * load_balancing_loss_func((own_logits,), 6, 2) + 0.001 * (torch.logsumexp(own_logits, -1) ** 2).mean()
    (out.reshape(-1, 16) * torch.tensor(dout)).sum().add(aux).backward()
    dx, drw, dwgu, dwd = R.moe_backward(dout, xn, rw, wgu, wd, 2, act=act, dlogits_extra=extra)
    assert lt.shape == (18, 6)
    for name, a, b in (("dx", dx, x.grad.reshape(-1, 16)), ("drouter_w", drw, block.gate.weight.grad),
                       ("dw_gate_up", dwgu, block.experts.gate_up_proj.grad),
                       ("dw_down", dwd, block.experts.down_proj.grad)):
        np.testing.assert_allclose(a, b.numpy(), rtol=2e-5, atol=2e-6, err_msg=name)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_the_benchs_pytorch_peers_compute_what_the_kernels_do(dtype):
    """The bench's PyTorch side (cukern/moe/bench.py) on the CPU: the grouped products' forward
    and both backward products (an empty expert among them) equal the references', and the
    experts written on grouped products equal transformers' fused experts. float32 takes
    ``torch._grouped_mm``; float64, which it refuses, the loop over the experts."""
    from cukern.moe import bench
    from cukern.torch import _recognize_experts

    dt, tol = getattr(torch, dtype), {"float64": 1e-12, "float32": 1e-5}[dtype]
    g = torch.Generator().manual_seed(0)
    counts = [3, 0, 5, 2]
    off = torch.tensor(np.concatenate([[0], np.cumsum(counts)]), dtype=torch.int32)
    t = {"a": torch.randn(10, 8, generator=g, dtype=dt),
         "b": torch.randn(4, 16, 8, generator=g, dtype=dt),   # (rows of 16 and 8: 16-byte strides)
         "dout": torch.randn(10, 16, generator=g, dtype=dt), "offsets": off, "counts": counts}
    out, da, db = bench._torch_fwd_bwd(t)
    np.testing.assert_allclose(bench._torch_fwd(t).numpy(), R.grouped_matmul(t["a"], t["b"], off), rtol=tol, atol=tol)
    np.testing.assert_allclose(out.numpy(), R.grouped_matmul(t["a"], t["b"], off), rtol=tol, atol=tol)
    want_da, want_db = R.grouped_matmul_backward(t["dout"], t["a"], t["b"], off)
    np.testing.assert_allclose(da.numpy(), want_da, rtol=tol, atol=tol)
    np.testing.assert_allclose(db.numpy(), want_db, rtol=tol, atol=tol)
    tk, h, e, i, k = 9, 8, 5, 6, 2
    x = torch.randn(tk, h, generator=g, dtype=dt)
    idx = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(tk)])
    w = torch.rand(tk, k, generator=g, dtype=dt)
    gu = torch.randn(e, 2 * i, h, generator=g, dtype=dt)
    dn = torch.randn(e, h, i, generator=g, dtype=dt)
    torch.testing.assert_close(bench._torch_experts(x, idx, w, gu, dn),
                               _recognize_experts.experts_reference("silu", x, idx, w, gu, dn), rtol=tol, atol=tol)


def test_the_experts_benchs_pytorch_forms_agree_on_the_cpu():
    """bench --torch's two PyTorch forms of the experts, the grouped products and transformers'
    loop over the experts (its module on the meta device, the leaves passed in), give the same
    output and the same gradients of all four leaves."""
    pytest.importorskip("transformers")
    import torch.nn.functional as F

    from cukern.moe import bench

    t_, h, e, i, k = 40, 16, 5, 8, 2
    g = torch.Generator().manual_seed(8)
    idx = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t_)])
    leaves = [torch.randn(t_, h, generator=g).requires_grad_(True), torch.rand(t_, k, generator=g).requires_grad_(True),
              (torch.randn(e, 2 * i, h, generator=g) / 4).requires_grad_(True),
              (torch.randn(e, h, i, generator=g) / 3).requires_grad_(True)]
    t = {"leaves": leaves, "idx": idx}
    loop, grouped = bench._experts_or_loop(F, t), bench._experts_on(F, t)
    assert loop.abs().max() > 0.1
    torch.testing.assert_close(loop, grouped, rtol=1e-5, atol=1e-5)
    dy = torch.randn(t_, h, generator=g)
    for a, b in zip(torch.autograd.grad(loop, leaves, dy), torch.autograd.grad(grouped, leaves, dy)):
        assert a.abs().max() > 0
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
