"""`tunebook push` against a local endpoint that speaks the hub's upload API (tests/hubserver.py), never the network: the
command runs as users run it (a subprocess, HF_ENDPOINT and HF_TOKEN in its environment), the repo is downloaded back
with huggingface_hub's snapshot_download and compared byte for byte. huggingface_hub 2.x uploads large files through Xet
storage whenever hf_xet is installed; HF_HUB_DISABLE_XET=1 (the library's own switch) sends them through the git-LFS batch
API, which the server implements (batch, PUT with a sha256 check, verify): the test asserts that route was taken."""
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from huggingface_hub import ModelCard

sys.path.insert(0, os.path.dirname(__file__))
from hubserver import HubServer  # noqa: E402

TOKEN, OTHER = "hf_alice_write", "hf_bob_write"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    "A finished LoRA run of the embedded model (2 steps)."
    from tunebook.train import run_finetune
    out = tmp_path_factory.mktemp("push") / "reverse"
    run_finetune(progress=False, n_train=32, eval_samples=4, max_steps=2, batch_size=8, output_dir=str(out))
    return out


@pytest.fixture
def hub():
    with HubServer({TOKEN: "alice", OTHER: "bob"}, orgs={"acme": {"alice"}}) as h: yield h


def _env(hub, tmp_path, token=TOKEN):
    env = {**os.environ, "HF_ENDPOINT": hub.url, "HF_HUB_DISABLE_XET": "1", "HF_HUB_OFFLINE": "0", "HF_HOME": str(tmp_path / "home"),
           "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    env.pop("HF_HUB_CACHE", None)
    if token: env["HF_TOKEN"] = token
    else: env.pop("HF_TOKEN", None)
    return env


def _push(hub, tmp_path, *args, token=TOKEN):
    return subprocess.run([sys.executable, "-m", "tunebook.cli", "push", *map(str, args)], env=_env(hub, tmp_path, token),
                          capture_output=True, text=True, timeout=600)


def _download(hub, tmp_path, repo, dest, revision=None):
    "snapshot_download in a fresh process (HF_ENDPOINT is read when huggingface_hub is imported)."
    code = "import sys; from huggingface_hub import snapshot_download; print(snapshot_download(sys.argv[1], revision=sys.argv[3] or None, local_dir=sys.argv[2]))"
    r = subprocess.run([sys.executable, "-c", code, repo, str(dest), revision or ""], env=_env(hub, tmp_path),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return Path(dest)


def _sha(p: Path) -> str: return hashlib.sha256(p.read_bytes()).hexdigest()


def test_push_and_download_back(run, hub, tmp_path):
    r = _push(hub, tmp_path, run, "acme/reverse-lora", "--private")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "acme/reverse-lora" in r.stdout and "done:" in r.stdout
    assert "adapter_model.safetensors" in r.stderr   # huggingface_hub's progress bar for the LFS upload
    repo = hub.state.repos["acme/reverse-lora"]
    assert repo["private"] is True                   # --private reached the endpoint
    log = [p for _, p in hub.state.log]
    assert "/acme/reverse-lora.git/info/lfs/objects/batch" in log and any(p.startswith("/lfs-objects/") for p in log)
    files = repo["commits"][repo["branches"]["main"]]
    assert files["adapter_model.safetensors"][1] == _sha(run / "adapter" / "adapter_model.safetensors")   # committed as LFS
    assert files["adapter_config.json"][1] is None                                                        # regular, inline
    down = _download(hub, tmp_path, "acme/reverse-lora", tmp_path / "down")
    got = {p.relative_to(down).as_posix(): _sha(p) for p in down.rglob("*") if p.is_file() and ".cache" not in p.parts}
    want = {f.name: _sha(f) for f in (run / "adapter").iterdir()} | {"loss.png": _sha(run / "loss.png")}
    assert {k: v for k, v in got.items() if k != "README.md"} == want
    card = ModelCard.load(down / "README.md")   # the card rendered for the repo: it loads from the repo id
    assert card.data.library_name == "peft" and "PeftModel.from_pretrained(base, 'acme/reverse-lora')" in card.text
    summary = json.loads((run / "summary.json").read_text())
    assert card.data.eval_results[0].metric_value == summary[summary["lead_metric"] + "_after"]


def test_push_merged_to_a_branch(run, hub, tmp_path):
    r = _push(hub, tmp_path, run, "alice/reverse", "--merged", "--revision", "v1")
    assert r.returncode == 0, r.stderr[-3000:]
    repo = hub.state.repos["alice/reverse"]
    assert repo["private"] is False and repo["branches"]["main"] == "0" * 40 and "v1" in repo["branches"]
    down = _download(hub, tmp_path, "alice/reverse", tmp_path / "down", revision="v1")
    for f in (run / "model").iterdir(): assert _sha(down / f.name) == _sha(f), f.name
    assert ModelCard.load(down / "README.md").data.library_name == "transformers"


@pytest.mark.parametrize("token, repo, expect", [
    ("hf_wrong", "alice/x", "the token was refused (401 Unauthorized)"),
    (OTHER, "acme/x", "the token may not write to acme/x (403 Forbidden)"),
    (None, "alice/x", "no Hugging Face token: log in with `hf auth login`"),
])
def test_refusals_are_one_line(run, hub, tmp_path, token, repo, expect):
    r = _push(hub, tmp_path, run, repo, token=token)
    assert r.returncode == 2 and expect in r.stderr, r.stderr[-2000:]
    errors = [l for l in r.stderr.splitlines() if l.strip()]
    assert len(errors) == 1 and errors[0].startswith("tunebook push: error: ")
    assert not hub.state.repos and not hub.state.lfs   # nothing was created or uploaded


def test_refused_before_any_request(run, hub, tmp_path, monkeypatch, capsys):
    "A failed run, a bad name, a folder that is no run: one line each, and not one request (in process: the endpoint patched)."
    from huggingface_hub import constants
    from tunebook.push import push_main
    monkeypatch.setattr(constants, "ENDPOINT", hub.url)
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    failed = tmp_path / "failed"
    failed.mkdir()
    (failed / "summary.json").write_text(json.dumps({"status": "failed", "error": "step 3: loss nan is not finite"}))
    for args, expect in (((failed, "alice/x"), "did not finish (status 'failed': step 3: loss nan is not finite)"),
                         ((run, "alice/bad..name"), "is not a valid hub name"),
                         ((run, "reverse"), "give it as ORG/NAME"),
                         ((tmp_path, "alice/x"), "has no summary.json")):
        assert push_main([str(a) for a in args]) == 2
        err = capsys.readouterr().err
        assert expect in err and len(err.strip().splitlines()) == 1, err
    assert hub.state.log == []


def test_private_is_not_silently_dropped(run, hub, tmp_path):
    "An existing public repo: --private is refused, not ignored (create_repo(exist_ok=True) would keep it public)."
    assert _push(hub, tmp_path, run, "alice/pub").returncode == 0
    r = _push(hub, tmp_path, run, "alice/pub", "--private")
    assert r.returncode == 2 and "exists and is public" in r.stderr
