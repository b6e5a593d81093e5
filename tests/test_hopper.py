"""The Hopper primitives (cuda_src/common/hopper.cuh) and their host side: TMA tensor maps
(cukern._tensormap, checked with no GPU), their packing as kernel parameters, and the two
products attention makes, by one warpgroup through TMA, an mbarrier and wgmma, against NumPy
(sm_90 GPUs): A·Bᵀ from shared memory (S = QKᵀ) and P·V with P in registers (O += PV)."""
from __future__ import annotations

import struct

import numpy as np
import pytest

from cukern import _hopper, _kernels, _tensormap

from arrays import assert_close, np_dtype, poison_allocator, random_host, to_device, torch

gpu = pytest.mark.gpu
FRAMEWORKS = ["cupy", "torch"] if torch is not None else ["cupy"]


def _check(**kw):
    args = dict(name="q", shape=(256, 128), strides=(128, 1), itemsize=2, dtype="bfloat16", address=1 << 20,
                box=(64, 64), swizzle=128)
    args.update(kw)
    _tensormap.check_tile_map(**args)


def test_a_valid_map_passes_the_checks():
    _check()
    _check(shape=(4, 2048, 16, 128), strides=(2048 * 16 * 128, 16 * 128, 128, 1), box=(1, 128, 1, 64))
    _check(strides=(192, 1))                        # rows of a wider array (384 bytes apart)
    _check(swizzle=0, box=(64, 128))                # no swizzle: any inner extent of 16-byte multiples


@pytest.mark.parametrize("kw, match", [
    (dict(address=(1 << 20) + 8), "q: the data must start 16-byte aligned"),
    (dict(strides=(128, 2)), "q: the innermost axis must have unit stride"),
    (dict(strides=(100, 1)), "q: every outer stride must be a positive multiple of 16 bytes"),
    (dict(box=(257, 64)), "q: every box extent must be 1 to 256"),
    (dict(box=(64, 4)), r"q: the box's inner extent \(4 elements, 8 bytes\) must be a multiple of 16"),
    (dict(box=(64, 128)), r"q: the box's inner extent \(256 bytes\) must fit the 128-byte swizzle"),
    (dict(box=(64,)), "q: box .* must have one extent an axis"),
    (dict(dtype="int32", itemsize=4), "q: dtype int32 has no tensor map"),
    (dict(shape=(1,) * 6, strides=(8,) * 5 + (1,), box=(1,) * 6), "q: a tensor map takes 1 to 5 axes"),
    (dict(swizzle=16), "swizzle: 16 bytes"),
])
def test_bad_maps_are_refused_naming_the_argument(kw, match):
    with pytest.raises(ValueError, match=match):
        _check(**kw)


def test_tensor_maps_are_packed_by_value_64_byte_aligned():
    inst = _hopper.instance("bfloat16", 128, 128)
    sig = _kernels.signature(inst)
    assert sig.names == ("a_map", "b_map", "c") and sig.codes == (_kernels.TENSOR_MAP, _kernels.TENSOR_MAP, "P")
    a, b = bytes(range(128)), bytes(range(128, 256))

    class Array:   # a fixed float32 array argument
        ptr, dtype = 0xABC0, "float32"

    layout, values, slots = _kernels.pack(sig, inst.name, {"a_map": a, "b_map": b, "c": Array()}, {})
    raw = layout.pack(*values)
    assert raw[:128] == a and raw[128:256] == b and struct.unpack_from("Q", raw, 256)[0] == 0xABC0
    with pytest.raises(TypeError, match="a_map is a CUtensorMap"):
        _kernels.pack(sig, inst.name, {"a_map": a[:64], "b_map": b, "c": None}, {})


def test_a_map_after_a_scalar_is_padded_to_64_bytes():
    sig = _kernels.Signature("k", ("n", "m"), ("i", _kernels.TENSOR_MAP), (None, None))
    layout, values, _ = _kernels.pack(sig, "k", {"n": 7, "m": bytes(128)}, {})
    assert layout.size == 192 and struct.unpack_from("i", layout.pack(*values), 0)[0] == 7


def test_the_self_check_is_built_for_sm90a_alone():
    insts = _hopper.instances()
    assert any("hopper_tile_pv" in i.name for i in insts)
    assert insts and all(i.arch == "sm_90a" and i.threads == 128 for i in insts)
    assert all(i.smem > 48 * 1024 for i in insts if "256, 2," in i.name)   # (the opt-in above 48 KB)


def test_tile_product_checks_its_arguments_before_any_device_work(host_arrays_as_device):
    a = np.ones((64, 64), np.float16)
    with pytest.raises(ValueError, match=r"a: must be \(64, K\)"):
        _hopper.tile_product(np.ones((32, 64), np.float16), a)
    with pytest.raises(ValueError, match=r"b: must be \(N, 64\)"):
        _hopper.tile_product(a, np.ones((96, 64), np.float16))
    with pytest.raises(ValueError, match="b: dtype bfloat16 differs from a's float16"):
        _hopper.tile_product(a, np.ones((64, 64), np_dtype("bfloat16")))
    with pytest.raises((TypeError, ValueError), match="b: dtype float32 is not supported"):
        _hopper.tile_product(a, np.ones((64, 64), np.float32))
    with pytest.raises(ValueError, match=r"p: must be a contiguous \(64, KV\)"):
        _hopper.tile_pv(np.ones((64, 128), np.float16)[:, :64], a)
    with pytest.raises(ValueError, match=r"v: must be \(64, D\)"):
        _hopper.tile_pv(a, np.ones((64, 96), np.float16))
    with pytest.raises(ValueError, match="v: dtype bfloat16 differs from p's float16"):
        _hopper.tile_pv(a, np.ones((64, 64), np_dtype("bfloat16")))


@gpu
@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("dtype", _hopper.DTYPES)
@pytest.mark.parametrize("n", _hopper.NS)
@pytest.mark.parametrize("k", _hopper.KS)
def test_tile_product_matches_numpy(framework, dtype, n, k):
    """TMA (128-byte swizzle), the mbarrier's transaction count and wgmma's descriptors and k16
    steps: any of them wrong scrambles or drops products. B's rows are strided (a slice of a
    wider array), and the output comes from NaN-poisoned memory."""
    if _kernels.compute_capability(0) != (9, 0):
        pytest.skip("the Hopper primitives need an sm_90 GPU")
    rng = np.random.default_rng(n * 1000 + k)
    ah = random_host(rng, (64, k), dtype)
    bh_wide = random_host(rng, (n, k + 64), dtype)
    a = to_device(ah, framework)
    b = to_device(bh_wide, framework)[:, 32:32 + k]   # rows 2·(k + 64) bytes apart, 64 bytes in
    poison_allocator(framework, [64 * n * 4])
    c = _hopper.tile_product(a, b)
    ref = ah.astype(np.float64) @ bh_wide[:, 32:32 + k].astype(np.float64).T
    assert_close(c, ref, "float32", "c", tol=1e-5)


@gpu
@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("dtype", _hopper.DTYPES)
@pytest.mark.parametrize("d", _hopper.DS)
@pytest.mark.parametrize("kv", _hopper.KVS)
def test_tile_pv_matches_numpy(framework, dtype, d, kv):
    """P in wgmma's A registers and V read MN-major (transposed B) from 128-byte-swizzled
    boxes: a wrong fragment order, leading or stride byte offset, or k16 step scrambles C. V's
    rows are strided (a slice of a wider array); the output comes from NaN-poisoned memory."""
    if _kernels.compute_capability(0) != (9, 0):
        pytest.skip("the Hopper primitives need an sm_90 GPU")
    rng = np.random.default_rng(d * 1000 + kv)
    ph = random_host(rng, (64, kv), dtype)
    vh_wide = random_host(rng, (kv, d + 64), dtype)
    p = to_device(ph, framework)
    v = to_device(vh_wide, framework)[:, 64:64 + d]
    poison_allocator(framework, [64 * d * 4])
    c = _hopper.tile_pv(p, v)
    ref = ph.astype(np.float64) @ vh_wide[:, 64:64 + d].astype(np.float64)
    assert_close(c, ref, "float32", "c", tol=1e-5)


def test_tile_map_hands_the_driver_the_axes_innermost_first(monkeypatch):
    """(A stand-in driver: what cuTensorMapEncodeTiled receives, and the 128 bytes it writes
    at a 64-byte-aligned address coming back as the map.)"""
    import ctypes

    from cukern import _arrays, _driver

    seen = {}

    class Driver:
        def cuTensorMapEncodeTiled(self, tmap, dt, rank, addr, dims, strides, box, es, il, sw, l2, oob):
            n = rank.value
            seen.update(aligned=tmap.value % 64 == 0, dt=dt.value, addr=addr.value, dims=list(dims)[:n],
                        strides=list(strides)[:n - 1], box=list(box)[:n], es=list(es)[:n], il=il.value,
                        swizzle=sw.value, oob=oob.value)
            ctypes.memmove(tmap.value, bytes(range(128)), 128)
            return 0

    monkeypatch.setattr(_driver, "library", lambda: Driver())
    # (4, 2048, 16, 128) bf16 with its rows 192 elements apart: a (B, S, H, D) view of a wider array
    a = _arrays.DeviceArray(None, "cupy", 1 << 20, (4, 2048, 16, 128), (2048 * 16 * 192, 16 * 192, 192, 1),
                            "bfloat16", 0, "k")
    m = _tensormap.tile_map(a, (1, 128, 1, 64))
    assert m.raw == bytes(range(128)) and m.box == (1, 128, 1, 64) and m.box_bytes == 128 * 64 * 2
    assert seen == dict(aligned=True, dt=9, addr=1 << 20, dims=[128, 16, 2048, 4],
                        strides=[384, 16 * 384, 2048 * 16 * 384], box=[64, 1, 128, 1], es=[1, 1, 1, 1], il=0,
                        swizzle=3, oob=0)
    # an axis of one element may have any stride (0 here): the driver gets one it takes
    one = _arrays.DeviceArray(None, "cupy", 1 << 20, (1, 2048, 1, 128), (0, 192, 0, 1), "bfloat16", 0, "k")
    _tensormap.tile_map(one, (1, 128, 1, 64))
    assert seen["strides"] == [256, 384, 2048 * 384]


def test_a_launch_writes_pointers_and_per_call_maps_into_the_parameter_buffer(monkeypatch):
    """Launch.__call__ on the CPU (the driver call stood in for): each pointer slot gets its
    buffer's address plus offset, each map slot the map of its buffer as it is at this call, the
    rest the packed constants; a kernel with a map gets kernelParams, a pointer to each parameter
    (the whole-buffer form faults on the GPU with maps)."""
    import ctypes
    from types import SimpleNamespace

    from cukern import _arrays, _driver

    inst = _hopper.pv_instance("bfloat16", 64, 64)
    sig = _kernels.signature(inst)
    args = {"p": _kernels.Slot(0), "v_map": _kernels.MapSlot(1, (64, 64)), "c": _kernels.Slot(2, 256)}
    layout, values, slots = _kernels.pack(sig, inst.name, args, {0: "bfloat16", 2: "float32"})
    kernel = SimpleNamespace(ptr=0xF00, instance=inst, signature=sig)
    launch = _kernels.Launch(kernel, (1, 1, 1), (128, 1, 1), layout, values, slots)
    encoded = []

    class Driver:
        def cuTensorMapEncodeTiled(self, tmap, dt, rank, addr, *rest):
            encoded.append(addr.value)
            ctypes.memmove(tmap.value, addr.value.to_bytes(8, "little") * 16, 128)
            return 0

    monkeypatch.setattr(_driver, "library", lambda: Driver())
    seen = []

    def launch_kernel(*a):   # kernelParams: a pointer to each of p, v_map and c; no extra
        assert a[-1] == 0
        params = ctypes.cast(a[-2], ctypes.POINTER(ctypes.c_void_p))
        base = params[0]
        assert [params[i] - base for i in range(3)] == [0, 64, 192]
        seen.append((a, ctypes.string_at(base, layout.size)))

    monkeypatch.setattr(_kernels, "_launch_kernel", launch_kernel)
    # the map follows the buffer from call to call; an address seen lately reuses its map, with
    # no driver call (the plan fixes everything else about the buffer)
    for v_ptr in (0x10000, 0x20000, 0x10000, 0x20000):
        bufs = [None, _arrays.DeviceArray(None, "cupy", v_ptr, (64, 64), (64, 1), "bfloat16", 0, "v"), None]
        launch(bufs, [0x5000, v_ptr, 0x9000], stream=7)
        got, raw = seen[-1]
        assert got[:8] == (0xF00, 1, 1, 1, 128, 1, 1, inst.smem) and got[8] == 7 and len(raw) == layout.size
        assert struct.unpack_from("Q", raw, 0)[0] == 0x5000
        assert raw[64:192] == v_ptr.to_bytes(8, "little") * 16
        assert struct.unpack_from("Q", raw, 192)[0] == 0x9000 + 256
    assert encoded == [0x10000, 0x20000]
    # more addresses than it keeps: still each one's own map
    for i in range(20):
        v_ptr = 0x100000 + 0x1000 * (i % 10)
        bufs = [None, _arrays.DeviceArray(None, "cupy", v_ptr, (64, 64), (64, 1), "bfloat16", 0, "v"), None]
        launch(bufs, [0x5000, v_ptr, 0x9000], stream=7)
        assert seen[-1][1][64:192] == v_ptr.to_bytes(8, "little") * 16
    # a misaligned address is checked as on the first call, by name
    bad = [None, _arrays.DeviceArray(None, "cupy", 0x30008, (64, 64), (64, 1), "bfloat16", 0, "v"), None]
    with pytest.raises(ValueError, match="^v: "):
        launch(bad, [0x5000, 0x30008, 0x9000], stream=7)


def test_parameter_offsets_follow_the_packed_layout():
    """kernelParams points into the packed buffer: each parameter's offset (pointers and
    scalars at their natural alignment, a tensor map at 64 bytes) is where pack put its value."""
    sig = _kernels.Signature("k", ("a", "n", "m", "x", "b", "m2"), ("P", "i", "M", "f", "I", "M"),
                             (None,) * 6)
    args = {"a": None, "n": 7, "m": bytes(range(128)), "x": 0.5, "b": 9, "m2": bytes(range(1, 129))}
    layout, values, _ = _kernels.pack(sig, "k", args, {})
    raw = layout.pack(*values)
    at = sig.param_offsets
    assert at == (0, 8, 64, 192, 196, 256) and layout.size == 384
    assert struct.unpack_from("i", raw, at[1])[0] == 7 and raw[at[2]:at[2] + 128] == bytes(range(128))
    assert struct.unpack_from("f", raw, at[3])[0] == 0.5 and struct.unpack_from("I", raw, at[4])[0] == 9
    assert raw[at[5]:at[5] + 128] == bytes(range(1, 129))
