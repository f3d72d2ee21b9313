#!/usr/bin/env bash
# The GPU rows of docs/benchmarks.md in one run, each stage bounded so that a slow one cannot take
# the others' time: the CUDA tests, the sharpness rows of BERT-base and the Qwen2-0.5B shape (32 x
# 128 tokens), the launch and sync counts of one iteration, the geometry core on BERT-base's heads
# (the inv frame's eigendecomposition among them), geodesic SAM on BERT-base, and the 7B decoder
# shape (32 x 32 tokens), and the memory rows (bench_gpu_memory.py: the Qwen2-7B shape with the
# default solver on the whole device and the compact one under an 80 GB limit, the 13B shape with
# the compact one; each row: seconds per iteration against the bf16 forward+backward, peak GiB,
# bytes per parameter). The memory rows have not run on a GPU yet: run them first,
# GPU_ROWS_STAGES=memory (at most 540 s).
#
#   bash benchmarks/gpu_rows.sh [OUT_DIR]        (default: gpu-rows/; logs and JSON land there)
#   GPU_ROWS_STAGES="geometry sam" bash benchmarks/gpu_rows.sh OUT_DIR     (only those stages)
#
# The stages' bounds add up to 900 s. On one H200 they took: tests 74 s, sharpness more than 190 s
# (the 0.5B's float32 baseline comes last), launches 42 s, geometry 19 s, sam 119 s; decoders (the
# 7B alone: the 3B was measured before) is bounded by 240 s. A lent machine that runs one command
# for at most 600 s takes the first four (at most 510 s) in one call and the rest in another,
# selected with GPU_ROWS_STAGES.
#
# Run from the repository root with the package installed: `pip install --no-deps
# --no-build-isolation -e .` works offline beside an installed torch, transformers, geoopt and
# pymanopt (the adapters are a package of their own directory, so the source tree alone does not
# import). Without installing, two links make the source tree importable (as on the H200 above):
# `ln -sfn ../adapters quotient_manifolds/adapters; ln -sfn ../experiments
# quotient_manifolds/experiments; export PYTHONPATH=$PWD`.
set -u
out=${1:-gpu-rows}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
python3 -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.__version__, torch.cuda.get_device_name())" || exit 1
stages=" ${GPU_ROWS_STAGES:-tests sharpness launches geometry sam decoders memory} "
stage() {  # stage NAME SECONDS COMMAND...: the command's output to the screen and $out/NAME.log
    local name=$1 seconds=$2
    shift 2
    case "$stages" in
        *" $name "*) ;;
        *) echo "== $name: skipped (not in GPU_ROWS_STAGES)"; return 0 ;;
    esac
    echo "== $name (at most $seconds s)"
    timeout "$seconds" "$@" 2>&1 | tee "$out/$name.log"
}
stage tests 120 python3 -m pytest -q tests/test_cuda.py -p no:cacheprovider -W ignore::DeprecationWarning
stage sharpness 240 python3 benchmarks/bench_sharpness.py --device cuda --models bert-base qwen2-0.5b \
    --batch 32 --seq 128 --iters 6 --rounds 1 --threads 4 --json "$out/sharpness.json"
stage launches 90 python3 benchmarks/bench_launches.py --device cuda --models bert-base --batch 32 --seq 128
stage geometry 60 python3 benchmarks/bench_geometry.py --device cuda
stage sam 150 python3 benchmarks/bench_sam.py --device cuda --models bert-base --seq 128 --steps 4 \
    --rounds 1 --threads 4
stage decoders 240 python3 benchmarks/bench_sharpness.py --device cuda --models qwen2-7b \
    --batch 32 --seq 32 --iters 4 --rounds 1 --threads 4 --methods adaptive geodesic-inv \
    --json "$out/decoders.json"
stage memory 540 python3 benchmarks/bench_gpu_memory.py --iters 4 --json "$out/memory.json"
