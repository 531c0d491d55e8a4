#!/usr/bin/env bash
# Trains ditrun's editor on one GPU (python -m ditrun.editor.train, docs/EDITOR.md) and returns the
# pipeline folder as $OUT/editor.tar with the training's losses, evaluation and settings beside it.
#   bash benchmarks/train_editor.sh [train.py options]
# The device machine has torch, transformers and scikit-image/-learn but not diffusers: carry its wheel in .whl/.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-results/editor}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 CUBLAS_WORKSPACE_CONFIG=:4096:8
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv | tee "$OUT/gpu.txt"
rm -rf /tmp/editor /tmp/editor.training
python3 -m ditrun.editor.train --out /tmp/editor "$@" 2>&1 | grep -v -i warning | tee "$OUT/train.log"
tar -C /tmp -cf "$OUT/editor_vae.tar" editor/vae
tar -C /tmp -cf "$OUT/editor_rest.tar" --exclude editor/vae editor
cp /tmp/editor.training/eval.json /tmp/editor.training/train.json /tmp/editor.training/losses.jsonl "$OUT/"
