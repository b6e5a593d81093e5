"""GroupNorm: the ``group_norm`` cases of ``python -m cukern bench`` as asv metrics
(``track_<case>_gbps``, ``track_<case>_speedup``, ``track_copy_gbps``; see
``cukern._bench.asv_module``)."""
from cukern import _bench


def setup_cache():
    return _bench.asv_results(_bench.cases(family="group_norm"))


_bench.asv_module("group_norm", globals())
