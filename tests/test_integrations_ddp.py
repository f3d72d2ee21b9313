"""SharpnessCallback under the Trainer's DistributedDataParallel (two CPU processes, gloo): the held
batches are spread over the ranks, every rank logs the same value, the value of a direct
single-process adapters.sharpness call on the trained weights."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("transformers")

WORKER = textwrap.dedent("""
    import json, os, sys
    import torch
    torch.set_num_threads(1)
    sys.path.insert(0, {tests!r})
    import transformers
    from quotient_manifolds import adapters
    from quotient_manifolds.adapters.integrations import SharpnessCallback
    from test_integrations import examples, held_batches, tiny_model, training_args
    import pathlib

    model = tiny_model(dropout=0.0)
    args = training_args(pathlib.Path(os.environ["OUT_DIR"]), max_steps=2, per_device_train_batch_size=2)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=examples(8, 0))
    callback = SharpnessCallback(trainer, held_batches(), geometries=["geodesic-inv"], every_n_steps=2,
                                 rho=0.1, n_iters=2)
    trainer.add_callback(callback)
    trainer.train()
    logged = [h["sharpness/geodesic-inv"] for h in trainer.state.log_history if "sharpness/geodesic-inv" in h]
    direct = adapters.sharpness(model, held_batches(), geometry="geodesic-inv", rho=0.1, n_iters=2).value
    result = dict(logged=logged, direct=direct, world=trainer.args.world_size,
                  ranks=callback.monitor.last_results["geodesic-inv"].options.get("world_size"),
                  weights=float(sum(p.double().sum() for p in model.parameters())))
    with open(os.environ["OUT"], "w") as fh:
        json.dump(result, fh)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)
""")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_the_callback_under_ddp_logs_the_same_value_on_every_rank(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER.format(tests=os.path.dirname(__file__)))
    port, world, procs = str(_free_port()), 2, []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                   LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                   OUT=str(tmp_path / f"rank{rank}.json"), OUT_DIR=str(tmp_path / f"run{rank}"),
                   OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, str(script)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    for p in procs:
        out, _ = p.communicate(timeout=120)
        assert p.returncode == 0, out.decode()[-3000:]
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    assert results[0]["world"] == 2 and results[0]["ranks"] == 2     # the Trainer ran DDP; batches spread
    assert results[0]["weights"] == results[1]["weights"]            # DDP kept the replicas equal
    for res in results:
        assert len(res["logged"]) == 1
        assert abs(res["logged"][0] - res["direct"]) <= 1e-10
    assert results[0]["logged"] == results[1]["logged"]
