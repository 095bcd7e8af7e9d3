#!/usr/bin/env bash
# bench/gpu.sh — the engine and the full pipeline on one CUDA GPU, bf16, for two models:
# SmolLM2-135M (the default model) and llama-1b-random (Llama-3.2-1B-shaped, random weights:
# no download needed to measure speed). Each against its raw batched forward ceiling, with
# TTFT, in one run per model (python -m bench.pipeline), and weight-only int8/int4 against bf16
# (python -m bench.quant --device cuda). Budget: under 9 minutes on one H200.
#
#   make install && bench/gpu.sh          # or PY=/path/to/python bench/gpu.sh
#
# On an offline machine whose python3 has torch + transformers (the lent H200), prepare
# .gpu-carry/ here first with bench/gpu_pack.sh: the missing wheels are installed from it and,
# since the SmolLM2 weights cannot travel, smollm2-135m-random (same shapes, same speed) is
# measured in their place. Writes bench/out/gpu-<model>.json and bench/out/gpu.json.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v nvidia-smi >/dev/null 2>&1; then
  echo "bench/gpu.sh: no NVIDIA GPU here (nvidia-smi not found); bench/RESULTS.md has the CPU numbers" >&2
  exit 2
fi
if [ -x .venv/bin/python ]; then PY=${PY:-.venv/bin/python}; else PY=${PY:-python3}; fi
DATA_ARGS=()
SMOLLM2=smollm2-135m
if [ -d .gpu-carry/whl ]; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/tokenpipe-site .gpu-carry/whl/*.whl
  export PYTHONPATH="/tmp/tokenpipe-site:$PWD${PYTHONPATH:+:$PYTHONPATH}" PATH="/tmp/tokenpipe-site/bin:$PATH"
  DATA_ARGS=(--data-dir "$PWD/.gpu-carry/data")
  SMOLLM2=smollm2-135m-random
fi
STREAMS=${STREAMS:-64}
MAX_TOKENS=${MAX_TOKENS:-256}
PER_MODEL_S=${PER_MODEL_S:-180}   # hard limit per model: two models, the quant run and set-up stay under 9 minutes
QUANT_S=${QUANT_S:-120}

"$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else "bench/gpu.sh: this torch sees no CUDA device")'
mkdir -p bench/out
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee bench/out/gpu-device.txt
if [ "$SMOLLM2" = smollm2-135m ]; then
  "$PY" -m tokenpipe_cli prepare          # one-time GGUF de-quantization (~20 s), outside the timed runs
fi
# Weight-only int8/int4 on CUDA (torch's int8pack and tinygemm kernels) against bf16, same run.
status=0
timeout "$QUANT_S" "$PY" -m bench.quant --device cuda --model llama-1b-random --rounds 3 --prompts 8 \
  --new-tokens 16 --variants bfloat16/none,bfloat16/int8,bfloat16/int4 "${DATA_ARGS[@]}" \
  --out bench/out/gpu-quant.json || status=$?
for model in "$SMOLLM2" llama-1b-random; do
  timeout "$PER_MODEL_S" "$PY" -m bench.pipeline --model "$model" --device cuda --dtype bfloat16 \
    --streams "$STREAMS" --engine-batches 8,32,64 --max-tokens "$MAX_TOKENS" --ttft-requests 20 \
    "${DATA_ARGS[@]}" --out "bench/out/gpu-$model.json" || status=$?
done
[ "$status" = 0 ] && "$PY" -m bench.gpu_summary "bench/out/gpu-$SMOLLM2.json" bench/out/gpu-llama-1b-random.json --out bench/out/gpu.json
exit "$status"  # a failed run fails the script, after every run had its turn
