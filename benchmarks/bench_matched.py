"""Cost of the matched loss-rise study (``quotient-manifolds matched``) per model, measured on
its real configuration: the width-64 ViT of the vision fine-tunes (depth 4, 4 heads of dim 16,
139,018 weights), the first 256 Fashion-MNIST pool images, 20 Auto-PGD iterations, each of the
six measures once, one torch thread.

The cost of a measure does not depend on the weights (fixed iterations, fixed RK4 steps), except
that an exact geodesic that leaves GL(h) stops early; so the model here is the architecture at its
initialisation with the population's seed (no 40k-image pretraining needed), and the radius of
each measure is its vision-study starting ρ scaled to 1 nat. Prints CPU and wall seconds per
measure and the projection of the whole study:

* per model: fine-tune + evaluation (from the vision study's records: median 28 s + 12 s) and
  the six measures at each level;
* pilot: per pilot model, per measure and level, a ρ search of ``--evals-per-search`` sharpness
  runs (the vision calibration took 2 / 1.8 / 5.8 runs for adaptive / inv / mix at 3 nats);
* pretraining once (480k samples at the fine-tunes' ≈ 0.45 ms per sample: ≈ 220 s).

    python benchmarks/bench_matched.py [--data-dir DIR] [--levels 2] [--models 48]
                                       [--pilot-models 6] [--evals-per-search 4]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--levels", type=int, default=2)
    ap.add_argument("--models", type=int, default=48)
    ap.add_argument("--pilot-models", type=int, default=6)
    ap.add_argument("--evals-per-search", type=float, default=4.0)
    ap.add_argument("--train-eval-s", type=float, default=40.0,
                    help="fine-tune + evaluation seconds per model (vision study: 28 + 12)")
    ap.add_argument("--pretrain-s", type=float, default=220.0)
    args = ap.parse_args()

    import torch
    torch.set_num_threads(1)
    from quotient_manifolds.experiments import matched as MT
    from quotient_manifolds.experiments import vision as V
    from quotient_manifolds.experiments.measures import run_plan

    config = MT.defaults(False, False)
    pop = config["population"]
    data = V.load_data(pop, args.data_dir)
    hp = V.hparams(pop, 0)
    model = V.build_model(pop, hp["seed"])
    model.eval()
    batches = V.sharpness_batches({"sharp_points": config["points"],
                                   "sharp_batch": config["batch"]}, data)
    rows = []
    for m in config["measures"]:
        rho = MT._start(config, m, 1.0)
        c0, w0 = time.process_time(), time.perf_counter()
        e = run_plan(model, batches, [(m, rho)], n_iters=config["n_iters"])[0]
        rows.append(dict(measure=m, rho=rho, cpu_s=time.process_time() - c0,
                         wall_s=time.perf_counter() - w0, value=e["value"],
                         error=e.get("error")))
        print(json.dumps(rows[-1]), flush=True)
    per_level = sum(r["cpu_s"] for r in rows)
    per_model = args.train_eval_s + args.levels * per_level
    pilot_per_model = args.levels * per_level * args.evals_per_search  # trained once, below
    total = args.pretrain_s + args.pilot_models * pilot_per_model + args.models * per_model
    print(json.dumps(dict(six_measures_cpu_s=per_level, per_model_cpu_s=per_model,
                          pilot_per_model_cpu_s=pilot_per_model,
                          total_cpu_h=total / 3600,
                          wall_h_two_workers=total / 3600 / 2)), flush=True)
    assert all(math.isfinite(r["cpu_s"]) for r in rows)


if __name__ == "__main__":
    main()
