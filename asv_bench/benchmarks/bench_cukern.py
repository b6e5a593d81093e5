"""Every family's benchmark cases as asv metrics, discovered from cukern's registry (a new
family needs no change here). One ``setup_cache`` measures everything in one process, so all
ratios of a run share its ceilings; each ``track_`` benchmark reads its number from it.

The benchmarks keep the names they had when each family had a module of its own
(``bench_norm.track_layer_norm_fwd_gbps``, ...), through asv's ``benchmark_name``, and carry an
explicit ``version`` (``cukern._bench.ASV_VERSION``), so the history survives moving code.
"""
from cukern import _bench


def setup_cache():
    return _bench.asv_results()


_bench.asv_benchmarks(globals())
