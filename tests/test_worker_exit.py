"""``--workers N``: the worker processes (and the multiprocessing resource tracker) exit when the
parent is killed with SIGKILL, whether they are computing or idle."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

PARENT = textwrap.dedent("""
    import os, sys, time
    from quotient_manifolds.experiments.runner import OutputDir, run_population

    def job(model_id, pids_dir):
        # a worker that never calls check_parent_alive: only the watchdog can end it
        open(os.path.join(pids_dir, str(os.getpid())), "w").close()
        while True:
            time.sleep(0.05)

    if __name__ == "__main__":
        out, pids_dir = sys.argv[1], sys.argv[2]
        with OutputDir(out, "worker-exit", {"n": 1}) as outdir:
            run_population(outdir, job, [0, 1, 2], (pids_dir,), workers=2, progress=False,
                           threads=1)
""")


def _children(pid: int):
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            if ppid == pid:
                found.append(int(entry))
    return found


#: seconds after which a wait for the workers to start or to exit gives up (not a timing check)
HANG_GUARD_S = 300


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"   # a zombie has exited
    except OSError:
        return False


def test_workers_and_resource_tracker_exit_when_the_parent_is_killed(tmp_path):
    script, pids_dir = tmp_path / "parent.py", tmp_path / "pids"
    script.write_text(PARENT)
    pids_dir.mkdir()
    env = {**os.environ, "PYTHONPATH": os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "OMP_NUM_THREADS": "1"}
    parent = subprocess.Popen([sys.executable, str(script), str(tmp_path / "out"), str(pids_dir)],
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    kids = []
    try:
        # HANG_GUARD_S bounds only waits for an event that must come (a hung run fails instead of
        # blocking the suite); it is generous enough that a loaded machine never reaches it
        deadline = time.monotonic() + HANG_GUARD_S
        while len(os.listdir(pids_dir)) < 2 and time.monotonic() < deadline:
            assert parent.poll() is None, parent.stderr.read().decode()
            time.sleep(0.05)
        workers = sorted(int(p) for p in os.listdir(pids_dir))
        assert len(workers) == 2
        kids = _children(parent.pid)               # the two workers and the resource tracker
        assert set(workers) <= set(kids) and len(kids) >= 3
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        deadline = time.monotonic() + HANG_GUARD_S
        while any(_alive(k) for k in kids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not [k for k in kids if _alive(k)], "processes outlived their parent"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        for k in kids:                              # never leave one behind, even on failure
            if _alive(k):
                os.kill(k, signal.SIGKILL)
        parent.stderr.close()
