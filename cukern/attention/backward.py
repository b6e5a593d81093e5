"""The backward's array functions and launch plans, dense and packed documents."""
from __future__ import annotations

from .. import _arrays, _attention_mask, _checks, _faults, _kernels
from .._arrays import DeviceArray
from .._kernels import MapSlot
from .._plans import Builder, Plan, PlanCache
from . import configs as _cfg
from .checks import (_check_like_q, _check_lse, _check_qkv, _check_varlen, _dropout_args, _dropout_p, _dropout_rng,
                     _like, _read, _scale, _strides3, _tma_readable)
from .configs import LOG2E, Configs
from .forward import _check_sinks, _mask_key, _offsets, _qkv, _rng_slot, _sinks, _varlen_cacheable

# ---- backward -------------------------------------------------------------------------------

_BWD = PlanCache()


def attention_backward(dout, q, k, v, out, lse, *, causal=False, softmax_scale=None, deterministic=False,
                       window=(-1, -1), softcap=0.0, sinks=None, dropout_p=0.0, dropout_rng=None):
    """Gradients of ``attention``: ``(dq, dk, dv)``.

    Args:
        dout: (B, Sq, H, Dv) gradient of ``out``, q's dtype, any batch/sequence/head strides
            (Dv: v's head size).
        q, k, v, causal, softmax_scale, window, softcap, sinks, dropout_p, dropout_rng: as given
            to the forward (dropout_rng holding the same seed and offset: the same weights dropped).
        out, lse: the forward's output and log-sum-exp (``return_lse=True``; with sinks, the
            lse that includes them, as the forward returns it).
        deterministic: False (default, as FlashAttention): dQ is summed over key tiles with
            float32 atomics (5 matrix products a tile pair; the last bits of dq may differ run
            to run). True: every gradient has the same bits on every call. On Hopper (head
            dims 64 and 128) dQ's adds into each query tile take turns in a fixed order of the
            key blocks; elsewhere (and for d64 with the softcap, packed d64 documents without a
            mask, or an unmasked call whose key blocks outnumber half the SMs) dQ has its own pass
            (7 products). dk and dv are deterministic either way (a fixed-order sum over query
            tiles and heads).

    Returns:
        dq (B, Sq, H, D), dk (B, Sk, Hkv, D) and dv (B, Sk, Hkv, Dv) — dk and dv summed over the query heads
        that share each K/V head — of q's dtype, each laid out like its input (q, k, v) when
        that input is dense, else contiguous. With ``sinks``, ``(dq, dk, dv, dsinks)``: dsinks (H,)
        float32, summed over the batch and queries in a fixed order (the same bits every call).
    """
    return _attention_backward(dout, q, k, v, out, lse, causal, softmax_scale, deterministic, _cfg.CONFIGS, window,
                               softcap, sinks, dropout_p, dropout_rng)


def _bwd_arrays(dout, q, k, v, out, lse) -> list:
    return [_arrays.as_device_array(dout, "dout", _arrays.FLOATS), *_qkv(q, k, v),
            _arrays.as_device_array(out, "out", _arrays.FLOATS), _arrays.as_device_array(lse, "lse", ("float32",))]


def _gradients(plan: Plan, bufs, sinks) -> tuple:
    grads = (plan.out(bufs, "dq"), plan.out(bufs, "dk"), plan.out(bufs, "dv"))
    return grads if sinks is None else (*grads, plan.out(bufs, "dsinks"))


def _attention_backward(dout, q, k, v, out, lse, causal, softmax_scale, deterministic, configs: Configs,
                        window=(-1, -1), softcap=0.0, sinks=None, dropout_p=0.0, dropout_rng=None):
    p = _dropout_p(dropout_p, softcap)
    arrays = [*_bwd_arrays(dout, q, k, v, out, lse), *_sinks(sinks), *_dropout_rng(p, dropout_rng)]
    mkey = _mask_key(window, softcap)
    plain = (softmax_scale is None or type(softmax_scale) in (float, int)) and mkey is not None
    key = (bool(causal), softmax_scale, bool(deterministic), configs, mkey, p, sinks is None, *(a.key for a in arrays))
    plan = _BWD.plan(key if plain else None, _plan_backward, arrays, bool(causal), softmax_scale, bool(deterministic),
                     configs, window, softcap, None, sinks is not None, p)
    return _gradients(plan, plan(arrays), sinks)


def attention_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                              causal=False, softmax_scale=None, deterministic=False, window=(-1, -1), softcap=0.0,
                              sinks=None, dropout_p=0.0, dropout_rng=None):
    """Gradients of ``attention_varlen``: ``(dq, dk, dv)`` of the packed documents.

    Args:
        dout: (total_q, H, Dv) gradient of ``out``.
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale,
            window, softcap, sinks, dropout_p, dropout_rng: as given to the forward.
        out, lse: the forward's output and log-sum-exp (H, total_q) (``return_lse=True``).
        deterministic: as for ``attention_backward``.

    Bad offsets are reported by ``cukern.check_errors()`` as for the forward; the gradients of
    such a call are not valid (a bad document's are not written).

    Returns:
        dq (total_q, H, D), dk (total_k, Hkv, D) and dv (total_k, Hkv, Dv) of q's dtype; with ``sinks`` also
        dsinks (H,) float32.
    """
    p = _dropout_p(dropout_p, softcap)
    arrays = [*_bwd_arrays(dout, q, k, v, out, lse), *_offsets(cu_seqlens_q, cu_seqlens_k), *_sinks(sinks),
              *_dropout_rng(p, dropout_rng)]
    mkey = _mask_key(window, softcap)
    plain = _varlen_cacheable(softmax_scale, mkey, max_seqlen_q, max_seqlen_k)
    key = (bool(causal), softmax_scale, bool(deterministic), _cfg.CONFIGS, mkey, max_seqlen_q, max_seqlen_k, p,
           sinks is None, *(a.key for a in arrays))
    plan = _BWD_VARLEN.plan(key if plain else None, _plan_backward, arrays, bool(causal), softmax_scale,
                            bool(deterministic), _cfg.CONFIGS, window, softcap, (max_seqlen_q, max_seqlen_k),
                            sinks is not None, p)
    return _gradients(plan, plan(arrays), sinks)


_BWD_VARLEN = PlanCache()


def _plan_backward(arrays, causal, softmax_scale, deterministic, configs: Configs, window=(-1, -1), softcap=0.0,
                   varlen: tuple | None = None, has_sinks: bool = False, dropout_p: float = 0.0) -> Plan:
    """The backward's plan; ``varlen`` = (max_seqlen_q, max_seqlen_k) for packed documents,
    whose offsets are arrays 6 and 7 (the kernels then see one batch of all the tokens); the
    sinks, where given, next; the dropout draw, where dropout_p > 0, last."""
    sinks_at = (8 if varlen else 6) if has_sinks else None
    da, qa, ka, va, oa, la = arrays[:6]
    if varlen is None:
        _check_qkv(qa, ka, va, configs.bwd_head_dims, " by the backward", configs.value_dims)
        _check_like_q(da, qa, (*qa.shape[:-1], va.shape[-1]))
        _check_like_q(oa, qa, (*qa.shape[:-1], va.shape[-1]))
        _check_lse(la, qa)
        batch, sq, h, d = qa.shape
        sk, hkv = ka.shape[1], ka.shape[2]
        groups, rows_q, rows_k = batch, sq, sk
        mask = _attention_mask.mask_of(causal, window, softcap, sq, sk)
        strides_of = _read
        like = _like
    else:
        rows_q, rows_k = _check_varlen(qa, ka, va, arrays[6], arrays[7], *varlen, configs.bwd_head_dims,
                                       " by the backward", configs.value_dims)
        _checks.like(da, qa, (*qa.shape[:-1], va.shape[-1]))
        _checks.like(oa, qa, (*qa.shape[:-1], va.shape[-1]))
        if la.shape != (qa.shape[1], qa.shape[0]):
            raise ValueError(f"lse: shape {la.shape} does not match (heads, total_q) = {(qa.shape[1], qa.shape[0])}")
        batch, (sq, h, d), (sk, hkv) = 1, qa.shape, ka.shape[:2]
        groups = arrays[6].shape[0] - 1
        mask = _attention_mask.mask_of(causal, window, softcap, rows_q, rows_k)

        def strides_of(b, i, a):   # (packed: batch stride 0)
            return (0, *_read(b, i, a))

        def like(a, copied):
            return (0, *_like(a, copied))
    scale = _scale(softmax_scale, d)
    dv_ = va.shape[-1]   # (the value head size)
    device = _arrays.same_device(*arrays)
    b = Builder(arrays)
    ds, qs, ks, vs, os_ = (strides_of(b, i, a) for i, a in enumerate(arrays[:5]))
    for i in range(5, len(arrays)):
        if not _arrays.is_contiguous(arrays[i]):
            b.fix(i, DeviceArray.contiguous)
    copied = {i for i, _ in b.fixes}
    dq = b.alloc(qa.shape, qa.dtype, "contiguous" if 1 in copied else "like", 1, name="dq")
    dk = b.alloc(ka.shape, qa.dtype, "contiguous" if 2 in copied else "like", 2, name="dk")
    dv = b.alloc(va.shape, qa.dtype, "contiguous" if 3 in copied else "like", 3, name="dv")
    sinks = _check_sinks(arrays, sinks_at, h, b)
    rng = _rng_slot(arrays, dropout_p, b)
    dsinks = None if sinks is None else b.alloc((h,), "float32", name="dsinks")
    if batch * h * sq == 0 or sk == 0:   # (no key: O is 0, so is every row's correction, so dsinks)
        b.fill(0.0, dq, dk, dv, dsinks)
        return b.plan(device, first=1)
    dqs, dks, dvs = like(qa, 1 in copied), like(ka, 2 in copied), like(va, 3 in copied)
    dsum = b.alloc((batch, h, sq), "float32")
    # (dropout on Hopper: dense, without the softcap, where use_sm90_dropout)
    hopper = (configs.use_sm90_bwd and d in dict(configs.bwd_sm90) and dv_ == d
              and (not dropout_p or (configs.use_sm90_dropout and varlen is None
                                     and d in dict(configs.bwd_sm90_dropout)))
              and _kernels.compute_capability(device) == (9, 0)
              and all(i in copied or _tma_readable(a) for i, a in enumerate(arrays[:4])))
    cfg_sm90 = configs.sm90_backward(d, bool(mask.softcap), bool(dropout_p)) if hopper else None
    # head dim 256 and MLA's 192/128 on Hopper: kernels of their own (d256's splitting a step's
    # products between the warpgroups, MLA's giving each warpgroup keys of its own; dense; dQ by
    # TMA reduce-adds, deterministic in turns)
    cfg_wide = (configs.bwd_sm90_d256 if configs.use_sm90_bwd_d256 and d == 256 and dv_ == d else
                configs.bwd_sm90_mla if configs.use_sm90_bwd_mla and (d, dv_) == (192, 128) else None)
    wide = (cfg_wide is not None and not dropout_p
            and varlen is None and _kernels.compute_capability(device) == (9, 0)
            and all(i in copied or _tma_readable(a) for i, a in enumerate(arrays[:4])))
    kblocks = (-(-rows_k // cfg_sm90.block_keys) if hopper else -(-rows_k // cfg_wide.block_keys) if wide else 0)
    pairs = groups * hkv
    # deterministic on Hopper: dQ's adds in turns where the config allows (resident: one block
    # an SM, counted as half the SMs: kernels running beside this one, NCCL's under DDP, hold
    # some, and an unmasked group's blocks wait on each other until all are resident)
    resident = _kernels.sm_count(device) // 2 if deterministic and (hopper or wide) else 0
    ordered = bool(deterministic and hopper and cfg_sm90.orders(d, mask.kind, kblocks, resident, varlen is not None))
    if wide and deterministic:   # (in turns, else the sm_80 kernels' dQ pass)
        wide = ordered = cfg_wide.orders(mask.kind, kblocks, resident)
    # dQ's float32 partial sums (B, Sq, H, D), zeroed by the Dsum kernel, then added to by
    # atomics (or TMA reduce-add); deterministic, unless in turns: none (attention_bwd_dq).
    dq_accum = b.alloc((batch, sq, h, d), "float32") if ordered or not deterministic else None
    tail = dict(H=h, Hkv=hkv, Sq=sq, Sk=sk, scale=scale, scale_log2=scale * LOG2E)
    cap_in, cap_out = _attention_mask.softcap_log2(mask, scale)
    masked = dict(win_left=mask.left, win_right=mask.right, cap_in=cap_in, cap_out=cap_out,
                  cu_q=b.slot(6) if varlen else None, cu_k=b.slot(7) if varlen else None,
                  max_q=rows_q if varlen else 0, max_k=rows_k if varlen else 0,
                  fault=_arrays.wrap(_faults.record(device), "fault record") if varlen else None)
    strided = {**{f"q_{n}": s for n, s in _strides3(qs).items()}, **{f"k_{n}": s for n, s in _strides3(ks).items()},
               **{f"v_{n}": s for n, s in _strides3(vs).items()}, **{f"d_{n}": s for n, s in _strides3(ds).items()}}
    out_strides = {**{f"dk_{n}": s for n, s in _strides3(dks).items()},
                   **{f"dv_{n}": s for n, s in _strides3(dvs).items()}}
    # The Hopper kernel loads lse * log2(e) and Dsum by TMA, a query tile's [2][rows] at once.
    tile = cfg_sm90.block_rows if hopper else cfg_wide.block_rows if wide else 0
    # (packed documents: each document's tiles apart, document d's from q0 / tile + d)
    tiles = -(-sq // tile) + (groups if varlen else 0) if hopper or wide else 0
    rows = None if not (hopper or wide) else b.alloc((batch, h, tiles, 2, tile), "float32")
    # (ordered: a turn counter a query tile of `rows`, from zero)
    turns = b.alloc((batch, h, tiles), "int32") if ordered else None
    if turns is not None:
        b.fill(0, turns)
    threads = configs.dot_threads
    k = _kernels.kernel(configs.dot(qa.dtype, d, dv_), device)
    b.launch(k, min(-(-(batch * sq * h * _dot_lanes(dv_)) // threads), 65535), dout=b.slot(0), out=b.slot(4),
             **{f"d_{n}": s for n, s in _strides3(ds).items()}, **{f"o_{n}": s for n, s in _strides3(os_).items()},
             dsum=dsum, lse=b.slot(5), rows=None if varlen else rows, tile=tile, dq_accum=dq_accum, B=batch, Sq=sq,
             H=h)
    if sinks is not None:
        b.launch(_kernels.kernel(configs.sink(), device), (h,), sinks=sinks, lse=b.slot(5), dsum=dsum, dsinks=dsinks,
                 B=batch, H=h, Sq=sq)
    if hopper and varlen:
        b.launch(_kernels.kernel(cfg_sm90.rows_instance(), device), (-(-rows_q // tile), groups * h), lse=b.slot(5),
                 dsum=dsum, rows=rows, cu_q=b.slot(6), H=h, total_q=sq)
    if hopper:
        # dK, dV (and dQ's float32 partial sums, by TMA reduce-add) by TMA and wgmma; dQ's
        # conversion or pass as below. (deterministic and not ordered: no dQ here, the dq_map is unused)
        cfg = cfg_sm90
        k = _kernels.kernel(cfg.instance(qa.dtype, d, mask.kind, deterministic, bool(mask.softcap), varlen is not None,
                                         ordered, bool(dropout_p)), device)
        qbox, kbox = (1, cfg.block_rows, 1, 64), (1, cfg.block_keys, 1, 64)
        dq_map = bytes(128) if dq_accum is None else MapSlot(dq_accum.index, (1, 16, 1, 32))
        if cfg.persistent_for(mask.kind, deterministic, varlen is not None):   # (one block an SM walks the units)
            grid = (min(kblocks * pairs, configs.bwd_sm90_blocks or _kernels.sm_count(device)), 1)
        elif varlen is None and mask.kind in (1, 2):   # (causal or a window: see the kernel)
            per = min(pairs, max(1, configs.bwd_l2_section_bytes // (h // hkv * rows_q * d * 8)))
            grid = (per, kblocks, -(-pairs // per))
        else:
            grid = (kblocks, pairs)
        b.launch(k, grid, q_map=MapSlot(1, qbox), k_map=MapSlot(2, kbox),
                 v_map=MapSlot(3, kbox), do_map=MapSlot(0, qbox), dq_map=dq_map, rows=rows, dk=dk, dv=dv,
                 **out_strides, **tail, win_left=mask.left, win_right=mask.right, cap_in=cap_in, cap_out=cap_out,
                 **{n: masked[n] for n in ("cu_q", "cu_k", "max_q", "max_k", "fault")},
                 groups=pairs, turns=turns, **_dropout_args(dropout_p, rng))
    elif wide:
        box, kbox = (1, cfg_wide.block_rows, 1, 64), (1, cfg_wide.block_keys, 1, 64)
        b.launch(_kernels.kernel(cfg_wide.instance(qa.dtype, mask.kind, bool(mask.softcap), ordered), device),
                 (kblocks, pairs), q_map=MapSlot(1, box), k_map=MapSlot(2, kbox),
                 v_map=MapSlot(3, kbox), do_map=MapSlot(0, box), dq_map=MapSlot(dq_accum.index, (1, 16, 1, 32)),
                 rows=rows, dk=dk, dv=dv, turns=turns,
                 **out_strides, **tail, win_left=mask.left, win_right=mask.right, cap_in=cap_in, cap_out=cap_out,
                 **{n: masked[n] for n in ("cu_q", "cu_k", "max_q", "max_k", "fault")})
    else:
        dropping = bool(dropout_p)
        cfg = configs.sm80("bwd", d, dropping)
        k = _kernels.kernel(cfg.instance(qa.dtype, d, mask.kind, deterministic, bool(mask.softcap), dropping, dv_),
                            device)
        b.launch(k, (-(-rows_k // cfg.bn), groups * hkv), q=b.slot(1), k=b.slot(2), v=b.slot(3), dout=b.slot(0),
                 lse=b.slot(5), dsum=dsum, dk=dk, dv=dv, dq_accum=dq_accum, **strided, **out_strides, **tail,
                 **masked, **_dropout_args(dropout_p, rng))
    if dq_accum is None:
        qcfg = configs.sm80("dq", d, bool(dropout_p))
        k = _kernels.kernel(qcfg.instance(qa.dtype, d, mask.kind, bool(mask.softcap), bool(dropout_p), dv_), device)
        b.launch(k, (-(-rows_q // (16 * qcfg.warps)), groups * h), q=b.slot(1), k=b.slot(2), v=b.slot(3),
                 dout=b.slot(0), lse=b.slot(5), dsum=dsum, dq=dq, **strided,
                 **{f"dq_{n}": s for n, s in _strides3(dqs).items()}, **tail, **masked,
                 **_dropout_args(dropout_p, rng))
    else:
        k = _kernels.kernel(configs.convert(qa.dtype, d), device)
        n8 = batch * sq * h * d // 8
        b.launch(k, min(-(-n8 // threads), 65535 * 16), acc=dq_accum, dq=dq, B=batch, Sq=sq, H=h,
                 **{f"dq_{n}": s for n, s in _strides3(dqs).items()}, scale=scale)
    return b.plan(device, first=1)


def _dot_lanes(d: int) -> int:
    """attention_bwd_dot's lanes a row: the largest power of two up to 16 that divides d / 8."""
    v = d // 8
    return next(n for n in (16, 8, 4, 2, 1) if v % n == 0)
