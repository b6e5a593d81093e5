"""LayerNorm and RMSNorm: the ``norm`` cases of ``python -m cukern bench`` as asv metrics.

For each case of ``cukern._bench.cases(family="norm")`` (the workload's shapes, defined there
once): ``track_<case>_gbps``, cukern's effective bandwidth over the case's byte floor, and
``track_<case>_speedup``, torch's time over cukern's (same process, same inputs). Also
``track_copy_gbps``, the device's copy bandwidth measured in the same run, to read the others
against.

asv runs every benchmark in a fresh process, so the measurement happens once, in
``setup_cache`` (its result is handed to each benchmark): one CUDA-event timing of every case,
and each track_ function only reads its number. Without a GPU ``setup`` skips every benchmark.
"""
from cukern import _bench

FAMILY = "norm"
CASES = _bench.cases(family=FAMILY)
TIMEOUT = 1800  # seconds: the first run of a kernel instance compiles it (NVRTC)

timeout = TIMEOUT


def setup_cache():
    return _bench.asv_results(CASES)


setup_cache.timeout = TIMEOUT


def setup(measured):
    if measured.get("skip"):
        raise NotImplementedError(measured["skip"])


def _metric(measured, case_name, key):
    r = measured["cases"][case_name]
    if r.get("error"):
        raise RuntimeError(f"{case_name}: {r['error']}")
    return r[key]


def _track(case, key, unit, what):
    def track(measured):
        return _metric(measured, case.name, key)

    track.__name__ = track.__qualname__ = f"track_{_bench.slug(case.name)}_{what}"
    track.unit = unit
    track.timeout = TIMEOUT
    track.pretty_name = f"{FAMILY}: {case.name} ({case.shape_label} {case.dtype}), {what}"
    return track


for _case in CASES:
    for _key, _unit, _what in (("gbps", "GB/s", "gbps"), ("speedup", "x", "speedup")):
        _fn = _track(_case, _key, _unit, _what)
        globals()[_fn.__name__] = _fn
del _case, _key, _unit, _what, _fn


def track_copy_gbps(measured):
    return measured["copy_gbps"]


track_copy_gbps.unit = "GB/s"
track_copy_gbps.timeout = TIMEOUT
track_copy_gbps.pretty_name = f"{FAMILY}: device-to-device copy bandwidth (the ceiling)"
