#!/usr/bin/env bash
# bench/gpu.sh — the engine and the full pipeline on one CUDA GPU, bf16, for two models:
# SmolLM2-135M (the default model) and llama-1b-random (Llama-3.2-1B-shaped, random weights:
# no download needed to measure speed). Each against its raw batched forward ceiling, with
# TTFT, in one run per model (python -m bench.pipeline). Budget: under 8 minutes on one H200.
#
#   make install && bench/gpu.sh          # or PY=/path/to/python bench/gpu.sh
#
# Writes bench/out/gpu-<model>.json and bench/out/gpu.json (the summary table's data).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
STREAMS=${STREAMS:-64}
MAX_TOKENS=${MAX_TOKENS:-256}
PER_MODEL_S=${PER_MODEL_S:-200}   # hard limit per model: two models + set-up stay under 8 minutes

if ! command -v nvidia-smi >/dev/null 2>&1; then
  echo "bench/gpu.sh: no NVIDIA GPU here (nvidia-smi not found); bench/RESULTS.md has the CPU numbers" >&2
  exit 2
fi
"$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else "bench/gpu.sh: this torch sees no CUDA device")'
mkdir -p bench/out
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee bench/out/gpu-device.txt
"$PY" -m tokenpipe prepare            # one-time GGUF de-quantization (~20 s), outside the timed runs
for model in smollm2-135m llama-1b-random; do
  timeout "$PER_MODEL_S" "$PY" -m bench.pipeline --model "$model" --device cuda --dtype bfloat16 \
    --streams "$STREAMS" --engine-batches 8,32,64 --max-tokens "$MAX_TOKENS" --ttft-requests 20 \
    --out "bench/out/gpu-$model.json"
done
"$PY" -m bench.gpu_summary bench/out/gpu-smollm2-135m.json bench/out/gpu-llama-1b-random.json --out bench/out/gpu.json
