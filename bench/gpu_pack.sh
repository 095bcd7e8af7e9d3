#!/usr/bin/env bash
# bench/gpu_pack.sh — prepare .gpu-carry/ for running bench/gpu.sh on an offline CUDA machine
# whose python3 already has torch + transformers (like the lent H200: nothing can be fetched
# there, and at most 64 MiB travel with the working tree).
#
#   bench/gpu_pack.sh                  # here, with network: wheels + tokenizer, ~25 MiB
#   bench/gpu.sh                       # there, from the repo root (uses .gpu-carry/ when present)
#
# The SmolLM2 weights (a 94 MiB GGUF) do not fit, so the GPU run there measures
# smollm2-135m-random: the same architecture and shapes with random weights — the same speed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=.gpu-carry
rm -rf "$OUT" && mkdir -p "$OUT/whl" "$OUT/data/models/smollm2-135m"
# What the project needs beyond the device image's packages, at the versions tested here.
# websockets: the producer SDK imports it (producer.RelaySocket), so bench.pipeline does; missing from
# the pack, every pipeline run of bench/gpu.sh failed at import on the H200 (2026-12-04).
PKGS=$("$PY" -m pip freeze 2>/dev/null | grep -i -E '^(fastapi|starlette|pydantic|pydantic[-_]core|annotated[-_]types|typing[-_]inspection|uvicorn|httptools|nats[-_]py|nats[-_]server[-_]bin|orjson|opentelemetry[-_][a-z_-]+|googleapis[-_]common[-_]protos|protobuf|gguf|websockets)==')
PLATFORMS=""
for n in 17 27 28 31 34 35; do PLATFORMS="$PLATFORMS --platform manylinux_2_${n}_x86_64"; done
# shellcheck disable=SC2086
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  $PLATFORMS --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$OUT/whl" $PKGS
"$PY" -m tokenpipe_cli prepare >/dev/null   # the tokenizer comes from the converted model's folder
SRC=$("$PY" -c 'from pathlib import Path; from tokenpipe.settings import Settings; print(Path(Settings.load().data_dir) / "models" / "smollm2-135m")')
cp "$SRC"/tokenizer.json "$SRC"/tokenizer_config.json "$SRC"/chat_template.jinja "$SRC"/.complete \
   "$OUT/data/models/smollm2-135m/"
du -sh "$OUT"
echo "now: run bench/gpu.sh on the CUDA machine with .gpu-carry in the working tree"
