#!/usr/bin/env bash
# bench/gpu.sh — the GPU worker on one CUDA GPU, bf16, each figure as a ratio to its limit or
# as after ÷ before within this run (issue 22). Budget: under 10 minutes on one H200.
#  1. bench.cudagraphs: the decode step eager vs captured as CUDA graphs per batch
#     bucket, Llama-3.2-1B- and Llama-3.1-8B-shaped random models, batch 1 and 64; each as
#     weight bytes x steps/s / measured copy bandwidth and FLOP/s / measured GEMM peak.
#  2. bench.pipeline on llama-1b-random (random weights, no download), before
#     (TOKENPIPE_ENGINE_PROCESS=off, TOKENPIPE_CUDA_GRAPHS=off) and after (on, on): engine and
#     whole pipeline against the raw batched forward ceiling, pipeline-added TTFT.
#  3. only with SMOLLM2=1 / QUANT=1: SmolLM2-135M the same way, weight-only int8/int4 vs bf16.
#
#   make install && bench/gpu.sh          # or PY=/path/to/python bench/gpu.sh
#   bench/gpu.sh --dry-run                # any machine: the Python parts on CPU, no timing
#
# On an offline machine whose python3 has torch + transformers (the lent H200), prepare
# .gpu-carry/ here first with bench/gpu_pack.sh: the missing wheels are installed from it and,
# since the SmolLM2 weights cannot travel, smollm2-135m-random (same shapes, same speed) is
# measured in their place. Each scenario runs through the suite's runner (`python -m bench run NAME --
# ARGS`, bench/suite.py). Writes bench/out/gpu-*.json and bench/out/gpu.json.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--dry-run" ]; then
  if [ -x .venv/bin/python ]; then PY=${PY:-.venv/bin/python}; else PY=${PY:-python3}; fi
  "$PY" -m bench run cudagraphs --quick --out-dir "${OUT_DIR:-bench/out}" -- \
    --out "${OUT_DIR:-bench/out}/gpu-cudagraphs-dry.json"
  exit $?
fi
if ! command -v nvidia-smi >/dev/null 2>&1; then
  echo "bench/gpu.sh: no NVIDIA GPU here (nvidia-smi not found); make bench measures the CPU" >&2
  exit 2
fi
if [ -x .venv/bin/python ]; then PY=${PY:-.venv/bin/python}; else PY=${PY:-python3}; fi
DATA_ARGS=()
SMOLLM2_MODEL=smollm2-135m
if [ -d .gpu-carry/whl ]; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/tokenpipe-site .gpu-carry/whl/*.whl
  export PYTHONPATH="/tmp/tokenpipe-site:$PWD${PYTHONPATH:+:$PYTHONPATH}" PATH="/tmp/tokenpipe-site/bin:$PATH"
  DATA_ARGS=(--data-dir "$PWD/.gpu-carry/data")
  SMOLLM2_MODEL=smollm2-135m-random
fi
STREAMS=${STREAMS:-64}
MAX_TOKENS=${MAX_TOKENS:-256}
GRAPHS_S=${GRAPHS_S:-200}         # bench.cudagraphs: two models, 8B built on the device, 7 captures each
PER_RUN_S=${PER_RUN_S:-170}       # hard limit per pipeline run: before + after + the above stay under 10 minutes
QUANT_S=${QUANT_S:-120}

"$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else "bench/gpu.sh: this torch sees no CUDA device")'
mkdir -p bench/out
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee bench/out/gpu-device.txt
status=0
timeout "$GRAPHS_S" "$PY" -m bench run cudagraphs -- --out bench/out/gpu-cudagraphs.json || status=$?
runs=()
pipeline() {  # model, label, engine process, CUDA graphs
  TOKENPIPE_ENGINE_PROCESS=$3 TOKENPIPE_CUDA_GRAPHS=$4 timeout "$PER_RUN_S" "$PY" -m bench run pipeline -- --model "$1" \
    --device cuda --dtype bfloat16 --streams "$STREAMS" --engine-batches 1,64 --max-tokens "$MAX_TOKENS" \
    --ttft-requests 20 --repeats 1 "${DATA_ARGS[@]}" --out "bench/out/gpu-$1-$2.json" || status=$?
  runs+=("bench/out/gpu-$1-$2.json")
}
pipeline llama-1b-random before off off
pipeline llama-1b-random after on on
if [ "${SMOLLM2:-0}" = 1 ]; then
  if [ "$SMOLLM2_MODEL" = smollm2-135m ]; then "$PY" -m tokenpipe_cli prepare; fi  # GGUF de-quantization, untimed
  pipeline "$SMOLLM2_MODEL" after on on
fi
if [ "${QUANT:-0}" = 1 ]; then  # weight-only int8/int4 on CUDA (torch's int8pack and tinygemm kernels) vs bf16
  timeout "$QUANT_S" "$PY" -m bench run quant -- --device cuda --model llama-1b-random --rounds 3 --prompts 8 \
    --new-tokens 16 --variants bfloat16/none,bfloat16/int8,bfloat16/int4 "${DATA_ARGS[@]}" \
    --out bench/out/gpu-quant.json || status=$?
fi
"$PY" -m bench.gpu_summary "${runs[@]}" --out bench/out/gpu.json || status=$?
exit "$status"  # a failed run fails the script, after every run had its turn
