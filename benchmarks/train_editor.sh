#!/usr/bin/env bash
# Trains ditrun's editor on one GPU (python -m recipes.editor.train, docs/EDITOR.md), one bounded command at a time:
#   bash benchmarks/train_editor.sh [recipes.editor.train options]
# Each command trains for at most $MINUTES (default 7) minutes, then saves a checkpoint in $CHECKPOINTS (default
# /tmp/editor-checkpoints, which stays on the machine between commands while it is held) and exits 75; the same
# command again resumes where it stopped, on this machine. CONTINUE=1 says that it must (--resume=required): a
# machine without the checkpoint (a fresh one: a lent machine is handed back soon after a call ends) then refuses in
# one sentence before any work, rather than training from the start again. When the training completes (exit 0), the
# pipeline folder comes back in $OUT as editor.tar.part-aa, -ab, ... (at most 15 MiB each: cat them, then tar -x)
# with the losses, the evaluation and the settings beside it. RETURN_VAE=1 also returns the VAE phase's checkpoint
# (vae.pt.part-*) so that another machine can go on from it (CHECKPOINTS=<folder holding vae.pt>). The DiT's encoded
# pool is kept there too (pool.pt, about 3 GB), so that a resuming command does not encode it again.
# The device machine has torch, transformers and scikit-image/-learn but not diffusers: carry its wheel in .whl/.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-results/editor}
CHECKPOINTS=${CHECKPOINTS:-/tmp/editor-checkpoints}
MINUTES=${MINUTES:-7}
FOLDER=${FOLDER:-/tmp/editor}  # the folder being trained; its records beside it in $FOLDER.training
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 CUBLAS_WORKSPACE_CONFIG=:4096:8
source benchmarks/wheels.sh
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv | tee "$OUT/gpu.txt"
resume=--resume
[ "${CONTINUE:-0}" = 1 ] && resume=--resume=required
python3 -m recipes.editor.train --out "$FOLDER" --replace --log-dir "$FOLDER.training" \
  --checkpoint-dir "$CHECKPOINTS" "$resume" --max-minutes "$MINUTES" "$@" 2>&1 \
  | grep -v -i warning | tee "$OUT/train.log"
status=${PIPESTATUS[0]}
cp "$FOLDER.training/losses.jsonl" "$OUT/" 2>/dev/null
if [ "${RETURN_VAE:-0}" = 1 ] && [ -f "$CHECKPOINTS/vae.pt" ]; then
  split -b 15m "$CHECKPOINTS/vae.pt" "$OUT/vae.pt.part-"
fi
if [ "$status" = 0 ]; then
  tar -C "$(dirname "$FOLDER")" -cf - "$(basename "$FOLDER")" | split -b 15m - "$OUT/editor.tar.part-"
  cp "$FOLDER.training/eval.json" "$FOLDER.training/train.json" "$OUT/"
fi
if [ "$status" = 75 ]; then
  echo "train_editor: stopped with a checkpoint in $CHECKPOINTS on $(hostname): CONTINUE=1 and the same command on" \
    "this machine go on from it"
fi
exit "$status"
