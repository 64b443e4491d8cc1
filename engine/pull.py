"""`genie-rt pull REPO[:FILE]`: a GGUF from the Hugging Face hub into models_dir(), and the
names `-m` accepts for what was pulled.

    genie-rt pull Qwen/Qwen3-4B-GGUF:Qwen3-4B-Q4_K_M.gguf
    genie-rt pull Qwen/Qwen3-4B-GGUF             # the repo's one GGUF, or its Q4_K_M one
    genie-rt run -m Qwen/Qwen3-4B-GGUF:Qwen3-4B-Q4_K_M.gguf -p ...

The hub's URL layout (also what a mirror serves; $HF_ENDPOINT names it, default
https://huggingface.co; $HF_TOKEN is sent as a bearer token when set):

- GET {endpoint}/api/models/{repo}/tree/{revision}?recursive=true - the files, each with
  its size and, for files in Git LFS (every GGUF), `lfs.oid`: the SHA-256 of the content;
  small files carry only `oid`, the git blob SHA-1.
- GET {endpoint}/{repo}/resolve/{revision}/{file} - the content (redirects followed), with
  `Range: bytes=N-` to resume.

Where: models_dir()/{owner}/{name}/{file} (engine/paths.py). The download goes to a
`.part` file beside it; an interrupted pull resumes from its size (the server answers 206;
a 200 starts over), the whole file is hashed, and only a file whose hash is the hub's is
renamed into place - a mismatch deletes the part and says so. A file already in place
with the hub's size is kept (pull again with --force to re-download).

Progress (engine/progress.py): a bar on a terminal, a line every 10 % otherwise (logs).
"""
from __future__ import annotations

import hashlib
import http.client
import json
import os
import re
import sys
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from .paths import models_dir
from .progress import StreamProgress

DEFAULT_ENDPOINT = "https://huggingface.co"
_REPO = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")
CHUNK = 1 << 20


class PullError(OSError):
    """The hub cannot give the file (named), or what it gave is not what it described."""


@dataclass(frozen=True)
class RemoteFile:
    repo: str
    path: str
    size: int
    sha256: str | None        # LFS files
    git_sha1: str | None      # small files


def parse_name(name: str) -> tuple[str, str | None]:
    """'owner/repo[:file]' -> (repo, file or None); ValueError for anything else."""
    repo, _, file = name.partition(":")
    if not _REPO.fullmatch(repo) or ".." in repo or (file and (file.startswith("/") or ".." in file.split("/"))):
        raise ValueError(f"{name!r} is not a hub name: use OWNER/REPO or OWNER/REPO:FILE.gguf")
    return repo, file or None


def local_path(repo: str, file: str) -> Path:
    return models_dir().joinpath(*repo.split("/"), *file.split("/"))


def resolve_pulled(name: str) -> Path | None:
    """The pulled file of `-m OWNER/REPO[:FILE]`, or None when `name` is no such name or not pulled."""
    try:
        repo, file = parse_name(name)
    except ValueError:
        return None
    if file is not None:
        p = local_path(repo, file)
        return p if p.is_file() else None
    folder = models_dir().joinpath(*repo.split("/"))
    found = sorted(folder.rglob("*.gguf")) if folder.is_dir() else []
    return found[0] if len(found) == 1 else None


def _request(url: str, **headers) -> urllib.request.Request:
    token = os.environ.get("HF_TOKEN")
    if token:
        headers["Authorization"] = f"Bearer {token}"
    return urllib.request.Request(url, headers={"User-Agent": "genie-rt", **headers})


def _open(req: urllib.request.Request, what: str, timeout: float):
    try:
        return urllib.request.urlopen(req, timeout=timeout)
    except urllib.error.HTTPError as exc:
        hint = " (private or gated: set HF_TOKEN)" if exc.code in (401, 403) else ""
        raise PullError(f"{what}: {req.full_url} answered HTTP {exc.code}{hint}") from None
    except (urllib.error.URLError, OSError) as exc:
        raise PullError(f"{what}: cannot reach {req.full_url} ({getattr(exc, 'reason', exc)})") from None


def list_files(endpoint: str, repo: str, revision: str, timeout: float = 60) -> list[RemoteFile]:
    url = f"{endpoint}/api/models/{repo}/tree/{urllib.parse.quote(revision)}?recursive=true"
    with _open(_request(url), f"listing {repo}", timeout) as resp:
        try:
            rows = json.loads(resp.read())
        except ValueError as exc:
            raise PullError(f"listing {repo}: {url} did not answer JSON ({exc})") from None
    out = []
    for row in rows if isinstance(rows, list) else []:
        if isinstance(row, dict) and row.get("type") == "file" and isinstance(row.get("path"), str):
            lfs = row.get("lfs") if isinstance(row.get("lfs"), dict) else {}
            size = lfs.get("size", row.get("size"))
            out.append(RemoteFile(repo, row["path"], int(size) if isinstance(size, int) else -1,
                                  lfs.get("oid") or lfs.get("sha256"), None if lfs else row.get("oid")))
    return out


def choose(files: list[RemoteFile], repo: str, file: str | None) -> RemoteFile:
    if file is not None:
        for f in files:
            if f.path == file:
                return f
        raise PullError(f"{repo} has no file {file!r}" + _listing(files))
    ggufs = [f for f in files if f.path.lower().endswith(".gguf")]
    if len(ggufs) == 1:
        return ggufs[0]
    q4km = [f for f in ggufs if "q4_k_m" in f.path.lower()]
    if len(q4km) == 1:
        return q4km[0]
    raise PullError(f"{repo}: " + ("no GGUF file" if not ggufs else f"{len(ggufs)} GGUF files; name one as "
                                   f"{repo}:FILE") + _listing(ggufs or files))


def _listing(files: list[RemoteFile]) -> str:
    names = [f"{f.path} ({f.size / 1e6:.0f} MB)" if f.size >= 0 else f.path for f in files[:20]]
    return (": " + ", ".join(names) + (", ..." if len(files) > 20 else "")) if names else ""


def _digest(f: RemoteFile):
    if f.sha256:
        return hashlib.sha256(), f.sha256
    if f.git_sha1 and f.size >= 0:
        h = hashlib.sha1()
        h.update(b"blob %d\0" % f.size)
        return h, f.git_sha1
    return None, None


def download(endpoint: str, f: RemoteFile, revision: str, target: Path, timeout: float = 60, out=None) -> Path:
    target.parent.mkdir(parents=True, exist_ok=True)
    part = target.with_name(target.name + ".part")
    have = part.stat().st_size if part.is_file() else 0
    if f.size >= 0 and have > f.size:
        part.unlink()
        have = 0
    url = f"{endpoint}/{f.repo}/resolve/{urllib.parse.quote(revision)}/{urllib.parse.quote(f.path)}"
    headers = {"Range": f"bytes={have}-"} if have else {}
    if not (have and have == f.size):
        with _open(_request(url, **headers), f"downloading {f.path}", timeout) as resp:
            if have and resp.status != 206:      # the server ignored the range: start over
                have = 0
            total = f.size if f.size >= 0 else have + int(resp.headers.get("Content-Length") or 0)
            progress = StreamProgress(out, every=10)
            progress.start(f.path, total, "B", done=have)
            with part.open("r+b" if have else "wb") as dst:
                dst.seek(have)
                dst.truncate()
                done = have
                try:
                    while block := resp.read(CHUNK):
                        dst.write(block)
                        done += len(block)
                        progress.advance(len(block))
                except (http.client.HTTPException, OSError) as exc:   # IncompleteRead, a reset, a timeout
                    raise PullError(f"{f.path}: the download broke off after {done} bytes "
                                    f"({type(exc).__name__}); pull again to resume") from None
                progress.done()
    size = part.stat().st_size
    if f.size >= 0 and size != f.size:
        raise PullError(f"{f.path}: got {size} bytes, the hub lists {f.size}; pull again to resume")
    h, want = _digest(f)
    if h is not None:
        with part.open("rb") as src:
            while block := src.read(4 * CHUNK):
                h.update(block)
        if h.hexdigest() != want:
            part.unlink()
            raise PullError(f"{f.path}: checksum {h.hexdigest()} is not the hub's {want}; the download was "
                            "deleted, pull again")
    os.replace(part, target)
    return target


def pull(name: str, *, revision: str = "main", endpoint: str | None = None, force: bool = False,
         out=None) -> Path:
    endpoint = (endpoint or os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")
    repo, file = parse_name(name)
    remote = choose(list_files(endpoint, repo, revision), repo, file)
    target = local_path(repo, remote.path)
    if target.is_file() and not force and (remote.size < 0 or target.stat().st_size == remote.size):
        print(f"{target}: already pulled", file=out or sys.stderr)
        return target
    return download(endpoint, remote, revision, target, out=out)


def cmd_pull(args) -> int:
    path = pull(args.name, revision=args.revision, endpoint=args.endpoint, force=args.force)
    repo, _ = parse_name(args.name)
    file = path.relative_to(models_dir().joinpath(*repo.split("/"))).as_posix()
    print(f"{path}\nuse it with: genie-rt run -m {repo}:{file}")
    return 0


def add_pull_parser(sub) -> None:
    p = sub.add_parser("pull", help="download a GGUF from the Hugging Face hub into ~/.cache/genie-rt/models")
    p.add_argument("name", metavar="REPO[:FILE]", help="OWNER/REPO, or OWNER/REPO:FILE.gguf")
    p.add_argument("--revision", default="main", help="branch, tag or commit (default main)")
    p.add_argument("--endpoint", default=None, help="hub address (default $HF_ENDPOINT or https://huggingface.co)")
    p.add_argument("--force", action="store_true", help="download again even if the file is here")
    p.set_defaults(func=cmd_pull)
