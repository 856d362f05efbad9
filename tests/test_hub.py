"""Hub names through huggingface_hub, offline: a cache laid out as huggingface_hub lays it out (blobs, snapshots of
links, refs) in a temp HF_HOME, a revision pin, the no-network error; and the hub's own error replies (missing,
gated, unknown revision) from a local HTTP server speaking the hub's error headers, so no test needs the network."""
import hashlib
import http.server
import json
import os
import socket
import subprocess
import sys
import threading

import pytest
import torch
from huggingface_hub import constants

from tunebook.checkpoint import load_hf
from tunebook.hub import HubError, resolve_model

SHA_OLD, SHA_NEW = "1" * 40, "2" * 40


def write_cache(hub_dir, repo, commits, refs):
    "huggingface_hub's layout: models--ORG--NAME/{blobs/<hash>, snapshots/<commit>/<file> -> blob, refs/<name>}."
    base = hub_dir / ("models--" + repo.replace("/", "--"))
    for sha, folder in commits.items():
        for f in folder.iterdir():
            data = f.read_bytes()
            blob = base / "blobs" / hashlib.sha256(data).hexdigest()
            blob.parent.mkdir(parents=True, exist_ok=True); blob.write_bytes(data)
            link = base / "snapshots" / sha / f.name
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(os.path.relpath(blob, link.parent))
    for ref, sha in refs.items():
        (base / "refs").mkdir(parents=True, exist_ok=True); (base / "refs" / ref).write_text(sha)


@pytest.fixture
def hf_home(tmp_path, make_hf):
    "HF_HOME with acme/tiny: main -> a model of seed 1, tag v1 -> another of seed 0."
    old, _ = make_hf("llama", name="old", seed=0)
    new, _ = make_hf("llama", name="new", seed=1)
    write_cache(tmp_path / "home" / "hub", "acme/tiny", {SHA_OLD: tmp_path / "old", SHA_NEW: tmp_path / "new"},
                {"main": SHA_NEW, "v1": SHA_OLD})
    return tmp_path / "home", old, new


def _resolve_in_subprocess(home, *args):
    "resolve_model in a fresh process with HF_HOME and HF_HUB_OFFLINE=1 set before huggingface_hub is imported."
    code = ("import sys; from tunebook.hub import resolve_model\n"
            "try: print(resolve_model(*sys.argv[1:2], *(sys.argv[2:3] or [None])))\n"
            "except Exception as e: print('ERROR', type(e).__name__, e)")
    env = {**os.environ, "HF_HOME": str(home), "HF_HUB_OFFLINE": "1"}
    env.pop("HF_HUB_CACHE", None)
    return subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True, timeout=120).stdout.strip()


def test_offline_cache_and_revision_pin(hf_home):
    home, old, new = hf_home
    snap = home / "hub" / "models--acme--tiny" / "snapshots"
    assert _resolve_in_subprocess(home, "acme/tiny") == str(snap / SHA_NEW)
    assert _resolve_in_subprocess(home, "acme/tiny", "v1") == str(snap / SHA_OLD)
    assert _resolve_in_subprocess(home, "acme/tiny", SHA_OLD) == str(snap / SHA_OLD)
    x = torch.randint(0, 256, (1, 9))
    for rev, ref in ((None, new), ("v1", old)):   # the pinned snapshot loads the right weights: logits as transformers'
        folder = resolve_model("acme/tiny", rev, cache_dir=home / "hub", local_files_only=True)
        torch.testing.assert_close(load_hf(folder)(x), ref(x).logits, atol=1e-5, rtol=1e-5)


def test_no_network_error(hf_home):
    home, _, _ = hf_home
    out = _resolve_in_subprocess(home, "acme/other")
    assert out.startswith("ERROR HubError") and "'acme/other'" in out and "HF_HUB_OFFLINE=1" in out and "hf download acme/other" in out
    out = _resolve_in_subprocess(home, "acme/tiny", "v9")
    assert "'acme/tiny' at revision 'v9' is not in the Hugging Face cache" in out and "--revision v9" in out


def test_local_folder_wins(tmp_path, hf_home, monkeypatch):
    home, _, _ = hf_home
    (tmp_path / "acme" / "tiny").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)   # a folder named like the cached repo, relative to the working directory
    got = resolve_model("acme/tiny", cache_dir=home / "hub", local_files_only=True)
    assert got.resolve() == (tmp_path / "acme" / "tiny").resolve()


@pytest.mark.parametrize("name", ["no-slash", "a/b/c", "org/na me", "../x/y", "org/name."])
def test_malformed_names(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="ORG/NAME"): resolve_model(name)


class _Hub(http.server.BaseHTTPRequestHandler):
    "Answers like the hub's API: error code headers by repo name."
    def do_GET(self):
        code, err = {"gated": (403, "GatedRepo"), "missing": (404, "RepoNotFound"), "revs": (404, "RevisionNotFound")}[self.path.split("/")[4]]
        self.send_response(code); self.send_header("X-Error-Code", err); self.send_header("Content-Type", "application/json")
        self.end_headers(); self.wfile.write(json.dumps({"error": err}).encode())
    do_HEAD = do_GET
    def log_message(self, *a): pass


@pytest.fixture
def online(monkeypatch):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Hub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()


@pytest.mark.parametrize("repo,rev,want", [
    ("acme/gated", None, "'acme/gated' is a gated repo: accept its terms at https://huggingface.co/acme/gated"),
    ("acme/missing", "main", "'acme/missing' at revision 'main' was not found on the hub"),
    ("acme/revs", "v3", "'acme/revs' has no revision 'v3'")])
def test_hub_errors(online, tmp_path, repo, rev, want):
    with pytest.raises(HubError) as e: resolve_model(repo, rev, cache_dir=tmp_path, endpoint=online)
    assert want in str(e.value) and "\n" not in str(e.value)


def test_unreachable_hub(monkeypatch, tmp_path):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    with socket.socket() as s: s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]   # closed once the block ends
    with pytest.raises(HubError, match=r"'acme/tiny' is not in the Hugging Face cache and the hub cannot be reached"):
        resolve_model("acme/tiny", cache_dir=tmp_path, endpoint=f"http://127.0.0.1:{port}")
