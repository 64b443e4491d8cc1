"""tools/check_wheels.py on folders of made-up wheels (no registry): the closure with markers
judged for CPython 3.10 / aarch64, the tags a JetPack 6 board accepts, no CUDA toolkit wheels."""
import sys
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
import check_wheels as cw  # noqa: E402


def wheel(folder: Path, filename: str, requires=()):
    name, version = filename.split("-")[:2]
    with zipfile.ZipFile(folder / filename, "w") as z:
        z.writestr(f"{name}-{version}.dist-info/METADATA", "Metadata-Version: 2.1\nName: %s\nVersion: %s\n%s"
                   % (name, version, "".join(f"Requires-Dist: {r}\n" for r in requires)))


def test_tags_the_jetson_accepts():
    ok = ["numpy-2.2.6-cp310-cp310-manylinux_2_17_aarch64.manylinux2014_aarch64.whl",
          "tokenizers-0.23.3-cp310-abi3-manylinux_2_17_aarch64.manylinux2014_aarch64.whl",
          "cuda_bindings-12.9.10-cp310-cp310-manylinux_2_24_aarch64.manylinux_2_28_aarch64.whl",
          "hf_xet-1.8.0-cp38-abi3-manylinux_2_28_aarch64.whl", "jinja2-3.1.6-py3-none-any.whl"]
    bad = ["numpy-2.2.6-cp310-cp310-manylinux_2_17_x86_64.whl",         # wrong machine
           "numpy-2.3.0-cp311-cp311-manylinux_2_28_aarch64.whl",        # wrong Python
           "foo-1.0-cp310-cp310-manylinux_2_39_aarch64.whl",            # glibc newer than Ubuntu 22.04's
           "bar-1.0-cp311-abi3-manylinux_2_28_aarch64.whl"]             # abi3 from 3.11 on
    assert all(cw.wheel_tags_ok(w) for w in ok)
    assert not any(cw.wheel_tags_ok(w) for w in bad)


def test_closure_judges_markers_for_the_target(tmp_path):
    wheel(tmp_path, "cuda_core-1.2.2-cp310-cp310-manylinux_2_28_aarch64.whl",
          ['cuda-pathfinder>=1.4.2', 'backports.strenum; python_version < "3.11"',
           'cuda-toolkit==13.*; extra == "cu13"', 'pywin32; sys_platform == "win32"'])
    wheel(tmp_path, "cuda_pathfinder-1.8.3-py3-none-any.whl")
    # what pip on a 3.11 interpreter fetches: backports.strenum is missing, the extra and
    # the Windows-only requirement are not needed
    assert cw.missing_requirements(tmp_path, ["cuda-core>=0.5"]) == ["backports.strenum"]
    wheel(tmp_path, "backports_strenum-1.3.1-py3-none-any.whl")
    assert cw.missing_requirements(tmp_path, ["cuda-core>=0.5"]) == []
    assert cw.missing_requirements(tmp_path, ["cuda-core>=2"]) == ["cuda-core>=2"]   # version too old
    assert cw.check(tmp_path, ["cuda-core>=0.5"], download=False, allow_cuda_wheels=False) == []


def test_check_reports_sdists_bad_tags_and_cuda_wheels(tmp_path):
    wheel(tmp_path, "a-1.0-py3-none-any.whl", ["nvidia-cuda-nvrtc-cu12"])
    wheel(tmp_path, "nvidia_cuda_nvrtc_cu12-12.9.86-py3-none-manylinux2014_aarch64.whl")
    wheel(tmp_path, "b-1.0-cp312-cp312-manylinux_2_28_aarch64.whl")
    (tmp_path / "c-1.0.tar.gz").write_bytes(b"")
    problems = "\n".join(cw.check(tmp_path, ["a", "b"], download=False, allow_cuda_wheels=False))
    assert "c-1.0.tar.gz: not a wheel" in problems
    assert "b-1.0-cp312" in problems and "no tag for CPython 3.10" in problems
    assert "nvidia_cuda_nvrtc_cu12" in problems and "CUDA toolkit wheel" in problems
    assert "CUDA toolkit wheel" not in "\n".join(cw.check(tmp_path, ["a"], download=False, allow_cuda_wheels=True))


def test_the_project_declares_the_jetson_extra():
    reqs = cw.project_requirements(["jetson"])
    assert any(r.startswith("numba-cuda") for r in reqs) and any(r.startswith("cuda-bindings") and "<13" in r
                                                                 for r in reqs)
