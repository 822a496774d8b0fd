"""A local HTTP server that speaks enough of the Hugging Face Hub's API for the real `huggingface_hub` client.

It serves model folders (the tiny fixture checkpoints, or a bare config.json) as hub repos:

- `GET /api/models` (search, author, filter on tags, sort, limit, expand; pagination by `Link` header),
- `GET /api/models/{repo}` and `/api/models/{repo}/revision/{rev}` (siblings, and with `blobs=1` their size,
  git blob id and LFS sha256; config, cardData, safetensors parameter counts, gated, sha),
- `HEAD`/`GET /{repo}/resolve/{rev}/{path}` with the headers `file_download.get_hf_file_metadata` reads:
  `ETag` (git blob sha1, or the LFS sha256), `X-Repo-Commit`, and for LFS files `X-Linked-Etag` and
  `X-Linked-Size`; `Range` requests answered with 206 and `Content-Range`.

Gated repos want `Authorization: Bearer <token>` and answer 401 with `X-Error-Code: GatedRepo` otherwise.
Faults are injected per file path: 500s, truncated bodies (the connection closes mid-body), stalls
(the body stops for longer than a client's read timeout) and corrupt bytes (same length, wrong
checksum); `throttle_bps` slows bodies so a test can pause or kill a download mid-file.
"""
from __future__ import annotations

import fnmatch
import hashlib
import json
import re
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlparse

LFS_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt")
PAGE_SIZE = 3           # small pages so pagination is exercised


def git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class RepoFile:
    path: str
    data: bytes
    lfs: bool

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.data).hexdigest()

    @property
    def blob_id(self) -> str:
        # LFS files live in git as a pointer; its blob id is what the hub reports as blobId
        return git_blob_sha1(self.pointer) if self.lfs else git_blob_sha1(self.data)

    @property
    def pointer(self) -> bytes:
        return (f"version https://git-lfs.github.com/spec/v1\noid sha256:{self.sha256}\nsize {len(self.data)}\n").encode()

    @property
    def etag(self) -> str:
        return self.sha256 if self.lfs else self.blob_id


@dataclass
class Repo:
    repo_id: str
    files: dict[str, RepoFile]
    gated: bool = False
    tags: list[str] = field(default_factory=list)
    downloads: int = 0
    likes: int = 0
    card: dict = field(default_factory=dict)

    @property
    def sha(self) -> str:
        h = hashlib.sha1(self.repo_id.encode())
        for path in sorted(self.files):
            h.update(path.encode() + self.files[path].etag.encode())
        return h.hexdigest()

    @property
    def config(self) -> dict:
        f = self.files.get("config.json")
        return json.loads(f.data) if f else {}


@dataclass
class Fault:
    pattern: str            # fnmatch over the file path in the repo
    kind: str               # "500" | "truncate" | "stall" | "corrupt"
    times: int = 1          # how many requests it hits; -1: every one


class HubServer:
    """`with HubServer() as hub: hub.add_folder("org/name", path); HfApi(endpoint=hub.url)...`"""

    def __init__(self, *, token: str = "hf_test_token", stall_s: float = 30.0):
        self.repos: dict[str, Repo] = {}
        self.faults: list[Fault] = []
        self.throttle_bps = 0                 # 0: no limit
        self.blobs_listing = True             # False: like a mirror whose file list has no sizes or checksums
        self.stall_s = stall_s
        self.token = token
        self.requests: list[tuple[str, str, str | None]] = []   # (method, path, Range header)
        self.lock = threading.Lock()
        self._stop = threading.Event()
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), _make_handler(self))
        self._httpd.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}"

    # ------------------------------------------------------------------ setup

    def add_folder(self, repo_id: str, folder: Path, **meta) -> Repo:
        files = {}
        for path in sorted(p for p in Path(folder).rglob("*") if p.is_file()):
            rel = path.relative_to(folder).as_posix()
            files[rel] = RepoFile(rel, path.read_bytes(), lfs=rel.endswith(LFS_SUFFIXES))
        return self.add_repo(repo_id, files, **meta)

    def add_config_only(self, repo_id: str, config: dict, *, extra_files: dict[str, bytes] | None = None, **meta) -> Repo:
        files = {"config.json": RepoFile("config.json", json.dumps(config).encode(), lfs=False)}
        for name, data in (extra_files or {}).items():
            files[name] = RepoFile(name, data, lfs=name.endswith(LFS_SUFFIXES))
        return self.add_repo(repo_id, files, **meta)

    def add_repo(self, repo_id: str, files: dict[str, RepoFile], **meta) -> Repo:
        repo = Repo(repo_id, files, **meta)
        with self.lock:
            self.repos[repo_id] = repo
        return repo

    def inject(self, pattern: str, kind: str, times: int = 1) -> None:
        with self.lock:
            self.faults.append(Fault(pattern, kind, times))

    def clear_faults(self) -> None:
        with self.lock:
            self.faults.clear()

    def take_fault(self, path: str) -> str | None:
        with self.lock:
            for fault in self.faults:
                if fault.times != 0 and fnmatch.fnmatch(path, fault.pattern):
                    if fault.times > 0:
                        fault.times -= 1
                    return fault.kind
        return None

    def file_requests(self, path: str) -> list[str | None]:
        """Range headers of every GET of the file `path` (None for a whole-file GET)."""
        with self.lock:
            return [rng for method, p, rng in self.requests if method == "GET" and p.endswith("/" + path)
                    and "/resolve/" in p]

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> "HubServer":
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="hub-server", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()                      # wakes stalled responses
        self._httpd.shutdown()
        self._httpd.server_close()

    def __enter__(self) -> "HubServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ------------------------------------------------------------------ API documents

    def model_document(self, repo: Repo, *, blobs: bool, expand: list[str] | None = None) -> dict:
        cfg = repo.config
        text_cfg = cfg.get("text_config", cfg)
        params: dict[str, int] = {}
        for f in repo.files.values():
            if f.path.endswith(".safetensors"):
                header_len = int.from_bytes(f.data[:8], "little")
                try:
                    header = json.loads(f.data[8:8 + header_len])
                except ValueError:          # not a real safetensors file: the hub lists no parameters either
                    continue
                for name, info in header.items():
                    if name == "__metadata__":
                        continue
                    n = 1
                    for dim in info["shape"]:
                        n *= dim
                    params[info["dtype"]] = params.get(info["dtype"], 0) + n
        siblings = []
        for f in repo.files.values():
            sib = {"rfilename": f.path}
            if blobs:
                sib.update(size=len(f.data), blobId=f.blob_id)
                if f.lfs:
                    sib["lfs"] = {"size": len(f.data), "sha256": f.sha256, "pointerSize": len(f.pointer)}
            siblings.append(sib)
        doc = {
            "_id": repo.sha[:24], "id": repo.repo_id, "modelId": repo.repo_id, "author": repo.repo_id.split("/")[0],
            "sha": repo.sha, "lastModified": "2026-11-01T00:00:00.000Z", "createdAt": "2026-10-01T00:00:00.000Z",
            "private": False, "gated": "auto" if repo.gated else False, "disabled": False,
            "downloads": repo.downloads, "likes": repo.likes, "library_name": "transformers",
            "pipeline_tag": "text-generation",
            "tags": sorted(set(repo.tags + ([text_cfg["model_type"]] if "model_type" in text_cfg else [])
                               + (["safetensors"] if params else []))),
            "config": {k: cfg[k] for k in ("architectures", "model_type", "quantization_config") if k in cfg},
            "cardData": repo.card, "siblings": siblings,
            "usedStorage": sum(len(f.data) for f in repo.files.values()),
        }
        if params:
            doc["safetensors"] = {"parameters": params, "total": sum(params.values())}
        if expand:
            keep = set(expand) | {"id", "_id", "modelId"}
            doc = {k: v for k, v in doc.items() if k in keep}
        return doc


def _make_handler(hub: HubServer):
    resolve_re = re.compile(r"^/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<path>.+)$")
    info_re = re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+?)(?:/revision/(?P<rev>[^/]+))?$")

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:     # keep test output clean
            pass

        # ---------------------------------------------------------- helpers

        def _json(self, status: int, body, headers: dict | None = None) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)

        def _error(self, status: int, code: str, message: str) -> None:
            self._json(status, {"error": message}, {"X-Error-Code": code, "X-Error-Message": message})

        def _repo(self, repo_id: str) -> Repo | None:
            repo = hub.repos.get(repo_id)
            if repo is None:
                self._error(404, "RepoNotFound", "Repository not found")
                return None
            if repo.gated and self.headers.get("Authorization") != f"Bearer {hub.token}":
                self._error(401, "GatedRepo", f"Access to model {repo_id} is restricted. You must have access "
                                              "to it and be authenticated to access it. Please log in.")
                return None
            return repo

        # ---------------------------------------------------------- routes

        def do_HEAD(self) -> None:
            self._route()

        def do_GET(self) -> None:
            self._route()

        def _route(self) -> None:
            url = urlparse(self.path)
            path = unquote(url.path)
            with hub.lock:
                hub.requests.append((self.command, path, self.headers.get("Range")))
            query = parse_qs(url.query)
            try:
                if path == "/api/models":
                    return self._list(query)
                m = info_re.match(path)
                if m:
                    repo = self._repo(m["repo"])
                    if repo is None:
                        return
                    if m["rev"] not in (None, "main", repo.sha):
                        return self._error(404, "RevisionNotFound", f"Invalid rev id: {m['rev']}")
                    blobs = hub.blobs_listing and query.get("blobs", ["false"])[0].lower() in ("1", "true")
                    return self._json(200, hub.model_document(repo, blobs=blobs, expand=query.get("expand")))
                m = resolve_re.match(path)
                if m:
                    return self._resolve(m["repo"], m["rev"], m["path"])
                self._error(404, "NotFound", f"no route for {path}")
            except (BrokenPipeError, ConnectionResetError):
                pass

        def _list(self, query: dict) -> None:
            search = query.get("search", [""])[0].lower()
            author = query.get("author", [None])[0]
            filters = query.get("filter", [])
            sort = query.get("sort", ["downloads"])[0]
            limit = int(query.get("limit", ["1000"])[0])
            offset = int(query.get("offset", ["0"])[0])
            expand = query.get("expand")
            docs = []
            for repo in list(hub.repos.values()):
                doc = hub.model_document(repo, blobs=False)
                if search and search not in repo.repo_id.lower():
                    continue
                if author and doc["author"] != author:
                    continue
                if any(f not in doc["tags"] for f in filters):
                    continue
                docs.append(doc)
            if sort in ("downloads", "likes"):
                docs.sort(key=lambda d: -d[sort])
            docs = docs[:limit]
            page = docs[offset:offset + PAGE_SIZE]
            if expand:
                keep = set(expand) | {"id", "_id", "modelId"}
                page = [{k: v for k, v in d.items() if k in keep} for d in page]
            elif not query.get("full") and not query.get("config"):
                page = [{k: v for k, v in d.items() if k != "config"} for d in page]
            headers = {}
            if offset + PAGE_SIZE < len(docs):
                params = dict(query)
                params["offset"] = [str(offset + PAGE_SIZE)]
                from urllib.parse import urlencode
                headers["Link"] = f'<{hub.url}/api/models?{urlencode(params, doseq=True)}>; rel="next"'
            self._json(200, page, headers)

        def _resolve(self, repo_id: str, rev: str, file_path: str) -> None:
            repo = self._repo(repo_id)
            if repo is None:
                return
            if rev not in ("main", repo.sha):
                return self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}")
            f = repo.files.get(file_path)
            if f is None:
                return self._error(404, "EntryNotFound", f"{file_path} does not exist on {rev}")
            fault = hub.take_fault(file_path) if self.command == "GET" else None
            if fault == "500":
                return self._error(500, "InternalError", "injected server error")
            data = f.data
            if fault == "corrupt":
                data = bytes([data[0] ^ 0xFF]) + data[1:]
            start, end = 0, len(data) - 1
            rng = self.headers.get("Range")
            status = 200
            if rng and self.command == "GET":
                m = re.fullmatch(r"bytes=(\d+)-(\d*)", rng.strip())
                if not m:
                    return self._error(400, "BadRange", f"bad Range {rng}")
                start = int(m[1])
                end = int(m[2]) if m[2] else len(data) - 1
                if start >= len(data):
                    self.send_response(416)
                    self.send_header("Content-Range", f"bytes */{len(data)}")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                status = 206
            body = data[start:end + 1]
            self.send_response(status)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Accept-Ranges", "bytes")
            self.send_header("ETag", f'"{f.etag}"')
            self.send_header("X-Repo-Commit", repo.sha)
            if f.lfs:
                self.send_header("X-Linked-Etag", f'"{f.sha256}"')
                self.send_header("X-Linked-Size", str(len(f.data)))
            if status == 206:
                self.send_header("Content-Range", f"bytes {start}-{end}/{len(data)}")
            self.end_headers()
            if self.command == "HEAD":
                return
            if fault == "truncate":
                self.wfile.write(body[: len(body) // 2])
                self.wfile.flush()
                self.close_connection = True
                return
            self._send_body(body, stall=fault == "stall")

        def _send_body(self, body: bytes, *, stall: bool) -> None:
            chunk = 16 * 1024
            sent = 0
            t0 = time.monotonic()
            while sent < len(body):
                if stall and sent >= len(body) // 2:
                    hub._stop.wait(hub.stall_s)    # the client's read timeout fires first
                    self.close_connection = True
                    return
                piece = body[sent:sent + chunk]
                self.wfile.write(piece)
                sent += len(piece)
                if hub.throttle_bps:
                    ahead = sent / hub.throttle_bps - (time.monotonic() - t0)
                    if ahead > 0 and hub._stop.wait(ahead):
                        return
            self.wfile.flush()

    return Handler
