"""Device plane layout: pack/unpack round trip, alignment, byte count equals GGUF."""
import numpy as np
import pytest

from genie_rt.quant.formats import BLOCK_SIZES, QType, dequantize, quantize, row_bytes
from genie_rt.quant.layout import PACKABLE, pack, unpack


@pytest.mark.parametrize("qtype", sorted(PACKABLE, key=lambda q: q.name))
def test_round_trip_and_size(qtype):
    rng = np.random.default_rng(0)
    rows, cols = 5, 512
    w = rng.standard_normal((rows, cols)).astype(np.float32)
    raw = quantize(w, qtype)
    p = pack(raw, qtype, (rows, cols))
    assert p.nbytes == raw.nbytes == rows * row_bytes(qtype, cols)
    np.testing.assert_array_equal(unpack(p), raw)
    for name, plane in p.planes.items():
        assert plane.flags.c_contiguous and plane.shape[0] == rows
    np.testing.assert_array_equal(dequantize(unpack(p), qtype, (rows, cols)), dequantize(raw, qtype, (rows, cols)))


def test_q6k_planes_hold_the_right_fields():
    rng = np.random.default_rng(1)
    raw = quantize(rng.standard_normal((3, 256)).astype(np.float32), QType.Q6_K)
    p = pack(raw, QType.Q6_K, (3, 256))
    np.testing.assert_array_equal(p.planes["d"][:, 0], raw[:, 208:210].copy().view("<f2")[:, 0])
    np.testing.assert_array_equal(p.planes["sc"].view(np.uint8), raw[:, 192:208])
    # rows of every plane start 16-byte aligned for real shapes (cols multiple of 256)
    p = pack(quantize(rng.standard_normal((2, 2560)).astype(np.float32), QType.Q6_K), QType.Q6_K, (2, 2560))
    for name in ("ql", "qh", "sc"):
        assert p.planes[name].strides[0] % 16 == 0


def test_every_supported_format_has_a_device_layout():
    from genie_rt.quant.formats import SUPPORTED
    assert PACKABLE == SUPPORTED


def test_refuses_unknown_types_and_shapes():
    with pytest.raises(ValueError, match="not supported"):
        pack(np.zeros((1, 110), np.uint8), QType.Q3_K, (1, 256))
    with pytest.raises(ValueError, match="not a multiple"):
        pack(np.zeros((1, 144), np.uint8), QType.Q4_K, (1, 200))


@pytest.mark.parametrize("qtype", [QType.Q4_K, QType.Q6_K, QType.Q8_0, QType.F16])
def test_parallel_gather_gives_the_same_planes(qtype, monkeypatch):
    """A big matrix is split into planes by row chunks on a few threads (layout.pack): the
    same bytes as one thread, whatever the number of rows per chunk (here 37 rows, uneven)."""
    import genie_rt.quant.layout as L
    monkeypatch.setattr(L, "PARALLEL_MIN_BYTES", 0)
    rows, cols = 37, 512
    raw = np.random.default_rng(1).integers(0, 256, rows * row_bytes(qtype, cols), dtype=np.uint8)
    one, many = L.pack(raw, qtype, (rows, cols), parallel=False), L.pack(raw, qtype, (rows, cols))
    assert one.planes.keys() == many.planes.keys()
    for name in one.planes:
        assert many.planes[name].dtype == one.planes[name].dtype and many.planes[name].flags.c_contiguous
        np.testing.assert_array_equal(many.planes[name].view(np.uint8), one.planes[name].view(np.uint8))
    np.testing.assert_array_equal(unpack(many), raw.reshape(rows, -1))
    L.release_threads()                    # what the CUDA weight upload does when it is done
    import threading
    assert not [t for t in threading.enumerate() if t.name.startswith("genie-pack")]
