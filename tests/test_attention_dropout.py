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


@needs_torch
@pytest.mark.parametrize("causal", [False, True])
def test_reference_with_a_value_head_size_of_its_own_matches_autograd(causal):
    """A value head size apart from q's and k's (MLA's 128 beside 192) in the references, dense and
    packed, against PyTorch's SDPA (which takes them) with autograd."""
    from cukern import reference as ref

    rng = np.random.default_rng(3)
    q, k = rng.standard_normal((2, 7, 4, 24)), rng.standard_normal((2, 9, 2, 24))
    v, do = rng.standard_normal((2, 9, 2, 16)), rng.standard_normal((2, 7, 4, 16))
    out, lse = ref.attention(q, k, v, causal=causal, return_lse=True, softmax_scale=0.2)
    grads = ref.attention_backward(do, q, k, v, causal=causal, softmax_scale=0.2)
    qt, kt, vt = (torch.tensor(a, requires_grad=True) for a in (q, k, v))
    keep = torch.as_tensor(M.visible(M.mask_of(causal, (-1, -1), 0.0, 7, 9), 7, 9))
    o = torch.nn.functional.scaled_dot_product_attention(
        qt.transpose(1, 2), kt.transpose(1, 2).repeat_interleave(2, 1), vt.transpose(1, 2).repeat_interleave(2, 1),
        attn_mask=keep, scale=0.2).transpose(1, 2)
    np.testing.assert_allclose(out, o.detach().numpy(), rtol=1e-11, atol=1e-12)
    o.backward(torch.tensor(do))
    for name, got, t in zip(("dq", "dk", "dv"), grads, (qt, kt, vt)):
        assert got.shape == t.shape
        np.testing.assert_allclose(got, t.grad.numpy(), rtol=1e-9, atol=1e-11, err_msg=name)
    cu = np.array([0, 3, 7], np.int32)
    packed = ref.attention_varlen(q[0], k[0, :7], v[0, :7], cu, cu, 4, 4, causal=causal, softmax_scale=0.2)
    assert packed.shape == (7, 4, 16)


def test_the_kernels_refuse_a_value_head_size_of_their_own_by_name(host_arrays_as_device):
    import cukern

    q = k = np.ones((1, 8, 2, 192), np.float16)
    v = np.ones((1, 8, 2, 128), np.float16)
    lse = np.zeros((1, 2, 8), np.float32)
    for call in (lambda: cukern.attention(q, k, v), lambda: cukern.attention_backward(q, q, k, v, q, lse),
                 lambda: cukern.attention_varlen(q[0], k[0], v[0], np.array([0, 8], np.int32),
                                                 np.array([0, 8], np.int32), 8, 8)):
        with pytest.raises(ValueError, match="^v: head_dim 128 differs from k's 192: the kernels take one head size"):
            call()
