"""Cross-entropy's kernel configurations, the shipped ``CONFIGS`` (read at each call: tools replace
``configs.CONFIGS``), the options and the kernel instances."""
from __future__ import annotations

from dataclasses import dataclass

from .. import _arrays
from .._kernels import Instance

SOURCE = "cross_entropy.cu"
INDEX_CTYPES = {"int32": "int", "int64": "long long"}
REDUCTIONS = ("mean", "sum", "none")
FORWARD, TRAIN, BACKWARD = 0, 1, 2   # the row kernel's MODE

# ---- kernel configurations --------------------------------------------------------------------

@dataclass(frozen=True, eq=False)   # (hashed by identity: plans are keyed by it, on every call)
class Configs:
    """A block of ``threads`` a row (each thread loads 4 vectors a step); the count and reduce
    kernels run one block of ``single_threads``; the gradient scaling ``scale_threads`` a row."""
    threads: int = 512
    single_threads: int = 1024
    scale_threads: int = 256
    blocks_per_sm: int = 0   # the row kernel's grid: 0 = as many as fit (measured: docs/notes-cross-entropy.md)
    # The training form on sm_90+: a row over a cluster of CTAs (of the first of `clusters` sizes
    # and `cluster_threads` threads, taken threads first, that holds its part of the row with one
    # of the `cluster_nv` 16-byte vectors a thread, the fewest). The smallest cluster of 256-thread
    # CTAs whose part (at most 32 KB) is staged in shared memory: six CTAs an SM, the fewest
    # barriers a row (bf16, H200: 128256 classes 2.30 ms on 8 CTAs against 3.15 in two passes;
    # 32000 0.57 on 2 against 0.72; 8192 0.244 on 2 against 0.265). A cluster of 16 is beyond the
    # portable size (the front allows it per kernel). Rows of fewer than `cluster_min` classes keep
    # the two-pass kernel (docs/notes-cross-entropy.md, v2 to v3).
    clusters: tuple[int, ...] = (2, 4, 8)
    cluster_threads: tuple[int, ...] = (256,)
    cluster_nv: tuple[int, ...] = (1, 2, 4, 8)
    cluster_min: int = 8192
    use_cluster: bool = True
    # A cluster a row (the hardware schedules the next row's CTAs as others finish, so one CTA's
    # loads overlap another's reductions) or, persistent, as many clusters as fit looping over
    # rows (measured 1.9x slower: a row's load, reductions and barrier then run back to back).
    cluster_persistent: bool = False
    max_clusters: int = 1 << 27   # the cluster kernel's grid at most (it loops over the rest)
    # CTAs of these sizes stage their part of the row in shared memory by cp.async instead of
    # holding it in registers: 256-thread CTAs go from four an SM to six (7-19% faster); 128-thread
    # ones measured 5% slower staged.
    cluster_stage: tuple[int, ...] = (256,)

    def cluster_vectors(self, v: int, vec: int) -> tuple[int, int, int] | None:
        """(cluster, threads, nv) that hold a row of ``v`` classes, or None (too wide)."""
        for threads in self.cluster_threads:
            for cluster in self.clusters:
                cols = -(-v // cluster)      # columns a CTA, then vectors (as the kernel splits the row)
                per = -(-cols // vec)
                for nv in self.cluster_nv:
                    if nv * threads >= per:
                        return cluster, threads, nv
        return None

    def train_cluster(self, dtype: str, index: str, cluster: int, threads: int, nv: int) -> Instance:
        vec = 16 // _arrays.DTYPES[dtype][1]
        return Instance(SOURCE, f"cross_entropy_train_cluster<{_arrays.DTYPES[dtype][0]}, {INDEX_CTYPES[index]}, "
                                f"{vec}, {threads}, {nv}, {cluster}, {int(threads in self.cluster_stage)}>", threads,
                        cluster=cluster)

    def rows(self, dtype: str, index: str, vec: int, mode: int, dloss_dtype: str = "float32") -> Instance:
        return Instance(SOURCE, f"cross_entropy_rows<{_arrays.DTYPES[dtype][0]}, {INDEX_CTYPES[index]}, {vec}, "
                                f"{self.threads}, {mode}, {_arrays.DTYPES[dloss_dtype][0]}>", self.threads)

    def count(self, index: str) -> Instance:
        return Instance(SOURCE, f"cross_entropy_count<{INDEX_CTYPES[index]}, {self.single_threads}>",
                        self.single_threads)

    def reduce(self, dtype: str) -> Instance:
        return Instance(SOURCE, f"cross_entropy_reduce<{_arrays.DTYPES[dtype][0]}, {self.single_threads}>",
                        self.single_threads)

    def cast(self, dtype: str) -> Instance:
        return Instance(SOURCE, f"cross_entropy_cast<{_arrays.DTYPES[dtype][0]}>", 256)

    def scale(self, src_dtype: str, dtype: str, loss_dtype: str, vec: int) -> Instance:
        return Instance(SOURCE, f"cross_entropy_scale<{_arrays.DTYPES[src_dtype][0]}, {_arrays.DTYPES[dtype][0]}, "
                                f"{_arrays.DTYPES[loss_dtype][0]}, {vec}, {self.scale_threads}>", self.scale_threads)


CONFIGS = Configs()


def instances(configs: Configs = CONFIGS) -> list[Instance]:
    """Every kernel instance the fronts can launch (for the compile check)."""
    out = []
    for dtype, (_, itemsize) in _arrays.DTYPES.items():
        loss_dtypes = sorted({"float32", dtype})
        for vec in sorted({1, 16 // itemsize}):
            for index in INDEX_CTYPES:
                out += [configs.rows(dtype, index, vec, mode) for mode in (FORWARD, TRAIN)]
                out += [configs.rows(dtype, index, vec, BACKWARD, ld) for ld in loss_dtypes]
                if vec > 1:
                    out += [configs.train_cluster(dtype, index, cluster, threads, nv) for cluster in configs.clusters
                            for threads in configs.cluster_threads for nv in configs.cluster_nv]
        # (the linear cross-entropy's gradients, kept in float32, scaled into their dtype)
        out += [configs.scale("float32", dtype, ld, vec) for ld in loss_dtypes for vec in (1, 4)]
        out += [configs.reduce(dtype), configs.cast(dtype)]
    return out + [configs.count(index) for index in INDEX_CTYPES]
