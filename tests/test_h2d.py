"""engine/h2d.py: pinned mirrors and async uploads (simulator or GPU)."""
import numpy as np
import pytest
from numba import cuda

from genie_rt.engine.h2d import pinned_like, upload


def test_upload_whole_and_leading_bytes():
    dev = cuda.to_device(np.full(10, -1, np.int32))
    host = pinned_like(dev)
    assert host.shape == (10,) and host.dtype == np.int32 and not host.any()
    host[:] = np.arange(10)
    s = cuda.stream()
    upload(dev, host, s, nbytes=4 * 3)              # only the first three values
    s.synchronize()
    np.testing.assert_array_equal(dev.copy_to_host(), [0, 1, 2] + [-1] * 7)
    upload(dev[5:7], host[8:10], s)                 # views at an offset
    s.synchronize()
    np.testing.assert_array_equal(dev.copy_to_host(), [0, 1, 2, -1, -1, 8, 9, -1, -1, -1])
    upload(dev, host, s, nbytes=0)                  # nothing to do


def test_upload_refuses_more_than_fits():
    dev = cuda.to_device(np.zeros(4, np.float32))
    host = pinned_like(cuda.to_device(np.zeros(8, np.float32)))
    with pytest.raises(ValueError, match="do not fit"):
        upload(dev, host, 0)                        # 32 host bytes into a 16-byte array
    with pytest.raises(ValueError, match="do not fit"):
        upload(dev, host, 0, nbytes=-4)


def test_bound_upload_copies_what_upload_copies():
    # h2d.Upload: the pointers and the stream's handle taken once (on a GPU a call is one
    # cuMemcpyHtoDAsync through cuda.bindings; under the simulator it is upload)
    from genie_rt.engine.h2d import Upload
    dev = cuda.to_device(np.full(10, -1, np.int32))
    host = pinned_like(dev)
    host[:] = np.arange(10)
    s = cuda.stream()
    ids = Upload(dev, host, s)
    ids(4 * 3)                                      # the first three values
    s.synchronize()
    np.testing.assert_array_equal(dev.copy_to_host(), [0, 1, 2] + [-1] * 7)
    Upload(dev[5:7], host[8:10], s)()               # views at an offset, all they hold
    s.synchronize()
    np.testing.assert_array_equal(dev.copy_to_host(), [0, 1, 2, -1, -1, 8, 9, -1, -1, -1])
    host[:3] = [70, 71, 72]                         # the same binding copies what the mirror holds now
    ids(4 * 2)
    ids(0)
    s.synchronize()
    np.testing.assert_array_equal(dev.copy_to_host()[:4], [70, 71, 2, -1])
    with pytest.raises(ValueError, match="do not fit"):
        ids(4 * 11)
    with pytest.raises(ValueError, match="do not fit"):
        Upload(dev[:4], host, s)(4 * 5)             # bound to the smaller of the two


def test_bound_upload_falls_back_to_numbas_copy_when_the_binding_refuses_the_call(caplog):
    # a cuda.bindings whose cuMemcpyHtoDAsync takes its arguments otherwise: a warning, then numba's copy
    from genie_rt.engine.h2d import Upload
    dev = cuda.to_device(np.zeros(4, np.int32))
    host = pinned_like(dev)
    host[:] = [1, 2, 3, 4]
    s = cuda.stream()
    up = Upload(dev, host, s)

    def refuses(*a):
        raise TypeError("Provided argument is of type <class 'int'> but expected CUdeviceptr")
    up._copy, up._dst, up._src, up._stream = refuses, None, None, None
    with caplog.at_level("WARNING", logger="genie_rt.cuda"):
        up(8)
    s.synchronize()
    assert up._copy is None and "numba's copy from now on" in caplog.text
    np.testing.assert_array_equal(dev.copy_to_host(), [1, 2, 0, 0])


def test_context_guard_makes_the_context_current_on_a_new_thread():
    # h2d.ContextGuard (CUDABackend._enter): on the thread that made it, a call finds the context
    # current and leaves it; on a new thread (none current) it makes it current, after which a copy
    # there works. Under the simulator a call does nothing and the copy works as before.
    import threading

    from genie_rt.engine.h2d import ContextGuard, Upload
    guard = ContextGuard()
    guard()
    dev = cuda.to_device(np.zeros(4, np.int32))
    host = pinned_like(dev)
    host[:] = [4, 3, 2, 1]
    s = cuda.stream()
    copy = Upload(dev, host, s)
    seen = []

    def worker():
        try:
            if guard._get is None:
                seen.append("simulator")
            else:
                from cuda.bindings import driver as cu
                seen.append(int(cu.cuCtxGetCurrent()[1]) == guard._handle)   # not current yet
                guard()
                seen.append(int(cu.cuCtxGetCurrent()[1]) == guard._handle)
            copy()
            s.synchronize()
            seen.append(dev.copy_to_host().tolist())
        except Exception as exc:      # noqa: BLE001 - reported below
            seen.append(exc)

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    if seen[0] == "simulator":
        assert seen[1:] == [[4, 3, 2, 1]]
    else:
        assert seen == [False, True, [4, 3, 2, 1]]
