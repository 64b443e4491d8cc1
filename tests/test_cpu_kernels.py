"""The CPU kernels (genie_rt.cpu) against their numpy references.

- linear: every GGML type against quant/formats.dequantize + a float64 matmul, within
  the elementwise bound of the int8 rounding of x (and, tighter, against the same matmul
  with x quantized as the kernel does); awkward shapes (cols 576 / 640 for the 32-blocks,
  rows 1, 7, 192, n = 1, 3, 33); the batch-invariance property (each row's bits do not
  depend on n, its place in the batch or the thread count); the GIL is released.
- attention: INT8 / F16 / F32 caches against dequantize-then-softmax, with a sliding
  window and a ring that wraps; a prompt prefilled in one chunk or token by token gives
  the same bits; kv_write is bit-exact with kvcache/pool.py.
- ops: rmsnorm, RoPE (NeoX, normal, partial), SiLU / GELU-tanh gated, embedding
  (bit-exact with dequantize).
- the disk cache: every jitted function a kernel calls is defined in genie_rt.cpu (so
  the package-wide source hash covers it) and the hash moves when any file changes.

The common types run in the quick suite; the rest are marked slow (each kernel's first
compile takes seconds; numba's disk cache makes later runs fast).
"""
import shutil
import threading
import time
import types as pytypes
from pathlib import Path

import numpy as np
import pytest

from genie_rt.cpu import attention as A
from genie_rt.cpu import jit, ops
from genie_rt.cpu.linear import (linear, linear_error_bound, linear_quantized_reference, linear_reference,
                                 quantize_rows_reference)
from genie_rt.cpu.threads import get_threads, physical_cores, set_threads
from genie_rt.cpu.topk import top_k, top_k_reference
from genie_rt.cpu.weights import CPUWeight
from genie_rt.engine.models.reference import rmsnorm as rmsnorm_reference
from genie_rt.engine.models.reference import rope_neox, rope_tables
from genie_rt.kvcache.pool import HostKVPool, KVShape, quantize_rows_int8
from genie_rt.quant.formats import dequantize, quantize

QUICK = ["Q8_0", "Q5_0", "Q4_K", "Q6_K", "F16"]
SLOW = ["Q4_0", "Q4_1", "Q5_1", "Q5_K", "F32", "BF16"]
ALL = [pytest.param(q) for q in QUICK] + [pytest.param(q, marks=pytest.mark.slow) for q in SLOW]
GEMMA = Path("/tmp/models/gemma-3-270m-q4_k_m.gguf")


def make_weight(qtype, rows, cols, seed=0):
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((rows, cols)) * 0.05).astype(np.float32)
    w[:, 3] += 0.2                                   # a column with an offset: non-trivial Q4_1 / K minima
    return CPUWeight.from_bytes(quantize(w, qtype), qtype, (rows, cols), f"test.{qtype}")


def cols_for(qtype):
    return (512, 768) if qtype.endswith("_K") else (576, 640)


def assert_within(got, ref, bound, what):
    err = np.abs(got.astype(np.float64) - ref)
    bad = err > bound
    if bad.any():
        t, r = np.argwhere(bad)[0]
        raise AssertionError(f"{what}: {int(bad.sum())} elements out of bound; first [{t}, {r}]: got {got[t, r]!r} "
                             f"ref {ref[t, r]!r} err {err[t, r]:.3g} bound {bound[t, r]:.3g}")


@pytest.fixture(autouse=True)
def _threads():
    before = get_threads()
    yield
    set_threads(before)


# -- linear -----------------------------------------------------------------------------

@pytest.mark.parametrize("qtype", ALL)
def test_linear_matches_dequantized_matmul(qtype):
    rng = np.random.default_rng(1)
    for cols in cols_for(qtype):
        for rows, n in ((1, 1), (7, 3), (192, 33), (7, 2)):
            w = make_weight(qtype, rows, cols, seed=rows + cols)
            x = (rng.standard_normal((n, cols)) * 2).astype(np.float32)
            x[0, :32] = 0                             # an all-zero activation block (scale 0)
            y = linear(x, w)
            assert y.shape == (n, rows) and y.dtype == np.float32
            assert_within(y, linear_reference(x, w), linear_error_bound(x, w), f"{qtype} {rows}x{cols} n={n}")
            assert_within(y, linear_quantized_reference(x, w), linear_error_bound(x, w, quantized=True),
                          f"{qtype} {rows}x{cols} n={n} (quantized x)")


def test_error_bound_catches_a_wrong_block():
    """The tight check is not vacuous: a weight with one block of another row fails it."""
    w = make_weight("Q8_0", 7, 576)
    x = np.random.default_rng(2).standard_normal((3, 576)).astype(np.float32)
    raw = w.data.copy().reshape(7, -1)
    raw[2, 34:68] = raw[5, 34:68]                      # row 2's second block swapped in from row 5
    bad = CPUWeight.from_bytes(raw, "Q8_0", w.shape)
    with pytest.raises(AssertionError):
        assert_within(linear(x, bad), linear_quantized_reference(x, w), linear_error_bound(x, w, True), "planted")


def test_activation_quantization_rule():
    x = np.array([[0.5, -1.0] + [0.0] * 30, [0.0] * 32], np.float32)
    q, d = quantize_rows_reference(x, 32)
    assert d[0, 0] == np.float32(1 / 127) and q[0, 1] == -127 and q[0, 0] == 64  # rint(63.5) = 64
    assert d[1, 0] == 0 and not q[1].any()


@pytest.mark.parametrize("qtype", ALL)
def test_linear_is_batch_invariant(qtype):
    """Row t of linear(x) has the same bits whether computed alone, in a batch of 2 (the
    fused path), 3 or 33 (buffered), at any place in the batch, on 1 or 2 threads."""
    cols = cols_for(qtype)[0]
    w = make_weight(qtype, 192, cols, seed=3)
    x = np.random.default_rng(4).standard_normal((33, cols)).astype(np.float32)
    full = linear(x, w)
    for t in (0, 1, 17, 32):
        assert np.array_equal(linear(x[t:t + 1].copy(), w)[0], full[t]), f"{qtype}: token {t} alone"
    assert np.array_equal(linear(x[10:12].copy(), w), full[10:12]), f"{qtype}: a pair"
    assert np.array_equal(linear(x[5:8].copy(), w), full[5:8]), f"{qtype}: three"
    assert np.array_equal(linear(x[::-1].copy(), w), full[::-1]), f"{qtype}: reversed batch"
    set_threads(1)
    assert np.array_equal(linear(x, w), full), f"{qtype}: 1 thread"


def test_linear_out_and_errors():
    w = make_weight("Q8_0", 7, 576)
    x = np.ones((2, 576), np.float32)
    out = np.full((2, 7), np.nan, np.float32)
    assert linear(x, w, out) is out and np.isfinite(out).all()
    with pytest.raises(ValueError, match="576"):
        linear(np.ones((2, 640), np.float32), w)
    with pytest.raises(ValueError, match="float32"):
        linear(np.ones((2, 576)), w)
    with pytest.raises(ValueError, match="out"):
        linear(x, w, np.empty((2, 8), np.float32))
    with pytest.raises(ValueError, match="bytes"):
        CPUWeight.from_bytes(w.data[:-1], "Q8_0", (7, 576), "short")
    with pytest.raises(ValueError, match="32-weight blocks"):
        CPUWeight.from_bytes(np.zeros(34 * 7, np.uint8), "Q8_0", (7, 33), "odd")
    with pytest.raises(ValueError, match="not support"):
        CPUWeight.from_bytes(np.zeros(100, np.uint8), "Q2_K", (1, 256), "q2")


def test_weight_is_a_view_of_the_bytes():
    raw = quantize(np.ones((4, 256), np.float32), "Q4_K")
    w = CPUWeight.from_bytes(raw, "Q4_K", (4, 256))
    assert np.shares_memory(w.data, raw) and not w.data.flags.writeable and w.nbytes == raw.nbytes


def test_linear_releases_the_gil():
    """A Python thread keeps counting while a big linear runs (it could not if the kernel
    held the GIL)."""
    w = make_weight("Q8_0", 4096, 1024, seed=5)
    x = np.random.default_rng(6).standard_normal((64, 1024)).astype(np.float32)
    linear(x[:3], w)                                   # compile outside the measurement
    set_threads(1)
    count, stop = [0], threading.Event()

    def tick():
        while not stop.is_set():
            count[0] += 1

    th = threading.Thread(target=tick)
    th.start()
    try:
        time.sleep(0.02)
        during = 0
        for _ in range(5):                             # a few calls: the ticker gets scheduled
            c0 = count[0]
            linear(x, w)
            during += count[0] - c0
    finally:
        stop.set()
        th.join()
    assert during > 1000, f"the ticker advanced only {during} times during the linear calls"


def test_threads():
    assert physical_cores() >= 1
    assert set_threads(1) == 1 and get_threads() == 1
    assert set_threads(0) == min(physical_cores(), jit.numba.config.NUMBA_NUM_THREADS)
    with pytest.raises(ValueError, match="positive"):
        set_threads(-1)
    with pytest.raises(ValueError, match="exceeds"):
        set_threads(10 ** 6)


# -- attention --------------------------------------------------------------------------

def _filled_cache(dtype, n_kv, hd, total, slots, ring, chunk, seed=0):
    rng = np.random.default_rng(seed)
    pool = HostKVPool(KVShape(1, slots, n_kv, hd, dtype))
    k_all = rng.standard_normal((total, n_kv, hd)).astype(np.float32)
    v_all = rng.standard_normal((total, n_kv, hd)).astype(np.float32)
    ks = pool.k_scale[0] if dtype == "int8" else None
    vs = pool.v_scale[0] if dtype == "int8" else None
    for p in range(0, total, chunk):
        A.kv_write(k_all[p:p + chunk], v_all[p:p + chunk], pool.k[0], pool.v[0], ks, vs, p, ring)
    return pool, ks, vs, k_all, v_all


def _position_cache(dtype, k_all, v_all):
    """What the cache holds for each position, unwrapped (the reference's view)."""
    if dtype == "int8":
        kq, ks = quantize_rows_int8(k_all)
        vq, vs = quantize_rows_int8(v_all)
        return kq, vq, ks, vs
    st = np.float16 if dtype == "f16" else np.float32
    return k_all.astype(st), v_all.astype(st), None, None


ATTN_CASES = [  # dtype, n_head, n_kv, hd, start, n, window, ring, slots
    ("int8", 4, 2, 64, 0, 5, 0, 0, 16),
    ("int8", 8, 2, 80, 37, 3, 0, 0, 64),
    ("int8", 4, 1, 256, 40, 7, 16, 22, 22),            # ring of exactly window + n - 1, wrapped
    ("int8", 4, 1, 128, 100, 1, 8, 8, 8),              # decode in a ring of the window
    ("f16", 4, 2, 64, 13, 4, 6, 0, 32),                # window without a ring
    ("f16", 4, 1, 256, 40, 7, 16, 22, 22),
    ("f32", 2, 2, 48, 9, 2, 0, 0, 11),
]


@pytest.mark.parametrize("case", ATTN_CASES)
def test_attention_matches_reference(case):
    dtype, n_head, n_kv, hd, start, n, window, ring, slots = case
    pool, ks, vs, k_all, v_all = _filled_cache(dtype, n_kv, hd, start + n, slots, ring, max(n, 1))
    q = np.random.default_rng(7).standard_normal((n, n_head, hd)).astype(np.float32) * 2
    scale = hd ** -0.5
    out = A.attention(q, pool.k[0], pool.v[0], ks, vs, start, scale, window, ring)
    kq, vq, kss, vss = _position_cache(dtype, k_all, v_all)
    ref = A.attention_reference(q, kq, vq, kss, vss, start, scale, window, 0)
    np.testing.assert_allclose(out, ref, rtol=0, atol=2e-6 * np.abs(ref).max() + 1e-6)


def test_attention_window_masks_old_keys():
    """With a window of 4, changing a key 4 positions back does not move the output."""
    pool, ks, vs, k_all, v_all = _filled_cache("int8", 1, 64, 12, 12, 0, 12)
    q = np.random.default_rng(8).standard_normal((1, 2, 64)).astype(np.float32)
    a = A.attention(q, pool.k[0], pool.v[0], ks, vs, 11, 0.125, window=4)
    pool.k[0][7] = -pool.k[0][7]                       # position 7 = 11 - 4: outside the window
    assert np.array_equal(A.attention(q, pool.k[0], pool.v[0], ks, vs, 11, 0.125, window=4), a)
    pool.k[0][8] = -pool.k[0][8]                       # position 8: inside
    assert not np.array_equal(A.attention(q, pool.k[0], pool.v[0], ks, vs, 11, 0.125, window=4), a)


@pytest.mark.parametrize("dtype,window,ring", [("int8", 0, 0), ("int8", 5, 13), ("f16", 5, 0)])
def test_attention_prefill_chunking_is_invariant(dtype, window, ring):
    """9 tokens prefilled at once, or one at a time (writing K/V as they come), give the
    same bits for every query."""
    n_head, n_kv, hd, total = 4, 2, 64, 9
    slots = ring or total
    rng = np.random.default_rng(9)
    k_all = rng.standard_normal((total, n_kv, hd)).astype(np.float32)
    v_all = rng.standard_normal((total, n_kv, hd)).astype(np.float32)
    q = rng.standard_normal((total, n_head, hd)).astype(np.float32)

    def run(chunk):
        pool = HostKVPool(KVShape(1, slots, n_kv, hd, dtype))
        ks = pool.k_scale[0] if dtype == "int8" else None
        vs = pool.v_scale[0] if dtype == "int8" else None
        outs = []
        for p in range(0, total, chunk):
            A.kv_write(k_all[p:p + chunk], v_all[p:p + chunk], pool.k[0], pool.v[0], ks, vs, p, ring)
            outs.append(A.attention(q[p:p + chunk].copy(), pool.k[0], pool.v[0], ks, vs, p, 0.125, window, ring))
        return np.concatenate(outs)

    if ring and ring < window + total - 1:
        whole = run(ring - window + 1)                # the largest chunk the ring allows
    else:
        whole = run(total)
    assert np.array_equal(whole, run(1))
    assert np.array_equal(whole, run(4))


def test_kv_write_matches_the_pool():
    rng = np.random.default_rng(10)
    k_new = rng.standard_normal((5, 2, 64)).astype(np.float32)
    v_new = rng.standard_normal((5, 2, 64)).astype(np.float32)
    k_new[1, 0] = 0                                    # an all-zero row: scale 0
    for dtype in ("int8", "f16", "f32"):
        ref = HostKVPool(KVShape(1, 16, 2, 64, dtype))
        ref.write(0, 3, k_new, v_new)
        got = HostKVPool(KVShape(1, 16, 2, 64, dtype))
        ks = got.k_scale[0] if dtype == "int8" else None
        vs = got.v_scale[0] if dtype == "int8" else None
        A.kv_write(k_new, v_new, got.k[0], got.v[0], ks, vs, 3)
        for name in ("k", "v") + (("k_scale", "v_scale") if dtype == "int8" else ()):
            assert np.array_equal(getattr(got, name), getattr(ref, name)), f"{dtype} {name}"
    ring = HostKVPool(KVShape(1, 4, 2, 64, "int8"))
    A.kv_write(k_new[:4], v_new[:4], ring.k[0], ring.v[0], ring.k_scale[0], ring.v_scale[0], 6, 4)  # wraps
    assert np.array_equal(ring.k[0][2], quantize_rows_int8(k_new[0])[0])                   # position 6
    assert np.array_equal(ring.k[0][1], quantize_rows_int8(k_new[3])[0])                   # position 9


def test_attention_refuses_bad_positions():
    pool = HostKVPool(KVShape(1, 8, 1, 64, "int8"))
    args = (pool.k[0], pool.v[0], pool.k_scale[0], pool.v_scale[0])
    q = np.zeros((3, 2, 64), np.float32)
    with pytest.raises(ValueError, match="ring"):
        A.attention(q, *args, 10, 0.1, window=7, ring=8)          # needs 7 + 3 - 1 = 9 slots
    with pytest.raises(IndexError, match="exceed"):
        A.attention(q, *args, 6, 0.1)
    with pytest.raises(ValueError, match="k_scale"):
        A.attention(q, pool.k[0], pool.v[0], None, None, 0, 0.1)
    with pytest.raises(ValueError, match="overwrite"):
        A.kv_write(np.zeros((9, 1, 64), np.float32), np.zeros((9, 1, 64), np.float32), *args, 0, 8)


# -- ops --------------------------------------------------------------------------------

def test_rmsnorm_and_qk_norm():
    rng = np.random.default_rng(11)
    for shape in ((1, 640), (33, 1000), (3, 5, 128)):
        x = (rng.standard_normal(shape) * 3).astype(np.float32)
        w = rng.standard_normal(shape[-1]).astype(np.float32)
        ref = rmsnorm_reference(x.astype(np.float64), w.astype(np.float64), 1e-6)
        np.testing.assert_allclose(ops.rmsnorm(x, w, 1e-6), ref, rtol=3e-6, atol=3e-6)
    x = np.zeros((2, 64), np.float32)
    assert np.array_equal(ops.rmsnorm(x, np.ones(64, np.float32), 1e-6), x)


def test_rope():
    rng = np.random.default_rng(12)
    x = rng.standard_normal((3, 4, 72)).astype(np.float32)
    cos, sin = rope_tables(72, np.arange(5, 8), 10000.0)
    assert np.array_equal(ops.rope(x.copy(), cos, sin, neox=True), rope_neox(x, cos, sin))
    assert np.array_equal(ops.rope(x.copy(), cos, sin, neox=False), ops.rope_normal_reference(x, cos, sin))
    c2, s2 = cos[:, :16].copy(), sin[:, :16].copy()               # partial rotation: 32 of 72 dims
    got = ops.rope(x.copy(), c2, s2, neox=True)
    assert np.array_equal(got, ops.rope_neox_reference(x, c2, s2)) and np.array_equal(got[..., 32:], x[..., 32:])
    # normal RoPE is NeoX on de-interleaved dims
    perm = np.concatenate([np.arange(0, 72, 2), np.arange(1, 72, 2)])
    np.testing.assert_array_equal(ops.rope(x.copy(), cos, sin, neox=False)[..., perm],
                                  ops.rope(np.ascontiguousarray(x[..., perm]), cos, sin, neox=True))


def test_gated_activations():
    rng = np.random.default_rng(13)
    g = (rng.standard_normal(4099) * 6).astype(np.float32)
    g[:6] = [-200, 200, 0, -0.0, 88.5, -88.5]
    u = rng.standard_normal(4099).astype(np.float32)
    for fn, ref in ((ops.silu_mul, ops.silu_reference), (ops.gelu_tanh_mul, ops.gelu_tanh_reference)):
        got = fn(g, u)
        want = ref(g) * u
        assert np.isfinite(got).all()
        np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-30 + 2e-6 * np.abs(want).max() * 1e-3)
    x = np.linspace(-87, 88, 100003).astype(np.float32)
    got = np.empty_like(x)
    ops._silu_mul(x, np.ones_like(x), got)             # exercise _exp's whole range via silu
    np.testing.assert_allclose(got, ops.silu_reference(x), rtol=2e-6, atol=1e-37)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q5_0", "Q4_K", "Q6_K", "F16",
                                   *[pytest.param(q, marks=pytest.mark.slow)
                                     for q in ("Q4_0", "Q4_1", "Q5_1", "Q5_K", "F32", "BF16")]])
def test_embed_is_bit_exact(qtype):
    table = make_weight(qtype, 50, 512, seed=14)
    toks = np.array([3, 0, 49, 3])
    ref = dequantize(table.data, table.qtype, table.shape)[toks]
    assert np.array_equal(ops.embed(toks, table), ref)
    assert np.array_equal(ops.embed(toks, table, scale=25.3), ref * np.float32(25.3))
    with pytest.raises(IndexError, match="vocabulary"):
        ops.embed([50], table)


def test_top_k():
    rng = np.random.default_rng(17)
    for vocab, k in ((10, 10), (1000, 40), (151936, 40), (5000, 300), (7, 1)):
        x = rng.standard_normal(vocab).astype(np.float32)
        x[::7] = x[3]                                  # ties: broken by the lower index
        x[min(5, vocab - 1)] = np.nan                  # ranks as -inf
        assert np.array_equal(top_k(x, k), top_k_reference(x, k)), (vocab, k)
    x = np.sort(rng.standard_normal(3000).astype(np.float32))   # ascending: every value enters the heap
    assert np.array_equal(top_k(x, 40), np.arange(2999, 2959, -1))
    assert np.array_equal(top_k(np.full(9, -np.inf, np.float32), 3), [0, 1, 2])
    with pytest.raises(ValueError, match="k must"):
        top_k(x, 0)


# -- the disk cache ---------------------------------------------------------------------

def _jitted_callees(fn):
    """Dispatchers and intrinsics a jitted function's code references by global name."""
    from numba.core.dispatcher import Dispatcher
    from numba.core.extending import _Intrinsic
    found, codes = [], [fn.py_func.__code__]
    while codes:
        code = codes.pop()
        codes += [c for c in code.co_consts if isinstance(c, pytypes.CodeType)]
        for name in code.co_names:
            obj = fn.py_func.__globals__.get(name)
            if isinstance(obj, (Dispatcher, _Intrinsic)):
                found.append(obj)
    return found


def test_kernels_call_only_this_package():
    """Every jitted function a kernel can inline is defined under genie_rt.cpu, so the
    package-wide source hash (jit.py) covers everything its cached code depends on."""
    from numba.core.dispatcher import Dispatcher
    from genie_rt.cpu import linear_kernels, rowdot, simd, topk
    seen, todo = set(), [obj for mod in (linear_kernels, ops, A, rowdot, simd, topk) for obj in vars(mod).values()
                         if isinstance(obj, Dispatcher)]
    while todo:
        fn = todo.pop()
        if id(fn) in seen:
            continue
        seen.add(id(fn))
        for callee in _jitted_callees(fn):
            mod = getattr(callee, "py_func", getattr(callee, "_defn", None)).__module__
            assert mod.startswith("genie_rt.cpu."), f"{fn.py_func.__qualname__} calls {callee} from {mod}"
            if isinstance(callee, Dispatcher):
                todo.append(callee)
    assert len(seen) > 10


def test_cache_key_is_the_package_sources(tmp_path, monkeypatch):
    from genie_rt.cpu import linear_kernels
    if jit._CACHE_CLASS is None:
        pytest.skip("this numba's caching internals are unknown; kernels run uncached")
    assert linear_kernels.linear_q8_0._cache._cache_file._source_stamp == jit.sources_hash()
    copy = tmp_path / "cpu"
    shutil.copytree(jit.PACKAGE_DIR, copy, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(jit, "PACKAGE_DIR", copy)
    before = jit.sources_hash()
    (copy / "simd.py").write_text((copy / "simd.py").read_text() + "\n# an edit\n")
    assert jit.sources_hash() != before


# -- a real model -----------------------------------------------------------------------

@pytest.mark.skipif(not GEMMA.exists(), reason=f"{GEMMA} is absent")
def test_gemma_tensors():
    from genie_rt.engine.gguf_file import open_gguf
    g = open_gguf(GEMMA)
    x = np.random.default_rng(15).standard_normal((3, 1024)).astype(np.float32)
    for name in ("blk.0.attn_q.weight", "blk.0.attn_v.weight", "blk.0.attn_output.weight",
                 "blk.0.ffn_down.weight", "token_embd.weight"):
        t = g.tensors[name]
        rows = min(t.shape[0], 300)
        w = CPUWeight.from_bytes(t.data[:rows], t.qtype, (rows, t.shape[1]), name)
        assert np.shares_memory(w.data, t.data)
        xi = np.ascontiguousarray(x[:, :t.shape[1]]) if t.shape[1] <= 1024 else \
            np.random.default_rng(16).standard_normal((3, t.shape[1])).astype(np.float32)
        assert_within(linear(xi, w), linear_reference(xi, w), linear_error_bound(xi, w), name)
    emb = CPUWeight.from_tensor(g.tensors["token_embd.weight"])
    toks = [2, 106, 262143]
    ref = dequantize(emb.data.reshape(emb.rows, -1)[toks], emb.qtype, (3, emb.cols))
    assert np.array_equal(ops.embed(toks, emb, scale=640 ** 0.5), ref * np.float32(640 ** 0.5))
