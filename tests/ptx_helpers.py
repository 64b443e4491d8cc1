"""PTX tests for kernel modules: compile kernels for real targets in one subprocess.

The pytest process may run with the CUDA simulator on (conftest.py turns it on when there
is no GPU), and the simulator cannot compile. `compile_in_subprocess` starts one Python
without NUMBA_ENABLE_CUDASIM, imports the kernels' module there, compiles every
(kernel, signature) for every compute capability with `cuda.compile_ptx` (needs only
NVRTC/NVVM, no GPU), and returns the PTX text. Use it once per test module:

    from ptx_helpers import compile_in_subprocess, assert_ptx_contains, assert_no_f64

    @pytest.fixture(scope="module")
    def ptx():
        return compile_in_subprocess("genie_rt.quant.gemv", {
            "gemv_q4k": "void(uint8[::1], float32[::1], float32[::1], int32, int32)",
            "dot_row": ("float32(uint8[::1], int64)", {"device": True}),
        })

    def test_gemv_uses_vector_loads(ptx):
        for cc, text in ptx["gemv_q4k"].items():
            assert_ptx_contains(text, "ld.global.nc.v4.u32", where=f"gemv_q4k sm_{cc[0]}{cc[1]}")
            assert_no_f64(text)

Kernels must be module-level names; `@cuda.jit` without a signature (lazy) is the right
form, since a decorator with signatures compiles at import. Signatures are numba strings.
"""
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import textwrap

DEFAULT_CCS = ((8, 7), (9, 0))   # Jetson Orin, H100/H200

# Runs in the child. argv: request.json, result.json
_CHILD = r"""
import importlib, importlib.util, json, os, sys, traceback
req = json.load(open(sys.argv[1]))
os.environ.pop("NUMBA_ENABLE_CUDASIM", None)
from numba import cuda
if not cuda.is_available():
    # numba compiles @cuda.jit(device=True) callees for the *current* device's compute
    # capability; without a GPU there is none. The callee is compiled into each kernel
    # for the kernel's own target, so any sm_80+ answer is harmless here.
    import types
    import numba.cuda.dispatcher as _dispatcher
    _dispatcher.get_current_device = lambda: types.SimpleNamespace(compute_capability=(8, 0))

def load(source):
    kind, value = source
    if kind == "module":
        return importlib.import_module(value)
    path = value
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
    name = "_ptx_subject_" + os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod

out = {"ptx": {}, "errors": {}}
try:
    mod = load(req["source"])
except Exception:
    out["errors"]["<import>"] = traceback.format_exc()
else:
    for name, (sig, opts) in req["kernels"].items():
        out["ptx"][name] = {}
        try:
            fn = getattr(mod, name)
            fn = getattr(fn, "py_func", fn)       # a @cuda.jit dispatcher -> its function
        except Exception:
            out["errors"][name] = traceback.format_exc()
            continue
        for cc in req["ccs"]:
            try:
                text, _ = cuda.compile_ptx(fn, sig, cc=tuple(cc), **opts)
                out["ptx"][name]["%d,%d" % tuple(cc)] = text
            except Exception:
                out["errors"]["%s sm_%d%d" % (name, cc[0], cc[1])] = traceback.format_exc()
json.dump(out, open(sys.argv[2], "w"))
"""

_cache = {}


def compile_in_subprocess(source, kernels, ccs=DEFAULT_CCS, timeout=900):
    """Compile kernels to PTX in a fresh Python without the simulator.

    source:  a dotted module name ("genie_rt.quant.gemv"), a path to a .py file (a test
             module's `__file__`; its folder goes on sys.path), or Python source text.
    kernels: {name: signature} or {name: (signature, options)}; options go to
             cuda.compile_ptx (device=True for device functions, fastmath, lineinfo, ...).
    ccs:     compute capabilities, default sm_87 and sm_90.

    Returns {name: {(major, minor): ptx_text}}. Raises AssertionError listing every kernel
    that failed to import or compile, with the child's traceback.
    """
    ccs = [tuple(int(x) for x in cc) for cc in ccs]
    norm = {}
    for name, spec in kernels.items():
        sig, opts = (spec if isinstance(spec, tuple) else (spec, {}))
        norm[name] = [str(sig), dict(opts)]
    tmp = None
    if isinstance(source, str) and "\n" in source:
        fd, tmp = tempfile.mkstemp(suffix=".py", prefix="ptx_subject_")
        with os.fdopen(fd, "w") as f:
            f.write(textwrap.dedent(source))
        src = ["path", tmp]
    elif str(source).endswith(".py"):
        src = ["path", os.path.abspath(str(source))]
    else:
        src = ["module", str(source)]
    key = json.dumps([src if tmp is None else ["code", source], norm, ccs], sort_keys=True)
    if key in _cache:
        if tmp:
            os.unlink(tmp)
        return _cache[key]

    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    with tempfile.TemporaryDirectory(prefix="ptx_compile_") as d:
        req, res = os.path.join(d, "req.json"), os.path.join(d, "res.json")
        with open(req, "w") as f:
            json.dump({"source": src, "kernels": norm, "ccs": ccs}, f)
        try:
            proc = subprocess.run([sys.executable, "-c", _CHILD, req, res], env=env,
                                  capture_output=True, text=True, timeout=timeout)
        finally:
            if tmp:
                os.unlink(tmp)
        if proc.returncode != 0 or not os.path.exists(res):
            raise AssertionError(f"PTX compile subprocess failed (rc={proc.returncode}):\n"
                                 f"{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
        with open(res) as f:
            out = json.load(f)
    if out["errors"]:
        msg = "\n".join(f"--- {k}\n{v}" for k, v in out["errors"].items())
        raise AssertionError(f"{len(out['errors'])} kernel(s) failed to compile to PTX:\n{msg}")
    result = {name: {tuple(int(x) for x in cc.split(",")): text for cc, text in per.items()}
              for name, per in out["ptx"].items()}
    _cache[key] = result
    return result


def assert_ptx_contains(ptx, *needles, where=""):
    """Every needle (plain substring) occurs in the PTX text."""
    missing = [n for n in needles if n not in ptx]
    assert not missing, f"{where}: PTX lacks {missing}"


def assert_compiled_for(ptx_text, kernels, ccs=DEFAULT_CCS):
    """compile_in_subprocess's result holds every kernel of `kernels`, each for exactly `ccs`,
    each text naming its target."""
    assert set(ptx_text) == set(kernels)
    for name, per_cc in ptx_text.items():
        assert set(per_cc) == {tuple(cc) for cc in ccs}, name
        for cc, text in per_cc.items():
            assert f".target sm_{cc[0]}{cc[1]}" in text


def assert_every_target_contains(per_cc, needles, name=""):
    """assert_ptx_contains on each target's text of one kernel ({(major, minor): ptx})."""
    for cc, text in per_cc.items():
        assert_ptx_contains(text, *needles, where=f"{name} sm_{cc[0]}{cc[1]}")


def assert_ptx_lacks(ptx, *needles, where=""):
    """No needle (plain substring) occurs in the PTX text."""
    found = [n for n in needles if n in ptx]
    assert not found, f"{where}: PTX unexpectedly contains {found}"


_F64_OP = re.compile(r"^\s*(?:@!?%p\d+\s+)?([a-z][\w.]*\.f64)\b", re.M)


def f64_ops(ptx):
    """Instructions doing float64 work (cvt.f64.f32, mul.f64, fma.rn.f64, ...): usually a
    Python float literal that should have been float32(...)."""
    return [m.group(1) for m in _F64_OP.finditer(ptx)
            if not m.group(1).startswith(("ld.param", "st.param", "mov.b64"))]


def assert_no_f64(ptx, where=""):
    ops = f64_ops(ptx)
    assert not ops, f"{where}: float64 instructions in PTX: {sorted(set(ops))[:10]}"


def local_memory_bytes(ptx):
    """Bytes of per-thread local memory (`.local` depots: local arrays, spills at PTX level)."""
    return sum(int(n) for n in re.findall(r"\.local\s+\.align\s+\d+\s+\.b8\s+\w+\[(\d+)\]", ptx))


# ---- before / after griddepcontrol.wait (the PDL builds: test_pdl_ptx.py, test_pdl_sass.py,
# tools/pdl_sass.py) ----------------------------------------------------------------------
_GLOBAL_LOAD = re.compile(r"^\s*(@%p\d+\s+)?ld\.global\.", re.M)
_SASS_INSN = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;")


def global_loads(ptx_text):
    """The number of global loads (ld.global.*) in a piece of PTX."""
    return len(_GLOBAL_LOAD.findall(ptx_text))


def ptx_pre_wait_loads(ptx_text):
    """Global loads before the first griddepcontrol.wait in the PTX."""
    wait = ptx_text.find("griddepcontrol.wait;")
    assert wait >= 0, "no griddepcontrol.wait in the PTX"
    return global_loads(ptx_text[:wait])


def sass_instructions(nvdisasm_text):
    """The instructions of `nvdisasm -c` output, predicate first, without the addresses."""
    return _SASS_INSN.findall(nvdisasm_text)


def sass_pre_wait_loads(insns):
    """Global loads (LDG) before the first ACQBULK (griddepcontrol.wait) of the SASS, or None
    when it has no wait."""
    waits = [i for i, s in enumerate(insns) if s.startswith("ACQBULK")]
    if not waits:
        return None
    return sum(1 for s in insns[:waits[0]] if re.match(r"(@!?U?P\w+\s+)?LDG\b", s))


def cuda_tool(name, wheel_dirs=("cuda_nvcc", "cu13", "cu12")):
    """A CUDA tool (ptxas, nvdisasm) from $NAME (upper case), the PATH, or an nvidia-* wheel's bin
    folder (nvidia/<dir>/bin); None if none has it."""
    import shutil
    found = os.environ.get(name.upper()) or shutil.which(name)
    if found:
        return found
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations if spec else ()):
        for d in wheel_dirs:
            path = os.path.join(root, d, "bin", name)
            if os.path.isfile(path) and os.access(path, os.X_OK):
                return path
    return None
