"""The shared launch mechanism, with no GPU: kernel signatures read from the CUDA sources,
arguments packed against them by name (a wrong C type, dtype or name is an error), and the
parameter buffer's layout against the C ABI."""
from __future__ import annotations

import struct

import numpy as np
import pytest

from cukern import _arrays, _kernels, norm
from cukern._kernels import Instance, Slot


def _array(dtype: str, ptr: int = 0x7F0000001000):
    return _arrays.DeviceArray(None, "cupy", ptr, (4,), (1,), dtype, 0, "a")


def test_signature_is_read_from_the_source_with_template_types_resolved():
    inst = norm.configs.CONFIGS.fwd[0].instance("fwd", "bfloat16", False, 8)
    sig = _kernels.signature(inst)
    assert sig.names == ("x", "x_stride", "res", "res_stride", "w", "b", "y", "h", "mean_out", "rstd_out",
                         "rows", "cols", "eps", "w_offset", "y_scale", "y_amax")
    assert sig.codes == ("P", "q", "P", "q", "P", "P", "P", "P", "P", "P", "q", "i", "f", "f", "P", "P")
    assert sig.dtypes[0] == "bfloat16" and sig.dtypes[6] == "bfloat16" and sig.dtypes[8] == "float32"
    f32 = _kernels.signature(norm.configs.CONFIGS.fwd[0].instance("fwd", "float32", True, 4))
    assert f32.dtypes[0] == "float32"
    fp8 = _kernels.signature(norm.configs.CONFIGS.fwd[0].instance("fwd", "bfloat16", True, 8, out="float8_e5m2"))
    assert fp8.dtypes[0] == "bfloat16" and fp8.dtypes[6] == "float8_e5m2" and fp8.dtypes[7] == "bfloat16"


def test_signature_errors_name_the_instance():
    with pytest.raises(ValueError, match="declares no __global__ function"):
        _kernels.signature(Instance("norm.cu", "no_such_kernel<float>", 128))
    with pytest.raises(ValueError, match="template arguments"):
        _kernels.signature(Instance("norm.cu", "norm_fwd<float, true>", 128))


def _norm_args(**over):
    args = dict(x=Slot(0), x_stride=64, res=None, res_stride=0, w=Slot(1), b=None, y=Slot(2), h=None,
                mean_out=None, rstd_out=Slot(3), rows=10, cols=64, eps=1e-5, w_offset=0.0, y_scale=None, y_amax=None)
    args.update(over)
    return args


SIG = _kernels.signature(Instance("norm.cu", "norm_fwd<cuk::bf16, true, 8, 1, 4, 128, 1, 1, false, 0, cuk::bf16>",
                                  128))
DTYPES = {0: "bfloat16", 1: "bfloat16", 2: "bfloat16", 3: "float32"}


def test_arguments_are_packed_by_name_as_the_c_parameter_list():
    layout, values, slots = _kernels.pack(SIG, "k", _norm_args(), DTYPES)
    # pointers 8 bytes, long long 8, int 4 and float 4 at their natural alignment
    assert layout.size == 10 * 8 + 8 + 4 + 4 + 4 + 4 + 2 * 8   # (4 bytes of padding before y_scale)
    assert [(at, slot) for at, slot, _ in slots] == [(0, 0), (4, 1), (6, 2), (9, 3)]
    buf = bytearray(layout.size)
    values[0] = 0x1000
    layout.pack_into(buf, 0, *values)
    assert struct.unpack_from("<Q", buf, 0)[0] == 0x1000
    assert struct.unpack_from("<q", buf, 8)[0] == 64
    assert struct.unpack_from("<q", buf, 80)[0] == 10       # rows
    assert struct.unpack_from("<i", buf, 88)[0] == 64       # cols
    assert struct.unpack_from("<f", buf, 92)[0] == pytest.approx(1e-5)
    _, _, slots = _kernels.pack(SIG, "k", _norm_args(y=Slot(2) + 256), DTYPES)
    assert (6, 2, 256) in slots


@pytest.mark.parametrize("over, exc, pattern", [
    ({"x": Slot(3)}, TypeError, "x points to bfloat16, but the array given has dtype float32"),
    ({"rstd_out": Slot(0)}, TypeError, "rstd_out points to float32"),
    ({"w": _array("float16")}, TypeError, "w points to bfloat16"),
    ({"rows": 2.5}, TypeError, "rows is an integer"),
    ({"cols": 2**31}, ValueError, "cols = 2147483648 is outside the range"),
    ({"rows": True}, TypeError, "rows is a scalar"),
    ({"x": 5}, TypeError, "x is a pointer"),
    ({"eps": None}, TypeError, "eps is a scalar"),
    ({"extra": 1}, TypeError, r"unknown \['extra'\]"),
])
def test_a_wrong_argument_is_an_error_not_a_shifted_list(over, exc, pattern):
    with pytest.raises(exc, match=pattern):
        _kernels.pack(SIG, "k", _norm_args(**over), DTYPES)
    args = _norm_args()
    del args["eps"]
    with pytest.raises(TypeError, match=r"missing \['eps'\]"):
        _kernels.pack(SIG, "k", args, DTYPES)


def test_numpy_scalars_are_taken_by_value():
    layout, values, _ = _kernels.pack(SIG, "k", _norm_args(rows=np.int64(7), eps=np.float32(0.5)), DTYPES)
    assert values[10] == 7 and values[12] == 0.5


# ---- a struct taken by value (the attention kernels' parameters) -------------------------------

_STRUCT_SOURCE = """
namespace ns {
struct Inner { int a, b; float c; const int* cu; long long* fault; };
template <typename T> struct Params {
    const T* x;
    T* y;
    int n;          // (4 bytes of padding follow: Inner starts 8-aligned)
    Inner inner;
    int tail;       // (4 bytes of padding end the struct: its size is a multiple of 8)
};
struct Helper { int k; __device__ int twice() const { return 2 * k; } };
}
template <typename T, int N>
__global__ void with_struct(const __grid_constant__ CUtensorMap m, const __grid_constant__ ns::Params<T> p,
                            int after) {}
template <typename T>
__global__ void with_helper(ns::Helper h) {}
template <typename T>
__global__ void twice_named(ns::Params<T> p, int n) {}
"""


@pytest.fixture
def struct_source(monkeypatch):
    from cukern import _signatures, _sources

    real = _sources.load_source
    monkeypatch.setattr(_sources, "load_source", lambda name: _STRUCT_SOURCE if name == "structs.cu" else real(name))
    for fn in (_signatures.declarations, _signatures._struct_bodies, _signatures.signature):
        fn.cache_clear()
    yield Instance("structs.cu", "with_struct<cuk::bf16, 4>", 128)
    for fn in (_signatures.declarations, _signatures._struct_bodies, _signatures.signature):
        fn.cache_clear()


def test_a_struct_parameter_is_flattened_into_its_fields_at_the_c_layout(struct_source):
    sig = _kernels.signature(struct_source)
    assert sig.names == ("m", "x", "y", "n", "a", "b", "c", "cu", "fault", "tail", "after")
    assert sig.codes == (_kernels.TENSOR_MAP, "P", "P", "i", "i", "i", "f", "P", "P", "i", "i")
    assert sig.dtypes[1:3] == ("bfloat16", "bfloat16") and sig.dtypes[7:9] == ("int32", "int64")
    # the map at 0 (128 bytes); Params 8-aligned at 128: x 0, y 8, n 16, Inner at 24 (a 0, b 4,
    # c 8, cu 16, fault 24: 32 bytes), tail 56, size 64; after at 192
    assert sig.offsets == (0, 128, 136, 144, 152, 156, 160, 168, 176, 184, 192)
    assert sig.param_offsets == (0, 128, 192)
    assert struct.calcsize(sig.format) == 196


def test_a_struct_is_packed_by_field_name(struct_source):
    sig = _kernels.signature(struct_source)
    args = dict(m=bytes(range(128)), x=Slot(0), y=Slot(1), n=7, a=-1, b=2, c=0.5, cu=None, fault=None, tail=9, after=3)
    layout, values, slots = _kernels.pack(sig, "k", args, {0: "bfloat16", 1: "bfloat16"})
    raw = layout.pack(*values)
    assert [at for at, _, _ in slots] == [1, 2]
    assert struct.unpack_from("i", raw, 144)[0] == 7 and struct.unpack_from("ii", raw, 152) == (-1, 2)
    assert struct.unpack_from("f", raw, 160)[0] == 0.5 and struct.unpack_from("i", raw, 184)[0] == 9
    assert struct.unpack_from("i", raw, 192)[0] == 3
    with pytest.raises(TypeError, match=r"missing \['tail'\], unknown \['p'\]"):
        _kernels.pack(sig, "k", {**{k: v for k, v in args.items() if k != "tail"}, "p": 1}, {})
    with pytest.raises(TypeError, match="parameter cu points to int32"):
        _kernels.pack(sig, "k", {**args, "cu": _array("int64")}, {0: "bfloat16", 1: "bfloat16"})
    with pytest.raises(ValueError, match="n = 4294967296 is outside"):
        _kernels.pack(sig, "k", {**args, "n": 2**32}, {0: "bfloat16", 1: "bfloat16"})


def test_a_struct_with_more_than_fields_or_a_repeated_name_is_refused(struct_source):
    with pytest.raises(ValueError, match="more than data members"):
        _kernels.signature(Instance("structs.cu", "with_helper<float>", 128))
    with pytest.raises(ValueError, match=r"fields \['n'\] appear twice"):
        _kernels.signature(Instance("structs.cu", "twice_named<float>", 128))
