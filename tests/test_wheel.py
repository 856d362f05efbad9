"""A wheel built from the repository installs into a fresh virtual environment, and `import tunebook`
works there without nbdev or the notebooks."""
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

BLOCKER = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('nbdev', 'execnb', 'fastcore'):
            raise ImportError(f'tunebook must not import {name} (a dev-only dependency)')
sys.meta_path.insert(0, Block())
"""


@pytest.mark.slow
def test_wheel_installs_and_imports(tmp_path):
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(wheels)], check=True, cwd=tmp_path)
    whl = next(wheels.glob("tunebook-*.whl"))
    names = zipfile.ZipFile(whl).namelist()
    assert not any(n.endswith(".ipynb") for n in names), "notebooks must not ship in the wheel"
    assert "tunebook/model.py" in names
    meta = zipfile.ZipFile(whl).read(next(n for n in names if n.endswith("METADATA"))).decode()
    runtime = [l for l in meta.splitlines() if l.startswith("Requires-Dist:") and "extra ==" not in l]
    assert "Requires-Dist: torch>=2.6" in runtime
    assert not any(dev in l for l in runtime for dev in ("nbdev", "fastcore", "execnb")), runtime

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    with zipfile.ZipFile(whl) as z:  # install the wheel's files (no pip in the fresh venv, no deps)
        z.extractall(site)
    # the runtime dependencies (torch, safetensors, ...) come from this environment, placed *after*
    # the fresh venv; nbdev and friends are blocked outright
    (Path(site) / "zz_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    (Path(site) / "block_dev.py").write_text(BLOCKER)
    (Path(site) / "aa_block.pth").write_text("import block_dev\n")
    code = ("import tunebook, pkgutil, importlib, pathlib;"
            "[importlib.import_module('tunebook.' + m.name) for m in pkgutil.iter_modules(tunebook.__path__) if m.name != '_modidx'];"
            "print(tunebook.__file__, tunebook.__version__)")
    out = subprocess.run([str(py), "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert str(venv) in out.stdout
