"""Embedding lookup (quant/embed.py): bit-exact against formats.dequantize for every
supported table type; ids read on the device (a view of the state array for decode);
PTX for sm_87 / sm_90 without float64; GPU at the real shape (151936 x 2560, -m gpu)."""
import numpy as np
import pytest
from numba import cuda

from genie_rt.quant import embed
from genie_rt.quant.formats import QType, dequantize, quantize
from genie_rt.quant.layout import pack
from ptx_helpers import assert_no_f64, assert_ptx_contains, compile_in_subprocess

TYPES = sorted(embed.SUPPORTED, key=lambda q: q.name)


def make_table(qtype, rows, cols, seed=0):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((rows, cols)).astype(np.float32)
    w[1] *= 1e-3                                     # tiny scales
    w[2] = np.abs(w[2])                              # one-signed rows (Q4_K mins)
    raw = quantize(w, qtype)
    return raw, pack(raw, qtype, (rows, cols))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_rows_are_bit_exact(qtype):
    rows, cols = 13, 512
    raw, host = make_table(qtype, rows, cols)
    dev = embed.to_device(host)
    ids_h = np.array([3, 0, 12, 3, 2, 1], np.int32)     # repeats, first and last rows
    out = cuda.device_array((len(ids_h), cols), np.float32)
    embed.embed(dev, cuda.to_device(ids_h), out)
    ref = dequantize(raw, qtype, (rows, cols))[ids_h]
    got = out.copy_to_host()
    assert np.array_equal(got.view(np.uint32), ref.view(np.uint32)), \
        f"{qtype.name}: {np.sum(got != ref)} weights differ, first at {np.argwhere(got != ref)[:3].tolist()}"
    np.testing.assert_array_equal(embed.embed_reference(host, ids_h), ref)


@pytest.mark.parametrize("qtype", [QType.Q8_0, QType.Q4_K, QType.Q4_1], ids=lambda q: q.name)
def test_scale_multiplies_in_float32(qtype):
    """Gemma's embeddings times sqrt(hidden): one float32 multiply per weight, bit-exact
    with the reference (dequantize, then * float32(scale)); 576 columns = 2.25 super-blocks
    of the grid's 256-weight tiles (the last tile part-empty)."""
    rows, cols = 7, 576 if qtype != QType.Q4_K else 512
    raw, host = make_table(qtype, rows, cols, seed=3)
    dev = embed.to_device(host)
    ids_h = np.array([6, 0, 2], np.int32)
    out = cuda.device_array((3, cols), np.float32)
    scale = float(np.sqrt(640.0))
    embed.embed(dev, cuda.to_device(ids_h), out, scale=scale)
    ref = dequantize(raw, qtype, (rows, cols))[ids_h] * np.float32(scale)
    got = out.copy_to_host()
    assert np.array_equal(got.view(np.uint32), ref.view(np.uint32)), f"{qtype.name}: {np.sum(got != ref)} differ"
    np.testing.assert_array_equal(embed.embed_reference(host, ids_h, scale), ref)


def test_decode_reads_the_token_from_the_state_array():
    rows, cols = 9, 256
    raw, host = make_table(QType.Q6_K, rows, cols, seed=1)
    dev = embed.to_device(host)
    planes = embed.device_planes(dev)
    state = cuda.to_device(np.array([17, 5, 0, 0], np.int32))   # state[1] = token id
    out = cuda.device_array((1, cols), np.float32)
    embed.embed(dev, state[1:2], out, planes=planes)
    np.testing.assert_array_equal(out.copy_to_host()[0], dequantize(raw, QType.Q6_K, (rows, cols))[5])
    state.copy_to_device(np.array([18, 7, 0, 0], np.int32))     # next step: same launch
    embed.embed(dev, state[1:2], out, planes=planes)
    np.testing.assert_array_equal(out.copy_to_host()[0], dequantize(raw, QType.Q6_K, (rows, cols))[7])


def test_bad_ids_give_zero_rows():
    raw, host = make_table(QType.Q8_0, 4, 64)
    dev = embed.to_device(host)
    out = cuda.to_device(np.full((3, 64), 7.0, np.float32))
    embed.embed(dev, cuda.to_device(np.array([1, 4, -1], np.int32)), out)
    got = out.copy_to_host()
    np.testing.assert_array_equal(got[0], dequantize(raw, QType.Q8_0, (4, 64))[1])
    assert not got[1:].any()


def test_refusals():
    raw, host = make_table(QType.Q4_K, 4, 256)
    with pytest.raises(TypeError, match="on the device"):
        embed.embed(host, cuda.to_device(np.zeros(1, np.int32)), cuda.device_array((1, 256), np.float32))
    dev = embed.to_device(host)
    with pytest.raises(TypeError, match="int32"):
        embed.embed(dev, cuda.to_device(np.zeros(1, np.int64)), cuda.device_array((1, 256), np.float32))
    with pytest.raises(ValueError, match="float32\\[1, 256\\]"):
        embed.embed(dev, cuda.to_device(np.zeros(1, np.int32)), cuda.device_array((2, 256), np.float32))
    bf = pack(quantize(np.zeros((2, 64), np.float32), QType.Q4_0), QType.Q4_0, (2, 64))
    bf.qtype = QType.Q2_K
    with pytest.raises(ValueError, match="no embedding kernel"):
        embed.device_planes(bf)


# ---- PTX --------------------------------------------------------------------------
PTX_SOURCE = """
from genie_rt.quant.embed import _KERNELS
globals().update({k.py_func.__name__: k for k in _KERNELS.values()})   # module-level names
"""


@pytest.fixture(scope="module")
def ptx():
    return compile_in_subprocess(PTX_SOURCE, embed.KERNEL_SIGNATURES)


def test_kernels_compile_without_f64(ptx):
    for name, per in ptx.items():
        assert set(per) == {(8, 7), (9, 0)}
        for cc, text in per.items():
            assert_no_f64(text, where=f"{name} sm_{cc[0]}{cc[1]}")
    # Q4_K/Q5_K: (d*sc)*q - dmin*m with round-to-nearest products (never an FMA)
    for name in ("_embed_q4_k", "_embed_q5_k"):
        assert_ptx_contains(ptx[name][(8, 7)], "mul.rn.f32", where=name)
        assert "fma.rn.f32" not in ptx[name][(8, 7)]


# ---- GPU at the real shape ---------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("qtype", [QType.Q6_K, QType.Q4_K, QType.Q8_0, QType.F16], ids=lambda q: q.name)
def test_gpu_real_table(qtype):
    embed.compile_kernels()
    rows, cols = 151936, 2560
    rng = np.random.default_rng(4)
    base = quantize(rng.standard_normal((512, cols)).astype(np.float32), qtype)
    raw = np.tile(base, (rows // 512 + 1, 1))[:rows]          # random blocks, tiled
    host = pack(raw, qtype, (rows, cols))
    dev = embed.to_device(host)
    ids_h = np.concatenate([[0, rows - 1], rng.integers(0, rows, 510)]).astype(np.int32)
    out = cuda.device_array((len(ids_h), cols), np.float32)
    embed.embed(dev, cuda.to_device(ids_h), out)
    ref = dequantize(raw[ids_h], qtype, (len(ids_h), cols))
    assert np.array_equal(out.copy_to_host().view(np.uint32), ref.view(np.uint32))


@pytest.mark.gpu
@pytest.mark.parametrize("qtype,rows,cols", [(QType.Q8_0, 262144, 640), (QType.Q8_0, 49152, 576),
                                             (QType.Q4_1, 49152, 576), (QType.Q5_1, 4096, 640),
                                             (QType.BF16, 4096, 576), (QType.Q5_K, 4096, 768)],
                         ids=["gemma-q8_0", "smol-q8_0", "q4_1", "q5_1", "bf16", "q5_k"])
def test_gpu_model_tables(qtype, rows, cols):
    """Gemma 3 270M's and SmolLM2's token_embd shapes (Gemma's scaled by sqrt(640))."""
    rng = np.random.default_rng(5)
    base = quantize(rng.standard_normal((256, cols)).astype(np.float32), qtype)
    raw = np.tile(base, (rows // 256 + 1, 1))[:rows]
    dev = embed.to_device(pack(raw, qtype, (rows, cols)))
    ids_h = np.concatenate([[0, rows - 1], rng.integers(0, rows, 62)]).astype(np.int32)
    out = cuda.device_array((len(ids_h), cols), np.float32)
    scale = float(np.sqrt(cols)) if cols == 640 else 1.0
    embed.embed(dev, cuda.to_device(ids_h), out, scale=scale)
    ref = dequantize(raw[ids_h], qtype, (len(ids_h), cols)) * np.float32(scale)
    assert np.array_equal(out.copy_to_host().view(np.uint32), ref.view(np.uint32))
