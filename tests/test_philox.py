"""Philox4x32-10, the random words attention dropout draws: cukern/_philox.py (NumPy, the
references') against the published known answers, and against cuda_src/common/philox.cuh (the
kernels') compiled for the host, word for word and keep bit for keep bit."""
from __future__ import annotations

import os
import shutil
import subprocess

import numpy as np
import pytest

from cukern import _philox, _sources

# Random123's known-answer vectors for philox4x32 with 10 rounds: counter, key, output
KAT = [((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
       ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
       ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
        (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1))]


@pytest.mark.parametrize("counter, key, expect", KAT)
def test_numpy_philox_gives_the_known_answers(counter, key, expect):
    assert tuple(int(v) for v in _philox.philox4x32_10(counter, key)) == expect


def test_numpy_philox_is_elementwise_over_any_batch_shape():
    rng = np.random.default_rng(0)
    counters = rng.integers(0, 2**32, (3, 5, 4), dtype=np.uint64).astype(np.uint32)
    keys = rng.integers(0, 2**32, (3, 5, 2), dtype=np.uint64).astype(np.uint32)
    got = _philox.philox4x32_10(counters, keys)
    for idx in np.ndindex(3, 5):
        np.testing.assert_array_equal(got[idx], _philox.philox4x32_10(counters[idx], keys[idx]))


_HOST_MAIN = r"""
#include <cstdio>
#include "philox.cuh"
// stdin: "w c0 c1 c2 c3 k0 k1" (words) or "k seed offset bh i j threshold" (keep bits)
int main() {
    char what;
    while (std::scanf(" %c", &what) == 1) {
        if (what == 'w') {
            unsigned int c[4], k[2];
            std::scanf("%u %u %u %u %u %u", c, c + 1, c + 2, c + 3, k, k + 1);
            cuk::Philox4 r = cuk::philox4x32_10(cuk::Philox4{c[0], c[1], c[2], c[3]}, k[0], k[1]);
            std::printf("%u %u %u %u\n", r.x, r.y, r.z, r.w);
        } else {
            unsigned long long seed;
            unsigned int offset, bh, i, j, threshold;
            std::scanf("%llu %u %u %u %u %u", &seed, &offset, &bh, &i, &j, &threshold);
            std::printf("%u\n", cuk::dropout_keep2(seed, offset, bh, i, j, threshold));
        }
    }
}
"""


@pytest.fixture(scope="module")
def host_philox(tmp_path_factory):
    """cuda_src/common/philox.cuh compiled for the host with the system's C++ compiler."""
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        if os.environ.get("CI"):
            pytest.fail("CI is set but no C++ compiler is found: the device Philox would go unchecked")
        pytest.skip("no C++ compiler (c++, g++ or $CXX)")
    d = tmp_path_factory.mktemp("philox")
    (d / "main.cpp").write_text(_HOST_MAIN)
    header = _sources.source_dir() / "common"
    subprocess.run([cxx, "-O1", "-std=c++17", f"-I{header}", str(d / "main.cpp"), "-o", str(d / "philox")],
                   check=True, capture_output=True, text=True, timeout=120)
    return d / "philox"


def _run(binary, lines: list[str]) -> list[str]:
    done = subprocess.run([str(binary)], input="\n".join(lines) + "\n", capture_output=True, text=True, timeout=60,
                          check=True)
    return done.stdout.split("\n")[:len(lines)]


def test_device_philox_gives_numpys_words(host_philox):
    rng = np.random.default_rng(1)
    counters = rng.integers(0, 2**32, (300, 4), dtype=np.uint64).astype(np.uint32)
    keys = rng.integers(0, 2**32, (300, 2), dtype=np.uint64).astype(np.uint32)
    counters[:3], keys[:3] = [c for c, _, _ in KAT], [k for _, k, _ in KAT]
    out = _run(host_philox, [f"w {' '.join(map(str, c))} {k[0]} {k[1]}" for c, k in zip(counters, keys)])
    got = np.array([[int(v) for v in line.split()] for line in out], dtype=np.uint32)
    np.testing.assert_array_equal(got, _philox.philox4x32_10(counters, keys))
    assert [tuple(int(v) for v in row) for row in got[:3]] == [e for _, _, e in KAT]


@pytest.mark.parametrize("p", [0.0, 0.1, 0.5, 0.9375])
def test_device_keep_bits_are_numpys_mask(host_philox, p):
    rng = np.random.default_rng(2)
    seed, offset = int(rng.integers(0, 2**63)), int(rng.integers(0, 2**32))
    bh, rows, keys = (rng.integers(0, n, 200) for n in (64, 4096, 4096))
    keys = keys & ~1   # (a pair of keys a line)
    t = _philox.dropout_threshold(p)
    out = _run(host_philox, [f"k {seed} {offset} {a} {b} {c} {t}" for a, b, c in zip(bh, rows, keys)])
    bits = np.array([int(v) for v in out])
    expect = _philox.dropout_keep(seed, offset, bh[:, None], rows[:, None], keys[:, None] + np.arange(2), p)
    np.testing.assert_array_equal((bits[:, None] >> np.arange(2)) & 1, expect.astype(int))


def test_the_mask_keeps_one_minus_p_and_differs_by_call_and_element():
    shape_bh, rows, keys = np.arange(4)[:, None, None], np.arange(64)[None, :, None], np.arange(512)[None, None, :]
    for p in (0.1, 0.5):
        keep = _philox.dropout_keep(7, 0, shape_bh, rows, keys, p)
        n = keep.size
        assert abs(keep.mean() - (1 - p)) < 5 * np.sqrt(p * (1 - p) / n)
        other = _philox.dropout_keep(7, 1, shape_bh, rows, keys, p)   # the next call: a new mask
        assert abs((keep != other).mean() - 2 * p * (1 - p)) < 5 * np.sqrt(2 * p * (1 - p) / n)
        seed2 = _philox.dropout_keep(8, 0, shape_bh, rows, keys, p)
        assert abs((keep != seed2).mean() - 2 * p * (1 - p)) < 5 * np.sqrt(2 * p * (1 - p) / n)
    assert _philox.dropout_keep(7, 0, shape_bh, rows, keys, 0.0).all()


def test_threshold_refuses_what_is_not_a_probability():
    assert _philox.dropout_threshold(0.0) == 0 and _philox.dropout_threshold(0.5) == 2**15
    assert _philox.dropout_threshold(1 - 2**-40) == 2**16 - 1
    for bad in (-0.1, 1.0, float("nan")):
        with pytest.raises(ValueError, match="^dropout_p: must be in"):
            _philox.dropout_threshold(bad)
