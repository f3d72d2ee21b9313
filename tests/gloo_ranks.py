"""Run a function of a test module on several processes of one gloo group (the CPU), as
``torchrun`` would: each rank calls it after ``init_process_group`` and writes what it returns as
JSON; the test collects every rank's answer. Used by the FSDP2 tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from typing import Any, List

from test_distributed import _free_port

WORKER = textwrap.dedent("""
    import json, os, sys
    import torch, torch.distributed as dist
    torch.set_num_threads(1)
    sys.path.insert(0, {tests!r})
    from {module} import {function}
    dist.init_process_group("gloo", init_method="env://")
    out = {function}()
    with open(os.environ["OUT"], "w") as fh:
        json.dump(out, fh)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)
""")


def launch(world: int, tmp_path, module: str, function: str, **env: str) -> List[subprocess.Popen]:
    """``world`` processes, each calling ``module.function()`` on its rank (``env``: more
    environment variables for the function to read)."""
    script = tmp_path / f"{function}_worker.py"
    script.write_text(WORKER.format(tests=os.path.dirname(__file__), module=module, function=function))
    port = str(_free_port())
    return [subprocess.Popen([sys.executable, str(script)], env=dict(
        os.environ, RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
        OUT=str(tmp_path / f"{function}{world}_{rank}.json"), OMP_NUM_THREADS="1", **env),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for rank in range(world)]


def collect(procs: List[subprocess.Popen], tmp_path, function: str) -> List[Any]:
    """Every rank's answer, in rank order, once every process ended well (else its output)."""
    for p in procs:
        out, _ = p.communicate(timeout=300)
        assert p.returncode == 0, out.decode()[-4000:]
    return [json.loads((tmp_path / f"{function}{len(procs)}_{r}.json").read_text()) for r in range(len(procs))]
