#!/usr/bin/env bash
# Wheels the H200 image lacks, downloaded here into .whl/ (gitignored) and carried to the
# device with `carry: [".whl"]`. The image already has torch, triton, transformers,
# accelerate, safetensors, pyarrow, fsspec, huggingface-hub, rich, pytest, matplotlib; pytest-xdist
# (the suite runs with -n auto, pyproject.toml) is not.
# On the device:  pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PYTHONPATH
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
PY=(--python-version 3.12 --implementation cp --only-binary=:all: --no-deps -d .whl
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
    --platform manylinux_2_5_x86_64 --platform any)
# pure-python or manylinux wheels
WHEELS=(
  hydra-core==1.3.8 omegaconf==2.3.1
  datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 xxhash==4.1.0
  wandb==0.31.0 opentelemetry-api==1.45.2 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
  sentry-sdk==2.75.0 gitpython==3.2.1 gitdb==4.0.12 smmap==5.0.3 platformdirs==4.14.8
  hjson==3.1.0 fla-core==0.6.0 liger-kernel==0.8.5 peft==0.21.2
  pytest-xdist==3.8.0 execnet==2.1.2
)
python3 -m pip download -q "${PY[@]}" "${WHEELS[@]}"
# sdists turned into wheels here (pure python)
python3 -m pip wheel -q --no-deps -w .whl deepspeed==0.19.8 antlr4-python3-runtime==4.9.3
ls -la .whl
du -sh .whl
