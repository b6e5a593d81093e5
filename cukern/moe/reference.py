"""The mixture-of-experts references, in float64 on the host, forward and backward. Layouts as
``transformers``' fused experts (Mixtral, Qwen3-MoE, OLMoE): tokens ``x`` (T, H); the router's
weight (E, H); ``w_gate_up`` (E, 2 I, H), the gate's I rows first; ``w_down`` (E, H, I).

Routing of token t: scores s = softmax(logits_t) (or sigmoid, DeepSeek-V3), the ``top_k``
largest (ties: the lower expert first; a ``selection_bias`` (E,) shifts which are chosen, not
their weights), weights = the chosen scores, renormalized to sum to 1 where asked, times
``scale``. Permutation: the (token, slot) pairs sorted stably by expert, so expert e's rows are
``offsets[e]:offsets[e + 1]`` in token order; the same order every call."""
from __future__ import annotations

import numpy as np

SCORES = ("softmax", "sigmoid")
ACTS = ("silu", "gelu", "gelu_tanh")


def _scores(logits: np.ndarray, score: str) -> np.ndarray:
    if score == "softmax":
        z = logits - logits.max(axis=-1, keepdims=True)
        e = np.exp(z)
        return e / e.sum(axis=-1, keepdims=True)
    if score == "sigmoid":
        return 1.0 / (1.0 + np.exp(-logits))
    raise ValueError(f"score: expected one of {SCORES}, got {score!r}")


def _check_top_k(top_k, num_experts: int) -> int:
    if isinstance(top_k, bool) or not isinstance(top_k, (int, np.integer)) or not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k: must be an int in [1, {num_experts}] (the experts), got {top_k!r}")
    return int(top_k)


def router(logits, top_k: int, *, score: str = "softmax", renormalize: bool = True, selection_bias=None,
           scale: float = 1.0):
    """(weights (T, k) float64, experts (T, k) int32, counts (E,) int32) of router ``logits``
    (T, E): each token's ``top_k`` experts by score (plus ``selection_bias``), highest first, and
    how many (token, slot) pairs each expert received."""
    lg = np.asarray(logits, dtype=np.float64)
    if lg.ndim != 2:
        raise ValueError(f"logits: expected (tokens, experts), got shape {lg.shape}")
    k = _check_top_k(top_k, lg.shape[1])
    s = _scores(lg, score)
    sel = s if selection_bias is None else s + np.asarray(selection_bias, dtype=np.float64)
    experts = np.argsort(-sel, axis=-1, kind="stable")[:, :k]
    w = np.take_along_axis(s, experts, axis=-1)
    if renormalize:
        w = w / w.sum(axis=-1, keepdims=True)
    counts = np.bincount(experts.reshape(-1), minlength=lg.shape[1]).astype(np.int32)
    return w * scale, experts.astype(np.int32), counts


def router_backward(dweights, logits, experts, *, score: str = "softmax", renormalize: bool = True,
                    scale: float = 1.0) -> np.ndarray:
    """d logits (T, E) from d weights (T, k): the choice of experts is held fixed."""
    lg = np.asarray(logits, dtype=np.float64)
    dw = np.asarray(dweights, dtype=np.float64) * scale
    s = _scores(lg, score)
    chosen = np.take_along_axis(s, experts, axis=-1)
    if renormalize:   # w_j = s_j / S: ds_j = dw_j / S - sum_i dw_i s_i / S^2
        total = chosen.sum(axis=-1, keepdims=True)
        dchosen = dw / total - (dw * chosen).sum(axis=-1, keepdims=True) / total ** 2
    else:
        dchosen = dw
    ds = np.zeros_like(s)
    np.put_along_axis(ds, experts.astype(np.int64), dchosen, axis=-1)
    if score == "softmax":
        return s * (ds - (ds * s).sum(axis=-1, keepdims=True))
    return ds * s * (1.0 - s)


def load_balancing_loss(logits, experts, num_experts: int) -> float:
    """Switch Transformer's auxiliary loss in Mixtral's form: num_experts * sum over slots and
    experts of (the fraction of tokens whose slot went to the expert) * (the expert's mean
    softmax probability over the tokens)."""
    p = _scores(np.asarray(logits, dtype=np.float64), "softmax")
    hit = np.eye(num_experts)[np.asarray(experts)]           # (T, k, E)
    return float(num_experts * (hit.mean(axis=0) * p.mean(axis=0)[None, :]).sum())


def load_balancing_loss_backward(dloss: float, logits, experts, num_experts: int) -> np.ndarray:
    """d logits (T, E) of ``load_balancing_loss`` (the fractions are counts: no gradient)."""
    lg = np.asarray(logits, dtype=np.float64)
    p = _scores(lg, "softmax")
    f = np.eye(num_experts)[np.asarray(experts)].mean(axis=0).sum(axis=0)   # (E,)
    dp = np.broadcast_to(dloss * num_experts * f / lg.shape[0], p.shape)
    return p * (dp - (dp * p).sum(axis=-1, keepdims=True))


def router_z_loss(logits) -> float:
    """ST-MoE's router z-loss: the mean over tokens of logsumexp(logits)^2."""
    lg = np.asarray(logits, dtype=np.float64)
    m = lg.max(axis=-1)
    lse = m + np.log(np.exp(lg - m[:, None]).sum(axis=-1))
    return float((lse ** 2).mean())


def router_z_loss_backward(dloss: float, logits) -> np.ndarray:
    lg = np.asarray(logits, dtype=np.float64)
    m = lg.max(axis=-1)
    lse = m + np.log(np.exp(lg - m[:, None]).sum(axis=-1))
    return dloss * 2.0 * lse[:, None] * _scores(lg, "softmax") / lg.shape[0]


def permute(x, experts, num_experts: int):
    """(x_perm (T k, H), order (T k,) int64, offsets (E + 1,) int64): row r of x_perm is token
    order[r] // k's, the pairs (t, slot) = divmod(order[r], k) sorted stably by expert."""
    ex = np.asarray(experts)
    order = np.argsort(ex.reshape(-1), kind="stable")
    counts = np.bincount(ex.reshape(-1), minlength=num_experts)
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    return np.asarray(x, dtype=np.float64)[order // ex.shape[1]], order.astype(np.int64), offsets


def unpermute(y_perm, order, weights) -> np.ndarray:
    """out (T, H): each token's rows of ``y_perm`` times its weights, summed."""
    w = np.asarray(weights, dtype=np.float64)
    t, k = w.shape
    out = np.zeros((t, np.asarray(y_perm).shape[1]))
    np.add.at(out, order // k, np.asarray(y_perm, dtype=np.float64) * w.reshape(-1)[order][:, None])
    return out


def grouped_matmul(a, b, offsets) -> np.ndarray:
    """Rows offsets[e]:offsets[e + 1] of ``a`` (R, K) times ``b[e]`` transposed (b: (E, N, K), as
    nn.Linear's weight): (R, N)."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    out = np.zeros((a.shape[0], b.shape[1]))
    for e in range(b.shape[0]):
        lo, hi = int(offsets[e]), int(offsets[e + 1])
        out[lo:hi] = a[lo:hi] @ b[e].T
    return out


def grouped_matmul_backward(dout, a, b, offsets) -> tuple[np.ndarray, np.ndarray]:
    """(d a (R, K), d b (E, N, K)) of ``grouped_matmul``: rows outside every group get a zero
    d a; an expert without rows a zero d b[e]."""
    dout, a, b = (np.asarray(v, dtype=np.float64) for v in (dout, a, b))
    da, db = np.zeros_like(a), np.zeros_like(b)
    for e in range(b.shape[0]):
        lo, hi = int(offsets[e]), int(offsets[e + 1])
        da[lo:hi] = dout[lo:hi] @ b[e]
        db[e] = dout[lo:hi].T @ a[lo:hi]
    return da, db


def _row_bias(bias, offsets, rows: int) -> np.ndarray:
    """(rows, n): each row's expert's bias (zeros after offsets[E])."""
    bias = np.asarray(bias, dtype=np.float64)
    out = np.zeros((rows, bias.shape[1]))
    for e in range(bias.shape[0]):
        out[int(offsets[e]):int(offsets[e + 1])] = bias[e]
    return out


def biased_glu(h, bias, offsets, alpha: float, limit: float) -> np.ndarray:
    """GPT-OSS's gate on h (R, 2I) plus its row's expert's bias (E, 2I), gate and up columns
    interleaved: (u + 1) g sigmoid(alpha g), g = min(gate, limit), u = clamp(up, -limit, limit);
    (R, I)."""
    hb = np.asarray(h, dtype=np.float64) + _row_bias(bias, offsets, len(h))
    g, u = np.minimum(hb[:, 0::2], limit), np.clip(hb[:, 1::2], -limit, limit)
    return (u + 1) * g / (1 + np.exp(-alpha * g))


def biased_glu_backward(dz, h, bias, offsets, alpha: float, limit: float) -> tuple[np.ndarray, np.ndarray]:
    """(dh (R, 2I) interleaved as h, dbias (E, 2I): each expert's rows of dh summed) of
    ``biased_glu``; a clamp passes the gradient where its input is within its bounds, ends
    included (as torch.clamp's backward)."""
    dz = np.asarray(dz, dtype=np.float64)
    hb = np.asarray(h, dtype=np.float64) + _row_bias(bias, offsets, len(h))
    hg, hu = hb[:, 0::2], hb[:, 1::2]
    g, u = np.minimum(hg, limit), np.clip(hu, -limit, limit)
    s = 1 / (1 + np.exp(-alpha * g))
    dh = np.empty_like(hb)
    dh[:, 0::2] = dz * (u + 1) * (s + alpha * g * s * (1 - s)) * (hg <= limit)
    dh[:, 1::2] = dz * g * s * ((hu >= -limit) & (hu <= limit))
    return dh, group_sums(dh, offsets, np.shape(bias)[0])


def group_bias(y, bias, offsets) -> np.ndarray:
    """y (R, N) plus each row's expert's bias (E, N); the rows after offsets[E] as they are."""
    return np.asarray(y, dtype=np.float64) + _row_bias(bias, offsets, len(y))


def group_sums(x, offsets, experts: int) -> np.ndarray:
    """(E, N): expert e's rows of x summed (zeros for an expert without rows)."""
    x = np.asarray(x, dtype=np.float64)
    return np.stack([x[int(offsets[e]):int(offsets[e + 1])].sum(0) for e in range(experts)])


def _act(g: np.ndarray, act: str):
    """(act(g), act'(g))."""
    if act == "silu":
        sg = 1.0 / (1.0 + np.exp(-g))
        return g * sg, sg * (1.0 + g * (1.0 - sg))
    if act == "gelu":
        from math import erf, pi, sqrt
        phi = np.exp(-0.5 * g * g) / sqrt(2.0 * pi)
        cdf = 0.5 * (1.0 + np.vectorize(erf)(g / sqrt(2.0)))
        return g * cdf, cdf + g * phi
    if act == "gelu_tanh":
        c = np.sqrt(2.0 / np.pi)
        u = c * (g + 0.044715 * g ** 3)
        th = np.tanh(u)
        return 0.5 * g * (1.0 + th), 0.5 * (1.0 + th) + 0.5 * g * (1.0 - th * th) * c * (1.0 + 3 * 0.044715 * g * g)
    raise ValueError(f"act: expected one of {ACTS}, got {act!r}")


def moe(x, router_w, w_gate_up, w_down, top_k: int, *, act: str = "silu", score: str = "softmax",
        renormalize: bool = True, selection_bias=None, scale: float = 1.0, return_logits: bool = False):
    """The MoE block: out (T, H) = sum over each token's experts e of weight * down_e(act(gate_e
    x) * up_e x); with ``return_logits`` also the router logits (T, E) (for the auxiliary losses)."""
    x = np.asarray(x, dtype=np.float64)
    logits = x @ np.asarray(router_w, dtype=np.float64).T
    w, ex, _ = router(logits, top_k, score=score, renormalize=renormalize, selection_bias=selection_bias,
                      scale=scale)
    xp, order, off = permute(x, ex, logits.shape[1])
    h = grouped_matmul(xp, w_gate_up, off)
    i = h.shape[1] // 2
    z = _act(h[:, :i], act)[0] * h[:, i:]
    out = unpermute(grouped_matmul(z, w_down, off), order, w)
    return (out, logits) if return_logits else out


def moe_backward(dout, x, router_w, w_gate_up, w_down, top_k: int, *, act: str = "silu", score: str = "softmax",
                 renormalize: bool = True, selection_bias=None, scale: float = 1.0, dlogits_extra=None):
    """(dx, drouter_w, dw_gate_up, dw_down) of ``moe``; ``dlogits_extra`` (T, E): the auxiliary
    losses' gradient with respect to the router logits, added (``load_balancing_loss_backward``,
    ``router_z_loss_backward``)."""
    x, dout = np.asarray(x, dtype=np.float64), np.asarray(dout, dtype=np.float64)
    rw, wgu, wd = (np.asarray(a, dtype=np.float64) for a in (router_w, w_gate_up, w_down))
    logits = x @ rw.T
    e_count = logits.shape[1]
    w, ex, _ = router(logits, top_k, score=score, renormalize=renormalize, selection_bias=selection_bias,
                      scale=scale)
    k = ex.shape[1]
    xp, order, off = permute(x, ex, e_count)
    h = grouped_matmul(xp, wgu, off)
    i = h.shape[1] // 2
    a, da_dg = _act(h[:, :i], act)
    z = a * h[:, i:]
    yp = grouped_matmul(z, wd, off)
    tok, slot = order // k, order % k
    dyp = dout[tok] * w[tok, slot][:, None]
    dw = np.zeros_like(w)
    dw[tok, slot] = (yp * dout[tok]).sum(axis=1)
    dz = np.zeros_like(z)
    dwd = np.zeros_like(wd)
    dh = np.zeros_like(h)
    dwgu = np.zeros_like(wgu)
    for e in range(e_count):
        lo, hi = int(off[e]), int(off[e + 1])
        dz[lo:hi] = dyp[lo:hi] @ wd[e]
        dwd[e] = dyp[lo:hi].T @ z[lo:hi]
    dh[:, :i] = dz * h[:, i:] * da_dg
    dh[:, i:] = dz * a
    dxp = np.zeros_like(xp)
    for e in range(e_count):
        lo, hi = int(off[e]), int(off[e + 1])
        dxp[lo:hi] = dh[lo:hi] @ wgu[e]
        dwgu[e] = dh[lo:hi].T @ xp[lo:hi]
    dx = np.zeros_like(x)
    np.add.at(dx, tok, dxp)
    dlogits = router_backward(dw, logits, ex, score=score, renormalize=renormalize, scale=scale)
    if dlogits_extra is not None:
        dlogits = dlogits + np.asarray(dlogits_extra, dtype=np.float64)
    dx += dlogits @ rw
    return dx, dlogits.T @ x, dwgu, dwd
