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
