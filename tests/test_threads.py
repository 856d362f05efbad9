"""Threads on a shared CPU: `import tunebook` makes OpenMP threads sleep while they wait when other work shares the CPUs
(unless the user chose, or torch was loaded first), torch's threads follow the CPUs the process may use (affinity,
cgroup quota), and a run's log says how many threads it used, how they wait and why."""
import contextlib
import os
import subprocess
import sys

import torch

import tunebook.core as core


def _env_after(code, *names, **env):
    "The environment variables `names` (default OMP_WAIT_POLICY) after `code` ran in a fresh interpreter, space-separated."
    e = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "TUNEBOOK_SET_OMP_WAIT")}
    show = ", ".join(f"os.environ.get({n!r})" for n in names or ("OMP_WAIT_POLICY",))
    out = subprocess.run([sys.executable, "-c", code + f"\nimport os; print({show})"],
                         capture_output=True, text=True, env={**e, **env}, cwd="/tmp")
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().splitlines()[-1]


@contextlib.contextmanager
def busy_cpus():
    "A busy process on each CPU this process may use, for the length of the block."
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in os.sched_getaffinity(0)]
    try: yield
    finally:
        for p in procs: p.kill(); p.wait()


def test_import_tunebook_before_torch_chooses_how_threads_wait():
    with busy_cpus():                                                 # other work on every CPU: threads sleep
        assert _env_after("import tunebook") == "PASSIVE"
        assert _env_after("import tunebook.train") == "PASSIVE"      # the package's __init__ runs before any module
        assert _env_after("import tunebook", OMP_WAIT_POLICY="ACTIVE") == "ACTIVE"   # the user's choice stands
        assert _env_after("import tunebook", GOMP_SPINCOUNT="1000") == "None"
        assert _env_after("import torch, tunebook") == "None"        # too late to matter: left alone, and said (below)
    # whatever the load now: the policy is the one the measured load calls for, and the measurement is kept
    mark, policy = _env_after("import tunebook", "TUNEBOOK_SET_OMP_WAIT", "OMP_WAIT_POLICY").split()
    assert policy == ("PASSIVE" if float(mark) >= 0.5 else "None"), (mark, policy)


def test_the_load_of_other_work_is_read_from_proc_stat():
    "Busy ticks of this process's CPUs (steal counted, idle and iowait not), minus its own, per tick of those CPUs."
    import tunebook
    cpus = sorted(os.sched_getaffinity(0))
    def stat(busy, idle):   # every CPU of ours the same: user, nice, system, idle, iowait, irq, softirq, steal
        lines = ["cpu  9 9 9 9 9 9 9 9"] + [f"cpu{c} {busy - 10} 0 5 {idle} 7 0 0 5" for c in cpus] + ["cpu999 1000 0 0 0 0 0 0 0"]
        return "\n".join(lines) + "\nintr 1 2 3\n"
    assert tunebook._cpu_ticks(stat(100, 50), set(cpus)) == (100 * len(cpus), 157 * len(cpus))
    snaps = iter([stat(100, 50), stat(130, 60)])                      # 30 busy and 10 idle ticks a CPU in between
    assert abs(tunebook._others_load(0.0, read=lambda: next(snaps)) - 0.75 * len(cpus)) < 0.05   # own time: ~0 ticks
    assert tunebook._others_load(0.0, read=lambda: stat(100, 50)) is None                         # no tick passed: unknown


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
    with busy_cpus(): assert _env_after(code) == "PASSIVE"
    line = [l for l in (tmp_path / "run" / "log.txt").read_text().splitlines() if l.startswith("threads:")]
    assert line and "they sleep while they wait (OMP_WAIT_POLICY=PASSIVE, set by tunebook: other work used" in line[0], line
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


def test_idle_cpus_keep_openmps_default_and_say_so(monkeypatch):
    "What `import tunebook` found idle CPUs: OpenMP's own wait kept, the load seen and the way to sleep instead said."
    for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"): monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("TUNEBOOK_SET_OMP_WAIT", "0.12")
    said = core.fit_threads()
    assert "they spin a moment, then sleep, while they wait (OpenMP's default, kept by tunebook: other work used 0.1 CPUs" in said
    assert said.endswith("start Python with OMP_WAIT_POLICY=PASSIVE"), said
    monkeypatch.setenv("TUNEBOOK_SET_OMP_WAIT", "unknown"); monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    assert "set by tunebook: the load of other work could not be read" in core.fit_threads()
