"""Fused attention: the ``attention`` cases of ``python -m cukern bench`` as asv metrics
(``track_<case>_tflops``, ``track_<case>_speedup``; see ``cukern._bench.asv_module``)."""
from cukern import _bench


def setup_cache():
    return _bench.asv_results(_bench.cases(family="attention"))


_bench.asv_module("attention", globals())
