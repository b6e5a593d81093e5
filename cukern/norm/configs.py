"""LayerNorm and RMSNorm's kernel configurations: row and loop configs, the shipped ``CONFIGS``
(read at each call: tools replace ``configs.CONFIGS``) and the kernel instances."""
from __future__ import annotations

from dataclasses import dataclass

from .. import _arrays
from .._kernels import Instance

SOURCE = "norm.cu"


# ---- kernel configurations --------------------------------------------------------------------

@dataclass(frozen=True)
class RowConfig:
    """norm_fwd / norm_bwd, a row in registers: a thread holds ``nv`` vectors of a row, ``g``
    threads own a row, a block has ``threads`` threads, a group takes ``r`` rows at a time, and
    ptxas is asked to fit ``minb`` blocks an SM (which sets the register budget)."""
    nv: int
    g: int
    threads: int
    r: int = 1
    minb: int = 1

    @property
    def capacity(self) -> int:
        """Vectors a row can have."""
        return self.nv * self.g

    @property
    def groups(self) -> int:
        """Row groups a block (each writes one partial weight-gradient row in the backward)."""
        return self.threads // self.g

    @property
    def rows_per_block(self) -> int:
        return self.groups * self.r

    def instance(self, kind: str, dtype: str, rms: bool, vec: int, offset: bool = False, cast: int = 0,
                 out: str | None = None) -> Instance:
        ctype = _arrays.DTYPES[dtype][0]
        return Instance(SOURCE, f"norm_{kind}<{ctype}, {str(rms).lower()}, {vec}, {self.nv}, {self.g}, "
                                f"{self.threads}, {self.r}, {self.minb}, {_variant(kind, dtype, offset, cast, out)}>",
                        self.threads)


@dataclass(frozen=True)
class LoopConfig:
    """norm_fwd_loop / norm_bwd_loop: rows of any width, one block a row, in chunks."""
    threads: int = 512
    rows_per_block = 1
    groups = 1

    def instance(self, kind: str, dtype: str, rms: bool, vec: int, offset: bool = False, cast: int = 0,
                 out: str | None = None) -> Instance:
        ctype = _arrays.DTYPES[dtype][0]
        return Instance(SOURCE, f"norm_{kind}_loop<{ctype}, {str(rms).lower()}, {vec}, {self.threads}, "
                                f"{_variant(kind, dtype, offset, cast, out)}>", self.threads)


def _variant(kind: str, dtype: str, offset: bool, cast: int, out: str | None) -> str:
    """The trailing template arguments: OFFSET, CAST and (forward) the output type TO."""
    args = f"{str(offset).lower()}, {cast}"
    if kind == "fwd":
        args += f", {_arrays.FP8[out][0] if out else _arrays.DTYPES[dtype][0]}"
    return args


@dataclass(frozen=True, eq=False)   # (hashed by identity: plans are keyed by it, on every call)
class Configs:
    """The row-in-registers configurations of each direction, in order of capacity (the first
    that holds the row is used; wider rows take the looped kernel). Chosen by measurement
    (docs/notes-norm.md); none spills (the compile check)."""
    fwd: tuple[RowConfig, ...]
    bwd: tuple[RowConfig, ...]
    loop: LoopConfig = LoopConfig()
    # the forward with a fused residual, where it differs from fwd (None: fwd's)
    residual: tuple[RowConfig, ...] | None = None
    # RMSNorm's plain forward (16-bit rows, no residual, casting mode or fp8 output) where its
    # row fills one of these exactly, in 16-byte vectors
    rms_exact: tuple[RowConfig, ...] = ()
    # the forward of 16-bit rows with an fp8 output and no residual, where it differs from fwd
    fp8: tuple[RowConfig, ...] | None = None

    def table(self, kind: str) -> tuple[RowConfig, ...]:
        """"fwd", "res" (the forward with a residual), "fp8" (16-bit rows to an fp8 output) or
        "bwd"."""
        if kind == "res":
            return self.residual or self.fwd
        if kind == "fp8":
            return self.fp8 or self.fwd
        return self.fwd if kind == "fwd" else self.bwd

    def rms_exact_pick(self, cols: int, vec: int) -> RowConfig | None:
        """rms_exact's config whose capacity is the row's vectors, if any."""
        if cols % vec == 0:
            for c in self.rms_exact:
                if c.capacity == cols // vec:
                    return c
        return None

    def pick(self, kind: str, cols: int, vec: int) -> RowConfig | LoopConfig:
        nvec = -(-cols // vec)
        for c in self.table(kind):
            if c.capacity >= nvec:
                return c
        return self.loop


_FWD_ROWS = (RowConfig(1, 4, 128), RowConfig(1, 16, 128), RowConfig(1, 32, 128, 2), RowConfig(2, 32, 128, 2),
             RowConfig(4, 32, 128), RowConfig(2, 128, 128), RowConfig(4, 128, 128, 2, 5), RowConfig(4, 256, 256),
             RowConfig(4, 512, 512))
CONFIGS = Configs(
    fwd=_FWD_ROWS,
    bwd=(RowConfig(1, 4, 128), RowConfig(1, 16, 128), RowConfig(1, 32, 128), RowConfig(2, 32, 128, 1, 6),
         RowConfig(4, 32, 128, 1, 4), RowConfig(2, 128, 128, 1, 6), RowConfig(4, 128, 128, 1, 4),
         RowConfig(4, 256, 256, 1, 2)),
    # (two rows a group lost a tenth with a residual at 4096 columns: one row, 8 blocks an SM)
    residual=_FWD_ROWS[:6] + (RowConfig(4, 128, 128, 1, 8),) + _FWD_ROWS[7:],
    # (a 4096-column row on 256 threads: faster for RMSNorm's plain forward, slower for LayerNorm,
    # the fp8 output and rows it does not fill: docs/notes-norm.md)
    rms_exact=(RowConfig(2, 256, 256, 1, 4),),
    # (a row of 257-512 vectors on 64 threads, 16 blocks an SM: the fp8 output's step is short
    # enough that more rows in flight pay; the 16-bit outputs lose 1-2% there)
    fp8=_FWD_ROWS[:6] + (RowConfig(8, 64, 64, 1, 16),) + _FWD_ROWS[7:],
)


# RMSNorm's casting modes (the CAST template argument; cuda_src/norm.cu says what each rounds).
# Their backward is one: "llama" and "none" differ in the forward's rstd alone.
CASTING_MODES = {"gemma": 0, "llama": 1, "none": 2}


def _variants(kind: str, dtype: str, rms: bool) -> list[tuple[int, str | None]]:
    """(cast, fp8 output) of the variants beside the plain one: the casting modes (RMSNorm,
    16-bit inputs) and the fp8 outputs (forward)."""
    out = []
    if rms and _arrays.DTYPES[dtype][1] == 2:
        out += [(c, None) for c in ((1, 2) if kind == "fwd" else (1,))]
    if kind == "fwd":
        out += [(0, f) for f in _arrays.FP8]
    return out


def instances(configs: Configs = CONFIGS) -> list[Instance]:
    """Every kernel instance the fronts can launch (for the compile check). The variants
    (casting modes, fp8 output) of rows that take scalar loads run the looped kernel."""
    out = []
    for dtype, (_, itemsize) in _arrays.DTYPES.items():
        for rms in (False, True):
            if rms and itemsize == 2:
                out += [c.instance("fwd", dtype, rms, 8, offset) for c in configs.rms_exact
                        for offset in (False, True)]
            for vec in sorted({1, 16 // itemsize}):
                for kind in ("fwd", "res", "bwd"):
                    table = configs.table(kind)
                    k = "bwd" if kind == "bwd" else "fwd"
                    out += [c.instance(k, dtype, rms, vec, offset) for c in (*table, configs.loop)
                            for offset in (False, True)]
                    cfgs = (*table, configs.loop) if vec > 1 else (configs.loop,)
                    out += [c.instance(k, dtype, rms, vec, offset, cast, fp8) for cast, fp8 in
                            _variants(k, dtype, rms) for c in cfgs for offset in (False, True)]
                    if kind == "fwd" and itemsize == 2 and vec > 1:
                        out += [c.instance(k, dtype, rms, vec, offset, 0, fp8) for fp8 in _arrays.FP8
                                for c in configs.table("fp8") for offset in (False, True)]
    return list(dict.fromkeys(out))   # (the residual table repeats most of fwd's)
