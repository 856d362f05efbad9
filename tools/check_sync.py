"""Fail if the notebooks are not clean, if tools/export.py (`make export`) would change tunebook/, or if README.md
does not match index.ipynb. Works on a dirty tree too: it compares the tree before and after."""
import hashlib, subprocess, sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def snapshot():
    out = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    state = {}
    for line in out.splitlines():
        p = ROOT / line[3:].split(" -> ")[-1].strip('"')
        state[line[3:]] = (line[:2], hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else None)
    return state


def run(*cmd):
    subprocess.run(cmd, cwd=ROOT, check=True)


def main():
    before = snapshot()
    run(str(BIN / "nbdev_clean"))
    run(str(BIN / "nbdev_clean"), "--fname", "index.ipynb")
    run(sys.executable, "tools/export.py")
    run(sys.executable, "tools/make_readme.py")
    after = snapshot()
    changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    if changed:
        print("These files changed under nbdev_clean / tools/export.py / make_readme:", *changed, sep="\n  ")
        print("Fix: run `make check` locally (it rewrites them), review, and commit notebooks and modules together.")
        sys.exit(1)
    print("notebooks clean, tunebook/ in sync with nbs/, README.md in sync with index.ipynb")


if __name__ == "__main__":
    main()
