"""Does every runtime dependency install from binary wheels on a Jetson (JetPack 6)?

    python tools/check_wheels.py                       # the default target: JetPack 6
    python tools/check_wheels.py --extra jetson -d /tmp/w
    python tools/check_wheels.py --no-download -d DIR  # only check wheels already in DIR

The target is JetPack 6 (L4T R36): Ubuntu 22.04, glibc 2.35, aarch64, CPython 3.10, CUDA
12.6 from JetPack's own toolkit. The check:

1. `pip download --only-binary=:all:` of pyproject.toml's runtime dependencies (and the
   extras named) for that platform and Python: no sdist, so nothing a user would compile.
2. The closure, with environment markers evaluated for the target. pip evaluates markers
   against the interpreter it runs on, not --python-version, so a dependency that only
   3.10 needs (`backports.strenum; python_version < "3.11"` of cuda-core) is missed by
   step 1; each wheel's Requires-Dist is read here, and what is missing is fetched too.
3. Every file is a wheel whose tags the target accepts (cp310 / abi3 / py3, manylinux
   with glibc <= 2.35 on aarch64, or any): a manylinux_2_39 wheel would fail on the Jetson.
4. No CUDA toolkit wheels (nvidia-*, cuda-toolkit): numba-cuda uses JetPack's toolkit
   (/usr/local/cuda), and the cu12 wheels would duplicate it (or mismatch its driver).

Exit status 0 when all hold, 1 otherwise, with what failed. Needs the package registry
(step 1); `--no-download` runs steps 2-4 on a folder.
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import zipfile
from email.parser import Parser
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename

ROOT = Path(__file__).resolve().parent.parent
PLATFORMS = ("manylinux2014_aarch64", "manylinux_2_28_aarch64", "manylinux_2_31_aarch64", "manylinux_2_35_aarch64")
PYTHON = "3.10"
GLIBC = (2, 35)                 # Ubuntu 22.04 (JetPack 6)
MARKERS = {"python_version": "3.10", "python_full_version": "3.10.12", "platform_machine": "aarch64",
           "sys_platform": "linux", "platform_system": "Linux", "os_name": "posix",
           "implementation_name": "cpython", "platform_python_implementation": "CPython",
           "platform_release": "5.15.148-tegra", "implementation_version": "3.10.12"}
CUDA_WHEELS = re.compile(r"^(nvidia-.*|cuda-toolkit)$")


def project_requirements(extras: list[str]) -> list[str]:
    import tomllib
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = list(project["dependencies"])
    for e in extras:
        if e not in project.get("optional-dependencies", {}):
            raise SystemExit(f"pyproject.toml has no extra {e!r}")
        reqs += project["optional-dependencies"][e]
    return reqs


def pip_download(reqs: list[str], dest: Path) -> None:
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--only-binary=:all:", "--implementation", "cp",
           "--python-version", PYTHON, "-d", str(dest)]
    for p in PLATFORMS:
        cmd += ["--platform", p]
    r = subprocess.run(cmd + reqs, capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError("pip download failed (a dependency has no wheel for aarch64 / CPython 3.10?):\n"
                           + "\n".join(line for line in r.stderr.splitlines() if "ignored" not in line))


def wheel_tags_ok(filename: str) -> bool:
    """True when the target (cp310, glibc 2.35, aarch64) can install this wheel."""
    _name, _ver, _build, tags = parse_wheel_filename(filename)
    for t in tags:
        py_ok = t.interpreter in ("cp310", "py3", "py310", "py2.py3") or \
            (t.abi == "abi3" and re.fullmatch(r"cp3(\d+)", t.interpreter) and int(t.interpreter[3:]) <= 10)
        abi_ok = t.abi in ("cp310", "abi3", "none")
        m = re.fullmatch(r"manylinux_(\d+)_(\d+)_aarch64", t.platform)
        legacy = {"manylinux2014_aarch64": (2, 17)}.get(t.platform)
        plat_ok = t.platform == "any" or (m and (int(m.group(1)), int(m.group(2))) <= GLIBC) or \
            (legacy is not None and legacy <= GLIBC)
        if py_ok and abi_ok and plat_ok:
            return True
    return False


def _metadata(wheel: Path):
    with zipfile.ZipFile(wheel) as z:
        name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        return Parser().parsestr(z.read(name).decode("utf-8", "replace"))


def missing_requirements(folder: Path, roots: list[str]) -> list[str]:
    """Requirements of the closure (markers for the target) that no wheel in `folder` meets."""
    have = {}
    for w in folder.glob("*.whl"):
        name, version, *_ = parse_wheel_filename(w.name)
        have[name] = (version, w)
    missing, seen = [], set()
    todo = [(Requirement(r), None) for r in roots]
    while todo:
        req, parent_extras = todo.pop()
        env = dict(MARKERS, extra="")
        if req.marker is not None and not any(req.marker.evaluate(dict(env, extra=e))
                                              for e in (parent_extras or {""})):
            continue
        key = (canonicalize_name(req.name), tuple(sorted(req.extras)))
        if key in seen:
            continue
        seen.add(key)
        found = have.get(canonicalize_name(req.name))
        if found is None or not req.specifier.contains(found[0], prereleases=True):
            missing.append(str(req).split(";")[0].strip())
            continue
        for line in _metadata(found[1]).get_all("Requires-Dist") or []:
            todo.append((Requirement(line), set(req.extras) | {""}))
    return sorted(set(missing))


def check(folder: Path, roots: list[str], download: bool, allow_cuda_wheels: bool) -> list[str]:
    problems = []
    if download:
        pip_download(roots, folder)
        for _ in range(5):               # markers pip judged for its own interpreter
            miss = missing_requirements(folder, roots)
            if not miss:
                break
            pip_download(miss, folder)
    miss = missing_requirements(folder, roots)
    if miss:
        problems.append("not resolved for the target: " + ", ".join(miss))
    for f in sorted(folder.iterdir()):
        if not f.name.endswith(".whl"):
            problems.append(f"{f.name}: not a wheel (it would be compiled on the Jetson)")
        elif not wheel_tags_ok(f.name):
            problems.append(f"{f.name}: no tag for CPython 3.10 / aarch64 / glibc {GLIBC[0]}.{GLIBC[1]}")
        elif not allow_cuda_wheels and CUDA_WHEELS.match(str(parse_wheel_filename(f.name)[0])):
            problems.append(f"{f.name}: a CUDA toolkit wheel (JetPack's own toolkit is meant to serve)")
    return problems


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--extra", action="append", default=[], help="also the extra's dependencies (e.g. jetson)")
    ap.add_argument("-d", "--dest", default=None, help="folder for the wheels (default: a temporary one)")
    ap.add_argument("--no-download", action="store_true", help="check the wheels already in --dest")
    args = ap.parse_args(argv)
    roots = project_requirements(args.extra)
    allow_cuda = any(e.startswith("cu") for e in args.extra)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(args.dest or tmp)
        folder.mkdir(parents=True, exist_ok=True)
        try:
            problems = check(folder, roots, not args.no_download, allow_cuda)
        except RuntimeError as exc:
            problems = [str(exc)]
        wheels = sorted(f.name for f in folder.glob("*.whl"))
    for w in wheels:
        print(f"  {w}")
    if problems:
        print("NOT installable with pip alone on JetPack 6 (aarch64, CPython 3.10):", file=sys.stderr)
        for p in problems:
            print(f"  - {p}", file=sys.stderr)
        return 1
    print(f"ok: {len(wheels)} wheels for aarch64 / CPython {PYTHON} / glibc <= {GLIBC[0]}.{GLIBC[1]}, "
          "no sdist, no CUDA toolkit wheel")
    return 0


if __name__ == "__main__":
    sys.exit(main())
