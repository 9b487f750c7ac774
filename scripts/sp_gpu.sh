#!/usr/bin/env bash
# Ulysses sequence parallelism on two H200s (kind nvidia-h200-x2), results under $OUT. Run from the
# repo root with the wheels of scripts/gpu_wheels.sh carried in .whl/:
#   bash scripts/sp_gpu.sh [stages...]     stages: check tiny onegpu dpo_onegpu long
# check: both attention backends on 2 GPUs (NCCL, bf16, the Triton kernels) against the whole
#        sequence on each GPU (tests/msa_train/sp_worker.py with SP_DEVICE=cuda)
# tiny:  the tiny recipe with fmsa, 30 steps: 1 GPU, then parallel.sp_degree=2 on 2 GPUs
# onegpu: the tiny stage on ONE GPU, both ranks on it (gloo; torchrun's LOCAL_RANK overridden to 0),
#        for when no 2-GPU machine is lent: the trainer's SP path on the CUDA kernels, not its speed
# dpo_onegpu: DPO (fmsa, bf16) on pairs whose prompt is a long document, 1 process against
#        sp_degree=2 with both ranks on ONE GPU (gloo, as onegpu): per-step loss, reward margin,
#        gradient norm and the held-out evaluation
# long:  Llama-3-8B layer shapes (llama3_8b_64k, 4 layers, fmsa, ZeRO-2, activation checkpointing)
#        on the generated corpus: SP_LENS on 1 GPU and with sp_degree=2 on 2 GPUs (SP2_ONLY_LENS: 2 GPUs only)
set -uo pipefail
. "$(dirname "$0")/gpu_env.sh"  # $OUT, the carried wheels, PYTHONPATH
RUN2=(python3 -m torch.distributed.run --nproc-per-node 2 --master-addr 127.0.0.1 --master-port 29533)
stages=${*:-check tiny}
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/gpu.txt"

run_point() {  # name procs seq_len steps [overrides...]: one msa-train run of the long stage
  local name=$1 procs=$2 len=$3 steps=$4; shift 4
  local cmd=(python3 -m msa_train.cli)
  [ "$procs" = 2 ] && cmd=("${RUN2[@]}" -m msa_train.cli)
  timeout "${POINT_TIMEOUT:-280}" "${cmd[@]}" recipe=llama3_8b_64k attention=fmsa model.hf_config.num_hidden_layers=4 \
    train.seq_len="$len" train.steps="$steps" train.warmup_steps=1 train.save_final=false train.save_hf=false \
    train.progress=false data=generated data.num_docs=$((steps * procs + 2)) data.min_doc_tokens=$((len / 2)) \
    data.max_doc_tokens="$len" train.output_dir="$OUT/$name" "$@" > "$OUT/$name.log" 2>&1
  echo "== $name rc=$?"
  python3 - "$OUT/$name" <<'PY'
import json, sys, pathlib
p = pathlib.Path(sys.argv[1]) / "metrics.jsonl"
rows = [json.loads(l) for l in p.read_text().splitlines() if l.strip()] if p.exists() else []
for r in rows:
    print(f"  step {r['step']}: loss {r['loss']:.4f} tokens/s {r['tokens_per_s']:.0f} peak {r['peak_memory_gb']:.1f} GB")
timed = [r["tokens_per_s"] for r in rows if r["step"] > 1]
if timed:
    print(f"  mean tokens/s after step 1: {sum(timed) / len(timed):.0f}")
PY
  tail -3 "$OUT/$name.log" | grep -i -E "error|out of memory" || true
}

for stage in $stages; do
  case $stage in
    check)
      SP_DEVICE=cuda timeout 240 "${RUN2[@]}" tests/msa_train/sp_worker.py > "$OUT/sp_worker_cuda.log" 2>&1
      echo "== sp_worker (cuda) rc=$?" | tee -a "$OUT/sp_worker_cuda.log"
      grep -c " ok" "$OUT/sp_worker_cuda.log"; grep -E "MISMATCH|Error|uneven" "$OUT/sp_worker_cuda.log" | head -10 ;;
    tiny)
      for sp in 1 2; do
        cmd=(python3 -m msa_train.cli); [ "$sp" = 2 ] && cmd=("${RUN2[@]}" -m msa_train.cli)
        timeout 150 "${cmd[@]}" recipe=tiny attention=fmsa train.steps=30 parallel.sp_degree=$sp train.save_final=false \
          train.save_hf=false train.progress=false train.output_dir="$OUT/tiny_sp$sp" > "$OUT/tiny_sp$sp.log" 2>&1
        echo "== tiny sp=$sp rc=$?"; cp "$OUT/tiny_sp$sp/metrics.jsonl" "$OUT/tiny_sp${sp}_metrics.jsonl" 2>/dev/null
      done
      python3 - "$OUT" <<'PY'
import json, sys, pathlib
out = pathlib.Path(sys.argv[1])
a, b = ([json.loads(l) for l in (out / f"tiny_sp{s}_metrics.jsonl").read_text().splitlines() if l.strip()] for s in (1, 2))
for x, y in zip(a, b):
    if x["step"] in (1, 2, 5, 10, 20, 30):
        print(f"step {x['step']}: loss 1 GPU {x['loss']:.4f}  sp=2 {y['loss']:.4f}  (diff {y['loss'] - x['loss']:+.4f})")
PY
      ;;
    onegpu)
      C=(recipe=tiny attention=fmsa train.steps=30 train.save_final=false train.save_hf=false train.progress=false
         parallel.backend=gloo)
      timeout 150 python3 -m msa_train.cli "${C[@]}" train.output_dir="$OUT/onegpu_1" > "$OUT/onegpu_1.log" 2>&1
      echo "1 process rc=$?"
      timeout 200 "${RUN2[@]}" --no-python bash -c 'LOCAL_RANK=0 exec python3 -m msa_train.cli "$@"' _ "${C[@]}" \
        parallel.sp_degree=2 train.output_dir="$OUT/onegpu_sp2" > "$OUT/onegpu_sp2.log" 2>&1
      echo "2 processes sp=2 rc=$?"
      python3 - "$OUT" <<'PY'
import json, sys, pathlib
out = pathlib.Path(sys.argv[1])
a, b = ([json.loads(l) for l in (out / n / "metrics.jsonl").read_text().splitlines() if l.strip()] for n in ("onegpu_1", "onegpu_sp2"))
for x, y in zip(a, b):
    if x["step"] in (1, 2, 5, 10, 20, 30):
        print(f"step {x['step']}: loss 1 process {x['loss']:.4f}  2 processes sp=2 {y['loss']:.4f}  diff {y['loss'] - x['loss']:+.4f}; "
              f"grad norm {x['grad_norm']:.4f} / {y['grad_norm']:.4f}")
PY
      ;;
    dpo_onegpu)
      python3 - "$OUT/pairs.jsonl" <<'PY'
import json, random, sys
rng = random.Random(0)
words = "the court held that a party may not rely on a clause it did not disclose before the hearing".split()
with open(sys.argv[1], "w") as f:
    for i in range(96):  # prompts of about 1,000-2,000 characters: every pair crosses the ranks' halves
        doc = " ".join(rng.choice(words) for _ in range(rng.randint(150, 280)))
        f.write(json.dumps({"prompt": f"Document {i}: {doc}\nQuestion: what did the court hold? ",
                            "chosen": "That an undisclosed clause cannot be relied on.",
                            "rejected": "That the hearing was postponed."}) + "\n")
PY
      C=(attention=fmsa data=preference data.path="$OUT/pairs.jsonl" train.seq_len=4096 train.steps=12 train.lr=1e-4
         train.warmup_steps=2 data.eval_fraction=0.125 eval.at_start=true train.save_final=false train.save_hf=false
         train.progress=false parallel.backend=gloo)
      timeout 200 python3 -m msa_train.cli "${C[@]}" train.output_dir="$OUT/dpo_1" > "$OUT/dpo_1.log" 2>&1
      echo "DPO 1 process rc=$?"
      timeout 240 "${RUN2[@]}" --no-python bash -c 'LOCAL_RANK=0 exec python3 -m msa_train.cli "$@"' _ "${C[@]}" \
        parallel.sp_degree=2 train.output_dir="$OUT/dpo_sp2" > "$OUT/dpo_sp2.log" 2>&1
      echo "DPO 2 processes sp=2 rc=$?"
      python3 - "$OUT" <<'PY'
import json, sys, pathlib
out = pathlib.Path(sys.argv[1])
a, b = ([json.loads(l) for l in (out / n / "metrics.jsonl").read_text().splitlines() if l.strip()] for n in ("dpo_1", "dpo_sp2"))
for x, y in zip(a, b):
    keys = ("loss", "reward_margin", "reward_accuracy", "grad_norm") if "loss" in x else ("eval_loss", "eval_reward_margin", "eval_reward_accuracy")
    print(f"{'step' if 'loss' in x else 'eval at step'} {x['step']}: " + "; ".join(
        f"{k} {x[k]:.5f} / {y[k]:.5f}" for k in keys) + "  (1 process / sp=2)")
PY
      ;;
    long)
      for len in ${SP_LENS:-131072}; do
        run_point "long_1gpu_$len" 1 "$len" "${SP_STEPS:-4}"
        run_point "long_sp2_$len" 2 "$len" "${SP_STEPS:-4}" parallel.sp_degree=2
      done
      for len in ${SP2_ONLY_LENS:-}; do
        run_point "long_sp2_$len" 2 "$len" "${SP_STEPS:-4}" parallel.sp_degree=2
      done ;;
  esac
done
