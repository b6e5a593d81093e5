"""A value head size apart from q's and k's (DeepSeek's MLA: 192 for q and k, 128 for v): the
references take it (the kernels to come are held to them), the kernels' fronts refuse it by name."""
from __future__ import annotations

import importlib

import numpy as np
import pytest

from arrays import torch

needs_torch = pytest.mark.skipif(torch is None, reason="torch is not installed")
M = importlib.import_module("cukern._attention_mask")


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
