"""Threads on a shared CPU: `import tunebook` makes OpenMP threads sleep while they wait (unless the user chose, or torch
was loaded first), torch's threads follow the CPUs the process may use (affinity, cgroup quota), and a run's log says
how many threads it used and why."""
import subprocess
import sys

import torch

import tunebook.core as core


def _env_after(code, **env):
    import os
    e = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "TUNEBOOK_SET_OMP_WAIT")}
    out = subprocess.run([sys.executable, "-c", code + "\nimport os; print(os.environ.get('OMP_WAIT_POLICY'))"],
                         capture_output=True, text=True, env={**e, **env}, cwd="/tmp")
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().splitlines()[-1]


def test_import_tunebook_before_torch_sets_passive_waiting():
    assert _env_after("import tunebook") == "PASSIVE"
    assert _env_after("import tunebook.train") == "PASSIVE"          # the package's __init__ runs before any module
    assert _env_after("import tunebook", OMP_WAIT_POLICY="ACTIVE") == "ACTIVE"   # the user's choice stands
    assert _env_after("import tunebook", GOMP_SPINCOUNT="1000") == "None"
    assert _env_after("import torch, tunebook") == "None"            # too late to matter: left alone, and said (below)


def test_threads_follow_the_cgroup_quota(monkeypatch, tmp_path):
    (tmp_path / "cpu.max").write_text("100000 100000\n")   # one CPU's worth
    real = core.Path
    monkeypatch.setattr(core, "Path", lambda p: real(str(p).replace("/sys/fs/cgroup", str(tmp_path))))
    assert core.cpu_quota() == 1.0 and core.cpu_cores() == 1
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2); monkeypatch.setattr(core, "_TORCH_THREADS", 2)   # torch's own choice: 2
        said = core.fit_threads()
        assert torch.get_num_threads() == 1 and "1 torch threads for the 1 CPU(s) this process may use (cgroup quota 1)" in said
        assert "lowered from 2" in said, said
        torch.set_num_threads(3)   # a caller's own number stands, and is said
        assert "3 torch threads for the 1 CPU(s) this process may use (cgroup quota 1) (as the caller set them)" in core.fit_threads()
        assert torch.get_num_threads() == 3
    finally: torch.set_num_threads(before)
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert core.cpu_quota() is None


def test_the_run_log_says_how_threads_wait(tmp_path):
    code = ("import tempfile; from tunebook.train import Trainer, TrainConfig; "
            f"t = Trainer(TrainConfig(max_steps=1, eval_samples=0, output_dir={str(tmp_path / 'run')!r})); t.fit(progress=False)")
    assert _env_after(code) == "PASSIVE"
    line = [l for l in (tmp_path / "run" / "log.txt").read_text().splitlines() if l.startswith("threads:")]
    assert line and "they sleep while they wait (OMP_WAIT_POLICY=PASSIVE, set by tunebook" in line[0], line
    _env_after("import torch\n" + code)
    line = [l for l in (tmp_path / "run" / "log.txt").read_text().splitlines() if l.startswith("threads:")]
    assert "they spin while they wait (torch was imported before tunebook)" in line[0], line


def test_a_spin_count_of_the_users_is_said_as_set(monkeypatch):
    "GOMP_SPINCOUNT alone was reported as spinning because torch came first; it is the user's setting, and said so."
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False); monkeypatch.delenv("TUNEBOOK_SET_OMP_WAIT", raising=False)
    monkeypatch.setenv("GOMP_SPINCOUNT", "1000")
    assert core.fit_threads().endswith("; GOMP_SPINCOUNT=1000, as set")
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    assert core.fit_threads().endswith("; OMP_WAIT_POLICY=PASSIVE and GOMP_SPINCOUNT=1000, as set")
