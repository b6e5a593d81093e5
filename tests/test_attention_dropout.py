"""Attention dropout's reference (the kernels to come are held to it): the weights dropped by the
Philox mask the kernels draw (``dropout_keep_mask``), the kept scaled by 1 / (1 - p), against
PyTorch's autograd of the same composite in float64, forward and backward, with a causal mask,
GQA and sinks; and the mask's draw: where each element is drawn, dense and packed."""
from __future__ import annotations

import importlib

import numpy as np
import pytest

from arrays import torch

needs_torch = pytest.mark.skipif(torch is None, reason="torch is not installed")
R = importlib.import_module("cukern.attention.reference")
M = importlib.import_module("cukern._attention_mask")


@needs_torch
@pytest.mark.parametrize("causal, sinks", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("p", [0.1, 0.5])
def test_reference_dropout_matches_autograd_of_the_dropped_softmax(causal, sinks, p):
    rng = np.random.default_rng(int(p * 10) + 2 * causal + sinks)
    b, sq, sk, h, hkv, d = 2, 9, 11, 4, 2, 8
    q = rng.standard_normal((b, sq, h, d))
    k, v = rng.standard_normal((b, sk, hkv, d)), rng.standard_normal((b, sk, hkv, d))
    do = rng.standard_normal(q.shape)
    s_h = rng.standard_normal(h) if sinks else None
    keep = R.dropout_keep_mask(p, seed=1234, offset=5, batch=b, heads=h, sq=sq, sk=sk)
    assert 0 < keep.mean() < 1
    mask = M.mask_of(causal, (-1, -1), 0.0, sq, sk)
    out, lse = R._ref_forward(q, k, v, 0.3, mask, s_h, keep, p)
    grads = R._ref_backward(do, q, k, v, 0.3, mask, s_h, keep, p)

    qt, kt, vt = (torch.tensor(a, requires_grad=True) for a in (q, k, v))
    st = torch.tensor(s_h, requires_grad=True) if sinks else None
    kk, vv = (a.transpose(1, 2).repeat_interleave(h // hkv, 1) for a in (kt, vt))
    s = (qt.transpose(1, 2) @ kk.transpose(-1, -2)) * 0.3
    s = s.masked_fill(~torch.as_tensor(M.visible(mask, sq, sk)), -float("inf"))
    if sinks:
        s = torch.cat([s, st.reshape(1, -1, 1, 1).expand(b, -1, sq, 1)], dim=-1)
    w = torch.softmax(s, -1)[..., :sk]
    w = torch.where(torch.as_tensor(keep), w / (1 - p), torch.zeros_like(w))
    o = (w @ vv).transpose(1, 2)
    np.testing.assert_allclose(out, o.detach().numpy(), rtol=1e-11, atol=1e-12)
    o.backward(torch.tensor(do))
    leaves = (qt, kt, vt) + ((st,) if sinks else ())
    assert len(grads) == len(leaves)
    for name, got, t in zip(("dq", "dk", "dv", "dsinks"), grads, leaves):
        np.testing.assert_allclose(got, t.grad.numpy(), rtol=1e-9, atol=1e-11, err_msg=name)


def test_each_element_is_drawn_at_its_own_place():
    """Dense: (b * H + h, i, j); packed: the document's tokens' places in the pack. Two calls
    (offsets) and two seeds draw different masks; the same arguments draw the same one."""
    a = R.dropout_keep_mask(0.5, 3, 0, 2, 3, 5, 7)
    assert a.shape == (2, 3, 5, 7) and np.array_equal(a, R.dropout_keep_mask(0.5, 3, 0, 2, 3, 5, 7))
    assert not np.array_equal(a, R.dropout_keep_mask(0.5, 3, 1, 2, 3, 5, 7))
    assert not np.array_equal(a, R.dropout_keep_mask(0.5, 4, 0, 2, 3, 5, 7))
    whole = R.dropout_keep_mask(0.5, 3, 0, 1, 6, 5, 7)      # (one batch of 6 heads: bh = h)
    np.testing.assert_array_equal(a.reshape(1, 6, 5, 7), whole)   # (b * 3 + h: the same draws)
    doc = R.dropout_keep_mask(0.5, 3, 0, 1, 3, 4, 6, q0=10, k0=20)
    pack = R.dropout_keep_mask(0.5, 3, 0, 1, 3, 14, 26)
    np.testing.assert_array_equal(doc, pack[:, :, 10:14, 20:26])

