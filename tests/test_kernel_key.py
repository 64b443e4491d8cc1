"""engine/kernel_key.py: what a compiled kernel's code depends on.

Checked on the CPU: the folder key changes when any package source changes (a copy of
the package imported in a subprocess, one byte edited) and when a version, the toolchain
or the compute capability changes; entries of closures specialised on different
constants, device functions, globals, target options or argument types never collide.
"""
from __future__ import annotations

import subprocess
import sys
import types
from pathlib import Path

import pytest

from genie_rt.engine import kernel_key
from kernel_cache_helpers import Dispatcher, child_env, copy_package, fresh_state, make_kernel  # noqa: F401


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
    for must in ("genie_rt.quant/ptx.py", "genie_rt.quant/ptx_device.py", "genie_rt.quant/gemv_kernels.py",
                 "genie_rt.engine/norm.py", "genie_rt.kvcache/attention_decode_kernels.py", "genie_rt.engine/kernel_cache.py"):
        assert must in names


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
    with open(pkg / "quant" / "ptx_device.py", "a") as f:                 # a device-side helper module
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
