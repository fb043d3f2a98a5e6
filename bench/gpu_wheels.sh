#!/usr/bin/env bash
# Wheels the GPU machine lacks for bench/gpu_suite.py, downloaded HERE (the GPU machine has no
# package registry) into .whl/ at the repository root (ignored by .gitignore), which a `run` call carries.
#
#   bash bench/gpu_wheels.sh            # then: ls -la .whl (about 3 MB)
#
# The GPU image (/work/.library/device/KINDS.md) runs Python 3.12 and already holds torch 2.11,
# einops, pyyaml, pillow, tokenizers, matplotlib, numpy, pytest, psutil, py-cpuinfo, msgpack,
# ninja, packaging, tqdm, typing-extensions. Missing: DeepSpeed (the MoE anchor of
# bench/moe_layer) and its pure-Python needs hjson and pydantic (+ pydantic-core, annotated-types,
# typing-inspection). wandb is not carried: m6 imports it only when logging.wandb is on.
# DeepSpeed publishes only a source archive, so it is built into a pure-Python wheel here with no
# compiled ops (DS_BUILD_OPS=0); bench/moe_layer uses only deepspeed.moe, which needs none.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
PY=${PYTHON:-python3}
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl hjson==3.1.0 pydantic==2.14.3 pydantic-core==2.50.4 annotated-types==0.8.0 typing-inspection==0.4.5
ls .whl/deepspeed-*.whl >/dev/null 2>&1 || \
    DS_BUILD_OPS=0 "$PY" -m pip wheel -q --no-deps --no-build-isolation -w .whl deepspeed==0.19.8
ls -la .whl
du -sh .whl
