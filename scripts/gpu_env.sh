# Sourced by the device scripts (gpu_session.sh, sp_gpu.sh), run from the repo root: $OUT, the
# wheels of scripts/gpu_wheels.sh carried in .whl/ installed into /tmp/site, and the environment.
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1 && [ ! -f /tmp/site/.installed ]; then  # once per machine
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && touch /tmp/site/.installed
fi
export PYTHONPATH=/tmp/site:$PWD/kernels:$PWD:${PYTHONPATH:-}
export PYTHONUNBUFFERED=1 WANDB_MODE=offline HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
