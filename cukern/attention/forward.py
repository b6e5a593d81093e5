"""The forward's array functions and launch plans: dense (``attention``) and packed documents
(``attention_varlen``), on the sm_80 kernels or the Hopper ones."""
from __future__ import annotations

from .. import _arrays, _attention_mask, _faults, _kernels
from .._arrays import DeviceArray
from .._attention_mask import Mask
from .._kernels import MapSlot
from .._plans import Builder, Plan, PlanCache
from . import configs as _cfg
from .checks import (_check_qkv, _check_varlen, _dropout_args, _dropout_p, _dropout_rng, _like, _read, _scale,
                     _strides3, _tma_readable)
from .configs import LOG2E, Configs

# ---- forward --------------------------------------------------------------------------------

_FWD = PlanCache()


def _qkv(q, k, v) -> list:
    return [_arrays.as_device_array(q, "q", _arrays.FLOATS), _arrays.as_device_array(k, "k", _arrays.FLOATS),
            _arrays.as_device_array(v, "v", _arrays.FLOATS)]


def attention(q, k, v, *, causal=False, softmax_scale=None, return_lse=False, window=(-1, -1), softcap=0.0,
              sinks=None, dropout_p=0.0, dropout_rng=None):
    """softmax(q k^T * softmax_scale [+ mask]) v, fused (FlashAttention-2 style).

    Args:
        q: (B, Sq, H, D) float16 or bfloat16 (CuPy array or torch CUDA tensor), unit stride
            over D; any batch, sequence and head strides (SDPA's (B, H, S, D) transposed, a
            slice of a packed qkv tensor) are read in place.
        k: (B, Sk, Hkv, D) of q's dtype; Hkv divides H (GQA / MQA).
        v: (B, Sk, Hkv, Dv) of q's dtype: Dv = D, or 128 beside D = 192 (DeepSeek's MLA: the
            scores on 192, the values on 128; on Hopper both directions run Hopper kernels,
            packed documents' and dropout's backward excepted).
        causal: mask keys after the query, aligned to the bottom right when Sq != Sk
            (query i sees keys j <= i + Sk - Sq); a query that sees no key outputs zeros.
        softmax_scale: positive; defaults to 1 / sqrt(D).
        return_lse: also return the log-sum-exp (B, H, Sq) float32 (natural log; +inf for a
            query that sees no key).
        window: ``(left, right)``, flash-attn's ``window_size``: query i sees keys j with
            i + Sk - Sq - left <= j <= i + Sk - Sq + right; -1 leaves a side unbounded
            (causal sets right to 0). Key tiles outside a block's window are skipped.
        softcap: c > 0 replaces each scaled score s by c * tanh(s / c) (Gemma 2); 0 or None: none.
        sinks: (H,) float32 attention sinks (GPT-OSS; flash-attn's ``learnable_sink``): a logit
            per query head, in the units of the scaled (and capped) scores, that joins every
            row's softmax denominator and has no value: each row's weights sum to less than 1.
            The lse then includes it (a query that sees no key gets zeros and lse = its sink).
        dropout_p: drops each attention weight with this probability and scales the kept ones
            by 1 / (1 - dropout_p) (the lse stays the softmax's). On Hopper the Hopper kernels
            take it (dense; the backward at head dims 64 and 128), elsewhere the sm_80 ones;
            not with ``softcap``.
        dropout_rng: with dropout_p > 0, (2,) int64 on q's device: the seed and the Philox
            offset of the draw (read on the device at the launch, so a CUDA graph replays with
            the values there). Weight (b, h, i, j) is dropped when the 16-bit half j % 2 of
            word (j // 8) % 4 of Philox4x32-10(counter ((j // 32) * 4 + (j // 2) % 4, i, b * H + h,
            offset % 2**32), key seed) is below dropout_p * 2**16
            (``cukern.attention.reference.dropout_keep_mask``); the backward takes the
            same array and draws the same mask.

    Returns:
        ``out`` (B, Sq, H, Dv) of q's dtype, laid out like q (its stride order) when q is
        dense, else contiguous; with ``return_lse`` ``(out, lse)``.
    """
    return _attention(q, k, v, causal, softmax_scale, return_lse, _cfg.CONFIGS, window, softcap, sinks, dropout_p,
                      dropout_rng)


def _sinks(sinks) -> list:
    """The sinks as the last array of a call, or nothing."""
    return [] if sinks is None else [_arrays.as_device_array(sinks, "sinks", ("float32",))]


def _rng_slot(arrays, dropout_p: float, b: Builder):
    """The dropout draw's slot (the last array, made contiguous where it is not) or None."""
    if not dropout_p:
        return None
    at = len(arrays) - 1
    if not _arrays.is_contiguous(arrays[at]) and at not in {i for i, _ in b.fixes}:
        b.fix(at, DeviceArray.contiguous)
    return b.slot(at)


def _check_sinks(arrays, at: int | None, h: int, b: Builder):
    """The sinks' slot (arrays[at], made contiguous where it is not) or None."""
    if at is None:
        return None
    sa = arrays[at]
    if sa.shape != (h,):
        raise ValueError(f"sinks: shape {sa.shape}; expected (heads,) = ({h},), one logit a query head")
    if not _arrays.is_contiguous(sa):
        b.fix(at, DeviceArray.contiguous)
    return b.slot(at)


def _mask_key(window, softcap):
    """The plan-cache key of a call's window and softcap, or None where they are not plain
    values (the plan is then built for the call and not kept)."""
    w = tuple(window) if isinstance(window, (tuple, list)) else window
    plain = ((w is None or (isinstance(w, tuple) and all(type(x) is int for x in w)))
             and (softcap is None or type(softcap) in (float, int)))
    return (w, softcap) if plain else None


def _attention(q, k, v, causal, softmax_scale, return_lse, configs: Configs, window=(-1, -1), softcap=0.0,
               sinks=None, dropout_p=0.0, dropout_rng=None):
    p = _dropout_p(dropout_p, softcap)
    arrays = [*_qkv(q, k, v), *_sinks(sinks), *_dropout_rng(p, dropout_rng)]
    mkey = _mask_key(window, softcap)
    plain = (softmax_scale is None or type(softmax_scale) in (float, int)) and mkey is not None
    key = (bool(causal), softmax_scale, bool(return_lse), configs, mkey, p, sinks is None, *(a.key for a in arrays))
    plan = _FWD.plan(key if plain else None, _plan_forward, arrays, bool(causal), softmax_scale, bool(return_lse),
                     configs, window, softcap, sinks is not None, p)
    bufs = plan(arrays)
    return (plan.out(bufs, "out"), plan.out(bufs, "lse")) if return_lse else plan.out(bufs, "out")


def _plan_forward(arrays, causal, softmax_scale, return_lse, configs: Configs, window=(-1, -1),
                  softcap=0.0, has_sinks=False, dropout_p=0.0) -> Plan:
    qa, ka, va = arrays[:3]
    _check_qkv(qa, ka, va, configs.head_dims, "", configs.value_dims)
    batch, sq, h, d = qa.shape
    sk, hkv, dv = ka.shape[1], ka.shape[2], va.shape[3]
    scale = _scale(softmax_scale, d)
    mask = _attention_mask.mask_of(causal, window, softcap, sq, sk)
    device = _arrays.same_device(*arrays)
    b = Builder(arrays)
    qs, ks, vs = (_read(b, i, a) for i, a in enumerate(arrays[:3]))
    sinks = _check_sinks(arrays, 3 if has_sinks else None, h, b)
    rng = _rng_slot(arrays, dropout_p, b)
    q_copied = any(i == 0 for i, _ in b.fixes)
    out = b.alloc((batch, sq, h, dv), qa.dtype, "contiguous" if q_copied else "like", 0, name="out")
    lse = b.alloc((batch, h, sq), "float32", name="lse") if return_lse else None
    if batch * h * sq:
        if sk == 0 and sinks is None:  # no keys: zeros, lse = +inf (with sinks the kernel writes theirs)
            b.fill(0.0, out)
            b.fill(float("inf"), lse)
        elif (configs.use_sm90 and sk and (not dropout_p or configs.use_sm90_dropout) and d in dict(configs.fwd_sm90)
              and _kernels.compute_capability(device) == (9, 0)
              and all(i in {j for j, _ in b.fixes} or _tma_readable(a) for i, a in enumerate(arrays[:3]))):
            # TMA reads the inputs in place where cp.async can (16-byte rows and strides: _read)
            # (a window takes the causal config; its work tiles are handed out as the unmasked ones)
            causal = mask.causal
            cfg = configs.sm90_forward(d, mask.kind > 0, bool(mask.softcap), bool(dropout_p))
            k = _kernels.kernel(cfg.instance(qa.dtype, d, mask.kind, bool(mask.softcap), dropout=bool(dropout_p),
                                             dv=dv), device)
            cap_in, cap_out = _attention_mask.softcap_log2(mask, scale)
            os_ = _like(qa, q_copied, (batch, sq, h, dv))
            m_tiles = -(-sq // cfg.block_rows)
            blocks = configs.fwd_sm90_blocks or _kernels.sm_count(device)
            grid = (min(m_tiles * batch * h, blocks), 1) if cfg.persistent else (m_tiles, batch * h)
            # (causal persistent: work tiles from a counter that starts at zero every call; causal
            # tiles in sections of (batch, head) pairs whose K and V fill l2_section_bytes)
            counter = b.alloc((1,), "int32") if cfg.persistent and causal else None
            if counter is not None:
                b.fill(0.0, counter)
            section_pairs = max(1, configs.l2_section_bytes // (sk * (d + dv) * 2)) if causal else 1
            b.launch(k, grid, q_map=MapSlot(0, (1, cfg.block_rows, 1, 64)),
                     k_map=MapSlot(1, (1, cfg.bn, 1, 64)), v_map=MapSlot(2, (1, cfg.bn, 1, 64)),
                     o_map=MapSlot(out.index, (1, 64, 1, 64)) if cfg.persistent else bytes(128), out=out, lse=lse,
                     sinks=sinks,
                     **{f"o_{n}": s for n, s in _strides3(os_).items()},
                     H=h, Hkv=hkv, Sq=sq, Sk=sk, scale=scale, scale_log2=scale * LOG2E, tiles=m_tiles * batch * h,
                     tile_counter=counter, section_pairs=section_pairs, cap_in=cap_in, cap_out=cap_out,
                     win_left=mask.left, win_right=mask.right, cu_q=None, cu_k=None, max_q=0, max_k=0, fault=None,
                     **_dropout_args(dropout_p, rng))
        else:
            _launch_forward_sm80(b, configs, qa, (qs, ks, vs), _like(qa, q_copied, (batch, sq, h, dv)), out, lse,
                                 sinks, mask, scale,
                                 grid_rows=sq, batches=batch, sq=sq, sk=sk, hkv=hkv, device=device,
                                 dropout=(dropout_p, rng))
    return b.plan(device)


def _launch_forward_sm80(b: Builder, configs: Configs, qa: DeviceArray, strides, os_, out, lse, sinks, mask: Mask,
                         scale: float, *, grid_rows: int, batches: int, sq: int, sk: int, hkv: int, device: int,
                         varlen: tuple | None = None, dropout: tuple = (0.0, None)) -> None:
    """attention_fwd over ``batches`` (batch, head) groups of ``grid_rows`` query rows (packed:
    ``varlen`` = (cu_q slot, cu_k slot, max_q, max_k), and sq, sk the token totals);
    ``dropout`` = (dropout_p, the draw's slot)."""
    d, h = qa.shape[-1], qa.shape[-2]
    cfg = configs.sm80("fwd", d, bool(dropout[0]))
    k = _kernels.kernel(cfg.instance(qa.dtype, d, mask.kind, bool(mask.softcap), bool(dropout[0]), configs.dv(d)),
                        device)
    cap_in, cap_out = _attention_mask.softcap_log2(mask, scale)
    cu_q, cu_k, max_q, max_k = varlen if varlen is not None else (None, None, 0, 0)
    fault = _arrays.wrap(_faults.record(device), "fault record") if varlen is not None else None
    b.launch(k, (-(-grid_rows // cfg.block_rows), batches * h), q=b.slot(0), k=b.slot(1), v=b.slot(2), out=out,
             lse=lse, sinks=sinks,
             **{f"{x}_{n}": s for x, st in zip("qkvo", (*strides, os_)) for n, s in _strides3(st).items()},
             H=h, Hkv=hkv, Sq=sq, Sk=sk, scale=scale, scale_log2=scale * LOG2E, win_left=mask.left,
             win_right=mask.right, cap_in=cap_in, cap_out=cap_out, cu_q=cu_q, cu_k=cu_k, max_q=max_q, max_k=max_k,
             fault=fault, **_dropout_args(*dropout))


# ---- packed documents (varlen) ----------------------------------------------------------------

_FWD_VARLEN = PlanCache()


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal=False,
                     softmax_scale=None, return_lse=False, window=(-1, -1), softcap=0.0, sinks=None, dropout_p=0.0,
                     dropout_rng=None):
    """``attention`` over documents packed into one sequence with no padding (flash-attn's
    ``flash_attn_varlen_func``): each document attends to its own tokens only.

    Args:
        q: (total_q, H, D) float16 or bfloat16, the documents' queries one after another.
        k: (total_k, Hkv, D) of q's dtype; v: (total_k, Hkv, Dv), Dv as for ``attention``.
        cu_seqlens_q, cu_seqlens_k: (B + 1,) int32 offsets of each document's first token,
            from 0 to total_q (total_k), none decreasing (a document may be empty).
        max_seqlen_q, max_seqlen_k: ints at least the longest document's length (the grid
            covers that many rows).
        causal, softmax_scale, window, softcap, sinks: as for ``attention``, each document's mask
            aligned to its own bottom right.
        dropout_p, dropout_rng: as for ``attention``, the draw at the tokens' places in the pack
            (b = 0, i and j counted from the pack's first token).
        return_lse: also return the log-sum-exp (H, total_q) float32.

    Offsets are read on the device: bad ones (decreasing, not from 0 to the total, a document
    longer than its max_seqlen) leave that document uncomputed (and documents that overlap it
    may be wrong) and are reported by ``cukern.check_errors()``, as an out-of-range embedding
    index is: the call's outputs are then not valid.

    Returns:
        ``out`` (total_q, H, Dv) of q's dtype; with ``return_lse`` ``(out, lse)``.
    """
    return _attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale,
                             return_lse, window, softcap, _cfg.CONFIGS, sinks, dropout_p, dropout_rng)


def _offsets(cu_seqlens_q, cu_seqlens_k) -> list:
    return [_arrays.as_device_array(cu_seqlens_q, "cu_seqlens_q", ("int32",)),
            _arrays.as_device_array(cu_seqlens_k, "cu_seqlens_k", ("int32",))]


def _varlen_cacheable(softmax_scale, mkey, max_seqlen_q, max_seqlen_k) -> bool:
    """Whether a packed call's plan may be kept by its arguments (plain numbers, a known mask)."""
    return ((softmax_scale is None or type(softmax_scale) in (float, int)) and mkey is not None
            and type(max_seqlen_q) is int and type(max_seqlen_k) is int)


def _attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale,
                      return_lse, window, softcap, configs: Configs, sinks=None, dropout_p=0.0, dropout_rng=None):
    p = _dropout_p(dropout_p, softcap)
    arrays = [*_qkv(q, k, v), *_offsets(cu_seqlens_q, cu_seqlens_k), *_sinks(sinks), *_dropout_rng(p, dropout_rng)]
    mkey = _mask_key(window, softcap)
    plain = _varlen_cacheable(softmax_scale, mkey, max_seqlen_q, max_seqlen_k)
    key = (bool(causal), softmax_scale, bool(return_lse), configs, mkey, max_seqlen_q, max_seqlen_k, p,
           sinks is None, *(a.key for a in arrays))
    plan = _FWD_VARLEN.plan(key if plain else None, _plan_forward_varlen, arrays, max_seqlen_q, max_seqlen_k,
                            bool(causal), softmax_scale, bool(return_lse), window, softcap, configs,
                            sinks is not None, p)
    bufs = plan(arrays)
    return (plan.out(bufs, "out"), plan.out(bufs, "lse")) if return_lse else plan.out(bufs, "out")


def _plan_forward_varlen(arrays, max_seqlen_q, max_seqlen_k, causal, softmax_scale, return_lse, window, softcap,
                         configs: Configs, has_sinks=False, dropout_p=0.0) -> Plan:
    qa, ka, va, cq, ck = arrays[:5]
    max_q, max_k = _check_varlen(qa, ka, va, cq, ck, max_seqlen_q, max_seqlen_k, configs.head_dims, "",
                                 configs.value_dims)
    total_q, h, d = qa.shape
    total_k, hkv, dv = ka.shape[0], ka.shape[1], va.shape[2]
    docs = cq.shape[0] - 1
    scale = _scale(softmax_scale, d)
    # (the window's sides normalized against the longest documents: exact for every shorter one)
    mask = _attention_mask.mask_of(causal, window, softcap, max_q, max_k)
    device = _arrays.same_device(*arrays)
    b = Builder(arrays)
    qs, ks, vs = ((0, *_read(b, i, a)) for i, a in enumerate(arrays[:3]))   # (no batch stride)
    for i in (3, 4):
        if not _arrays.is_contiguous(arrays[i]):
            b.fix(i, DeviceArray.contiguous)
    sinks = _check_sinks(arrays, 5 if has_sinks else None, h, b)
    rng = _rng_slot(arrays, dropout_p, b)
    q_copied = any(i == 0 for i, _ in b.fixes)
    out = b.alloc((total_q, h, dv), qa.dtype, "contiguous" if q_copied else "like", 0, name="out")
    lse = b.alloc((h, total_q), "float32", name="lse") if return_lse else None
    if total_q * h and max_q:
        os_ = (0, *_like(qa, q_copied, (total_q, h, dv)))
        if (configs.use_sm90 and not dropout_p and d in dict(configs.fwd_sm90_varlen) and total_k
                and _kernels.compute_capability(device) == (9, 0)
                and all(i in {j for j, _ in b.fixes} or _tma_readable(a) for i, a in enumerate(arrays[:3]))):
            # attention_fwd_sm90 over (query tiles of the longest document, documents x heads);
            # the packed arrays read by TMA as one batch (a box of one more axis than they have)
            cfg = configs.get("fwd_sm90_varlen", d)
            k = _kernels.kernel(cfg.instance(qa.dtype, d, mask.kind, bool(mask.softcap), varlen=True, dv=dv), device)
            cap_in, cap_out = _attention_mask.softcap_log2(mask, scale)
            m_tiles = -(-max_q // cfg.block_rows)
            b.launch(k, (m_tiles, docs * h), q_map=MapSlot(0, (1, cfg.block_rows, 1, 64)),
                     k_map=MapSlot(1, (1, cfg.bn, 1, 64)), v_map=MapSlot(2, (1, cfg.bn, 1, 64)), o_map=bytes(128),
                     out=out, lse=lse, sinks=sinks, **{f"o_{n}": s for n, s in _strides3(os_).items()},
                     H=h, Hkv=hkv, Sq=total_q, Sk=total_k, scale=scale, scale_log2=scale * LOG2E,
                     tiles=m_tiles * docs * h,
                     tile_counter=None, section_pairs=1, cap_in=cap_in, cap_out=cap_out, win_left=mask.left,
                     win_right=mask.right, cu_q=b.slot(3), cu_k=b.slot(4), max_q=max_q, max_k=max_k,
                     fault=_arrays.wrap(_faults.record(device), "fault record"), **_dropout_args(0.0, None))
        else:
            _launch_forward_sm80(b, configs, qa, (qs, ks, vs), os_, out, lse, sinks, mask, scale, grid_rows=max_q,
                                 batches=docs, sq=total_q, sk=total_k, hkv=hkv, device=device,
                                 varlen=(b.slot(3), b.slot(4), max_q, max_k), dropout=(dropout_p, rng))
    return b.plan(device)
