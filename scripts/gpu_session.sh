#!/usr/bin/env bash
# One device call that checks and measures everything that needs the H200, stage by stage,
# each bounded in time, results under $OUT. Run from the repo root on the GPU machine with the
# wheels of scripts/gpu_wheels.sh carried in .whl/:
#   bash scripts/gpu_session.sh [stages...]     stages: tests tune tiny e2e report plancheck lora grpo longest finder phases fusedops nsa selected variants ncu probe quality
# The maintainers copy a stage's files to benchmarks/results/<benchmark>/latest.* (docs/performance.md
# lists which stage writes which benchmark). (e2e reads E2E_LENS, E2E_ATTN and E2E_TIMEOUT to run a subset; tests reads TESTS and TESTS_TIMEOUT;
# longest reads LONG_LENS, LONG_ATTN, LONG_OPTS, LONG_TAG, LONG_NPROC, LONG_TIMEOUT and LONG_POINT_TIMEOUT;
# phases reads PHASE_LEN, PHASE_SETS, PHASE_STEPS and PHASE_TIMEOUT; fusedops reads FUSED_TS, FUSED_MODELS and FUSED_TIMEOUT;
# on two GPUs: LONG_NPROC=2 LONG_LENS=2097152 LONG_OPTS="parallel.sp_degree=2 parallel.offload_activations=true ...")
set -uo pipefail
. "$(dirname "$0")/gpu_env.sh"  # $OUT, the carried wheels, PYTHONPATH
stages=${*:-tests tiny e2e nsa}
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/gpu.txt"

for stage in $stages; do
  case $stage in
    tests)  # the whole GPU kernel suite on CUDA (bf16 against fp32 references), every failure listed:
            # no -x, and a limit that fits it (276 tests took 219 s on the H200 with pyproject's -n auto)
      timeout "${TESTS_TIMEOUT:-560}" python3 -m pytest -q -p no:cacheprovider -rfEs ${TESTS:-tests/kernels} > "$OUT/gpu_tests_full.log" 2>&1
      echo "pytest rc=$?" >> "$OUT/gpu_tests_full.log"
      grep -E "^(E |FAILED|ERROR)" "$OUT/gpu_tests_full.log" | head -40; tail -25 "$OUT/gpu_tests_full.log" | tee "$OUT/gpu_tests.log" ;;
    tiny)   # the default recipe on the GPU with the Flash-MSA kernels
      timeout 90 python3 -m msa_train.cli recipe=tiny attention=fmsa train.output_dir="$OUT/tiny_fmsa" \
        train.save_hf=false train.progress=false 2>&1 | tail -15 | tee "$OUT/tiny_fmsa.log"
      cp "$OUT/tiny_fmsa/metrics.jsonl" "$OUT/tiny_fmsa_metrics.jsonl" 2>/dev/null
      cp "$OUT/tiny_fmsa/summary.json" "$OUT/tiny_fmsa_summary.json" 2>/dev/null
      rm -rf "$OUT/tiny_fmsa" ;;
    e2e)    # end-to-end tokens/s, Llama3-8B layer shapes (4 layers), full vs nsa vs fmsa
      timeout "${E2E_TIMEOUT:-560}" python3 -m msa_train.bench --recipe llama3_8b_64k --attention "${E2E_ATTN:-full,nsa,fmsa}" \
        --seq-lens "${E2E_LENS:-65536,131072}" --steps 4 --timeout 240 --out "$OUT/e2e_llama3_8b_4layers_h200" \
        -- model.hf_config.num_hidden_layers=4 2>&1 | tail -15 | tee "$OUT/e2e.log" ;;
    report) # the full-depth end-to-end report (python -m msa_train.bench report), in pieces: points accumulate
            # in /tmp/e2e_report while the machine stays warm; each call starts points for REPORT_MINUTES and packs
            # latest.{json,md,png} and points.jsonl into $OUT/e2e_report.tgz (REPORT_MODELS, REPORT_LENS, REPORT_DEPTHS,
            # REPORT_OPTIONS, REPORT_ARMS, REPORT_STEPS and REPORT_WARMUP choose a part of the grid)
      mkdir -p /tmp/e2e_report
      # a fresh machine starts from the committed report's points (bench_report.seed_points: those that ran
      # on this GPU with the same steps and warmup; the report says which it took, or why none)
      [ -f /tmp/e2e_report/points.jsonl ] || cp benchmarks/results/e2e/latest.json /tmp/e2e_report/latest.json
      timeout 590 python3 -m msa_train.bench report --out /tmp/e2e_report --max-minutes "${REPORT_MINUTES:-7}" \
        --models "${REPORT_MODELS:-llama3_8b,qwen3_14b,qwen25_32b}" --seq-lens "${REPORT_LENS:-65536,131072,262144}" \
        --options "${REPORT_OPTIONS:-same,fastest}" --arms "${REPORT_ARMS:-full,nsa,fmsa}" --steps "${REPORT_STEPS:-4}" --warmup "${REPORT_WARMUP:-1}" \
        ${REPORT_DEPTHS:+--depths $REPORT_DEPTHS} 2>&1 | tail -20 | tee "$OUT/e2e_report.log"
      (cd /tmp/e2e_report && tar czf "$OUT/e2e_report.tgz" --ignore-failed-read latest.json latest.md latest.png points.jsonl) ;;
    plancheck)  # the memory planner against measured peaks (python -m msa_train.bench plan-check)
      timeout "${PLANCHECK_TIMEOUT:-560}" python3 -m msa_train.bench plan-check --out "$OUT/plan_check" 2>&1 | tail -20 \
        | tee "$OUT/plan_check.log" ;;
    lora)   # LoRA (r=16) fine-tuning throughput and peak memory, Llama3-8B at full depth on one GPU, full vs fmsa
            # (LORA_OPTS: more overrides, e.g. parallel.tile_tokens=32768 at 128K; LORA_TAG names the output)
      timeout "${LORA_TIMEOUT:-420}" python3 -m msa_train.bench --recipe llama3_8b_64k --attention "${LORA_ATTN:-full,fmsa}" \
        --seq-lens "${LORA_LENS:-65536}" --steps 3 --warmup 1 --timeout "${LORA_POINT_TIMEOUT:-200}" \
        --out "$OUT/lora_llama3_8b${LORA_TAG:-}" -- model.lora.r=16 model.lora.alpha=32 ${LORA_OPTS:-} 2>&1 | tail -15 \
        | tee "$OUT/lora${LORA_TAG:-}.log" ;;
    grpo)   # GRPO (msa_train/grpo.py) on Llama3-8B at full depth with LoRA (r=16), GRPO_LEN-token pass-key prompts,
            # 8 completions each, full vs fmsa: generation tokens/s, step time and reward per step (random
            # weights: the reward stays near 0, the timings are what this measures). GRPO_OPTS: more overrides,
            # by default tiled MLPs from 16K prompts up (the planner: 85.9 GiB of 80 at 16K without them)
      grpo_opts=${GRPO_OPTS-$([ "${GRPO_LEN:-16384}" -ge 16384 ] && echo parallel.tile_tokens=32768)}
      for attn in ${GRPO_ATTN:-full fmsa}; do
        timeout "${GRPO_TIMEOUT:-270}" python3 -m msa_train.cli recipe=llama3_8b_64k data=retrieval attention=$attn \
          model.lora.r=16 model.lora.alpha=32 train.seq_len="${GRPO_LEN:-16384}" train.grad_accum=1 train.grpo_group=8 \
          train.grpo_max_new_tokens=32 train.grpo_reward=chars train.steps="${GRPO_STEPS:-6}" train.save_final=false \
          train.save_hf=false train.progress=false data.num_prompts=64 data.num_docs=32 data.min_doc_tokens=8192 \
          data.max_doc_tokens=65536 train.output_dir="$OUT/grpo_llama3_8b_lora_$attn" $grpo_opts 2>&1 | grep -v "^$" | tail -6
        cp "$OUT/grpo_llama3_8b_lora_$attn/metrics.jsonl" "$OUT/grpo_${attn}_metrics.jsonl" 2>/dev/null
        rm -rf "$OUT/grpo_llama3_8b_lora_$attn"
      done 2>&1 | tee "$OUT/grpo.log" ;;
    longest)  # the longest sequences that train: Llama3-8B layer shapes (4 layers), 2 steps per point,
              # with the memory options (host-held layer inputs, tiled MLPs and norms, host optimizer state)
      timeout "${LONG_TIMEOUT:-560}" python3 -m msa_train.bench --recipe llama3_8b_64k --attention "${LONG_ATTN:-fmsa}" \
        --seq-lens "${LONG_LENS:-524288,1048576}" --steps 2 --warmup 1 --timeout "${LONG_POINT_TIMEOUT:-400}" --nproc "${LONG_NPROC:-1}" \
        --out "$OUT/long_llama3_8b_4layers_h200${LONG_TAG:-}" -- model.hf_config.num_hidden_layers=4 \
        ${LONG_OPTS-parallel.offload_activations=true parallel.tile_tokens=32768 parallel.offload_optimizer=true} \
        2>&1 | tail -20 | tee "$OUT/longest${LONG_TAG:-}.log" ;;
    finder)   # the longest-sequence finder (python -m msa_train.bench longest) at Llama3-8B's full depth, full
              # fine-tuning with 80% of the optimizer state on the host (all of it does not fit a 125 GiB host),
              # one attention a call (a trial at full depth takes minutes): FIND_ATTN, FIND_OPTS (e.g. LoRA:
              # "model.lora.r=16 model.lora.alpha=32 parallel.tile_tokens=32768"), FIND_TIMEOUT, FIND_POINT_TIMEOUT
      timeout "${FIND_TIMEOUT:-580}" python3 -m msa_train.bench longest --recipe llama3_8b_64k --attention "${FIND_ATTN:-fmsa}" \
        --steps 2 --timeout "${FIND_POINT_TIMEOUT:-300}" --out "$OUT/finder_${FIND_ATTN:-fmsa}" -- \
        ${FIND_OPTS-parallel=zero3 parallel.offload_optimizer=true parallel.optimizer=deepspeed parallel.offload_ratio=0.8 parallel.tile_tokens=32768} \
        2>&1 | tail -20 | tee "$OUT/finder_${FIND_ATTN:-fmsa}.log" ;;
    phases)  # where a long step's time goes (train.phase_times): Llama3-8B layer shapes (4 layers) at
             # PHASE_LEN tokens, one point per memory-option set NAME:ATTENTION:OVERRIDES (space-separated)
      opts="parallel.offload_activations=true parallel.tile_tokens=32768"
      sets=${PHASE_SETS:-"plain:fmsa: tile:fmsa:parallel.tile_tokens=32768 act_tile:fmsa,full:$opts
        all:fmsa:$opts parallel.offload_optimizer=true all_cpu_adam:fmsa:$opts parallel.offload_optimizer=true parallel.optimizer=deepspeed"}
      start=$SECONDS
      while IFS=: read -r name attn overrides; do
        [ -z "$name" ] && continue
        left=$(( ${PHASE_TIMEOUT:-560} - (SECONDS - start) ))
        [ "$left" -lt 60 ] && { echo "phases: $name not run (time)"; continue; }
        timeout "$left" python3 -m msa_train.bench --recipe llama3_8b_64k --attention "$attn" --seq-lens "${PHASE_LEN:-262144}" \
          --steps "${PHASE_STEPS:-2}" --warmup 1 --timeout "$left" --out "$OUT/phases_llama3_8b_4layers_h200_$name" \
          -- model.hf_config.num_hidden_layers=4 train.phase_times=true $overrides < /dev/null 2>&1 | grep -v "^$" | tail -12
      done < <(echo $sets | sed -E 's/ ([a-z0-9_]+:[a-z,]+:)/\n\1/g') 2>&1 | tee "$OUT/phases.log" ;;
    fusedops)  # our RMSNorm, RoPE, SiLU*up and fused linear CE against HF and liger-kernel, checked and timed side by side
      timeout "${FUSED_TIMEOUT:-240}" python3 scripts/bench_fused_ops.py --out "$OUT" --Ts "${FUSED_TS:-65536,262144}" \
        --models "${FUSED_MODELS:-llama3_8b,qwen3_14b}" 2>&1 | tee "$OUT/fused_ops_rows.log" | grep -v '^{' | tail -30 \
        | tee "$OUT/fused_ops.log" ;;  # the rows (JSON lines) as they come, in case the timeout ends it
    nsa)    # whole NSA op vs cuDNN dense (dense rows reused from the committed sweep: phi does not change them)
      timeout 300 python3 scripts/bench_nsa.py --out "$OUT" --Ts 8192,32768,65536,131072,262144,524288 \
        --models llama3_8b,qwen3_14b --qwen-Ts 65536,262144 \
        --dense-from benchmarks/results/nsa/dense.json --budget-s 240 2>&1 | tail -30 | tee "$OUT/nsa.log" ;;
    tune)   # launch-setting sweep of range attention (cmp, window) and top-n (benchmarks/results/tune/latest.md)
      timeout 330 python3 scripts/tune_nsa.py --out "$OUT" --Ts 65536,262144 --models llama3_8b > "$OUT/tune.log" 2>&1
      mkdir -p "$OUT/qwen"
      timeout 90 python3 scripts/tune_nsa.py --out "$OUT/qwen" --Ts 65536 --models qwen3_14b --ops topk >> "$OUT/tune.log" 2>&1 ;;
    variants)  # kernel variants side by side at 64K: fmsa launch settings (flash_msa.tuning overrides of
               # fmsa's LAUNCH table), then the top-n kernel's launch settings and sort networks (Llama3-8B, then Qwen3-14B)
      timeout 240 python3 scripts/bench_selected.py --out "$OUT/variants" --variants "65536,4;65536,5" --no-fla 2>&1 | tee "$OUT/selected_variants.log"
      mkdir -p "$OUT/topk" "$OUT/topk_qwen"
      timeout 150 python3 scripts/tune_nsa.py --out "$OUT/topk" --Ts 65536,262144 --models llama3_8b --ops topk > "$OUT/topk.log" 2>&1
      timeout 60 python3 scripts/tune_nsa.py --out "$OUT/topk_qwen" --Ts 65536 --models qwen3_14b --ops topk >> "$OUT/topk.log" 2>&1
      tail -40 "$OUT/topk.log" ;;
    selected)  # G=4, 5 (the targets) and 16 (with fla-core) at 64K; then fmsa vs qc (query-centric) forward at 1M tokens, G=4
      timeout 240 python3 scripts/bench_selected.py --out "$OUT" --Ts 65536 --Gs 4,5,16 --check-T 4096 2>&1 | tail -20 | tee "$OUT/selected.log"
      mkdir -p "$OUT/sel1m"
      timeout 120 python3 scripts/bench_selected.py --out "$OUT/sel1m" --Ts 1048576 --Gs 4 --check-T 2048 \
        --skip-bwd-over 524288 --no-fla --warmup 2 --rep 10 2>&1 | tail -8 | tee -a "$OUT/selected.log" ;;
    probe)  # the retrieval probe (msa_train/quality/probe.py) on the GPU, dense and NSA side by side, each arm
            # its own process: does NSA learn to copy and retrieve as dense does where a needle lies beyond its
            # window and local blocks? PROBE_ARMS: "attention:seed[:nsa-sizes]" ... (at most 6: each arm's JSON
            # lines are a file of $OUT, written as they come, so a call cut short keeps them); PROBE_ARGS: the
            # probe's other arguments; PROBE_TIMEOUT. The arms' stderr and the corpus log: $OUT/probe_logs.tgz
      P=/tmp/probe; mkdir -p "$P/logs"; start=$SECONDS
      [ -f "$P/corpus/manifest.json" ] || TOKENIZERS_PARALLELISM=true python3 -m msa_train.quality corpus --out "$P/corpus" --max-tokens 3000000 \
        --vocab 2048 > "$P/logs/corpus.log" 2>&1
      left=$(( ${PROBE_TIMEOUT:-560} - (SECONDS - start) ))
      for arm in ${PROBE_ARMS:-full:0 full:1 full:2 fmsa:0 fmsa:1 fmsa:2}; do
        IFS=: read -r att seed sizes <<< "$arm"
        name=probe_${att}_s${seed}${sizes:+_${sizes//,/-}}
        timeout "$left" python3 -u -m msa_train.quality probe --corpus "$P/corpus" --device cuda --threads 2 \
          --attention "$att" --seed "$seed" ${sizes:+--nsa-sizes $sizes} \
          ${PROBE_ARGS:---copy-fraction 0.5 --lengths 256,512 --eval-lengths 256,512 --steps 3000 --eval-every 250} \
          > "$OUT/$name.jsonl" 2> "$P/logs/$name.err" < /dev/null &
      done
      wait
      for f in "$OUT"/probe_*.jsonl; do echo "$(basename "$f"): $(tail -1 "$f")"; done
      tail -n 3 "$P"/logs/*.err | grep -v "^$" | tail -20
      (cd "$P/logs" && tar czf "$OUT/probe_logs.tgz" ./*) ;;
    quality)  # the quality study (docs/quality.md) as a background job that outlives this call (the machine
              # keeps its disk while warm): the first call builds the corpus and starts `python -m
              # msa_train.quality all` (QUALITY_BUDGET s, QUALITY_STEPS steps, QUALITY_MIX, QUALITY_ARGS: its
              # other arguments, by default --retrieval-phase 3000); a call after the job stopped at its budget (exit 3)
              # starts it again for another QUALITY_BUDGET s, from its checkpoints; every call then waits up to
              # QUALITY_WAIT s and packs what exists (summary, plots, each run's metrics, the logs) into $OUT/quality.tgz
      W=/tmp/quality; mkdir -p "$W"
      export TOKENIZERS_PARALLELISM=true  # gpu_env.sh turns it off; the corpus and the data tokenize on every core
      study="python3 -m msa_train.quality all --work $W --out $W/results --budget-s ${QUALITY_BUDGET:-1560} \
             ${QUALITY_STEPS:+--steps $QUALITY_STEPS} ${QUALITY_MIX:+--mix-fraction $QUALITY_MIX} ${QUALITY_ARGS---retrieval-phase 3000}"
      if [ ! -f "$W/started" ]; then
        touch "$W/started"; nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > "$W/gpu.txt"
        setsid nohup bash -c "python3 -m msa_train.quality corpus --out $W/corpus --max-tokens ${QUALITY_TOKENS:-23000000} \
            --vocab 16384 && $study; echo \$? > $W/rc" > "$W/log" 2>&1 < /dev/null &
      elif [ "$(cat "$W/rc" 2>/dev/null)" = 3 ]; then
        rm "$W/rc"; setsid nohup bash -c "$study; echo \$? > $W/rc" >> "$W/log" 2>&1 < /dev/null &
      fi
      end=$((SECONDS + ${QUALITY_WAIT:-540}))
      while [ ! -f "$W/rc" ] && [ $SECONDS -lt $end ]; do sleep 5; done
      [ -f "$W/rc" ] && echo "quality: finished, rc=$(cat "$W/rc")" || echo "quality: still running"
      (cd "$W" && tar czf "$OUT/quality.tgz" --ignore-failed-read gpu.txt log rc state.json results data/mix.json data/retrieval_phase.json \
         corpus/manifest.json runs/*/metrics.jsonl runs/*/summary.json runs/*/nsa_distill.json runs/*/config.yaml 2>/dev/null)
      grep -v "^\s*$" "$W/log" | tail -40 ;;
    ncu)    # where the time goes at 64K (Llama3-8B shape): torch.profiler table, then Nsight Compute
            # sections of one launch of each main kernel (NAME:launches to skip:launches to profile)
      mkdir -p "$OUT/ncu_work"
      timeout 120 python3 scripts/profile_nsa.py --T 65536 --table 2>&1 | tail -40 | tee "$OUT/ncu_table.log"
      for spec in fmsa_fwd_kernel:40:1 fmsa_merge_kernel:40:1 fmsa_bwd_dkdv_kernel:40:1 fmsa_bwd_dq_kernel:40:1 \
                  select_blocks_kernel:2:1 range_attn_fwd_kernel:4:1 range_attn_bwd_dq_kernel:4:2 range_attn_bwd_dkdv_kernel:4:2; do
        IFS=: read -r name skip count <<< "$spec"
        timeout 150 ncu --clock-control none -k "regex:^${name}\$" --launch-skip "$skip" --launch-count "$count" \
          --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
          --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis --section InstructionStats \
          python3 scripts/profile_nsa.py --T 65536 --iters 3 > "$OUT/ncu_work/$name.txt" 2>&1
        echo "== $name rc=$?"; grep -E "Duration|DRAM Throughput|Memory Throughput|Compute \(SM\) Throughput|Registers Per|Achieved Occupancy|Theoretical Occupancy|Local Memory Spilling" "$OUT/ncu_work/$name.txt" | head -16
      done 2>&1 | tee "$OUT/ncu_summary.log"
      tar czf "$OUT/ncu_reports.tgz" -C "$OUT" ncu_work && rm -rf "$OUT/ncu_work" ;;
  esac
done
ls -la "$OUT"
