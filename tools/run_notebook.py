"""Run notebooks outside nbs/ (index.ipynb) the way nbdev_test runs those inside it."""
import sys

from nbdev.test import test_nb

ok = True
for fn in sys.argv[1:]:
    success, secs = test_nb(fn, skip_flags=["cuda", "multigpu"])
    print(f"{fn}: {'ok' if success else 'FAILED'} in {secs:.1f}s")
    ok &= success
sys.exit(0 if ok else 1)
