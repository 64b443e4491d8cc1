"""`genie-rt pull` (engine/pull.py) against a local HTTP server in the Hugging Face hub's URL
layout (tree API with LFS SHA-256, resolve URLs with Range): download, resume, checksum,
choosing the file, errors, and `-m OWNER/REPO:FILE` afterwards."""
from __future__ import annotations

import hashlib
import http.server
import io
import json
import re
import threading

import pytest

from genie_rt.engine import pull as pl
from genie_rt.engine.cli import main
from genie_rt.engine.default_model import resolve_model

BLOB = bytes(range(256)) * 12_000 + b"end"          # ~3 MB: several chunks


class Hub:
    """repo -> {path: bytes}; `lfs_sha` overrides the listed SHA-256; `ranges` records Range headers."""

    def __init__(self):
        self.files = {"acme/tiny-GGUF": {"tiny-Q4_K_M.gguf": BLOB, "tiny-Q8_0.gguf": BLOB[:1000], "README.md": b"hi"}}
        self.lfs_sha: dict[str, str] = {}
        self.ranges: list[str | None] = []
        self.honour_range = True
        self.fail_after: int | None = None       # cut the body after this many bytes (once)


def serve(hub: Hub):
    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_GET(self):
            m = re.fullmatch(r"/api/models/([^/]+/[^/]+)/tree/main\?recursive=true", self.path)
            if m and m.group(1) in hub.files:
                rows = []
                for path, data in hub.files[m.group(1)].items():
                    if path.endswith(".gguf"):
                        sha = hub.lfs_sha.get(path, hashlib.sha256(data).hexdigest())
                        rows.append({"type": "file", "path": path, "size": len(data),
                                     "lfs": {"oid": sha, "size": len(data), "pointerSize": 130}})
                    else:
                        oid = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
                        rows.append({"type": "file", "path": path, "size": len(data), "oid": oid})
                return self._send(200, json.dumps(rows).encode())
            m = re.fullmatch(r"/([^/]+/[^/]+)/resolve/main/(.+)", self.path)
            if m and m.group(2) in hub.files.get(m.group(1), {}):
                data = hub.files[m.group(1)][m.group(2)]
                rng = self.headers.get("Range")
                hub.ranges.append(rng)
                if rng and hub.honour_range:
                    start = int(re.fullmatch(r"bytes=(\d+)-", rng).group(1))
                    return self._send(206, data[start:])
                if hub.fail_after is not None:
                    cut, hub.fail_after = hub.fail_after, None
                    self.send_response(200)
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data[:cut])
                    return            # the connection closes short of Content-Length
                return self._send(200, data)
            self._send(404, b"not found")

        def _send(self, code, body):
            self.send_response(code)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.fixture
def hub(monkeypatch, tmp_path):
    monkeypatch.setenv("GENIE_RT_MODELS", str(tmp_path / "models"))
    h = Hub()
    server = serve(h)
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{server.server_address[1]}")
    yield h
    server.shutdown()
    server.server_close()


def test_pull_downloads_verifies_and_m_finds_it(hub, tmp_path, capsys):
    assert main(["pull", "acme/tiny-GGUF:tiny-Q4_K_M.gguf"]) == 0
    out, err = capsys.readouterr()
    path = tmp_path / "models" / "acme" / "tiny-GGUF" / "tiny-Q4_K_M.gguf"
    assert path.read_bytes() == BLOB and not path.with_name(path.name + ".part").exists()
    assert "genie-rt run -m acme/tiny-GGUF:tiny-Q4_K_M.gguf" in out
    lines = [ln for ln in err.splitlines() if ln.startswith("tiny-Q4_K_M.gguf: ")]   # plain lines, not a tty
    assert len(lines) >= 3 and lines[-2].startswith("tiny-Q4_K_M.gguf: 100% (3 of 3 MB") and "\r" not in err
    assert lines[-1].startswith("tiny-Q4_K_M.gguf: done, 3 MB in ")
    assert resolve_model("acme/tiny-GGUF:tiny-Q4_K_M.gguf") == path
    # pulled again: kept, nothing downloaded
    n = len(hub.ranges)
    assert main(["pull", "acme/tiny-GGUF:tiny-Q4_K_M.gguf"]) == 0 and len(hub.ranges) == n
    assert "already pulled" in capsys.readouterr().err


def test_an_interrupted_pull_resumes_from_the_part(hub, tmp_path):
    hub.fail_after = 1_000_000
    with pytest.raises(pl.PullError, match="1000000 bytes.*pull again to resume"):
        pl.pull("acme/tiny-GGUF:tiny-Q4_K_M.gguf", out=io.StringIO())
    part = tmp_path / "models" / "acme" / "tiny-GGUF" / "tiny-Q4_K_M.gguf.part"
    assert part.stat().st_size == 1_000_000
    got = pl.pull("acme/tiny-GGUF:tiny-Q4_K_M.gguf", out=io.StringIO())
    assert got.read_bytes() == BLOB and hub.ranges[-1] == "bytes=1000000-" and not part.exists()


def test_a_server_that_ignores_the_range_restarts_cleanly(hub, tmp_path):
    part = tmp_path / "models" / "acme" / "tiny-GGUF" / "tiny-Q4_K_M.gguf.part"
    part.parent.mkdir(parents=True)
    part.write_bytes(b"garbage" * 100)
    hub.honour_range = False
    assert pl.pull("acme/tiny-GGUF:tiny-Q4_K_M.gguf", out=io.StringIO()).read_bytes() == BLOB


def test_a_checksum_mismatch_deletes_the_download(hub, tmp_path):
    hub.lfs_sha["tiny-Q4_K_M.gguf"] = "0" * 64
    with pytest.raises(pl.PullError, match="checksum .* is not the hub's 0000"):
        pl.pull("acme/tiny-GGUF:tiny-Q4_K_M.gguf", out=io.StringIO())
    folder = tmp_path / "models" / "acme" / "tiny-GGUF"
    assert list(folder.iterdir()) == []


def test_small_files_are_checked_by_git_blob_sha1(hub, tmp_path):
    assert pl.pull("acme/tiny-GGUF:README.md", out=io.StringIO()).read_bytes() == b"hi"


def test_choosing_the_file(hub, capsys):
    # two GGUFs: the one Q4_K_M is taken
    assert pl.pull("acme/tiny-GGUF", out=io.StringIO()).name == "tiny-Q4_K_M.gguf"
    hub.files["acme/tiny-GGUF"]["other-Q4_K_M.gguf"] = b"x"
    with pytest.raises(pl.PullError, match="3 GGUF files; name one as acme/tiny-GGUF:FILE: .*tiny-Q8_0.gguf"):
        pl.pull("acme/tiny-GGUF", out=io.StringIO())
    with pytest.raises(pl.PullError, match="has no file 'nope.gguf'"):
        pl.pull("acme/tiny-GGUF:nope.gguf", out=io.StringIO())


def test_errors_are_one_line(hub, capsys, monkeypatch):
    assert main(["pull", "acme/absent"]) == 1
    assert "answered HTTP 404" in capsys.readouterr().err
    assert main(["pull", "../etc"]) == 1
    assert "is not a hub name" in capsys.readouterr().err
    assert main(["run", "-m", "acme/tiny-GGUF:tiny-Q8_0.gguf", "-p", "hi"]) == 1
    err = capsys.readouterr().err
    assert "not pulled (genie-rt pull acme/tiny-GGUF:tiny-Q8_0.gguf" in err and "Traceback" not in err
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")       # nothing listens there
    assert main(["pull", "acme/tiny-GGUF"]) == 1
    assert "cannot reach http://127.0.0.1:9" in capsys.readouterr().err
