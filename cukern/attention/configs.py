"""Attention's kernel configurations: the sources, the tile configurations by head dim and
path (sm_80; Hopper forward and backward), the shipped ``CONFIGS`` and the kernel instances.

The functions read ``configs.CONFIGS`` when they are called, so a tool or a test that tries
other configurations replaces it here."""
from __future__ import annotations

import os
from dataclasses import dataclass

from .. import _arrays
from .._kernels import Instance

SOURCE = "attention_fwd.cu"
SM90_SOURCE = "attention_fwd_sm90.cu"
BWD_SOURCE = "attention_bwd.cu"
SM90_BWD_SOURCE = "attention_bwd_sm90.cu"
SM90_BWD_D256_SOURCE = "attention_bwd_sm90_d256.cu"
SM90_BWD_MLA_SOURCE = "attention_bwd_sm90_mla.cu"
DTYPES = ("float16", "bfloat16")
LOG2E = 1.4426950408889634


def row_elems(d: int) -> int:
    """Shared-memory row length of the kernels (row_elems in cuda_src/common/attn_tile.cuh):
    head_dim padded to a power of two of at least 64 elements."""
    r = 64
    while r < d:
        r *= 2
    return r


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

    def smem(self, d: int, itemsize: int, dv: int | None = None) -> int:
        """Q, two K and two V tiles (V's rows of the value head size ``dv``, d unless given),
        and 1 KB to align the tiles."""
        return ((self.block_rows + 2 * self.bn) * row_elems(d) + 2 * self.bn * row_elems(dv or d)) * itemsize + 1024

    def instance(self, dtype: str, d: int, mask: int, softcap: bool = False, dropout: bool = False,
                 dv: int | None = None) -> Instance:
        """``mask``: Mask.kind (a bool: causal or not); ``dv``: the value head size (d unless given)."""
        smem = self.smem(d, _arrays.DTYPES[dtype][1], dv)
        return Instance(SOURCE, f"attention_fwd<{_ctype(dtype)}, {d}, {dv or d}, {self.warps}, {self.mt}, {self.bn}, "
                                f"{self.bnc}, {_b(self.qreg)}, {int(mask)}, {_b(softcap)}, {_b(dropout)}, {smem}>",
                        32 * self.warps, smem)


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

    def smem(self, d: int, dv: int | None = None) -> int:
        """Q, the ring of K and V tiles (and O's own buffer, if any), 128-byte rows (64 head-dim
        columns a box; V's and O's of the value head size ``dv``, d unless given), and 1 KB to
        align them (16-bit elements)."""
        dv = dv or d
        return ((self.block_rows + self.stages * self.bn) * d
                + ((self.block_rows if self.own_o_buffer else 0) + self.stages * self.bn) * dv) * 2 + 1024

    @property
    def static_smem(self) -> int:
        """The kernel's static shared memory: its barriers (two, two a stage, and V's own two a
        stage with the overlap, a producer and one work tile a block, else two unused), the
        overlap's store sink (a word a computing thread), two work tile numbers and 8 bytes of
        padding."""
        split_kv = self.overlap and self.producer and not self.persistent
        return 8 * (2 + 2 * self.stages + 2 * (self.stages if split_kv else 1)) \
            + 4 * (128 * self.warpgroups if self.overlap else 1) + 16

    def instance(self, dtype: str, d: int, mask: int, softcap: bool = False, varlen: bool = False,
                 dropout: bool = False, dv: int | None = None) -> Instance:
        """``mask``: Mask.kind (a bool: causal or not); ``varlen``: packed documents (not persistent);
        ``dropout``: the weights dropped by the draw (not with the softcap; key tiles of at most 128);
        ``dv``: the value head size (d unless given)."""
        if dropout and (softcap or self.bn > 128):
            raise ValueError(f"dropout: not with the softcap, and with key tiles of at most 128 (bn={self.bn})")
        if varlen and self.persistent:
            raise ValueError("varlen: packed documents take a config that is not persistent")
        dv = dv or d
        if self.warpgroups == 3 and dv > 128:
            raise ValueError(f"warpgroups=3 takes value head sizes up to 128, not {dv}: the O accumulators of "
                             "64 rows x dv do not fit a thread's share of the registers "
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
        smem = self.smem(d, dv)
        if self.blocks_per_sm > 1 and self.blocks_per_sm * (smem + self.static_smem + 1024) > SM90_SMEM_PER_SM:
            raise ValueError(f"this config takes {smem} bytes of shared memory at head dim {d} and "
                             f"{self.static_smem} of static; "
                             f"{self.blocks_per_sm} blocks of it do not fit an SM's {SM90_SMEM_PER_SM}")
        if smem > SM90_MAX_SMEM:
            raise ValueError(f"this config takes {smem} bytes of shared memory at head dim {d} (bn={self.bn}, "
                             f"stages={self.stages}{', O in a buffer of its own' if self.own_o_buffer else ''}); "
                             f"a block on sm_90 may have {SM90_MAX_SMEM}")
        return Instance(SM90_SOURCE, f"attention_fwd_sm90<{_ctype(dtype)}, {d}, {dv}, {self.bn}, {self.stages}, "
                        f"{self.warpgroups}, {int(mask)}, {_b(softcap)}, {_b(self.producer)}, {_b(self.pingpong)}, "
                        f"{_b(self.overlap)}, {_b(self.persistent)}, {self.blocks_per_sm}, {smem}, {_b(varlen)}, "
                        f"{_b(dropout)}>",
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

    def smem(self, d: int, itemsize: int, dv: int | None = None) -> int:
        """K, V, Q and dO (double-buffered; V's and dO's rows of the value head size ``dv``, d
        unless given), P and dS, lse and Dsum (double-buffered), and 1 KB to align the tiles."""
        return ((self.bn + 2 * self.bm) * (row_elems(d) + row_elems(dv or d)) * itemsize
                + 2 * self.bm * row_elems(self.bn) * itemsize + 4 * self.bm * 4 + 1024)

    def instance(self, dtype: str, d: int, mask: int, deterministic: bool, softcap: bool = False,
                 dropout: bool = False, dv: int | None = None) -> Instance:
        """``mask``: Mask.kind (a bool: causal or not); ``dv``: the value head size (d unless given)."""
        smem = self.smem(d, _arrays.DTYPES[dtype][1], dv)
        return Instance(BWD_SOURCE, f"attention_bwd_dkdv<{_ctype(dtype)}, {d}, {dv or d}, {self.bm}, {self.bn}, "
                                    f"{self.warps}, {self.wm_s}, {self.wn_kv}, {self.wm_q}, {int(mask)}, "
                                    f"{_b(softcap)}, {_b(dropout)}, {_b(not deterministic)}, {smem}>",
                        32 * self.warps, smem)


@dataclass(frozen=True)
class Sm90BwdConfig:
    """attention_bwd_sm90 (TMA + wgmma, sm_90a): two warpgroups of 64 keys a block, query tiles
    of ``block_rows`` (64 or 128) in a ring of ``stages`` Q and dO buffers. ``producer``: a third
    warpgroup issues the loads and the two others get 240 registers (setmaxnreg), with dQ by
    atomics only (deterministic=False; the deterministic instance would spill). Replaces
    attention_bwd_dkdv. ``persistent``: without a mask (dense, dQ by atomics, with a producer),
    one block an SM walks the (batch, kv head, key block) units, a unit's first loads issued as
    the one before ends.

    ``ordered`` (the instance methods): deterministic=True with dQ still added by reduce-add, the
    adds into a query tile taking turns in a fixed order of the key blocks (the kernel's top
    says which); where :meth:`orders` is False the deterministic instance leaves dQ to
    attention_bwd_dq."""
    block_rows: int = 64
    stages: int = 2
    producer: bool = False
    persistent: bool = False
    block_keys = 128

    def orders(self, d: int, mask: int, kblocks: int, resident: int, varlen: bool = False) -> bool:
        """Whether deterministic=True can keep dQ's reduce-adds, in turns: with a producer
        warpgroup (one of its warps adds), where each warp stages its own part of a tile (64 x 128
        or 128 x 64 tiles), and, without a mask, where a
        (batch, kv head) group's ``kblocks`` key blocks are ``resident`` together (its blocks
        wait on each other's turns). Not for packed documents without a mask at 128-row tiles:
        that instance spilled 20 B (NVRTC 13.0 and 12.9)."""
        if varlen and int(mask) == 0 and self.block_rows == 128:
            return False
        return self.producer and self.block_rows * d == 2 * 64 * 64 and (int(mask) != 0 or kblocks <= resident)

    def persistent_for(self, mask: int, deterministic: bool, varlen: bool) -> bool:
        """Whether the instance for these arguments walks units (see the class; not deterministic:
        the ordered instance's dQ writer spilled its 24 registers walking the units)."""
        return self.persistent and not deterministic and self.producer and int(mask) == 0 and not varlen

    def threads(self, deterministic: bool, ordered: bool = False) -> int:
        return 384 if self.producer and (ordered or not deterministic) else 256

    def smem(self, d: int, deterministic: bool, ordered: bool = False) -> int:
        """K, V, the Q and dO rings (128-byte rows, 64 head-dim columns a box); where dQ is added
        here (not deterministic, or ordered), two dS^T buffers of 128 keys x 64 queries and dQ's
        staging boxes (16 rows x 32 floats, two a warp); a ring of lse_log2 and Dsum rows; and
        1 KB to align them."""
        atomic = ordered or not deterministic
        ds = 2 * self.block_rows // 64 * self.block_keys * 128 if atomic else 0
        dq = 8 * 2 * 16 * 128 if atomic else 0
        rows = self.stages * 2 * self.block_rows * 4
        return (2 * self.block_keys + 2 * self.stages * self.block_rows) * d * 2 + ds + dq + rows + 1024

    def instance(self, dtype: str, d: int, mask: int, deterministic: bool, softcap: bool = False,
                 varlen: bool = False, ordered: bool = False, dropout: bool = False) -> Instance:
        """``mask``: Mask.kind (a bool: causal or not); ``varlen``: packed documents;
        ``ordered``: deterministic by dQ's adds in turns (see the class); ``dropout``: the
        forward's dropped weights (dense, not with the softcap)."""
        if dropout and (softcap or varlen):
            raise ValueError("dropout: the Hopper backward takes it dense and without the softcap")
        ordered = bool(ordered and deterministic)
        smem = self.smem(d, deterministic, ordered)
        threads = self.threads(deterministic, ordered)
        return Instance(SM90_BWD_SOURCE, f"attention_bwd_sm90<{_ctype(dtype)}, {d}, {self.block_rows}, {self.stages}, "
                        f"{int(mask)}, {_b(softcap)}, {_b(ordered or not deterministic)}, {_b(threads == 384)}, "
                        f"{smem}, {_b(varlen)}, {_b(self.persistent_for(mask, deterministic, varlen))}, "
                        f"{_b(ordered)}, {_b(dropout)}>",
                        threads, smem, "sm_90a")

    def rows_instance(self) -> Instance:
        """attention_bwd_rows_varlen: lse and Dsum as this config's query tiles of packed documents."""
        return Instance(SM90_BWD_SOURCE, f"attention_bwd_rows_varlen<{self.block_rows}>", self.block_rows, 0,
                        "sm_90a")


@dataclass(frozen=True)
class Sm90BwdD256Config:
    """attention_bwd_sm90_d256 (TMA + wgmma, sm_90a): head dim 256, 64 keys a block, two
    computing warpgroups splitting dK and dV by head-dim halves, query tiles of 64 rows in a ring
    of two, and a producer warpgroup (384 threads), whose second warp adds dQ by TMA
    reduce-add; deterministic=True takes the ORDERED instances (the adds in turns)."""
    block_rows = 64
    block_keys = 64

    def orders(self, mask: int, kblocks: int, resident: int) -> bool:
        """Whether deterministic=True can add dQ in turns here: with a mask always (a key block
        waits only on blocks launched before it), without one where a (batch, kv head) group's
        ``kblocks`` key blocks are ``resident`` together (they wait on each other's turns)."""
        return int(mask) != 0 or kblocks <= resident

    def smem(self) -> int:
        """K and V (64 x 256), the Q and dO rings (2 x 64 x 256 each), P^T and dS^T (64 x 64),
        dP^T's float32 exchange (128 threads x 32), lse_log2 and Dsum (2 x 2 x 64), 1 KB slack."""
        tile = 64 * 256 * 2
        return 2 * tile + 4 * tile + 2 * 64 * 128 + 128 * 32 * 4 + 2 * 2 * 64 * 4 + 1024

    def instance(self, dtype: str, mask: int, softcap: bool = False, ordered: bool = False) -> Instance:
        smem = self.smem()
        return Instance(SM90_BWD_D256_SOURCE, f"attention_bwd_sm90_d256<{_ctype(dtype)}, {int(mask)}, {_b(softcap)}, "
                        f"{_b(ordered)}, {smem}>", 384, smem, "sm_90a")


@dataclass(frozen=True)
class Sm90BwdMlaConfig(Sm90BwdD256Config):
    """attention_bwd_sm90_mla (TMA + wgmma, sm_90a): q and k of 192 with v of 128 (DeepSeek's
    MLA), 96 keys a block, two computing warpgroups of 48 keys each computing every product for
    its own keys (dQ's columns split between them), query tiles of 64 rows in a ring of two, and
    a producer warpgroup (384 threads) whose second warp adds dQ by TMA reduce-add;
    deterministic=True takes the ORDERED instances (the adds in turns), as d256's."""
    block_keys = 96

    def smem(self) -> int:
        """K and V (96 rows x 192 and x 128), the Q and dO rings of two (64 rows x 192 and x 128
        each), P^T and two steps' dS^T (96 x 64), dQ's stage (64 x 192 float32), lse_log2 and Dsum
        (2 x 2 x 64), 1 KB slack."""
        qk, vo = 64 * 192 * 2, 64 * 128 * 2
        return 96 * (192 + 128) * 2 + 2 * (qk + vo) + 3 * 96 * 128 + 64 * 192 * 4 + 2 * 2 * 64 * 4 + 1024

    def instance(self, dtype: str, mask: int, softcap: bool = False, ordered: bool = False) -> Instance:
        smem = self.smem()
        return Instance(SM90_BWD_MLA_SOURCE, f"attention_bwd_sm90_mla<{_ctype(dtype)}, {int(mask)}, {_b(softcap)}, "
                        f"{_b(ordered)}, {smem}>", 384, smem, "sm_90a")


@dataclass(frozen=True)
class DqConfig:
    """attention_bwd_dq (deterministic=True): ``warps`` of 16 queries, ``bn`` keys a tile."""
    warps: int
    bn: int

    def smem(self, d: int, itemsize: int, dv: int | None = None) -> int:
        """Q and dO, two K and two V tiles (dO's and V's rows of the value head size ``dv``)."""
        return (16 * self.warps + 2 * self.bn) * (row_elems(d) + row_elems(dv or d)) * itemsize

    def instance(self, dtype: str, d: int, mask: int, softcap: bool = False, dropout: bool = False,
                 dv: int | None = None) -> Instance:
        """``mask``: Mask.kind (a bool: causal or not); ``dv``: the value head size (d unless given)."""
        smem = self.smem(d, _arrays.DTYPES[dtype][1], dv)
        return Instance(BWD_SOURCE, f"attention_bwd_dq<{_ctype(dtype)}, {d}, {dv or d}, {self.warps}, {self.bn}, "
                                    f"{int(mask)}, {_b(softcap)}, {_b(dropout)}, {smem}>", 32 * self.warps, smem)


@dataclass(frozen=True, eq=False)   # (hashed by identity: plans are keyed by it, on every call)
class Configs:
    """Configurations by head dim (measured: docs/notes-attention.md). ``dot_threads``: the
    Dsum and dQ-conversion kernels' blocks."""
    fwd: tuple[tuple[int, FwdConfig], ...]
    bwd: tuple[tuple[int, BwdConfig], ...]
    dq: tuple[tuple[int, DqConfig], ...]
    dot_threads: int = 256
    # Head dims whose value head size is its own, (q and k's, v's): DeepSeek's MLA (192 for the
    # scores, 128 for the values); every other head dim takes v's equal to it. On Hopper the
    # Hopper kernels take them (the backward: bwd_sm90_mla's), elsewhere the sm_80 ones.
    value_dims: tuple[tuple[int, int], ...] = ((192, 128),)
    # The forward on sm_90 (H100, H200) by TMA and wgmma, by head dim: key tiles as measured
    # fastest (tools/tune_attention.py; the figures: docs/notes-attention.md, the Hopper path).
    # d64, every mask: two blocks an SM of 128-key tiles, no producer (128 registers a thread),
    # two stages (three do not fit two blocks' shared memory); 64-key tiles with a producer issue
    # more instructions. d192 (with v's 128) and d256: the turns with the overlap, one work tile a
    # block (three stages do not fit; with two, K and V released on barriers of their own); d256's
    # tiles of 80 keys (FlashAttention-4's), 2-3.5% faster than 64.
    fwd_sm90: tuple[tuple[int, Sm90FwdConfig], ...] = (
        (64, Sm90FwdConfig(128, 2, pingpong=True, blocks_per_sm=2)),
        (128, Sm90FwdConfig(128, 3, producer=True, pingpong=True, overlap=True, persistent=True)),
        (192, Sm90FwdConfig(128, 2, producer=True, pingpong=True, overlap=True)),
        (256, Sm90FwdConfig(80, 2, producer=True, pingpong=True, overlap=True)))
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
        (128, Sm90FwdConfig(128, 3, producer=True, pingpong=True, overlap=True)),
        (192, Sm90FwdConfig(128, 2, producer=True, pingpong=True)))
    # ... and with dropout, as measured fastest among those that do not spill with the draw
    # (d64: 64-key tiles, two blocks an SM; d128: the turns without the overlap, whose instance
    # spilled with a window; d192 and d256: the same, the overlap's spilled 12-28 bytes with the
    # draw; docs/notes-attention.md)
    fwd_sm90_dropout: tuple[tuple[int, Sm90FwdConfig], ...] = (
        (64, Sm90FwdConfig(64, 2, pingpong=True, blocks_per_sm=2)),
        (128, Sm90FwdConfig(128, 3, producer=True, pingpong=True)),
        (192, Sm90FwdConfig(128, 2, producer=True, pingpong=True)),
        (256, Sm90FwdConfig(64, 2, producer=True, pingpong=True)))
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
    # ... with dropout (dense, no softcap): 64-row query tiles (d64's 128 spilled 168-336 B with
    # the draw; d128's persistent instance 4 B)
    bwd_sm90_dropout: tuple[tuple[int, Sm90BwdConfig], ...] = ((64, Sm90BwdConfig(64, producer=True, persistent=True)),
                                                               (128, Sm90BwdConfig(64, producer=True)))
    use_sm90_bwd: bool = True
    # Dropout on the Hopper kernels (forward: d64-d256, dense; backward: d64 and d128, dense, no
    # softcap); False: the sm_80 kernels, as packed documents and d256's backward take it
    use_sm90_dropout: bool = True
    # Head dim 256's Hopper backward (dense, not deterministic, no dropout).
    bwd_sm90_d256: Sm90BwdD256Config = Sm90BwdD256Config()
    use_sm90_bwd_d256: bool = True
    # MLA's Hopper backward (q and k 192, v 128; dense, no dropout; deterministic as d256's).
    bwd_sm90_mla: Sm90BwdMlaConfig = Sm90BwdMlaConfig()
    use_sm90_bwd_mla: bool = True
    # Dropout's sm_80 kernels (every GPU but Hopper, and there what its kernels do not take), with
    # these configs where the default's spill with the draw's registers (d32 and d64: half-width
    # key sub-tiles; d64's backward as d96's; d128's and d256's backward with 32-query steps:
    # d128's default spilled 4 B under NVRTC 12.9 with a window).
    fwd_dropout: tuple[tuple[int, FwdConfig], ...] = ((32, FwdConfig(4, 2, 64, 32, True)),
                                                      (64, FwdConfig(4, 2, 64, 32, True)))
    bwd_dropout: tuple[tuple[int, BwdConfig], ...] = ((64, BwdConfig(64, 128, 8, 2, 4, 4)),
                                                      (128, BwdConfig(32, 128, 8, 2, 4, 2)),
                                                      (256, BwdConfig(32, 64, 8, 2, 2, 2)))
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

    def dv(self, d: int) -> int:
        """The value head size the kernels take beside head dim ``d``."""
        return dict(self.value_dims).get(d, d)

    def sm80(self, which: str, d: int, dropout: bool = False):
        """The sm_80 kernel's config (``which``: fwd, bwd or dq) for head dim ``d``: with
        dropout, ``<which>_dropout``'s where it has one."""
        return (dropout and dict(getattr(self, f"{which}_dropout", ())).get(d)) or self.get(which, d)

    def sm90_forward(self, d: int, causal: bool, softcap: bool = False, dropout: bool = False) -> Sm90FwdConfig:
        """The Hopper forward's config for head dim ``d``: ``fwd_sm90_dropout``'s with dropout,
        ``fwd_sm90_softcap``'s with the softcap, else ``fwd_sm90_full``'s when not causal, where
        they have one; else ``fwd_sm90``'s."""
        return ((dropout and dict(self.fwd_sm90_dropout).get(d)) or (softcap and dict(self.fwd_sm90_softcap).get(d))
                or (not causal and dict(self.fwd_sm90_full).get(d)) or self.get("fwd_sm90", d))

    def sm90_backward(self, d: int, softcap: bool = False, dropout: bool = False) -> Sm90BwdConfig:
        """The Hopper backward's config for head dim ``d`` (``bwd_sm90_dropout``'s with dropout,
        ``bwd_sm90_softcap``'s with the softcap, else ``bwd_sm90``'s)."""
        return self.get("bwd_sm90_dropout" if dropout else "bwd_sm90_softcap" if softcap else "bwd_sm90", d)

    def replace(self, which: str, d: int, config) -> "Configs":
        """A new Configs with ``config`` for head dim ``d`` in table ``which`` (the tuning
        tools try candidates this way; the shipped CONFIGS never changes)."""
        import dataclasses

        table = tuple((k, config if k == d else c) for k, c in getattr(self, which))
        return dataclasses.replace(self, **{which: table})

    def dot(self, dtype: str, d: int, dv: int | None = None) -> Instance:
        """Dsum over the value head size ``dv`` (d unless given) and dQ's zeroed sums over d."""
        return Instance(BWD_SOURCE, f"attention_bwd_dot<{_ctype(dtype)}, {d}, {dv or d}>", self.dot_threads)

    def convert(self, dtype: str, d: int) -> Instance:
        return Instance(BWD_SOURCE, f"attention_bwd_dq_convert<{_ctype(dtype)}, {d}>", self.dot_threads)

    def sink(self) -> Instance:
        """The sinks' gradient: one block of 256 threads a head."""
        return Instance(BWD_SOURCE, "attention_bwd_sink", 256)


# CUKERN_ATTENTION_SM80=1 (read at import): Hopper runs the sm_80 kernels too, forward and backward
# (to compare the two paths, or to rule the Hopper kernels out when something looks wrong).
SM80_ONLY = os.environ.get("CUKERN_ATTENTION_SM80", "0") not in ("", "0")
CONFIGS = Configs(
    fwd=((32, FwdConfig(4, 2, 64, 64, True)), (64, FwdConfig(4, 2, 64, 64, True)), (96, FwdConfig(4, 2, 32, 32, False)),
         (128, FwdConfig(4, 2, 32, 32, False)), (192, FwdConfig(8, 1, 64, 64, False)),
         (256, FwdConfig(4, 1, 32, 32, False))),
    # Register budget of the backward: the dK and dV accumulators (keys x D) spread over all warps.
    bwd=((32, BwdConfig(128, 128, 8, 4, 8, 4)), (64, BwdConfig(128, 128, 8, 4, 4, 4)),
         (96, BwdConfig(64, 128, 8, 2, 4, 4)), (128, BwdConfig(64, 128, 8, 2, 4, 2)),
         (192, BwdConfig(64, 64, 8, 4, 2, 2)), (256, BwdConfig(64, 64, 8, 4, 2, 2))),
    dq=((32, DqConfig(4, 64)), (64, DqConfig(4, 64)), (96, DqConfig(4, 64)), (128, DqConfig(4, 64)),
        (192, DqConfig(4, 32)), (256, DqConfig(4, 32))),
    use_sm90=not SM80_ONLY, use_sm90_bwd=not SM80_ONLY,
    use_sm90_bwd_d256=not SM80_ONLY and os.environ.get("CUKERN_ATTENTION_BWD_D256", "1") not in ("", "0"),
    use_sm90_bwd_mla=not SM80_ONLY and os.environ.get("CUKERN_ATTENTION_BWD_MLA", "1") not in ("", "0"),
)
HEAD_DIMS = CONFIGS.head_dims
BWD_HEAD_DIMS = CONFIGS.bwd_head_dims


def instances(configs: Configs = CONFIGS) -> list[Instance]:
    """Every kernel instance the fronts can launch, forward and backward (compile check)."""
    dv = configs.dv
    out = [cfg.instance(dt, d, m, cap, dv=dv(d)) for dt in DTYPES for d, cfg in configs.fwd for m in (0, 1, 2)
           for cap in (False, True)]
    # (the Hopper forward's: chosen as the front chooses, by sm90_forward)
    out += [configs.sm90_forward(d, m > 0, cap).instance(dt, d, m, cap, dv=dv(d)) for dt in DTYPES
            for d, _ in configs.fwd_sm90 for m in (0, 1, 2) for cap in (False, True)]
    out += [cfg.instance(dt, d, m, cap, varlen=True, dv=dv(d)) for dt in DTYPES for d, cfg in configs.fwd_sm90_varlen
            for m in (0, 1, 2) for cap in (False, True)]
    # (deterministic: dQ's adds in turns where the config orders them, and attention_bwd_dq's
    # instance beside it, which the front takes where a group's key blocks outnumber the SMs)
    modes = ((False, False), (True, False), (True, True))
    for softcap, table in ((False, configs.bwd_sm90), (True, configs.bwd_sm90_softcap)):
        for varlen in (False, True):
            out += [cfg.instance(dt, d, m, det, softcap, varlen, ordered) for dt in DTYPES for d, cfg in table
                    for m in (0, 1, 2) for det, ordered in modes if not ordered or cfg.orders(d, m, 1, 1, varlen)]
    out += [cfg.instance(dt, m, cap, o) for cfg in (configs.bwd_sm90_d256, configs.bwd_sm90_mla) for dt in DTYPES
            for m in (0, 1, 2) for cap in (False, True) for o in (False, True)]
    # (dropout on Hopper: dense, no softcap)
    out += [configs.sm90_forward(d, m > 0, dropout=True).instance(dt, d, m, dropout=True, dv=dv(d)) for dt in DTYPES
            for d, _ in configs.fwd_sm90 for m in (0, 1, 2)]
    out += [cfg.instance(dt, d, m, det, ordered=ordered, dropout=True) for dt in DTYPES
            for d, cfg in configs.bwd_sm90_dropout for m in (0, 1, 2) for det, ordered in modes
            if not ordered or cfg.orders(d, m, 1, 1)]
    out += list({cfg.rows_instance().name: cfg.rows_instance()
                 for _, cfg in configs.bwd_sm90 + configs.bwd_sm90_softcap}.values())
    out.append(configs.sink())
    for dt in DTYPES:
        for d, cfg in configs.bwd:
            out.append(configs.dot(dt, d, dv(d)))
            out.append(configs.convert(dt, d))
            for m in (0, 1, 2):
                for cap in (False, True):
                    out += [cfg.instance(dt, d, m, det, cap, dv=dv(d)) for det in (False, True)]
                    out.append(configs.get("dq", d).instance(dt, d, m, cap, dv=dv(d)))
    # dropout's: every mask (the softcap is not taken with dropout)
    out += [configs.sm80("fwd", d, True).instance(dt, d, m, False, True, dv(d)) for dt in DTYPES
            for d, _ in configs.fwd for m in (0, 1, 2)]
    out += [configs.sm80("bwd", d, True).instance(dt, d, m, det, False, True, dv(d)) for dt in DTYPES
            for d, _ in configs.bwd for m in (0, 1, 2) for det in (False, True)]
    out += [configs.sm80("dq", d, True).instance(dt, d, m, False, True, dv(d)) for dt in DTYPES
            for d, _ in configs.bwd for m in (0, 1, 2)]
    return out
