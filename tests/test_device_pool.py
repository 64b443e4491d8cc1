"""Tests for genie_rt.kvcache.device_pool: layout, arena views, and export/import that is
interchangeable with the host pool (same names, shapes, dtypes and bytes).

Run in the simulator without a GPU (device arrays are numpy-backed there) and on a GPU
unchanged.
"""
import numpy as np
import pytest
from numba import cuda

from genie_rt.kvcache.device_pool import DeviceKVPool
from genie_rt.kvcache.pool import HostKVPool, KVShape


def _host_pool(shape, n, seed=0):
    rng = np.random.default_rng(seed)
    host = HostKVPool(shape)
    for layer in range(shape.n_layers):
        k = rng.standard_normal((n, shape.n_kv_heads, shape.head_dim)).astype(np.float32)
        v = rng.standard_normal((n, shape.n_kv_heads, shape.head_dim)).astype(np.float32)
        host.write(layer, 0, k, v)
    return host


@pytest.mark.parametrize("dtype", ["int8", "f16", "f32"])
def test_export_import_interchangeable_with_host_pool(dtype):
    shape = KVShape(3, 20, 2, 32, dtype)
    host = _host_pool(shape, 13)
    exported = host.export_positions(13)
    dev = DeviceKVPool(shape)
    dev.import_positions(exported, 13)
    back = dev.export_positions(13)
    assert set(back) == set(exported)
    for name, a in exported.items():
        assert back[name].dtype == a.dtype and back[name].shape == a.shape, name
        assert np.array_equal(back[name], a), name
    # and the other way: device export -> host import -> identical reads
    host2 = HostKVPool(shape)
    host2.import_positions(dev.export_positions(13), 13)
    for layer in range(3):
        for x, y in zip(host2.read(layer, 13), host.read(layer, 13)):
            assert np.array_equal(x, y)
        for x, y in zip(dev.read(layer, 13), host.read(layer, 13)):
            assert np.array_equal(x, y)


def test_import_ignores_extra_positions_and_leaves_the_rest():
    shape = KVShape(2, 16, 2, 32, "int8")
    host = _host_pool(shape, 10, seed=4)
    dev = DeviceKVPool(shape)
    dev.import_positions(host.export_positions(10), 6)     # arrays hold 10, import 6
    full = dev.export_positions(16)
    ref = host.export_positions(16)
    assert np.array_equal(full["k"][:, :6], ref["k"][:, :6])
    assert not full["k"][:, 6:].any() and not full["v_scale"][:, 6:].any()


def test_import_rejects_wrong_arrays():
    shape = KVShape(2, 16, 2, 32, "int8")
    dev = DeviceKVPool(shape)
    good = _host_pool(shape, 4).export_positions(4)
    with pytest.raises(ValueError, match="k_scale"):
        dev.import_positions({k: v for k, v in good.items() if k != "k_scale"}, 4)
    with pytest.raises(ValueError, match="'k' is float16"):
        dev.import_positions(dict(good, k=good["k"].astype(np.float16)), 4)
    with pytest.raises(ValueError, match="or more positions"):
        dev.import_positions(good, 5)
    with pytest.raises(IndexError):
        dev.import_positions(good, 17)
    with pytest.raises(IndexError):
        dev.export_positions(17)


@pytest.mark.parametrize("dtype", ["int8", "f16"])
def test_arena_views_are_zero_copy_and_aligned(dtype):
    shape = KVShape(2, 8, 2, 32, dtype)
    need = DeviceKVPool.nbytes(shape)
    assert need >= shape.nbytes() and need % 256 == 0
    arena = cuda.to_device(np.full(need + 512, 0xAB, np.uint8))
    dev = DeviceKVPool(shape, arena_view=arena[256:256 + need])
    raw = arena.copy_to_host()
    assert not raw[256:256 + need].any(), "the pool is zeroed"
    assert (raw[:256] == 0xAB).all() and (raw[256 + need:] == 0xAB).all(), "nothing outside"
    host = _host_pool(shape, 8, seed=2)
    dev.import_positions(host.export_positions(8), 8)
    raw = arena.copy_to_host()[256:256 + need]
    kbytes = host.export_positions(8)["k"].reshape(-1).view(np.uint8)
    assert np.array_equal(raw[:kbytes.size], kbytes), "k is the first region of the arena"
    layer = dev.layer(1)
    assert layer.k_words.dtype == np.uint32 and layer.k_words.ndim == 1
    assert np.array_equal(layer.k_words.copy_to_host().view(layer.k.dtype).reshape(layer.k.shape),
                          host.export_positions(8)["k"][1])
    if dtype == "int8":
        assert layer.k_scale.shape == (8, 2)
    else:
        assert layer.k_scale.shape == (1, 1)


def test_arena_too_small_or_wrong_type():
    shape = KVShape(1, 8, 2, 32, "int8")
    with pytest.raises(ValueError, match="needs DeviceKVPool.nbytes"):
        DeviceKVPool(shape, arena_view=cuda.device_array(DeviceKVPool.nbytes(shape) - 1, np.uint8))
    with pytest.raises(ValueError, match="uint8"):
        DeviceKVPool(shape, arena_view=cuda.device_array(4096, np.float32))


def test_nbytes_matches_the_layout():
    shape = KVShape(36, 4096, 8, 128, "int8")
    body = 36 * 4096 * 8 * 128
    assert DeviceKVPool.nbytes(shape) == 2 * body + 2 * 36 * 4096 * 8 * 4
    assert DeviceKVPool.nbytes(KVShape(36, 4096, 8, 128, "f16")) == 4 * body + 256
    with pytest.raises(ValueError, match="16 bytes"):
        DeviceKVPool(KVShape(1, 4, 1, 8, "int8"))


# ---- ring layers (sliding-window layers: R slots, position p in slot p % R) ----------
from genie_rt.kvcache.pool import ring_slots  # noqa: E402


def test_kvshape_slots_validate_and_normalise():
    sh = KVShape(3, 20, 2, 32, "int8", slots=(20, 20, 20))
    assert sh.slots is None and sh == KVShape(3, 20, 2, 32, "int8")
    sh = KVShape(3, 20, 2, 32, "int8", slots=[7, 20, 7])
    assert sh.slots == (7, 20, 7) and sh.ring_layers == (0, 2) and sh.global_layers == (1,)
    assert [sh.layer_slots(i) for i in range(3)] == [7, 20, 7]
    assert (sh.oldest_held(0, 5), sh.oldest_held(0, 12), sh.oldest_held(1, 12)) == (0, 5, 0)
    assert sh.nbytes() == sh.layer_bytes_per_position * 34
    assert sh.nbytes(5) == 3 * 5 * sh.layer_bytes_per_position          # nothing wrapped yet
    assert sh.nbytes(12) == (7 + 12 + 7) * sh.layer_bytes_per_position
    assert KVShape(3, 20, 2, 32, "int8").nbytes(12) == 12 * sh.bytes_per_position
    with pytest.raises(ValueError, match="2 entries for 3 layers"):
        KVShape(3, 20, 2, 32, "int8", slots=(4, 4))
    with pytest.raises(ValueError, match="layer 1 has 21 slots"):
        KVShape(3, 20, 2, 32, "int8", slots=(4, 21, 4))
    with pytest.raises(ValueError, match="layer 0 has 0 slots"):
        KVShape(3, 20, 2, 32, "int8", slots=(0, 4, 4))
    assert ring_slots(512, 512, 32768) == 1023 and ring_slots(512, 512, 600) == 600
    with pytest.raises(ValueError):
        ring_slots(0, 16, 100)


def test_host_pool_refuses_ring_layers():
    with pytest.raises(ValueError, match="ring layers"):
        HostKVPool(KVShape(2, 20, 2, 32, "int8", slots=(6, 20)))


def _positions(shape_like, T, seed):
    """Stored rows (storage dtype) of positions 0 .. T-1 for every layer, as a pool holds
    them: {k, v[, k_scale, v_scale]} [n_layers, T, ...] (int8 via HostKVPool's format)."""
    sh = KVShape(shape_like.n_layers, T, shape_like.n_kv_heads, shape_like.head_dim,
                 shape_like.dtype)
    return _host_pool(sh, T, seed).export_positions(T)


@pytest.mark.parametrize("dtype", ["int8", "f16"])
def test_ring_layers_views_and_bytes(dtype):
    shape = KVShape(3, 40, 2, 32, dtype, slots=(9, 40, 9))
    need = DeviceKVPool.nbytes(shape)
    arena = cuda.to_device(np.full(need + 256, 0xCD, np.uint8))
    dev = DeviceKVPool(shape, arena_view=arena[:need])
    assert dev.k is None and dev.v is None           # no stacked [n_layers, n_ctx] views
    for i, r in enumerate((9, 40, 9)):
        lay = dev.layer(i)
        assert lay.k.shape == (r, 2, 32) and lay.slots == r and lay.ring == (r < 40)
        assert lay.k_words.size == r * 2 * 32 * lay.k.dtype.itemsize // 4
        if dtype == "int8":
            assert lay.k_scale.shape == (r, 2)
    raw = arena.copy_to_host()
    assert not raw[:need].any() and (raw[need:] == 0xCD).all()
    # the regions hold 58 slots per quantity, nothing more
    itemsize = 1 if dtype == "int8" else 2
    assert need >= 2 * 58 * 2 * 32 * itemsize and need < 2 * 58 * 2 * 32 * itemsize + 4 * 256 + (
        2 * 58 * 2 * 4 if dtype == "int8" else 0)


@pytest.mark.parametrize("dtype", ["int8", "f16"])
def test_export_import_window_through_the_ring(dtype):
    # layers 0 and 2 are rings of 9 slots, layer 1 is global; positions written in
    # chunks as an engine would: 0..4, 5..12 (wraps), 13..20 (wraps again)
    shape = KVShape(3, 40, 2, 32, dtype, slots=(9, 40, 9))
    ref = _positions(shape, 21, seed=3)
    dev = DeviceKVPool(shape)
    for first, end in ((0, 5), (5, 12), (12, 21)):
        chunk = {k: a[:, first:end] for k, a in ref.items()}
        dev.import_window(chunk, first, end)          # every layer, one chunk at a time
    # ring layers: the last 9 positions, in position order
    first, got = dev.export_window(21, layers=(0, 2))
    assert first == 12
    for name, a in ref.items():
        assert got[name].dtype == a.dtype and got[name].shape == (2, 9) + a.shape[2:], name
        assert np.array_equal(got[name], a[[0, 2], 12:21]), name
    # where they sit: position p in slot p % 9
    k0 = dev.layer(0).k.copy_to_host()
    for p in range(12, 21):
        assert np.array_equal(k0[p % 9], ref["k"][0, p])
    # the global layer: every position, and export_window defaults to the oldest held
    first, got = dev.export_window(21, layers=(1,))
    assert first == 0 and np.array_equal(got["k"][0], ref["k"][1, :21])
    first, got = dev.export_window(21)                # all layers: the rings' oldest
    assert first == 12 and np.array_equal(got["v"], ref["v"][:, 12:21])
    # read: positions in order through the ring
    k, v = dev.read(2, 21, first=14)
    ks = ref["k_scale"][2, 14:21, :, None] if dtype == "int8" else 1
    assert np.allclose(k, ref["k"][2, 14:21].astype(np.float32) * ks)
    with pytest.raises(IndexError, match="ring of 9 slots"):
        dev.read(0, 21)
    with pytest.raises(IndexError, match="ring of 9 slots"):
        dev.export_window(21, layers=(0,), first=11)


def test_ring_round_trip_into_a_fresh_pool_and_refusals():
    shape = KVShape(2, 30, 2, 32, "int8", slots=(7, 30))
    ref = _positions(shape, 25, seed=9)
    a = DeviceKVPool(shape)
    a.import_window({k: x[:1, 18:25] for k, x in ref.items()}, 18, 25, layers=(0,))
    a.import_window({k: x[1:2] for k, x in ref.items()}, 0, 25, layers=(1,))
    first, ring = a.export_window(25, layers=(0,))
    _, glob = a.export_window(25, layers=(1,))
    b = DeviceKVPool(shape)
    b.import_window(ring, first, 25, layers=(0,))
    b.import_window(glob, 0, 25, layers=(1,))
    for name in ref:
        assert np.array_equal(b.layer(0).__getattribute__(name).copy_to_host(),
                              a.layer(0).__getattribute__(name).copy_to_host()), name
        assert np.array_equal(b.export_window(25, layers=(1,))[1][name], glob[name]), name
    # arrays holding more positions than asked: the last ones are used
    c = DeviceKVPool(shape)
    c.import_window({k: x[:1, 10:25] for k, x in ref.items()}, 20, 25, layers=(0,))
    assert np.array_equal(c.export_window(25, layers=(0,))[1]["k"][0, -5:], ref["k"][0, 20:25])
    with pytest.raises(ValueError, match="rings of 7 slots"):
        a.export_positions(5)
    with pytest.raises(ValueError, match="rings of 7 slots"):
        a.import_positions(ref, 5)
    with pytest.raises(IndexError, match="ring of 7 slots"):
        a.import_window({k: x[:1] for k, x in ref.items()}, 0, 8, layers=(0,))
    with pytest.raises(ValueError, match="'k_scale' is missing"):
        a.import_window({k: x for k, x in ref.items() if k != "k_scale"}, 0, 3)
    with pytest.raises(ValueError, match="needs int8"):
        a.import_window(dict(ref, k=ref["k"].astype(np.float16)), 0, 3)
    with pytest.raises(IndexError, match="layer 2"):
        a.export_window(3, layers=(2,))
