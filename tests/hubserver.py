"""A local endpoint that speaks the parts of the Hugging Face hub's HTTP API that huggingface_hub uses to create a repo,
commit a folder (regular files inline as base64; large files through the git-LFS batch API: batch, PUT, verify) and read
it back (repo info, tree listing, `resolve` downloads). Every uploaded LFS object is checked against its sha256 and size;
a commit that names an LFS object never uploaded is refused. Tokens, namespaces and private repos are enforced. Written
for tests/test_push.py from huggingface_hub's own client code (hf_api.py, _commit_api.py, lfs.py, file_download.py):
the server answers what the client asks, so a client that took another route (Xet) would fail here, not pass."""
from __future__ import annotations

import base64
import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlparse

LFS_SUFFIXES = (".safetensors", ".bin", ".png", ".gguf", ".pt")   # what the hub's default .gitattributes sends to LFS


def git_blob_sha1(data: bytes) -> str:
    "The git object id of a blob: what the hub returns as a regular file's ETag and oid."
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


# the model card metadata keys the hub documents (hub-docs modelcard.md) and the base_model relations it knows
CARD_KEYS = {"language", "license", "license_name", "license_link", "library_name", "tags", "datasets", "metrics", "base_model",
             "base_model_relation", "pipeline_tag", "model-index", "new_version", "thumbnail", "inference", "widget"}
RELATIONS = {"adapter", "merge", "quantized", "finetune"}


def card_errors(content: str) -> list[str]:
    """What /api/validate-yaml answers about a README.md, judged offline: the YAML header parsed by huggingface_hub's own
    ModelCard (model-index through its EvalResult conversion, which raises on a malformed one), then the keys and types
    the hub documents."""
    from huggingface_hub import ModelCard
    try: meta = ModelCard(content).data.to_dict()
    except Exception as e: return [f"metadata does not parse: {e}"]
    errs = [f"unknown metadata key {k!r}" for k in meta if k not in CARD_KEYS]
    for k in ("tags", "datasets", "metrics"):
        if k in meta and not (isinstance(meta[k], list) and all(isinstance(x, str) for x in meta[k])): errs.append(f"{k} must be a list of strings")
    for k in ("license", "library_name", "pipeline_tag", "base_model_relation"):
        if k in meta and not isinstance(meta[k], str): errs.append(f"{k} must be a string")
    if "base_model_relation" in meta and meta["base_model_relation"] not in RELATIONS: errs.append("unknown base_model_relation")
    if "base_model_relation" in meta and "base_model" not in meta: errs.append("base_model_relation without base_model")
    return errs


class Hub:
    "The endpoint's state: repos (visibility, branches, commits) and the LFS object store, with a log of requests."
    def __init__(self, tokens: dict[str, str], orgs: dict[str, set] | None = None):
        self.tokens, self.orgs = tokens, orgs or {}          # token -> user; org -> its members
        self.repos, self.lfs, self.log, self.lock = {}, {}, [], threading.Lock()

    def can_write(self, user: str, repo_id: str) -> bool:
        ns = repo_id.split("/")[0]
        return ns == user or user in self.orgs.get(ns, set())

    def files(self, repo_id: str, rev: str) -> tuple[str, dict] | None:
        "(commit id, {path: (bytes, lfs sha256 or None)}) of `rev` (a branch or a commit id), or None."
        r = self.repos[repo_id]
        oid = r["branches"].get(rev, rev if rev in r["commits"] else None)
        return None if oid is None else (oid, r["commits"][oid])


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    hub: Hub = None
    base: str = ""

    def log_message(self, *a): pass

    # ---------------------------------------------------------------- plumbing
    def _send(self, code: int, body=b"", headers=None, head_only=False):
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.send_response(code)
        ctype = "application/octet-stream" if isinstance(body, bytes) else "application/json"
        self.send_header("Content-Type", ctype)
        for k, v in (headers or {}).items(): self.send_header(k, v)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if not head_only: self.wfile.write(data)

    def _error(self, code: int, msg: str, error_code: str | None = None, head_only=False):
        h = {"X-Error-Message": msg, **({"X-Error-Code": error_code} if error_code else {})}
        self._send(code, {"error": msg}, h, head_only)

    def _body(self) -> bytes:
        "The request's body, read once (all of it, even when a route ignores it: the connection is kept alive)."
        if getattr(self, "_read", None) is None: self._read = self._read_body()
        return self._read

    def _read_body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            out = b""
            while True:
                n = int(self.rfile.readline().strip().split(b";")[0], 16)
                if n == 0: self.rfile.readline(); return out
                out += self.rfile.read(n); self.rfile.readline()
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _user(self) -> str | None | bool:
        "The token's user; None when no token was sent; False for a token the hub does not know."
        auth = self.headers.get("Authorization", "")
        if not auth.startswith("Bearer "): return None
        return self.hub.tokens.get(auth[7:], False)

    def _repo(self, repo_id: str, write=False, head_only=False):
        "The repo if this request may see (or write) it, else an error sent and None."
        user = self._user()
        if user is False: self._error(401, "Invalid credentials in Authorization header", head_only=head_only); return None
        repo = self.hub.repos.get(repo_id)
        if repo is None or (repo["private"] and not (user and self.hub.can_write(user, repo_id))):
            self._error(401 if user is None else 404, "Repository not found", "RepoNotFound", head_only); return None
        if write and not (user and self.hub.can_write(user, repo_id)):
            self._error(403, f"You don't have the rights to write to {repo_id}", head_only=head_only); return None
        return repo

    def _route(self, method: str):
        u = urlparse(self.path)
        parts, q = [unquote(p) for p in u.path.strip("/").split("/")], parse_qs(u.query)
        with self.hub.lock: self.hub.log.append((method, u.path))
        self._read = None
        if method in ("POST", "PUT"): self._body()
        try:
            return self._dispatch(method, parts, q)
        except Exception as e:   # a bug of this server: say so to the client, loudly
            self._error(500, f"test hub server error: {type(e).__name__}: {e}")
            raise

    def do_GET(self): self._route("GET")
    def do_HEAD(self): self._route("HEAD")
    def do_POST(self): self._route("POST")
    def do_PUT(self): self._route("PUT")

    # ---------------------------------------------------------------- the API
    def _dispatch(self, method, parts, q):
        hub = self.hub
        if parts[:2] == ["api", "validate-yaml"] and method == "POST":
            p = json.loads(self._body())
            errs = card_errors(p["content"]) if p.get("repoType", "model") == "model" else ["this test hub holds model repos only"]
            return self._send(400, {"errors": [{"message": e} for e in errs]}) if errs else self._send(200, {"warnings": []})
        if parts[:2] == ["api", "whoami-v2"]:
            user = self._user()
            if not user: return self._error(401, "Invalid credentials in Authorization header")
            return self._send(200, {"type": "user", "name": user, "auth": {"accessToken": {"role": "write"}},
                                    "orgs": [{"name": o} for o, m in hub.orgs.items() if user in m]})
        if parts[:3] == ["api", "repos", "create"] and method == "POST":
            user, p = self._user(), json.loads(self._body())
            if not user: return self._error(401, "Invalid credentials in Authorization header")
            repo_id = f"{p.get('organization') or user}/{p['name']}"
            if p.get("type", "model") != "model": return self._error(400, "this test hub holds model repos only")
            if not hub.can_write(user, repo_id): return self._error(403, f"You don't have the rights to create a repo under {repo_id.split('/')[0]}")
            with hub.lock:
                if repo_id in hub.repos:   # the hub's 409 names the repo's url, which create_repo(exist_ok=True) returns
                    return self._send(409, {"error": "You already created this model repo", "url": f"{self.base}/{repo_id}"},
                                      {"X-Error-Message": "You already created this model repo"})
                hub.repos[repo_id] = dict(private=p.get("visibility") == "private", branches={"main": "0" * 40},
                                          commits={"0" * 40: {}})
            return self._send(200, {"url": f"{self.base}/{repo_id}", "name": repo_id, "id": repo_id})
        if parts[:2] == ["api", "models"] and len(parts) >= 4:
            return self._api_model("/".join(parts[2:4]), parts[4:], method, q)
        if len(parts) >= 5 and parts[1].endswith(".git") and parts[2:] == ["info", "lfs", "objects", "batch"]:
            return self._lfs_batch(f"{parts[0]}/{parts[1][:-4]}")
        if parts[0] == "lfs-objects" and len(parts) == 3 and method == "PUT":
            return self._lfs_put(parts[1], parts[2])
        if parts[0] == "lfs-objects" and len(parts) == 4 and parts[3] == "verify" and method == "POST":
            p = json.loads(self._body())
            ok = hub.lfs.get(p["oid"]) is not None and len(hub.lfs[p["oid"]]) == p["size"]
            return self._send(200, {"ok": True}) if ok else self._error(404, f"LFS object {p['oid']} was not uploaded")
        if len(parts) >= 5 and parts[2] == "resolve" and method in ("GET", "HEAD"):
            return self._resolve("/".join(parts[:2]), parts[3], "/".join(parts[4:]), head_only=method == "HEAD")
        return self._error(404, f"test hub: no route for {method} {self.path}")

    def _api_model(self, repo_id, rest, method, q):
        hub = self.hub
        if method == "GET" and (not rest or rest[0] == "revision"):
            repo = self._repo(repo_id)
            if repo is None: return
            found = hub.files(repo_id, "/".join(rest[1:]) if rest else "main")
            if found is None: return self._error(404, "Revision not found", "RevisionNotFound")
            oid, files = found
            return self._send(200, {"id": repo_id, "modelId": repo_id, "sha": oid, "private": repo["private"],
                                    "siblings": [{"rfilename": p} for p in sorted(files)], "tags": [], "downloads": 0, "likes": 0})
        if method == "GET" and rest and rest[0] == "tree":
            repo = self._repo(repo_id)
            if repo is None: return
            found = hub.files(repo_id, rest[1])
            if found is None: return self._error(404, "Revision not found", "RevisionNotFound")
            return self._send(200, [{"type": "file", "path": p, "size": len(data), "oid": git_blob_sha1(data),
                                     **({"lfs": {"oid": sha, "size": len(data), "pointerSize": 134}} if sha else {})}
                                    for p, (data, sha) in sorted(found[1].items())])
        if method == "POST" and rest and rest[0] == "preupload":
            if self._repo(repo_id, write=True) is None: return
            p = json.loads(self._body())
            return self._send(200, {"files": [{"path": f["path"], "uploadMode": self._mode(f), "shouldIgnore": False}
                                              for f in p["files"]]})
        if method == "POST" and rest and rest[0] == "commit":
            return self._commit(repo_id, "/".join(rest[1:]))
        if method == "POST" and rest and rest[0] == "branch":
            repo = self._repo(repo_id, write=True)
            if repo is None: return
            branch = "/".join(rest[1:])
            with hub.lock:
                if branch in repo["branches"]: return self._error(409, f"Branch {branch} already exists")
                repo["branches"][branch] = repo["branches"]["main"]
            return self._send(200, {})
        return self._error(404, f"test hub: no route for {method} {self.path}")

    @staticmethod
    def _mode(f: dict) -> str:
        "The hub's rule: LFS for the binary kinds its .gitattributes lists, for anything over 10 MB, for a sample with NUL bytes."
        binary = b"\0" in base64.b64decode(f["sample"])
        return "lfs" if f["path"].endswith(LFS_SUFFIXES) or f["size"] > 10 * 2**20 or binary else "regular"

    def _lfs_batch(self, repo_id):
        if self._repo(repo_id, write=True) is None: return
        p = json.loads(self._body())
        assert p["operation"] == "upload", p
        objs = []
        for o in p["objects"]:
            have = self.hub.lfs.get(o["oid"])
            actions = None if have is not None else {
                "upload": {"href": f"{self.base}/lfs-objects/{o['oid']}/{o['size']}"},
                "verify": {"href": f"{self.base}/lfs-objects/{o['oid']}/{o['size']}/verify"}}
            objs.append({"oid": o["oid"], "size": o["size"], **({"actions": actions} if actions else {})})
        self._send(200, {"transfer": "basic", "objects": objs})

    def _lfs_put(self, oid, size):
        data = self._body()
        if hashlib.sha256(data).hexdigest() != oid or len(data) != int(size):
            return self._error(400, f"LFS object {oid}: the bytes received do not hash to it")
        with self.hub.lock: self.hub.lfs[oid] = data
        self._send(200, b"")

    def _commit(self, repo_id, rev):
        repo = self._repo(repo_id, write=True)
        if repo is None: return
        lines = [json.loads(l) for l in self._body().splitlines() if l.strip()]
        if not lines or lines[0]["key"] != "header": return self._error(400, "a commit starts with its header")
        with self.hub.lock:
            if rev not in repo["branches"]: return self._error(404, f"Revision {rev} not found", "RevisionNotFound")
            files = dict(repo["commits"][repo["branches"][rev]])
            for op in lines[1:]:
                v = op["value"]
                if op["key"] == "file":
                    files[v["path"]] = (base64.b64decode(v["content"]), None)
                elif op["key"] == "lfsFile":
                    data = self.hub.lfs.get(v["oid"])
                    if data is None or len(data) != v["size"]:
                        return self._error(400, f"{v['path']}: LFS object {v['oid']} was never uploaded")
                    files[v["path"]] = (data, v["oid"])
                elif op["key"] == "deletedFile": files.pop(v["path"], None)
                else: return self._error(400, f"test hub: commit operation {op['key']!r} is not implemented")
            tree = {p: hashlib.sha256(d).hexdigest() for p, (d, _) in files.items()}
            oid = hashlib.sha1(json.dumps([repo["branches"][rev], tree, lines[0]["value"]], sort_keys=True).encode()).hexdigest()
            repo["commits"][oid], repo["branches"][rev] = files, oid
        self._send(200, {"success": True, "commitOid": oid, "commitUrl": f"{self.base}/{repo_id}/commit/{oid}"})

    def _resolve(self, repo_id, rev, path, head_only):
        if self._repo(repo_id, head_only=head_only) is None: return
        found = self.hub.files(repo_id, rev)
        if found is None: return self._error(404, "Revision not found", "RevisionNotFound", head_only)
        oid, files = found
        if path not in files: return self._error(404, f"Entry {path} not found", "EntryNotFound", head_only)
        data, sha = files[path]
        h = {"X-Repo-Commit": oid, "ETag": f'"{git_blob_sha1(data)}"'}
        if sha: h.update({"X-Linked-Etag": f'"{sha}"', "X-Linked-Size": str(len(data))})
        self._send(200, data, h, head_only)


class HubServer:
    "`with HubServer(tokens) as hub:` a threaded local endpoint at `hub.url`; `hub.state` holds its repos and request log."
    def __init__(self, tokens: dict[str, str], orgs: dict[str, set] | None = None):
        self.state = Hub(tokens, orgs)
        handler = type("BoundHandler", (Handler,), {"hub": self.state})
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        handler.base = self.url
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start(); return self

    def __exit__(self, *exc):
        self.httpd.shutdown(); self.httpd.server_close()
