#!/usr/bin/env python3
"""Build llama.cpp once, from the registry's `llama-cpp-python` source distribution, into a cache folder.

`tunebook export --to gguf` runs llama.cpp's own converter (convert_hf_to_gguf.py with its gguf-py writer) and, for
the k-quants, llama.cpp's own quantizer; the tests load the GGUF in llama.cpp's runtime. All three come from the
sdist that `pip download --no-deps --no-binary :all: llama-cpp-python==VERSION` fetches from the registry (nothing
is downloaded from anywhere else). Only what is needed is built: the ggml CPU backend and libllama as shared
libraries (no common library, tools, tests, examples or server); the quantizer is libllama's `llama_model_quantize`,
the one llama-quantize calls, and the runtime is libllama through the sdist's own ctypes binding (`llama_cpp`).

The folder is $TUNEBOOK_LLAMA_CPP (default ~/.cache/tunebook/llama.cpp-VERSION-SHA12, SHA12 the sdist's sha256
prefix) with `src/` (the unpacked sdist) and `lib/` (the shared libraries); a `.built` file marks it whole. It is
written to a temporary folder that is renamed into place, so a killed build leaves nothing half-built. The CPU code
is built for AVX2/FMA/F16C (not -march=native) so that one cache serves every x86-64 host CI may land on.
Usage: `python tools/llama_cpp.py [SDIST.tar.gz]` (`make llama-cpp`); prints the folder."""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

VERSION = "0.3.36"   # llama-cpp-python's version; its vendor/llama.cpp is the llama.cpp we build
CMAKE_FLAGS = ["-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=ON", "-DLLAMA_BUILD_COMMON=OFF",
               "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_TOOLS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
               "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_BUILD_APP=OFF", "-DLLAMA_OPENSSL=OFF", "-DGGML_OPENMP=OFF",
               "-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON",
               "-DGGML_BMI2=ON"]


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""): h.update(block)
    return h.hexdigest()


def download(dest: Path) -> Path:
    "The sdist from the registry, fetched with pip into `dest` (once)."
    got = sorted(dest.glob(f"llama_cpp_python-{VERSION}.tar.gz"))
    if got: return got[0]
    dest.mkdir(parents=True, exist_ok=True)
    r = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                        "-d", str(dest), f"llama-cpp-python=={VERSION}"], capture_output=True, text=True)
    got = sorted(dest.glob(f"llama_cpp_python-{VERSION}.tar.gz"))
    if r.returncode != 0 or not got: sys.exit(f"pip download llama-cpp-python=={VERSION} failed: {r.stderr[-400:]}")
    return got[0]


def build(sdist: Path, root: Path) -> Path:
    "Unpack `sdist` and build libllama into `root/<llama.cpp-VERSION-SHA12>`; returns that folder (kept when built)."
    out = Path(os.environ.get("TUNEBOOK_LLAMA_CPP") or root / f"llama.cpp-{VERSION}-{sha256(sdist)[:12]}")
    if (out / ".built").exists(): return out
    out.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=".build-") as tmp:
        tmp = Path(tmp)
        with tarfile.open(sdist) as tf: tf.extractall(tmp, filter="data")
        (tmp / f"llama_cpp_python-{VERSION}").rename(tmp / "src")
        src, bld = tmp / "src" / "vendor" / "llama.cpp", tmp / "build"
        subprocess.run(["cmake", "-S", str(src), "-B", str(bld), *CMAKE_FLAGS], check=True, stdout=subprocess.DEVNULL)
        subprocess.run(["cmake", "--build", str(bld), "--target", "llama", "-j", str(os.cpu_count() or 1)], check=True)
        (tmp / "lib").mkdir()
        for so in bld.rglob("*.so*"):
            if so.is_file() and not so.is_symlink(): shutil.copy2(so, tmp / "lib" / so.name)
        for so in bld.rglob("*.so*"):   # the soname links (libllama.so -> libllama.so.0 -> ...)
            if so.is_symlink() and not (tmp / "lib" / so.name).exists(): (tmp / "lib" / so.name).symlink_to(os.readlink(so))
        shutil.rmtree(bld)
        (tmp / ".built").write_text(f"{sdist.name} {time.time() - t0:.0f}s\n")
        os.replace(tmp, out)
        tmp.mkdir()   # TemporaryDirectory removes the (now empty) name on exit
    print(f"built llama.cpp in {time.time() - t0:.0f} s", file=sys.stderr)
    return out


if __name__ == "__main__":
    root = Path.home() / ".cache" / "tunebook"
    sdist = Path(sys.argv[1]) if len(sys.argv) > 1 else download(root / "sdist")
    print(build(sdist, root))
