"""Fused attention on tensor cores (kernels: cuda_src/attention_fwd.cu, cuda_src/attention_bwd.cu,
and on sm_90 cuda_src/attention_fwd_sm90.cu, cuda_src/attention_bwd_sm90.cu).

Layout as flash-attention: q (batch, seqlen_q, heads, head_dim), k and v (batch, seqlen_k,
kv_heads, head_dim) with kv_heads dividing heads (grouped-query and multi-query attention
read the shared K/V heads in place). Every array is read and written through its batch,
sequence and head strides (unit stride over head_dim), so PyTorch's SDPA layout (B, H, S, D),
its transpose of a (B, S, H, D) projection, and packed qkv views need no copy; outputs take
the stride order of the input they belong to (out and dq like q, dk like k, dv like v) when
that input is dense, else they are contiguous. dtypes: float16, bfloat16 (the tensor-core
types); softmax and accumulation in float32. The log-sum-exp is float32 (batch, heads, seqlen_q).

The whole Python side of the family: configurations, array functions with launch plans, the
NumPy references, benchmark cases and PyTorch bindings (``FAMILY`` at the end).
"""
from __future__ import annotations

import functools
import math
import os
import dataclasses
from dataclasses import dataclass

import numpy as np

from . import _arrays, _attention_mask, _checks, _faults, _kernels
from ._bench_cases import Case, TorchCase, elements_bytes, generator, randn
from ._arrays import DeviceArray
from ._attention_mask import Mask
from ._family import DropIn, Family, TorchOp
from ._kernels import Instance, MapSlot
from ._plans import Builder, Plan, PlanCache

__all__ = ["attention", "attention_backward"]

SOURCE = "attention_fwd.cu"
SM90_SOURCE = "attention_fwd_sm90.cu"
BWD_SOURCE = "attention_bwd.cu"
SM90_BWD_SOURCE = "attention_bwd_sm90.cu"
DTYPES = ("float16", "bfloat16")
LOG2E = 1.4426950408889634


def row_elems(d: int) -> int:
    """Shared-memory row length of the kernels (row_elems in cuda_src/common/attn_tile.cuh):
    head_dim padded to a multiple of 64 elements."""
    return 64 if d <= 64 else -(-d // 64) * 64


def _ctype(dtype: str) -> str:
    return _arrays.DTYPES[dtype][0]


def _b(flag: bool) -> str:
    return "true" if flag else "false"


# ---- kernel configurations --------------------------------------------------------------------

@dataclass(frozen=True)
class FwdConfig:
    """attention_fwd: ``warps`` a block, ``mt`` 16-row m-tiles a warp, ``bn`` keys a staged
    tile, ``bnc`` keys a compute sub-tile, ``qreg``: Q fragments kept in registers."""
    warps: int
    mt: int
    bn: int
    bnc: int
    qreg: bool

    @property
    def block_rows(self) -> int:
        return 16 * self.mt * self.warps

    def smem(self, d: int, itemsize: int) -> int:
        """Q, two K and two V tiles, and 1 KB to align the tiles."""
        return (self.block_rows + 4 * self.bn) * row_elems(d) * itemsize + 1024

    def instance(self, dtype: str, d: int, mask: int, softcap: bool = False) -> Instance:
        """``mask``: Mask.kind (a bool: causal or not)."""
        smem = self.smem(d, _arrays.DTYPES[dtype][1])
        return Instance(SOURCE, f"attention_fwd<{_ctype(dtype)}, {d}, {self.warps}, {self.mt}, {self.bn}, "
                                f"{self.bnc}, {_b(self.qreg)}, {int(mask)}, {_b(softcap)}, {smem}>", 32 * self.warps,
                        smem)


SM90_MAX_SMEM = 227 * 1024   # (a block's opt-in shared memory on H100 and H200)
SM90_SMEM_PER_SM = 228 * 1024   # (an SM's, of which each block also takes 1 KB)


@dataclass(frozen=True)
class Sm90FwdConfig:
    """attention_fwd_sm90 (TMA + wgmma, sm_90a): ``warpgroups`` (2 or 3) of 64 query rows a
    block, ``bn`` keys a tile, a ring of ``stages`` K and V tiles in shared memory. Scheduling:
    ``producer``, one more warpgroup issues the loads (setmaxnreg: 240 registers for two others,
    160 for three); ``pingpong``, two warpgroups take turns issuing Q K^T; ``overlap``, a tile's
    softmax runs while the tensor cores finish the previous tile's P V (FlashAttention-3's
    intra-warpgroup overlap); ``persistent``, one block an SM walks the work tiles (with a
    producer and the overlap; causal tiles, which cost different amounts, are handed out by an
    atomic counter, the longest first; O staged in the last K tile, or in a buffer of its own
    where that is shorter than the block's rows); ``blocks_per_sm`` 2, two blocks of two
    warpgroups share an SM, so that one block's softmax and loads fill the other's gaps: without
    a producer every thread has 128 registers (the first thread of the second warpgroup, which
    runs behind the first with the turns, refills the ring); with one, the launch gives 80 and
    the consumers grow to 104, which holds key tiles of at most 64."""
    bn: int
    stages: int = 2
    producer: bool = False
    pingpong: bool = False
    overlap: bool = False
    warpgroups: int = 2
    persistent: bool = False
    blocks_per_sm: int = 1

    @property
    def block_rows(self) -> int:
        return 64 * self.warpgroups

    @property
    def threads(self) -> int:
        return 128 * (self.warpgroups + self.producer)

    @property
    def own_o_buffer(self) -> bool:
        """Persistent with key tiles shorter than the block's rows: O is staged in a buffer of
        its own (it does not fit the last K tile)."""
        return self.persistent and self.bn < self.block_rows

    def smem(self, d: int) -> int:
        """Q, the ring of K and V tiles (and O's own buffer, if any), 128-byte rows (64 head-dim
        columns a box), and 1 KB to align them (16-bit elements)."""
        return ((2 if self.own_o_buffer else 1) * self.block_rows + 2 * self.stages * self.bn) * d * 2 + 1024

    @property
    def static_smem(self) -> int:
        """The kernel's static shared memory: its barriers (two, and two a stage), the overlap's
        store sink (a word a computing thread), two work tile numbers and 8 bytes of padding."""
        return 8 * (2 + 2 * self.stages) + 4 * (128 * self.warpgroups if self.overlap else 1) + 16

    def instance(self, dtype: str, d: int, mask: int, softcap: bool = False, varlen: bool = False) -> Instance:
        """``mask``: Mask.kind (a bool: causal or not); ``varlen``: packed documents (not persistent)."""
        if varlen and self.persistent:
            raise ValueError("varlen: packed documents take a config that is not persistent")
        if self.warpgroups == 3 and d > 128:
            raise ValueError(f"warpgroups=3 takes head dims up to 128, not {d}: the O accumulators of "
                             "64 rows x d do not fit a thread's share of the registers "
                             "(128 with a producer, 168 without)")
        if self.persistent and not (self.producer and self.overlap):
            raise ValueError(f"persistent takes a producer and the overlap (producer={self.producer}, "
                             f"overlap={self.overlap})")
        if self.blocks_per_sm not in (1, 2) or (self.blocks_per_sm == 2 and not (
                self.warpgroups == 2 and not self.persistent)):
            raise ValueError(f"blocks_per_sm={self.blocks_per_sm}: 1, or 2 with two warpgroups, not "
                             f"persistent (warpgroups={self.warpgroups}, persistent={self.persistent})")
        if self.blocks_per_sm == 2 and self.producer and self.bn > 64:
            raise ValueError(f"blocks_per_sm=2 with a producer takes key tiles of at most 64 keys, not "
                             f"bn={self.bn}: its consumers have 104 registers (ptxas fails on the S "
                             "accumulators of wider tiles)")
        smem = self.smem(d)
        if self.blocks_per_sm > 1 and self.blocks_per_sm * (smem + self.static_smem + 1024) > SM90_SMEM_PER_SM:
            raise ValueError(f"this config takes {smem} bytes of shared memory at head dim {d} and "
                             f"{self.static_smem} of static; "
                             f"{self.blocks_per_sm} blocks of it do not fit an SM's {SM90_SMEM_PER_SM}")
        if smem > SM90_MAX_SMEM:
            raise ValueError(f"this config takes {smem} bytes of shared memory at head dim {d} (bn={self.bn}, "
                             f"stages={self.stages}{', O in a buffer of its own' if self.own_o_buffer else ''}); "
                             f"a block on sm_90 may have {SM90_MAX_SMEM}")
        return Instance(SM90_SOURCE, f"attention_fwd_sm90<{_ctype(dtype)}, {d}, {self.bn}, {self.stages}, "
                        f"{self.warpgroups}, {int(mask)}, {_b(softcap)}, {_b(self.producer)}, {_b(self.pingpong)}, "
                        f"{_b(self.overlap)}, {_b(self.persistent)}, {self.blocks_per_sm}, {smem}, {_b(varlen)}>",
                        self.threads, smem, "sm_90a")


@dataclass(frozen=True)
class BwdConfig:
    """attention_bwd_dkdv, FlashAttention-2's backward block: ``bm`` queries a step, ``bn`` keys
    a block, ``warps``, and the warps over queries in S = Q K^T (``wm_s``), over keys in dK/dV
    (``wn_kv``) and over queries in dQ (``wm_q``)."""
    bm: int
    bn: int
    warps: int
    wm_s: int
    wn_kv: int
    wm_q: int

    def smem(self, d: int, itemsize: int) -> int:
        """K, V, Q and dO (double-buffered), P and dS, lse and Dsum (double-buffered), and
        1 KB to align the tiles."""
        return ((2 * self.bn + 4 * self.bm) * row_elems(d) * itemsize + 2 * self.bm * row_elems(self.bn) * itemsize
                + 4 * self.bm * 4 + 1024)

    def instance(self, dtype: str, d: int, mask: int, deterministic: bool, softcap: bool = False) -> Instance:
        """``mask``: Mask.kind (a bool: causal or not)."""
        smem = self.smem(d, _arrays.DTYPES[dtype][1])
        return Instance(BWD_SOURCE, f"attention_bwd_dkdv<{_ctype(dtype)}, {d}, {self.bm}, {self.bn}, {self.warps}, "
                                    f"{self.wm_s}, {self.wn_kv}, {self.wm_q}, {int(mask)}, {_b(softcap)}, "
                                    f"{_b(not deterministic)}, {smem}>", 32 * self.warps, smem)


@dataclass(frozen=True)
class Sm90BwdConfig:
    """attention_bwd_sm90 (TMA + wgmma, sm_90a): two warpgroups of 64 keys a block, query tiles
    of ``block_rows`` (64 or 128) in a ring of ``stages`` Q and dO buffers. ``producer``: a third
    warpgroup issues the loads and the two others get 240 registers (setmaxnreg), with dQ by
    atomics only (deterministic=False; the deterministic instance would spill). Replaces
    attention_bwd_dkdv. ``persistent``: without a mask (dense, dQ by atomics, with a producer),
    one block an SM walks the (batch, kv head, key block) units, a unit's first loads issued as
    the one before ends."""
    block_rows: int = 64
    stages: int = 2
    producer: bool = False
    persistent: bool = False
    block_keys = 128

    def persistent_for(self, mask: int, deterministic: bool, varlen: bool) -> bool:
        """Whether the instance for these arguments walks units (see the class)."""
        return self.persistent and self.threads(deterministic) == 384 and int(mask) == 0 and not varlen

    def threads(self, deterministic: bool) -> int:
        return 384 if self.producer and not deterministic else 256

    def smem(self, d: int, deterministic: bool) -> int:
        """K, V, the Q and dO rings (128-byte rows, 64 head-dim columns a box); unless
        deterministic, two dS^T buffers of 128 keys x 64 queries and dQ's staging boxes (16 rows
        x 32 floats, two a warp); a ring of lse_log2 and Dsum rows; and 1 KB to align them."""
        ds = 0 if deterministic else 2 * self.block_rows // 64 * self.block_keys * 128
        dq = 0 if deterministic else 8 * 2 * 16 * 128
        rows = self.stages * 2 * self.block_rows * 4
        return (2 * self.block_keys + 2 * self.stages * self.block_rows) * d * 2 + ds + dq + rows + 1024

    def instance(self, dtype: str, d: int, mask: int, deterministic: bool, softcap: bool = False,
                 varlen: bool = False) -> Instance:
        """``mask``: Mask.kind (a bool: causal or not); ``varlen``: packed documents."""
        smem = self.smem(d, deterministic)
        producer = self.threads(deterministic) == 384
        return Instance(SM90_BWD_SOURCE, f"attention_bwd_sm90<{_ctype(dtype)}, {d}, {self.block_rows}, {self.stages}, "
                        f"{int(mask)}, {_b(softcap)}, {_b(not deterministic)}, {_b(producer)}, {smem}, "
                        f"{_b(varlen)}, {_b(self.persistent_for(mask, deterministic, varlen))}>",
                        self.threads(deterministic), smem, "sm_90a")

    def rows_instance(self) -> Instance:
        """attention_bwd_rows_varlen: lse and Dsum as this config's query tiles of packed documents."""
        return Instance(SM90_BWD_SOURCE, f"attention_bwd_rows_varlen<{self.block_rows}>", self.block_rows, 0,
                        "sm_90a")


@dataclass(frozen=True)
class DqConfig:
    """attention_bwd_dq (deterministic=True): ``warps`` of 16 queries, ``bn`` keys a tile."""
    warps: int
    bn: int

    def smem(self, d: int, itemsize: int) -> int:
        return (2 * 16 * self.warps + 4 * self.bn) * row_elems(d) * itemsize

    def instance(self, dtype: str, d: int, mask: int, softcap: bool = False) -> Instance:
        """``mask``: Mask.kind (a bool: causal or not)."""
        smem = self.smem(d, _arrays.DTYPES[dtype][1])
        return Instance(BWD_SOURCE, f"attention_bwd_dq<{_ctype(dtype)}, {d}, {self.warps}, {self.bn}, {int(mask)}, "
                                    f"{_b(softcap)}, {smem}>", 32 * self.warps, smem)


@dataclass(frozen=True, eq=False)   # (hashed by identity: plans are keyed by it, on every call)
class Configs:
    """Configurations by head dim (measured: docs/notes-attention.md). ``dot_threads``: the
    Dsum and dQ-conversion kernels' blocks."""
    fwd: tuple[tuple[int, FwdConfig], ...]
    bwd: tuple[tuple[int, BwdConfig], ...]
    dq: tuple[tuple[int, DqConfig], ...]
    dot_threads: int = 256
    # The forward on sm_90 (H100, H200) by TMA and wgmma, by head dim: key tiles as measured
    # fastest (tools/tune_attention.py; the figures: docs/notes-attention.md, the Hopper path).
    # d64, every mask: two blocks an SM of 128-key tiles, no producer (128 registers a thread),
    # two stages (three do not fit two blocks' shared memory); 64-key tiles with a producer issue
    # more instructions.
    fwd_sm90: tuple[tuple[int, Sm90FwdConfig], ...] = (
        (64, Sm90FwdConfig(128, 2, pingpong=True, blocks_per_sm=2)),
        (128, Sm90FwdConfig(128, 3, producer=True, pingpong=True, overlap=True, persistent=True)),
        (256, Sm90FwdConfig(64, 2, producer=True, pingpong=True)))
    # ... and where the forward without a causal mask measured faster with another config (d128:
    # the overlap without the warpgroups' turns, which the causal forward gains 3-5% by).
    fwd_sm90_full: tuple[tuple[int, Sm90FwdConfig], ...] = (
        (128, Sm90FwdConfig(128, 3, producer=True, overlap=True, persistent=True)),)
    # ... and with the softcap, where it differs (d64: the 128-key tiles spill with the softcap's
    # tanh, and measured no faster than 64-key tiles with a producer)
    fwd_sm90_softcap: tuple[tuple[int, Sm90FwdConfig], ...] = (
        (64, Sm90FwdConfig(64, 3, producer=True, pingpong=True, blocks_per_sm=2)),)
    # ... and for packed documents (one block a work tile: not persistent; every mask)
    fwd_sm90_varlen: tuple[tuple[int, Sm90FwdConfig], ...] = (
        (64, Sm90FwdConfig(128, 2, pingpong=True, blocks_per_sm=2)),
        (128, Sm90FwdConfig(128, 3, producer=True, pingpong=True, overlap=True)))
    use_sm90: bool = True
    # The persistent Hopper forward's grid (Sm90FwdConfig.persistent): blocks, 0 for one an SM
    # (tests set a few, so that every block walks many work tiles)
    fwd_sm90_blocks: int = 0
    # Causal Hopper forward tiles run the longest first within sections of (batch, head) pairs
    # whose K and V (16-bit) take this much: they stay in L2 (50 MB on H100) while read.
    l2_section_bytes: int = 32 << 20
    # Causal (and windowed) Hopper backward blocks run the longest first within sections of
    # (batch, kv head) groups whose Q, dO and dQ's float32 sums (8 bytes a query element) fill
    # this many bytes.
    bwd_l2_section_bytes: int = 32 << 20
    # The backward's dK/dV (and dQ-atomic) kernel on sm_90 by TMA and wgmma, by head dim: query
    # tiles as measured fastest, persistent (the figures: docs/notes-attention.md, the Hopper
    # backward).
    bwd_sm90: tuple[tuple[int, Sm90BwdConfig], ...] = ((64, Sm90BwdConfig(128, producer=True, persistent=True)),
                                                       (128, Sm90BwdConfig(64, producer=True, persistent=True)))
    # ... with the softcap (its P^T and dS^T pass holds more: 128-row tiles at d64 spill)
    bwd_sm90_softcap: tuple[tuple[int, Sm90BwdConfig], ...] = ((64, Sm90BwdConfig(64, producer=True)),
                                                               (128, Sm90BwdConfig(64, producer=True)))
    # (packed documents take the same configs: their span is kept in uniform registers)
    use_sm90_bwd: bool = True
    # The persistent backward's grid (Sm90BwdConfig.persistent): blocks, 0 for one an SM (tests
    # set a few, so that every block walks many units)
    bwd_sm90_blocks: int = 0

    @property
    def head_dims(self) -> tuple[int, ...]:
        return tuple(d for d, _ in self.fwd)

    @property
    def bwd_head_dims(self) -> tuple[int, ...]:
        return tuple(d for d, _ in self.bwd)

    def get(self, which: str, d: int):
        return dict(getattr(self, which))[d]

    def sm90_forward(self, d: int, causal: bool, softcap: bool = False) -> Sm90FwdConfig:
        """The Hopper forward's config for head dim ``d``: ``fwd_sm90_softcap``'s with the softcap,
        else ``fwd_sm90_full``'s when not causal, where they have one; else ``fwd_sm90``'s."""
        return ((softcap and dict(self.fwd_sm90_softcap).get(d)) or (not causal and dict(self.fwd_sm90_full).get(d))
                or self.get("fwd_sm90", d))

    def replace(self, which: str, d: int, config) -> "Configs":
        """A new Configs with ``config`` for head dim ``d`` in table ``which`` (the tuning
        tools try candidates this way; the shipped CONFIGS never changes)."""
        import dataclasses

        table = tuple((k, config if k == d else c) for k, c in getattr(self, which))
        return dataclasses.replace(self, **{which: table})

    def dot(self, dtype: str, d: int) -> Instance:
        return Instance(BWD_SOURCE, f"attention_bwd_dot<{_ctype(dtype)}, {d}>", self.dot_threads)

    def convert(self, dtype: str, d: int) -> Instance:
        return Instance(BWD_SOURCE, f"attention_bwd_dq_convert<{_ctype(dtype)}, {d}>", self.dot_threads)


# CUKERN_ATTENTION_SM80=1 (read at import): Hopper runs the sm_80 kernels too, forward and backward
# (to compare the two paths, or to rule the Hopper kernels out when something looks wrong).
SM80_ONLY = os.environ.get("CUKERN_ATTENTION_SM80", "0") not in ("", "0")
CONFIGS = Configs(
    fwd=((32, FwdConfig(4, 2, 64, 64, True)), (64, FwdConfig(4, 2, 64, 64, True)), (96, FwdConfig(4, 2, 32, 32, False)),
         (128, FwdConfig(4, 2, 32, 32, False)), (256, FwdConfig(4, 1, 32, 32, False))),
    # Register budget of the backward: the dK and dV accumulators (keys x D) spread over all warps.
    bwd=((32, BwdConfig(128, 128, 8, 4, 8, 4)), (64, BwdConfig(128, 128, 8, 4, 4, 4)),
         (96, BwdConfig(64, 128, 8, 2, 4, 4)), (128, BwdConfig(64, 128, 8, 2, 4, 2)),
         (256, BwdConfig(64, 64, 8, 4, 2, 2))),
    dq=((32, DqConfig(4, 64)), (64, DqConfig(4, 64)), (96, DqConfig(4, 64)), (128, DqConfig(4, 64)),
        (256, DqConfig(4, 32))),
    use_sm90=not SM80_ONLY, use_sm90_bwd=not SM80_ONLY,
)
HEAD_DIMS = CONFIGS.head_dims
BWD_HEAD_DIMS = CONFIGS.bwd_head_dims


def instances(configs: Configs = CONFIGS) -> list[Instance]:
    """Every kernel instance the fronts can launch, forward and backward (compile check)."""
    out = [cfg.instance(dt, d, m, cap) for dt in DTYPES for d, cfg in configs.fwd for m in (0, 1, 2)
           for cap in (False, True)]
    # (the Hopper forward's: chosen as the front chooses, by sm90_forward)
    out += [configs.sm90_forward(d, m > 0, cap).instance(dt, d, m, cap) for dt in DTYPES for d, _ in configs.fwd_sm90
            for m in (0, 1, 2) for cap in (False, True)]
    out += [cfg.instance(dt, d, m, cap, varlen=True) for dt in DTYPES for d, cfg in configs.fwd_sm90_varlen
            for m in (0, 1, 2) for cap in (False, True)]
    out += [cfg.instance(dt, d, m, det) for dt in DTYPES for d, cfg in configs.bwd_sm90 for m in (0, 1, 2)
            for det in (False, True)]
    out += [cfg.instance(dt, d, m, det, True) for dt in DTYPES for d, cfg in configs.bwd_sm90_softcap
            for m in (0, 1, 2) for det in (False, True)]
    out += [cfg.instance(dt, d, m, det, varlen=True) for dt in DTYPES for d, cfg in configs.bwd_sm90
            for m in (0, 1, 2) for det in (False, True)]
    out += [cfg.instance(dt, d, m, det, True, varlen=True) for dt in DTYPES for d, cfg in configs.bwd_sm90_softcap
            for m in (0, 1, 2) for det in (False, True)]
    out += list({cfg.rows_instance().name: cfg.rows_instance()
                 for _, cfg in configs.bwd_sm90 + configs.bwd_sm90_softcap}.values())
    for dt in DTYPES:
        for d, cfg in configs.bwd:
            out.append(configs.dot(dt, d))
            out.append(configs.convert(dt, d))
            for m in (0, 1, 2):
                for cap in (False, True):
                    out += [cfg.instance(dt, d, m, det, cap) for det in (False, True)]
                    out.append(configs.get("dq", d).instance(dt, d, m, cap))
    return out


# ---- argument checks (kernels and references alike) -----------------------------------------

def _check_rank(a: DeviceArray) -> None:
    if a.dtype == "float32":
        raise ValueError(f"{a.name}: float32 is not supported: attention runs on tensor cores in float16 "
                         "or bfloat16 (softmax and accumulation are float32 inside); cast q, k and v")
    if a.ndim != 4:
        raise ValueError(f"{a.name}: expected (batch, seqlen, heads, head_dim), got shape {a.shape}")


def _check_qkv(qa, ka, va, head_dims, which: str) -> None:
    for a in (qa, ka, va):
        _check_rank(a)
    b, sq, h, d = qa.shape
    bk, sk, hkv, dk = ka.shape
    for a in (ka, va):
        if a.dtype != qa.dtype:
            raise ValueError(f"{a.name}: dtype {a.dtype} differs from q's {qa.dtype}")
    if va.shape != ka.shape:
        raise ValueError(f"v: shape {va.shape} does not match k's {ka.shape}")
    if bk != b:
        raise ValueError(f"k: batch {bk} does not match q's {b}")
    if dk != d:
        raise ValueError(f"k: head_dim {dk} does not match q's {d}")
    if hkv == 0 or h % hkv:
        raise ValueError(f"k: {hkv} kv heads do not divide q's {h} heads (grouped-query attention "
                         "needs heads % kv_heads == 0)")
    if head_dims is not None and d not in head_dims:
        raise ValueError(f"q: head_dim {d} is not supported{which} (supported: {', '.join(map(str, head_dims))})")
    if b * h > 65535:
        raise ValueError(f"q: batch * heads = {b * h} exceeds 65535 (one grid axis); split the batch")


def _check_like_q(a: DeviceArray, ref: DeviceArray) -> None:
    _check_rank(a)
    if a.shape != ref.shape:
        raise ValueError(f"{a.name}: shape {a.shape} does not match {ref.name}'s {ref.shape}")
    if a.dtype != ref.dtype and not (a.kind == "numpy" and "float64" in (a.dtype, ref.dtype)):
        # (the references take float64 beside any dtype: their own results feed their backwards)
        raise ValueError(f"{a.name}: dtype {a.dtype} differs from {ref.name}'s {ref.dtype}")


def _check_lse(la: DeviceArray, qa: DeviceArray) -> None:
    b, sq, h, _ = qa.shape
    if la.shape != (b, h, sq):
        raise ValueError(f"lse: shape {la.shape} does not match (batch, heads, seqlen_q) = {(b, h, sq)}")


def _check_varlen(qa, ka, va, cu_q: DeviceArray, cu_k: DeviceArray, max_seqlen_q, max_seqlen_k, head_dims,
                  which: str) -> tuple[int, int]:
    """Packed documents: q (total_q, H, D), k and v (total_k, Hkv, D), cu_seqlens_q/k (B + 1)
    int32 offsets of each document's first token. The max lengths as ints."""
    for a in (qa, ka, va):
        if a.dtype == "float32":
            _check_rank(a)
        if a.ndim != 3:
            raise ValueError(f"{a.name}: expected (total_tokens, heads, head_dim) for packed documents, "
                             f"got shape {a.shape}")
    if va.shape != ka.shape:
        raise ValueError(f"v: shape {va.shape} does not match k's {ka.shape}")
    for cu in (cu_q, cu_k):
        if cu.dtype != "int32":
            raise ValueError(f"{cu.name}: dtype {cu.dtype}; expected int32 offsets (flash-attn's cu_seqlens)")
        if cu.ndim != 1 or cu.shape[0] < 2:
            raise ValueError(f"{cu.name}: expected (batch + 1,) offsets with batch >= 1, got shape {cu.shape}")
    if cu_k.shape != cu_q.shape:
        raise ValueError(f"cu_seqlens_k: {cu_k.shape[0] - 1} documents, cu_seqlens_q {cu_q.shape[0] - 1}")
    max_q, max_k = _checks.index(max_seqlen_q, "max_seqlen_q"), _checks.index(max_seqlen_k, "max_seqlen_k")
    for name, m, a in (("max_seqlen_q", max_q, qa), ("max_seqlen_k", max_k, ka)):
        if m < 0:
            raise ValueError(f"{name}: must be >= 0, got {m}")
        if m == 0 and a.shape[0] > 0:
            raise ValueError(f"{name}: 0, but {a.name} holds {a.shape[0]} tokens")
    # (the dense checks, on the packed arrays seen as one batch)
    _check_qkv(*(a.batched() for a in (qa, ka, va)), head_dims, which)
    if (cu_q.shape[0] - 1) * qa.shape[1] > 65535:
        raise ValueError(f"cu_seqlens_q: documents * heads = {(cu_q.shape[0] - 1) * qa.shape[1]} exceeds 65535 "
                         "(one grid axis); split the batch")
    return max_q, max_k


def _check_cu_values(cu: np.ndarray, name: str, total: int, max_seqlen: int) -> None:
    """The offsets' values (the references check them here; the kernels on the device, as a
    fault that ``cukern.check_errors()`` raises): from 0 to the token count, none decreasing,
    no document longer than max_seqlen."""
    if cu[0] != 0:
        raise ValueError(f"{name}: must start at 0, got {int(cu[0])}")
    steps = np.diff(cu.astype(np.int64))
    if (steps < 0).any():
        i = int(np.argmax(steps < 0))
        raise ValueError(f"{name}: offsets must not decrease, got {int(cu[i])} then {int(cu[i + 1])} at {i}")
    if cu[-1] != total:
        raise ValueError(f"{name}: the last offset {int(cu[-1])} must be the token count {total}")
    if steps.size and steps.max() > max_seqlen:
        i = int(np.argmax(steps))
        raise ValueError(f"{name}: document {i} has {int(steps[i])} tokens, more than max_seqlen {max_seqlen}")


def _scale(softmax_scale, d: int) -> float:
    if softmax_scale is None:
        return 1.0 / math.sqrt(d)
    # The kernels take scale and scale*log2(e) as float32: both must be normal numbers there
    # (0 or inf would turn masked scores into NaN).
    return _checks.positive_float32(softmax_scale, "softmax_scale", log2e=True)


def _misaligned(a: DeviceArray) -> bool:
    """cp.async moves 16-byte chunks: rows must start 16-byte aligned. Such a view is read from
    a fresh copy (a contiguous view at a misaligned address stays misaligned under contiguous())."""
    return (a.shape[-1] > 1 and a.strides[-1] != 1) or a.ptr % 16 != 0 or any(s % 8 for s in a.strides[:-1])


def _tma_readable(a: DeviceArray) -> bool:
    """A tensor map can describe ``a`` as it is: no axis of several elements is broadcast (a
    stride of 0, as K and V expanded over the heads); those take the sm_80 kernel."""
    return all(s > 0 or n == 1 for n, s in zip(a.shape[:3], a.strides[:3]))


def _strides3(strides) -> dict:
    return dict(zip(("sb", "ss", "sh"), strides[:3]))


def _read(b: Builder, i: int, a: DeviceArray) -> tuple:
    """The batch, sequence and head strides the kernels read input ``i`` with (a fresh copy's
    when it is misaligned: the plan then copies it first)."""
    if _misaligned(a):
        b.fix(i, DeviceArray.copy)
        return _contiguous_strides(a.shape)
    return a.strides


def _contiguous_strides(shape) -> tuple:
    strides, step = [0] * len(shape), 1
    for ax in reversed(range(len(shape))):
        strides[ax] = step
        step *= shape[ax]
    return tuple(strides)


def _like(a: DeviceArray, copied: bool) -> tuple:
    """Strides of an output laid out like input ``a`` (after its fix-up, if any)."""
    return _contiguous_strides(a.shape) if copied else _arrays.like_strides(a.shape, a.strides)


# ---- forward --------------------------------------------------------------------------------

_FWD = PlanCache()


def _qkv(q, k, v) -> list:
    return [_arrays.as_device_array(q, "q", _arrays.FLOATS), _arrays.as_device_array(k, "k", _arrays.FLOATS),
            _arrays.as_device_array(v, "v", _arrays.FLOATS)]


def attention(q, k, v, *, causal=False, softmax_scale=None, return_lse=False, window=(-1, -1), softcap=0.0):
    """softmax(q k^T * softmax_scale [+ mask]) v, fused (FlashAttention-2 style).

    Args:
        q: (B, Sq, H, D) float16 or bfloat16 (CuPy array or torch CUDA tensor), unit stride
            over D; any batch, sequence and head strides (SDPA's (B, H, S, D) transposed, a
            slice of a packed qkv tensor) are read in place.
        k, v: (B, Sk, Hkv, D) of q's dtype; Hkv divides H (GQA / MQA).
        causal: mask keys after the query, aligned to the bottom right when Sq != Sk
            (query i sees keys j <= i + Sk - Sq); a query that sees no key outputs zeros.
        softmax_scale: positive; defaults to 1 / sqrt(D).
        return_lse: also return the log-sum-exp (B, H, Sq) float32 (natural log; +inf for a
            query that sees no key).
        window: ``(left, right)``, flash-attn's ``window_size``: query i sees keys j with
            i + Sk - Sq - left <= j <= i + Sk - Sq + right; -1 leaves a side unbounded
            (causal sets right to 0). Key tiles outside a block's window are skipped.
        softcap: c > 0 replaces each scaled score s by c * tanh(s / c) (Gemma 2); 0 or None: none.

    Returns:
        ``out`` (B, Sq, H, D) of q's dtype, laid out like q (its stride order) when q is
        dense, else contiguous; with ``return_lse`` ``(out, lse)``.
    """
    return _attention(q, k, v, causal, softmax_scale, return_lse, CONFIGS, window, softcap)


def _mask_key(window, softcap):
    """The plan-cache key of a call's window and softcap, or None where they are not plain
    values (the plan is then built for the call and not kept)."""
    w = tuple(window) if isinstance(window, (tuple, list)) else window
    plain = ((w is None or (isinstance(w, tuple) and all(type(x) is int for x in w)))
             and (softcap is None or type(softcap) in (float, int)))
    return (w, softcap) if plain else None


def _attention(q, k, v, causal, softmax_scale, return_lse, configs: Configs, window=(-1, -1), softcap=0.0):
    arrays = _qkv(q, k, v)
    mkey = _mask_key(window, softcap)
    plain = (softmax_scale is None or type(softmax_scale) in (float, int)) and mkey is not None
    key = (bool(causal), softmax_scale, bool(return_lse), configs, mkey, *(a.key for a in arrays))
    plan = _FWD.get(key) if plain else None
    if plan is None:
        plan = _plan_forward(arrays, bool(causal), softmax_scale, bool(return_lse), configs, window, softcap)
        if plain:
            _FWD.put(key, plan)
    bufs = plan(arrays)
    return (bufs[3].obj, bufs[4].obj) if return_lse else bufs[3].obj


def _plan_forward(arrays, causal, softmax_scale, return_lse, configs: Configs, window=(-1, -1),
                  softcap=0.0) -> Plan:
    qa, ka, va = arrays
    _check_qkv(qa, ka, va, configs.head_dims, "")
    batch, sq, h, d = qa.shape
    sk, hkv = ka.shape[1], ka.shape[2]
    scale = _scale(softmax_scale, d)
    mask = _attention_mask.mask_of(causal, window, softcap, sq, sk)
    device = _arrays.same_device(qa, ka, va)
    b = Builder(arrays)
    qs, ks, vs = (_read(b, i, a) for i, a in enumerate(arrays))
    q_copied = any(i == 0 for i, _ in b.fixes)
    out = b.alloc(qa.shape, qa.dtype, "contiguous" if q_copied else "like", 0)
    lse = b.alloc((batch, h, sq), "float32") if return_lse else None
    if batch * h * sq:
        if sk == 0:  # no keys: zeros, lse = +inf
            b.fill(0.0, out)
            b.fill(float("inf"), lse)
        elif (configs.use_sm90 and d in dict(configs.fwd_sm90) and _kernels.compute_capability(device) == (9, 0)
              and all(i in {j for j, _ in b.fixes} or _tma_readable(a) for i, a in enumerate(arrays))):
            # TMA reads the inputs in place where cp.async can (16-byte rows and strides: _read)
            # (a window takes the causal config; its work tiles are handed out as the unmasked ones)
            causal = mask.causal
            cfg = configs.sm90_forward(d, mask.kind > 0, bool(mask.softcap))
            k = _kernels.kernel(cfg.instance(qa.dtype, d, mask.kind, bool(mask.softcap)), device)
            cap_in, cap_out = _attention_mask.softcap_log2(mask, scale)
            os_ = _like(qa, q_copied)
            m_tiles = -(-sq // cfg.block_rows)
            blocks = configs.fwd_sm90_blocks or _kernels.sm_count(device)
            grid = (min(m_tiles * batch * h, blocks), 1) if cfg.persistent else (m_tiles, batch * h)
            # (causal persistent: work tiles from a counter that starts at zero every call; causal
            # tiles in sections of (batch, head) pairs whose K and V fill l2_section_bytes)
            counter = b.alloc((1,), "int32") if cfg.persistent and causal else None
            if counter is not None:
                b.fill(0.0, counter)
            section_pairs = max(1, configs.l2_section_bytes // (sk * d * 4)) if causal else 1
            b.launch(k, grid, q_map=MapSlot(0, (1, cfg.block_rows, 1, 64)),
                     k_map=MapSlot(1, (1, cfg.bn, 1, 64)), v_map=MapSlot(2, (1, cfg.bn, 1, 64)),
                     o_map=MapSlot(out.index, (1, 64, 1, 64)) if cfg.persistent else bytes(128), out=out, lse=lse,
                     **{f"o_{n}": s for n, s in _strides3(os_).items()},
                     H=h, Hkv=hkv, Sq=sq, Sk=sk, scale_log2=scale * LOG2E, tiles=m_tiles * batch * h,
                     tile_counter=counter, section_pairs=section_pairs, cap_in=cap_in, cap_out=cap_out,
                     win_left=mask.left, win_right=mask.right, cu_q=None, cu_k=None, max_q=0, max_k=0, fault=None)
        else:
            _launch_forward_sm80(b, configs, qa, (qs, ks, vs), _like(qa, q_copied), out, lse, mask, scale,
                                 grid_rows=sq, batches=batch, sq=sq, sk=sk, hkv=hkv, device=device)
    return b.plan(device)


def _launch_forward_sm80(b: Builder, configs: Configs, qa: DeviceArray, strides, os_, out, lse, mask: Mask,
                         scale: float, *, grid_rows: int, batches: int, sq: int, sk: int, hkv: int, device: int,
                         varlen: tuple | None = None) -> None:
    """attention_fwd over ``batches`` (batch, head) groups of ``grid_rows`` query rows (packed:
    ``varlen`` = (cu_q slot, cu_k slot, max_q, max_k), and sq, sk the token totals)."""
    d, h = qa.shape[-1], qa.shape[-2]
    cfg = configs.get("fwd", d)
    k = _kernels.kernel(cfg.instance(qa.dtype, d, mask.kind, bool(mask.softcap)), device)
    cap_in, cap_out = _attention_mask.softcap_log2(mask, scale)
    cu_q, cu_k, max_q, max_k = varlen if varlen is not None else (None, None, 0, 0)
    fault = _arrays.wrap(_faults.record(device), "fault record") if varlen is not None else None
    b.launch(k, (-(-grid_rows // cfg.block_rows), batches * h), q=b.slot(0), k=b.slot(1), v=b.slot(2), out=out,
             lse=lse, **{f"{x}_{n}": s for x, st in zip("qkvo", (*strides, os_)) for n, s in _strides3(st).items()},
             H=h, Hkv=hkv, Sq=sq, Sk=sk, scale_log2=scale * LOG2E, win_left=mask.left, win_right=mask.right,
             cap_in=cap_in, cap_out=cap_out, cu_q=cu_q, cu_k=cu_k, max_q=max_q, max_k=max_k, fault=fault)


# ---- packed documents (varlen) ----------------------------------------------------------------

_FWD_VARLEN = PlanCache()


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal=False,
                     softmax_scale=None, return_lse=False, window=(-1, -1), softcap=0.0):
    """``attention`` over documents packed into one sequence with no padding (flash-attn's
    ``flash_attn_varlen_func``): each document attends to its own tokens only.

    Args:
        q: (total_q, H, D) float16 or bfloat16, the documents' queries one after another.
        k, v: (total_k, Hkv, D) of q's dtype.
        cu_seqlens_q, cu_seqlens_k: (B + 1,) int32 offsets of each document's first token,
            from 0 to total_q (total_k), none decreasing (a document may be empty).
        max_seqlen_q, max_seqlen_k: ints at least the longest document's length (the grid
            covers that many rows).
        causal, softmax_scale, window, softcap: as for ``attention``, each document's mask
            aligned to its own bottom right.
        return_lse: also return the log-sum-exp (H, total_q) float32.

    Offsets are read on the device: bad ones (decreasing, not from 0 to the total, a document
    longer than its max_seqlen) leave that document uncomputed (and documents that overlap it
    may be wrong) and are reported by ``cukern.check_errors()``, as an out-of-range embedding
    index is: the call's outputs are then not valid.

    Returns:
        ``out`` (total_q, H, D) of q's dtype; with ``return_lse`` ``(out, lse)``.
    """
    return _attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale,
                             return_lse, window, softcap, CONFIGS)


def _offsets(cu_seqlens_q, cu_seqlens_k) -> list:
    return [_arrays.as_device_array(cu_seqlens_q, "cu_seqlens_q", ("int32",)),
            _arrays.as_device_array(cu_seqlens_k, "cu_seqlens_k", ("int32",))]


def _varlen_cacheable(softmax_scale, mkey, max_seqlen_q, max_seqlen_k) -> bool:
    """Whether a packed call's plan may be kept by its arguments (plain numbers, a known mask)."""
    return ((softmax_scale is None or type(softmax_scale) in (float, int)) and mkey is not None
            and type(max_seqlen_q) is int and type(max_seqlen_k) is int)


def _attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale,
                      return_lse, window, softcap, configs: Configs):
    arrays = [*_qkv(q, k, v), *_offsets(cu_seqlens_q, cu_seqlens_k)]
    mkey = _mask_key(window, softcap)
    plain = _varlen_cacheable(softmax_scale, mkey, max_seqlen_q, max_seqlen_k)
    key = (bool(causal), softmax_scale, bool(return_lse), configs, mkey, max_seqlen_q, max_seqlen_k,
           *(a.key for a in arrays))
    plan = _FWD_VARLEN.get(key) if plain else None
    if plan is None:
        plan = _plan_forward_varlen(arrays, max_seqlen_q, max_seqlen_k, bool(causal), softmax_scale,
                                    bool(return_lse), window, softcap, configs)
        if plain:
            _FWD_VARLEN.put(key, plan)
    bufs = plan(arrays)
    return (bufs[5].obj, bufs[6].obj) if return_lse else bufs[5].obj


def _plan_forward_varlen(arrays, max_seqlen_q, max_seqlen_k, causal, softmax_scale, return_lse, window, softcap,
                         configs: Configs) -> Plan:
    qa, ka, va, cq, ck = arrays
    max_q, max_k = _check_varlen(qa, ka, va, cq, ck, max_seqlen_q, max_seqlen_k, configs.head_dims, "")
    total_q, h, d = qa.shape
    total_k, hkv = ka.shape[0], ka.shape[1]
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
    q_copied = any(i == 0 for i, _ in b.fixes)
    out = b.alloc(qa.shape, qa.dtype, "contiguous" if q_copied else "like", 0)
    lse = b.alloc((h, total_q), "float32") if return_lse else None
    if total_q * h and max_q:
        os_ = (0, *_like(qa, q_copied))
        if (configs.use_sm90 and d in dict(configs.fwd_sm90_varlen) and total_k
                and _kernels.compute_capability(device) == (9, 0)
                and all(i in {j for j, _ in b.fixes} or _tma_readable(a) for i, a in enumerate(arrays[:3]))):
            # attention_fwd_sm90 over (query tiles of the longest document, documents x heads);
            # the packed arrays read by TMA as one batch (a box of one more axis than they have)
            cfg = configs.get("fwd_sm90_varlen", d)
            k = _kernels.kernel(cfg.instance(qa.dtype, d, mask.kind, bool(mask.softcap), varlen=True), device)
            cap_in, cap_out = _attention_mask.softcap_log2(mask, scale)
            m_tiles = -(-max_q // cfg.block_rows)
            b.launch(k, (m_tiles, docs * h), q_map=MapSlot(0, (1, cfg.block_rows, 1, 64)),
                     k_map=MapSlot(1, (1, cfg.bn, 1, 64)), v_map=MapSlot(2, (1, cfg.bn, 1, 64)), o_map=bytes(128),
                     out=out, lse=lse, **{f"o_{n}": s for n, s in _strides3(os_).items()},
                     H=h, Hkv=hkv, Sq=total_q, Sk=total_k, scale_log2=scale * LOG2E, tiles=m_tiles * docs * h,
                     tile_counter=None, section_pairs=1, cap_in=cap_in, cap_out=cap_out, win_left=mask.left,
                     win_right=mask.right, cu_q=b.slot(3), cu_k=b.slot(4), max_q=max_q, max_k=max_k,
                     fault=_arrays.wrap(_faults.record(device), "fault record"))
        else:
            _launch_forward_sm80(b, configs, qa, (qs, ks, vs), os_, out, lse, mask, scale, grid_rows=max_q,
                                 batches=docs, sq=total_q, sk=total_k, hkv=hkv, device=device,
                                 varlen=(b.slot(3), b.slot(4), max_q, max_k))
    return b.plan(device)


# ---- backward -------------------------------------------------------------------------------

_BWD = PlanCache()


def attention_backward(dout, q, k, v, out, lse, *, causal=False, softmax_scale=None, deterministic=False,
                       window=(-1, -1), softcap=0.0):
    """Gradients of ``attention``: ``(dq, dk, dv)``.

    Args:
        dout: (B, Sq, H, D) gradient of ``out``, q's dtype, any batch/sequence/head strides.
        q, k, v, causal, softmax_scale, window, softcap: as given to the forward.
        out, lse: the forward's output and log-sum-exp (``return_lse=True``).
        deterministic: False (default, as FlashAttention): dQ is summed over key tiles with
            float32 atomics (5 matrix products a tile pair; the last bits of dq may differ run
            to run). True: dQ has its own pass (7 products, about 1.3x the backward's time)
            and every gradient has the same bits on every call. dk and dv are deterministic
            either way (a fixed-order sum over query tiles and heads).

    Returns:
        dq (B, Sq, H, D), dk and dv (B, Sk, Hkv, D) — dk and dv summed over the query heads
        that share each K/V head — of q's dtype, each laid out like its input (q, k, v) when
        that input is dense, else contiguous.
    """
    return _attention_backward(dout, q, k, v, out, lse, causal, softmax_scale, deterministic, CONFIGS, window,
                               softcap)


def _bwd_arrays(dout, q, k, v, out, lse) -> list:
    return [_arrays.as_device_array(dout, "dout", _arrays.FLOATS), *_qkv(q, k, v),
            _arrays.as_device_array(out, "out", _arrays.FLOATS), _arrays.as_device_array(lse, "lse", ("float32",))]


def _attention_backward(dout, q, k, v, out, lse, causal, softmax_scale, deterministic, configs: Configs,
                        window=(-1, -1), softcap=0.0):
    arrays = _bwd_arrays(dout, q, k, v, out, lse)
    mkey = _mask_key(window, softcap)
    plain = (softmax_scale is None or type(softmax_scale) in (float, int)) and mkey is not None
    key = (bool(causal), softmax_scale, bool(deterministic), configs, mkey, *(a.key for a in arrays))
    plan = _BWD.get(key) if plain else None
    if plan is None:
        plan = _plan_backward(arrays, bool(causal), softmax_scale, bool(deterministic), configs, window, softcap)
        if plain:
            _BWD.put(key, plan)
    bufs = plan(arrays)   # (the given arrays, then dq, dk, dv)
    return bufs[6].obj, bufs[7].obj, bufs[8].obj


def attention_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                              causal=False, softmax_scale=None, deterministic=False, window=(-1, -1), softcap=0.0):
    """Gradients of ``attention_varlen``: ``(dq, dk, dv)`` of the packed documents.

    Args:
        dout: (total_q, H, D) gradient of ``out``.
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale,
            window, softcap: as given to the forward.
        out, lse: the forward's output and log-sum-exp (H, total_q) (``return_lse=True``).
        deterministic: as for ``attention_backward``.

    Bad offsets are reported by ``cukern.check_errors()`` as for the forward; the gradients of
    such a call are not valid (a bad document's are not written).

    Returns:
        dq (total_q, H, D), dk and dv (total_k, Hkv, D) of q's dtype.
    """
    arrays = [*_bwd_arrays(dout, q, k, v, out, lse), *_offsets(cu_seqlens_q, cu_seqlens_k)]
    mkey = _mask_key(window, softcap)
    plain = _varlen_cacheable(softmax_scale, mkey, max_seqlen_q, max_seqlen_k)
    key = (bool(causal), softmax_scale, bool(deterministic), CONFIGS, mkey, max_seqlen_q, max_seqlen_k,
           *(a.key for a in arrays))
    plan = _BWD_VARLEN.get(key) if plain else None
    if plan is None:
        plan = _plan_backward(arrays, bool(causal), softmax_scale, bool(deterministic), CONFIGS, window, softcap,
                              (max_seqlen_q, max_seqlen_k))
        if plain:
            _BWD_VARLEN.put(key, plan)
    bufs = plan(arrays)   # (the given arrays with the offsets, then dq, dk, dv)
    return bufs[8].obj, bufs[9].obj, bufs[10].obj


_BWD_VARLEN = PlanCache()


def _plan_backward(arrays, causal, softmax_scale, deterministic, configs: Configs, window=(-1, -1), softcap=0.0,
                   varlen: tuple | None = None) -> Plan:
    """The backward's plan; ``varlen`` = (max_seqlen_q, max_seqlen_k) for packed documents,
    whose offsets are arrays 6 and 7 (the kernels then see one batch of all the tokens)."""
    da, qa, ka, va, oa, la = arrays[:6]
    if varlen is None:
        _check_qkv(qa, ka, va, configs.bwd_head_dims, " by the backward")
        _check_like_q(da, qa)
        _check_like_q(oa, qa)
        _check_lse(la, qa)
        batch, sq, h, d = qa.shape
        sk, hkv = ka.shape[1], ka.shape[2]
        groups, rows_q, rows_k = batch, sq, sk
        mask = _attention_mask.mask_of(causal, window, softcap, sq, sk)
        strides_of = _read
        like = _like
    else:
        rows_q, rows_k = _check_varlen(qa, ka, va, arrays[6], arrays[7], *varlen, configs.bwd_head_dims,
                                       " by the backward")
        _checks.like(da, qa, qa.shape)
        _checks.like(oa, qa, qa.shape)
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
    device = _arrays.same_device(*arrays)
    b = Builder(arrays)
    ds, qs, ks, vs, os_ = (strides_of(b, i, a) for i, a in enumerate(arrays[:5]))
    for i in range(5, len(arrays)):
        if not _arrays.is_contiguous(arrays[i]):
            b.fix(i, DeviceArray.contiguous)
    copied = {i for i, _ in b.fixes}
    dq = b.alloc(qa.shape, qa.dtype, "contiguous" if 1 in copied else "like", 1)
    dk = b.alloc(ka.shape, qa.dtype, "contiguous" if 2 in copied else "like", 2)
    dv = b.alloc(va.shape, qa.dtype, "contiguous" if 3 in copied else "like", 3)
    if batch * h * sq == 0 or sk == 0:
        b.fill(0.0, dq, dk, dv)
        return b.plan(device, first=1)
    dqs, dks, dvs = like(qa, 1 in copied), like(ka, 2 in copied), like(va, 3 in copied)
    dsum = b.alloc((batch, h, sq), "float32")
    # deterministic=False: dQ's float32 partial sums (B, Sq, H, D), zeroed by the Dsum kernel,
    # then added to by atomics (or TMA reduce-add).
    dq_accum = None if deterministic else b.alloc((batch, sq, h, d), "float32")
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
    hopper = (configs.use_sm90_bwd and d in dict(configs.bwd_sm90) and _kernels.compute_capability(device) == (9, 0)
              and all(i in copied or _tma_readable(a) for i, a in enumerate(arrays[:4])))
    # The Hopper kernel loads lse * log2(e) and Dsum by TMA, a query tile's [2][rows] at once.
    which = "bwd_sm90_softcap" if mask.softcap else "bwd_sm90"
    cfg_sm90 = configs.get(which, d) if hopper else None
    tile = cfg_sm90.block_rows if hopper else 0
    # (packed documents: each document's tiles apart, document d's from q0 / tile + d)
    rows = None if not hopper else b.alloc(
        (batch, h, -(-sq // tile) + (groups if varlen else 0), 2, tile), "float32")
    threads = configs.dot_threads
    k = _kernels.kernel(configs.dot(qa.dtype, d), device)
    b.launch(k, min(-(-(batch * sq * h * _dot_lanes(d)) // threads), 65535), dout=b.slot(0), out=b.slot(4),
             **{f"d_{n}": s for n, s in _strides3(ds).items()}, **{f"o_{n}": s for n, s in _strides3(os_).items()},
             dsum=dsum, lse=b.slot(5), rows=None if varlen else rows, tile=tile, dq_accum=dq_accum, B=batch, Sq=sq,
             H=h)
    if hopper and varlen:
        b.launch(_kernels.kernel(cfg_sm90.rows_instance(), device), (-(-rows_q // tile), groups * h), lse=b.slot(5),
                 dsum=dsum, rows=rows, cu_q=b.slot(6), H=h, total_q=sq)
    if hopper:
        # dK, dV (and dQ's float32 partial sums, by TMA reduce-add) by TMA and wgmma; dQ's
        # conversion or pass as below. (deterministic: no dQ here, the dq_map is unused)
        cfg = cfg_sm90
        k = _kernels.kernel(cfg.instance(qa.dtype, d, mask.kind, deterministic, bool(mask.softcap), varlen is not None),
                            device)
        qbox, kbox = (1, cfg.block_rows, 1, 64), (1, cfg.block_keys, 1, 64)
        dq_map = bytes(128) if deterministic else MapSlot(dq_accum.index, (1, 16, 1, 32))
        kblocks, pairs = -(-rows_k // cfg.block_keys), groups * hkv
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
                 groups=pairs)
    else:
        cfg = configs.get("bwd", d)
        k = _kernels.kernel(cfg.instance(qa.dtype, d, mask.kind, deterministic, bool(mask.softcap)), device)
        b.launch(k, (-(-rows_k // cfg.bn), groups * hkv), q=b.slot(1), k=b.slot(2), v=b.slot(3), dout=b.slot(0),
                 lse=b.slot(5), dsum=dsum, dk=dk, dv=dv, dq_accum=dq_accum, **strided, **out_strides, **tail,
                 **masked)
    if deterministic:
        qcfg = configs.get("dq", d)
        k = _kernels.kernel(qcfg.instance(qa.dtype, d, mask.kind, bool(mask.softcap)), device)
        b.launch(k, (-(-rows_q // (16 * qcfg.warps)), groups * h), q=b.slot(1), k=b.slot(2), v=b.slot(3),
                 dout=b.slot(0), lse=b.slot(5), dsum=dsum, dq=dq, **strided,
                 **{f"dq_{n}": s for n, s in _strides3(dqs).items()}, **tail, **masked)
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


# ---- NumPy references ------------------------------------------------------------------------

def _ref_head_dims(qa: DeviceArray, head_dims):
    """The kernels' head dims for the kernels' dtypes; any for float64, which no kernel takes
    (the tests' exact oracle, at head dims small enough for many hypothesis examples)."""
    return None if qa.dtype == "float64" else head_dims


def _host_qkv(q, k, v, head_dims, which: str = ""):
    qa, ka, va = (_arrays.as_host_array(a, n) for a, n in ((q, "q"), (k, "k"), (v, "v")))
    _check_qkv(qa, ka, va, _ref_head_dims(qa, head_dims), which)
    return qa, ka, va


def _ref_scores(q, k, scale, mask: Mask):
    """(p, lse, s): softmax probabilities (B, H, Sq, Sk) with rows that see no key all zero,
    the log-sum-exp (+inf for those rows) and the scaled scores before the softcap."""
    batch, sq, h, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    _attention_mask.softcap_log2(mask, scale)   # (its range checked as the kernels' fronts check it)
    kh = np.repeat(k, h // hkv, axis=2)  # (B, Sk, H, D): query head h reads kv head h // rep
    s = np.einsum("bqhd,bkhd->bhqk", q, kh) * scale
    sc = _attention_mask.capped(s, mask)
    if mask.any:
        sc = np.where(_attention_mask.visible(mask, sq, sk)[None, None], sc, -np.inf)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        m = sc.max(axis=-1, keepdims=True) if sk else np.full(sc.shape[:-1] + (1,), -np.inf)
        m_safe = np.where(np.isfinite(m), m, 0.0)
        p = np.exp(sc - m_safe)
        l_ = p.sum(axis=-1, keepdims=True)
        # (l_ == 0 only where no key is seen; a NaN score makes l_ NaN, and NaN goes on into p
        # and lse, as in torch.softmax)
        none = l_ == 0
        p = np.where(none, 0.0, p / np.where(none, 1.0, l_))
        lse = np.where(none, np.inf, np.log(np.where(none, 1.0, l_)) + m_safe)[..., 0]
    return p, lse, s


def _ref_forward(qf, kf, vf, scale, mask: Mask):
    p, lse, _ = _ref_scores(qf, kf, scale, mask)
    vh = np.repeat(vf, qf.shape[2] // kf.shape[2], axis=2)
    return np.einsum("bhqk,bkhd->bqhd", p, vh), lse


def _ref_backward(dof, qf, kf, vf, scale, mask: Mask):
    batch, sq, h, d = qf.shape
    sk, hkv = kf.shape[1], kf.shape[2]
    rep = h // hkv
    p, _, s = _ref_scores(qf, kf, scale, mask)
    kh, vh = np.repeat(kf, rep, axis=2), np.repeat(vf, rep, axis=2)
    dvh = np.einsum("bhqk,bqhd->bkhd", p, dof)
    dp = np.einsum("bqhd,bkhd->bhqk", dof, vh)
    ds = p * (dp - (p * dp).sum(axis=-1, keepdims=True)) * _attention_mask.softcap_grad(s, mask)
    dq = np.einsum("bhqk,bkhd->bqhd", ds, kh) * scale
    dkh = np.einsum("bhqk,bqhd->bkhd", ds, qf) * scale
    return dq, dkh.reshape(batch, sk, hkv, rep, d).sum(axis=3), dvh.reshape(batch, sk, hkv, rep, d).sum(axis=3)


def reference_attention(q, k, v, *, causal=False, softmax_scale=None, return_lse=False, window=(-1, -1),
                        softcap=0.0):
    """``attention`` in float64: out (B, Sq, H, D) [, lse (B, H, Sq)]; the mask aligned to the
    bottom right; a query that sees no key gives zeros and lse = +inf (as the kernel), one whose
    scores hold a NaN gives NaN (as torch.softmax)."""
    qa, ka, va = _host_qkv(q, k, v, CONFIGS.head_dims)
    mask = _attention_mask.mask_of(causal, window, softcap, qa.shape[1], ka.shape[1])
    qf, kf, vf = (a.obj.astype(np.float64) for a in (qa, ka, va))
    out, lse = _ref_forward(qf, kf, vf, _scale(softmax_scale, qa.shape[-1]), mask)
    return (out, lse) if return_lse else out


def reference_attention_backward(dout, q, k, v, out=None, lse=None, *, causal=False, softmax_scale=None,
                                 deterministic=False, window=(-1, -1), softcap=0.0):
    """``attention_backward`` in float64: (dq, dk, dv), dk and dv summed over the query heads
    sharing a K/V head. ``out`` and ``lse`` are recomputed (given ones are shape-checked)."""
    qa, ka, va = _host_qkv(q, k, v, CONFIGS.bwd_head_dims, " by the backward")
    mask = _attention_mask.mask_of(causal, window, softcap, qa.shape[1], ka.shape[1])
    da = _arrays.as_host_array(dout, "dout")
    _check_like_q(da, qa)
    if out is not None:
        _check_like_q(_arrays.as_host_array(out, "out"), qa)
    if lse is not None:
        _check_lse(_arrays.as_host_array(lse, "lse", ("float32",)), qa)
    qf, kf, vf, dof = (a.obj.astype(np.float64) for a in (qa, ka, va, da))
    return _ref_backward(dof, qf, kf, vf, _scale(softmax_scale, qa.shape[-1]), mask)


def _host_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, head_dims, which: str = ""):
    qa, ka, va = (_arrays.as_host_array(a, n) for a, n in ((q, "q"), (k, "k"), (v, "v")))
    cq, ck = (_arrays.as_host_array(a, n, ("int32",)) for a, n in ((cu_seqlens_q, "cu_seqlens_q"),
                                                                  (cu_seqlens_k, "cu_seqlens_k")))
    max_q, max_k = _check_varlen(qa, ka, va, cq, ck, max_seqlen_q, max_seqlen_k, _ref_head_dims(qa, head_dims),
                                 which)
    _check_cu_values(cq.obj, "cu_seqlens_q", qa.shape[0], max_q)
    _check_cu_values(ck.obj, "cu_seqlens_k", ka.shape[0], max_k)
    return qa, ka, va, cq.obj, ck.obj


def reference_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal=False,
                               softmax_scale=None, return_lse=False, window=(-1, -1), softcap=0.0):
    """``attention_varlen`` in float64: out (total_q, H, D) [, lse (H, total_q)]; each document
    attends to its own keys only, the mask aligned to the bottom right of each document."""
    qa, ka, va, cq, ck = _host_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                      CONFIGS.head_dims)
    scale = _scale(softmax_scale, qa.shape[-1])
    out = np.zeros(qa.shape)
    lse = np.full((qa.shape[1], qa.shape[0]), np.inf)
    for i in range(len(cq) - 1):
        (q0, q1), (k0, k1) = cq[i:i + 2], ck[i:i + 2]
        mask = _attention_mask.mask_of(causal, window, softcap, int(q1 - q0), int(k1 - k0))
        qf, kf, vf = (a.obj[None, r0:r1].astype(np.float64) for a, r0, r1 in ((qa, q0, q1), (ka, k0, k1), (va, k0, k1)))
        out[q0:q1], lse[:, q0:q1] = (x[0] for x in _ref_forward(qf, kf, vf, scale, mask))
    return (out, lse) if return_lse else out


def reference_attention_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                        max_seqlen_k, *, causal=False, softmax_scale=None, deterministic=False,
                                        window=(-1, -1), softcap=0.0):
    """``attention_varlen_backward`` in float64: (dq, dk, dv) of the packed documents. ``out``
    and ``lse`` are recomputed (given ones are shape-checked)."""
    qa, ka, va, cq, ck = _host_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                      CONFIGS.bwd_head_dims, " by the backward")
    da = _arrays.as_host_array(dout, "dout")
    _checks.like(da, qa, qa.shape)
    if out is not None:
        _checks.like(_arrays.as_host_array(out, "out"), qa, qa.shape)
    if lse is not None:
        la = _arrays.as_host_array(lse, "lse", ("float32",))
        if la.shape != (qa.shape[1], qa.shape[0]):
            raise ValueError(f"lse: shape {la.shape} does not match (heads, total_q) = {(qa.shape[1], qa.shape[0])}")
    scale = _scale(softmax_scale, qa.shape[-1])
    grads = [np.zeros(qa.shape), np.zeros(ka.shape), np.zeros(ka.shape)]
    for i in range(len(cq) - 1):
        (q0, q1), (k0, k1) = cq[i:i + 2], ck[i:i + 2]
        mask = _attention_mask.mask_of(causal, window, softcap, int(q1 - q0), int(k1 - k0))
        dof, qf = (a.obj[None, q0:q1].astype(np.float64) for a in (da, qa))
        kf, vf = (a.obj[None, k0:k1].astype(np.float64) for a in (ka, va))
        for g, x, (r0, r1) in zip(grads, _ref_backward(dof, qf, kf, vf, scale, mask), ((q0, q1), (k0, k1), (k0, k1))):
            g[r0:r1] = x[0]
    return tuple(grads)


# ---- benchmark cases ----------------------------------------------------------------------------

# (batch, heads, seqlen, head_dim, causal): batch * seqlen = 64k tokens, and long sequences.
WORKLOAD = {"full": [(32, 16, 2048, 128, False), (32, 16, 2048, 128, True), (4, 32, 8192, 128, True),
                     (16, 32, 2048, 64, True)],
            "quick": [(4, 16, 2048, 128, False), (4, 16, 2048, 128, True), (1, 32, 4096, 128, True),
                      (4, 32, 2048, 64, True)], "dtype": "bfloat16"}


def _inputs(B, H, S, D, dtype, seed, *, grad=False, sdpa=False) -> dict:
    """q, k, v (B, S, H, D); with ``sdpa`` the PyTorch-path layout instead: (B, H, S, D) leaves."""
    gen = generator(seed)
    shape = (B, H, S, D) if sdpa else (B, S, H, D)
    t = {n: randn(shape, dtype, gen) for n in ("q", "k", "v")}
    if grad:
        t["do"] = t["dy"] = randn(shape, dtype, gen)
        t["leaves"] = tuple(t[n].detach().requires_grad_(True) for n in ("q", "k", "v"))
    return t


def _sdpa(t, causal, backend, leaves=False):
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    which = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[backend]
    q, k, v = t["leaves"] if leaves else (t[n] for n in ("q", "k", "v"))
    with sdpa_kernel(which):
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                              is_causal=causal).transpose(1, 2)


def _fwd(t, causal):
    return attention(t["q"], t["k"], t["v"], causal=causal)


def _fwd_bwd(t, causal):
    out, lse = attention(t["q"], t["k"], t["v"], causal=causal, return_lse=True)
    return (out, *attention_backward(t["do"], t["q"], t["k"], t["v"], out, lse, causal=causal))


def _torch_fwd_bwd(t, causal, backend):
    import torch

    out = _sdpa(t, causal, backend, leaves=True)
    return (out.detach(), *torch.autograd.grad(out, t["leaves"], t["do"]))


def bench_cases(quick: bool) -> list:
    """FLOP-bound: 4·B·H·S²·D (half when causal) forward, FlashAttention's count for the
    backward (2.5 x forward), against torch's SDPA with the FLASH_ATTENTION backend
    (FlashAttention-2) and the CUDNN_ATTENTION backend."""
    dt = WORKLOAD["dtype"]
    cases = []
    for B, H, S, D, causal in WORKLOAD["quick" if quick else "full"]:
        flops = 4 * B * H * S * S * D // (2 if causal else 1)
        long = " long" if S > 2048 else ""  # (the same label for the --quick shape of a case)
        tag = f"attention{' causal' if causal else ''}{long} d{D}"
        make = functools.partial(_inputs, B, H, S, D, dt)
        for backend in ("flash", "cudnn"):
            cases.append(Case(f"{tag} fwd vs {backend}", "attention", (B, H, S, D), dt,
                                     elements_bytes((4 * B, S, H, D), dt), make,
                                     functools.partial(_fwd, causal=causal),
                                     functools.partial(_sdpa, causal=causal, backend=backend), flops=flops))
        for backend in ("flash", "cudnn"):
            cases.append(Case(f"{tag} fwd+bwd vs {backend}", "attention", (B, H, S, D), dt,
                                     elements_bytes((8 * B, S, H, D), dt), functools.partial(make, grad=True),
                                     functools.partial(_fwd_bwd, causal=causal),
                                     functools.partial(_torch_fwd_bwd, causal=causal, backend=backend),
                                     flops=int(3.5 * flops)))
    return cases + mask_bench_cases(quick)


# The masks' and packed documents' cases, each at the shape of the case it is measured against:
# documents of random lengths summing to 32768 tokens (16 of them, H32 d128, causal) against
# FlashAttention-2's varlen kernel; the same tokens as 16 documents of 2048 against the dense
# causal kernel on (16, 2048) (the same work: the packed path's own cost); a window of 1024 at
# S8192 against the full causal case of that shape; the softcap (Gemma 2's 50) against the
# same causal case without it.
MASK_WORKLOAD = {"full": dict(docs=16, tokens=32768, heads=32, d=128, long=(4, 32, 8192), window=1024,
                              dense=(32, 16, 2048)),
                 "quick": dict(docs=8, tokens=8192, heads=16, d=128, long=(1, 16, 4096), window=512,
                               dense=(4, 16, 2048))}


def _doc_lengths(docs: int, tokens: int, seed: int = 0) -> list[int]:
    """``docs`` random lengths, multiples of 8 and at least 64, that sum to ``tokens`` (the same
    every run)."""
    rng = np.random.default_rng(seed)
    while True:
        cuts = np.sort(rng.choice(np.arange(1, tokens // 8), size=docs - 1, replace=False)) * 8
        lengths = np.diff(np.concatenate([[0], cuts, [tokens]]))
        if lengths.min() >= 64:
            return [int(x) for x in lengths]


def _packed_inputs(lengths, H, D, dtype, seed, *, grad=False) -> dict:
    import torch

    gen = generator(seed)
    total = sum(lengths)
    t = {n: randn((total, H, D), dtype, gen) for n in ("q", "k", "v")}
    t["cu"] = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32, device="cuda")
    t["max"] = max(lengths)
    if grad:
        t["do"] = randn((total, H, D), dtype, gen)
    return t


def _varlen_fwd(t):
    return attention_varlen(t["q"], t["k"], t["v"], t["cu"], t["cu"], t["max"], t["max"], causal=True)


def _varlen_fwd_bwd(t):
    out, lse = attention_varlen(t["q"], t["k"], t["v"], t["cu"], t["cu"], t["max"], t["max"], causal=True,
                                return_lse=True)
    return (out, *attention_varlen_backward(t["do"], t["q"], t["k"], t["v"], out, lse, t["cu"], t["cu"], t["max"],
                                            t["max"], causal=True))


def _fa2_varlen(t, window=None, backward=False):
    """PyTorch's FlashAttention-2 (aten::_flash_attention_forward / _backward) on packed
    documents, causal, with a window if given; (B, S, H, D) inputs as B documents of S."""
    import torch

    dense = "cu" not in t
    names = ("q", "k", "v", "do") if backward else ("q", "k", "v")
    if dense:
        B, S = t["q"].shape[:2]
        flat = {n: t[n].reshape(B * S, *t[n].shape[2:]) for n in names}
        cu = torch.arange(0, (B + 1) * S, S, dtype=torch.int32, device=t["q"].device)
        mq = S
    else:
        flat, cu, mq = {n: t[n] for n in names}, t["cu"], t["max"]
    wl, wr = window if window is not None else (None, None)
    q, k, v = flat["q"], flat["k"], flat["v"]
    out, lse, rng, unused, _ = torch.ops.aten._flash_attention_forward(
        q, k, v, cu, cu, mq, mq, 0.0, True, False, window_size_left=wl, window_size_right=wr)
    res = (out,)
    if backward:
        res += tuple(torch.ops.aten._flash_attention_backward(
            flat["do"], q, k, v, out, lse, cu, cu, mq, mq, 0.0, True, rng, unused, window_size_left=wl,
            window_size_right=wr))
    if dense:
        res = tuple(x.view(B, S, *x.shape[1:]) for x in res)
    return res if backward else res[0]


def _window_fwd_bwd(t, window):
    out, lse = attention(t["q"], t["k"], t["v"], causal=True, return_lse=True, window=window)
    return (out, *attention_backward(t["do"], t["q"], t["k"], t["v"], out, lse, causal=True, window=window))


def _softcap_fwd_bwd(t, softcap):
    out, lse = attention(t["q"], t["k"], t["v"], causal=True, return_lse=True, softcap=softcap)
    return (out, *attention_backward(t["do"], t["q"], t["k"], t["v"], out, lse, causal=True, softcap=softcap))


def _window_flops(B, H, S, D, window) -> int:
    """4·D FLOPs a (query, key) pair each query sees: causal with ``window`` keys before it."""
    pairs = sum(min(i, window) + 1 for i in range(S))
    return 4 * B * H * pairs * D


def mask_bench_cases(quick: bool) -> list:
    """The masks' and packed documents' cases (MASK_WORKLOAD), FLOPs counted over the
    (query, key) pairs each computes; forward+backward at 3.5x the forward, as bench_cases."""
    w = MASK_WORKLOAD["quick" if quick else "full"]
    dt, H, D = WORKLOAD["dtype"], w["heads"], w["d"]
    cases = []
    lengths = _doc_lengths(w["docs"], w["tokens"])
    flops = sum(4 * H * L * L * D // 2 for L in lengths)
    nbytes = elements_bytes((4 * w["tokens"], H, D), dt)
    make = functools.partial(_packed_inputs, lengths, H, D, dt)
    shape = (w["docs"], H, w["tokens"] // w["docs"], D)
    cases.append(Case("attention varlen causal d128 fwd vs flash", "attention", shape, dt, nbytes, make,
                             _varlen_fwd, _fa2_varlen, flops=flops))
    cases.append(Case("attention varlen causal d128 fwd+bwd vs flash", "attention", shape, dt, 2 * nbytes,
                             functools.partial(make, grad=True), _varlen_fwd_bwd,
                             functools.partial(_fa2_varlen, backward=True), flops=int(3.5 * flops)))
    even = [w["tokens"] // w["docs"]] * w["docs"]
    S = even[0]
    flops_even = w["docs"] * 4 * H * S * S * D // 2
    cases.append(Case("attention varlen equal causal d128 fwd+bwd vs dense", "attention", shape, dt,
                             2 * nbytes, functools.partial(_packed_inputs, even, H, D, dt, grad=True),
                             _varlen_fwd_bwd, functools.partial(_as_dense_fwd_bwd, batch=w["docs"]),
                             flops=int(3.5 * flops_even)))
    B, HL, SL = w["long"]
    window = (w["window"], 0)
    wflops = _window_flops(B, HL, SL, D, w["window"])
    for label, fn, peer, f in (
            ("fwd", lambda t: attention(t["q"], t["k"], t["v"], causal=True, window=window),
             functools.partial(_fa2_varlen, window=window), wflops),
            ("fwd+bwd", functools.partial(_window_fwd_bwd, window=window),
             functools.partial(_fa2_varlen, window=window, backward=True), int(3.5 * wflops))):
        cases.append(Case(f"attention causal window long d128 {label} vs flash", "attention",
                                 (B, HL, SL, D), dt, elements_bytes((8 * B, SL, HL, D), dt),
                                 functools.partial(_inputs, B, HL, SL, D, dt, grad=label != "fwd"), fn, peer, flops=f))
    B, HD, SD = w["dense"]
    cflops = 4 * B * HD * SD * SD * D // 2
    cases.append(Case("attention causal softcap50 d128 fwd+bwd vs no softcap", "attention", (B, HD, SD, D), dt,
                             elements_bytes((8 * B, SD, HD, D), dt),
                             functools.partial(_inputs, B, HD, SD, D, dt, grad=True),
                             functools.partial(_softcap_fwd_bwd, softcap=50.0),
                             functools.partial(_softcap_fwd_bwd, softcap=0.0), flops=int(3.5 * cflops)))
    return cases


def _as_dense_fwd_bwd(t, batch):
    """The packed inputs of equal documents seen as (batch, S, H, D): the dense causal kernel."""
    q, k, v, do = (t[n].view(batch, -1, *t[n].shape[1:]) for n in ("q", "k", "v", "do"))
    out, lse = attention(q, k, v, causal=True, return_lse=True)
    grads = attention_backward(do, q, k, v, out, lse, causal=True)
    return tuple(x.reshape(-1, *x.shape[2:]) for x in (out, *grads))


def _sdpa_forward_on(F, t, causal):
    """The PyTorch user's call: F.scaled_dot_product_attention on (B, H, S, D) leaves."""
    q, k, v = t["leaves"]
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def _sdpa_array(t, causal):
    """The same work through the array API, on the same (B, H, S, D) tensors read through
    their transposes (no copies)."""
    q, k, v, do = (t[n].transpose(1, 2) for n in ("q", "k", "v", "dy"))
    out, lse = attention(q, k, v, causal=causal, return_lse=True)
    dq, dk, dv = attention_backward(do, q, k, v, out, lse, causal=causal)
    return tuple(a.transpose(1, 2) for a in (out, dq, dk, dv))


def _flash_forward_on(F, t, window=None):
    """A flash-attn user's call, causal: ``cukern.torch``'s flash_attn_varlen_func (packed inputs:
    ``t`` has "cu") or flash_attn_func; for F = torch.nn.functional, which has neither, PyTorch's
    own FlashAttention-2 kernel (aten's, under autograd), the kernel flash-attn's package runs."""
    import torch

    q, k, v = t["leaves"]
    w = window if window is not None else (-1, -1)
    if hasattr(F, "flash_attn_varlen_func"):
        if "cu" in t:
            return F.flash_attn_varlen_func(q, k, v, t["cu"], t["cu"], t["max"], t["max"], causal=True, window_size=w)
        return F.flash_attn_func(q, k, v, causal=True, window_size=w)
    dense = "cu" not in t
    B, S = q.shape[:2]
    if dense:
        q, k, v = (x.reshape(B * S, *x.shape[2:]) for x in (q, k, v))
    cu = torch.arange(0, (B + 1) * S, S, dtype=torch.int32, device=q.device) if dense else t["cu"]
    mq = S if dense else t["max"]
    wl, wr = window if window is not None else (None, None)
    out = torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, mq, mq, 0.0, True, False, window_size_left=wl,
                                                  window_size_right=wr)[0]
    return out.view(B, S, *out.shape[1:]) if dense else out


def _with_leaves(make, seed):
    t = make(seed)
    t["dy"] = t["do"]
    t["leaves"] = tuple(t[n].detach().requires_grad_(True) for n in ("q", "k", "v"))
    return t


def torch_bench_cases(quick: bool) -> list:
    """The SDPA drop-in (B, H, S, D) forward + backward against PyTorch's own choice of kernel
    (cuDNN on Hopper), torch.compile, and the array API on the same tensors; flash-attn's
    functions on packed documents and a sliding window (MASK_WORKLOAD's) against PyTorch's
    FlashAttention-2 kernel."""
    B, H, S, D, causal = WORKLOAD["quick" if quick else "full"][1]
    dt = WORKLOAD["dtype"]
    flops = int(3.5 * 4 * B * H * S * S * D // 2)
    cases = [TorchCase(f"sdpa causal d{D} fwd+bwd", "attention", (B, H, S, D), dt,
                              elements_bytes((8 * B, S, H, D), dt),
                              functools.partial(_inputs, B, H, S, D, dt, grad=True, sdpa=True),
                              functools.partial(_sdpa_forward_on, causal=causal),
                              functools.partial(_sdpa_array, causal=causal), flops=flops)]
    w = MASK_WORKLOAD["quick" if quick else "full"]
    lengths = _doc_lengths(w["docs"], w["tokens"])
    H, D = w["heads"], w["d"]
    cases.append(TorchCase(
        f"flash_attn_varlen_func causal d{D} fwd+bwd", "attention", (w["docs"], H, w["tokens"] // w["docs"], D), dt,
        2 * elements_bytes((4 * w["tokens"], H, D), dt),
        functools.partial(_with_leaves, functools.partial(_packed_inputs, lengths, H, D, dt, grad=True)),
        _flash_forward_on, _varlen_fwd_bwd, flops=int(3.5 * sum(4 * H * L * L * D // 2 for L in lengths))))
    B, HL, SL = w["long"]
    window = (w["window"], 0)
    cases.append(TorchCase(
        f"flash_attn_func causal window d{D} fwd+bwd", "attention", (B, HL, SL, D), dt,
        elements_bytes((8 * B, SL, HL, D), dt),
        functools.partial(_inputs, B, HL, SL, D, dt, grad=True),
        functools.partial(_flash_forward_on, window=window), functools.partial(_window_fwd_bwd, window=window),
        flops=int(3.5 * _window_flops(B, HL, SL, D, w["window"]))))
    return cases


# ---- PyTorch bindings -------------------------------------------------------------------------

def _empty_like(t):
    """An output laid out as the front lays out one like ``t`` (the same function decides)."""
    import torch

    return torch.empty_strided(t.shape, _arrays.like_strides(t.shape, t.stride()), dtype=t.dtype, device=t.device)


def _fake(q, k, v, causal, scale, window_left, window_right, softcap, deterministic):
    import torch

    b, sq, h, _ = q.shape
    return _empty_like(q), q.new_empty((b, h, sq), dtype=torch.float32)


def _bwd_fake(dout, q, k, v, out, lse, *args):
    return _empty_like(q), _empty_like(k), _empty_like(v)


def _varlen_fake(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, window_left, window_right, softcap, deterministic):
    import torch

    return _empty_like(q), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


# (window and softcap as flash-attn passes them: two ints, -1 unbounded, and a float, 0 none;
# deterministic -1 follows torch.use_deterministic_algorithms, 0 or 1 is flash-attn's argument)
_MASK_SCHEMA = "int window_left, int window_right, float softcap"


def _det(state, T) -> bool:
    return T.deterministic() if state[-1] < 0 else bool(state[-1])

TORCH_OPS = (
    TorchOp("attention", f"(Tensor q, Tensor k, Tensor v, bool causal, float scale, {_MASK_SCHEMA}, "
                         "int deterministic) -> (Tensor, Tensor)",
            forward=lambda q, k, v, c, s, wl, wr, cap, _: attention(q, k, v, causal=c, softmax_scale=s,
                                                                    return_lse=True, window=(wl, wr), softcap=cap),
            inference=lambda q, k, v, c, s, wl, wr, cap, _: attention(q, k, v, causal=c, softmax_scale=s,
                                                                      window=(wl, wr), softcap=cap),
            fake=_fake,
            save=lambda inputs, outputs: ((*inputs[:3], *outputs), inputs[3:]),
            backward_schema="(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, bool causal, "
                            f"float scale, {_MASK_SCHEMA}, bool deterministic) -> (Tensor, Tensor, Tensor)",
            backward=lambda do, q, k, v, o, lse, c, s, wl, wr, cap, det: attention_backward(
                do, q, k, v, o, lse, causal=c, softmax_scale=s, deterministic=det, window=(wl, wr), softcap=cap),
            backward_fake=_bwd_fake,
            backward_args=lambda saved, state, grads, T: (grads[0], *saved, *state[:-1], _det(state, T)),
            grads_to=(0, 1, 2), native=True),
    TorchOp("attention_varlen", "(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, "
                                f"int max_seqlen_q, int max_seqlen_k, bool causal, float scale, {_MASK_SCHEMA}, "
                                "int deterministic) -> (Tensor, Tensor)",
            forward=lambda q, k, v, cq, ck, mq, mk, c, s, wl, wr, cap, _: attention_varlen(
                q, k, v, cq, ck, mq, mk, causal=c, softmax_scale=s, return_lse=True, window=(wl, wr), softcap=cap),
            fake=_varlen_fake,
            # (saved: q, k, v, out, lse and the offsets; state: the lengths and the mask)
            save=lambda inputs, outputs: ((*inputs[:3], *outputs, *inputs[3:5]), inputs[5:]),
            backward_schema="(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor cu_seqlens_q, "
                            "Tensor cu_seqlens_k, int max_seqlen_q, int max_seqlen_k, bool causal, float scale, "
                            f"{_MASK_SCHEMA}, bool deterministic) -> (Tensor, Tensor, Tensor)",
            backward=lambda do, q, k, v, o, lse, cq, ck, mq, mk, c, s, wl, wr, cap, det: attention_varlen_backward(
                do, q, k, v, o, lse, cq, ck, mq, mk, causal=c, softmax_scale=s, deterministic=det, window=(wl, wr),
                softcap=cap),
            backward_fake=_bwd_fake,
            backward_args=lambda saved, state, grads, T: (grads[0], *saved, *state[:-1], _det(state, T)),
            # (native: the plan depends on the arguments alone; the offsets are read on the device.
            # max_seqlen and the number of documents are in the signature, so a workload whose
            # documents change every batch records each new (count, longest) pair once)
            grads_to=(0, 1, 2), visible=2, native=True),
)
# flash_attn_func(return_attn_probs=True): the same op with the lse visible (not differentiated)
TORCH_OPS += (dataclasses.replace(TORCH_OPS[0], name="attention_lse", visible=2, inference=None, native=False),)


def _torch_api(T, ops, modules) -> dict:
    """``cukern.torch.flash_attn_func`` and ``flash_attn_varlen_func``: flash-attn's functions
    (its signatures, (batch, seqlen, heads, head_dim) and packed (tokens, heads, head_dim)
    layouts, the lse it returns with ``return_attn_probs``), so that a flash-attn user switches
    by changing one import. Autograd and torch.compile through the custom ops."""
    dense, with_lse, packed = ops["attention"], ops["attention_lse"], ops["attention_varlen"]

    def _unsupported(dropout_p, alibi_slopes, block_table=None):
        if dropout_p:
            raise ValueError(f"dropout_p: cukern's attention has no dropout, got {dropout_p}")
        if alibi_slopes is not None:
            raise ValueError("alibi_slopes: cukern's attention has no ALiBi bias")
        if block_table is not None:
            raise ValueError("block_table: cukern's attention has no paged KV cache")

    def _flags(q, softmax_scale, window_size, softcap):
        if not hasattr(q, "shape"):   # (the default scale reads q before the op checks it)
            _arrays.as_device_array(q, "q")
        wl, wr = window_size if window_size is not None else (-1, -1)
        s = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
        return s, int(wl), int(wr), float(softcap or 0.0)

    def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                        alibi_slopes=None, deterministic=False, return_attn_probs=False):
        """flash-attn's ``flash_attn_func``: q (B, Sq, H, D), k and v (B, Sk, Hkv, D), float16 or
        bfloat16; the out (B, Sq, H, D); with ``return_attn_probs`` (out, lse (B, H, Sq), None).
        ``deterministic``: dq summed in a fixed order (as attention_backward's)."""
        _unsupported(dropout_p, alibi_slopes)
        s, wl, wr, cap = _flags(q, softmax_scale, window_size, softcap)
        args = (q, k, v, bool(causal), s, wl, wr, cap, int(bool(deterministic)))
        if not return_attn_probs:
            return dense.compiled(*args) if T.compiling() else dense(*args)
        out, lse = with_lse.compiled(*args) if T.compiling() else with_lse(*args)
        return out, lse, None

    def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                               softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                               deterministic=False, return_attn_probs=False, block_table=None):
        """flash-attn's ``flash_attn_varlen_func``: documents packed with no padding, q
        (total_q, H, D), k and v (total_k, Hkv, D), cu_seqlens (B + 1,) int32; the out
        (total_q, H, D); with ``return_attn_probs`` (out, lse (H, total_q), None)."""
        _unsupported(dropout_p, alibi_slopes, block_table)
        s, wl, wr, cap = _flags(q, softmax_scale, window_size, softcap)
        args = (q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k), bool(causal), s, wl, wr,
                cap, int(bool(deterministic)))
        out, lse = packed.compiled(*args) if T.compiling() else packed(*args)
        return (out, lse, None) if return_attn_probs else out

    return {"flash_attn_func": flash_attn_func, "flash_attn_varlen_func": flash_attn_varlen_func}


def _route(T, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """(B, H, S, D) inputs of float16/bfloat16 (after autocast), no mask tensor, no dropout,
    a supported head_dim, grouped-query K/V with ``enable_gqa``, ``is_causal`` with equal
    query and key lengths (PyTorch aligns the causal mask to the top left, cukern to the
    bottom right: they agree only there)."""
    q, k, v = query, key, value
    if not (q.is_cuda and k.is_cuda and v.is_cuda):
        return "not CUDA tensors"
    dt = T.autocast_dtype("scaled_dot_product_attention", q.dtype)
    q, k, v = T.cast(q, dt), T.cast(k, dt), T.cast(v, dt)
    if attn_mask is not None or dropout_p != 0.0:
        return "attn_mask or dropout"
    if q.dim() != 4 or k.dim() != 4 or k.shape != v.shape:
        return "shape"
    if q.dtype not in T.HALF_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        return f"dtype {q.dtype}"
    if not (q.device == k.device == v.device):
        return "devices differ"
    b, h, sq, d = q.shape
    bk, hkv, sk, dk = k.shape
    if bk != b or dk != d or d not in HEAD_DIMS:
        return "batch or head_dim"
    if hkv != h and not (enable_gqa and hkv > 0 and h % hkv == 0):
        return "heads"
    if is_causal and sq != sk:
        return "causal with seqlen_q != seqlen_k"
    if b * h > 65535 or sq == 0 or sk == 0:
        return "size"
    if T.small("scaled_dot_product_attention", b * h * sq * sk * d):
        return T.SMALL
    s = 1.0 / math.sqrt(d) if scale is None else float(scale)
    # (B, H, S, D) read through its transpose; the output comes back in SDPA's layout: no copies.
    return ("attention", (q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), bool(is_causal), s, -1, -1, 0.0,
                          -1), _transpose12)


def _transpose12(t):
    return t.transpose(1, 2)


FAMILY = Family(
    name="attention",
    api=(attention, attention_backward, attention_varlen, attention_varlen_backward),
    references={"attention": reference_attention, "attention_backward": reference_attention_backward,
                "attention_varlen": reference_attention_varlen,
                "attention_varlen_backward": reference_attention_varlen_backward},
    instances=instances,
    bench=bench_cases,
    torch_bench=torch_bench_cases,
    torch_ops=TORCH_OPS,
    torch_api=_torch_api,
    # Under torch.compile PyTorch runs SDPA on cuDNN's Hopper kernels, faster than these
    # FlashAttention-2-class kernels (docs/torch.md): compiled graphs keep PyTorch's.
    # min_size in B*H*Sq*Sk*D (a quarter of the forward's FLOPs).
    dropins=(DropIn("scaled_dot_product_attention", _route, compile=False, probe=lambda f, x: f(x, x, x),
                    min_size=2**28),),
)
