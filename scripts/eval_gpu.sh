#!/usr/bin/env bash
# Held-out evaluation on the GPU (docs/evaluation.md): the tiny model trained at 4096 tokens on
# generated documents (facts defined early, queried far later) with attention=fmsa and with
# attention=full, evaluated before step 1 and every 100 steps (loss by position, 8 pass-key
# probes); then eval.only on the fmsa run's final checkpoint with the query-centric nsa kernel
# and at twice the length. Logs and metrics go to $OUT.
#   OUT=$OUT bash scripts/eval_gpu.sh
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/gpu_env.sh
COMMON=(data.num_docs=1024 data.min_doc_tokens=2048 data.max_doc_tokens=16384 train.seq_len=4096 train.steps=300
        train.lr=2e-3 data.eval_fraction=0.05 eval.every=100 eval.at_start=true eval.passkey=8 eval.max_sequences=64
        train.progress=false train.save_hf=false train.log_every=50)
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$OUT/eval_gpu.log"
for att in fmsa full; do
  python -m msa_train.cli "${COMMON[@]}" attention=$att train.output_dir="$OUT/eval_$att" 2>&1 | tee -a "$OUT/eval_gpu.log"
done
python -m msa_train.cli "${COMMON[@]}" attention=nsa eval.only=true train.resume=auto \
  train.output_dir="$OUT/eval_fmsa" 2>&1 | tee -a "$OUT/eval_gpu.log"
cp "$OUT/eval_fmsa/eval.json" "$OUT/eval_only_nsa_4096.json"
python -m msa_train.cli "${COMMON[@]}" attention=fmsa eval.only=true train.resume=auto train.seq_len=8192 \
  train.output_dir="$OUT/eval_fmsa" 2>&1 | tee -a "$OUT/eval_gpu.log"
cp "$OUT/eval_fmsa/eval.json" "$OUT/eval_only_fmsa_8192.json"
for att in fmsa full; do cp "$OUT/eval_$att/metrics.jsonl" "$OUT/eval_${att}_metrics.jsonl"; rm -rf "$OUT/eval_$att"; done
