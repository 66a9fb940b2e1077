#!/usr/bin/env bash
# One device call (carry [".whl"], no model weights): install the wheels the machine lacks into
# /tmp/gpuc/site (as gpu_check.sh does), then benchmarks/gpu_profile.py on CUDA, bfloat16, 32 rows x 64
# new tokens, SmolLM2-135M's architecture with random weights.  Output: $OUT/gpu_profile.json and
# $OUT/gpu_profile.log.  GPUP_BUDGET_S (default 150): the script starts no case after that; GPUP_TIMEOUT_S (default
# 170): the python run is killed then (JSON rewritten after each case: what was measured comes back).
# Device call: `bash benchmarks/gpu_profile.sh`, carry [".whl"], timeout_s 200.
# Here (smoke test): GPUP_PY=.venv/bin/python GPUP_DEVICE=cpu GPUP_NO_PIP=1 \
#     GPUP_ARGS="--layers 2 --hidden 72 --vocab 1024 --batch 4 --new 8" bash benchmarks/gpu_profile.sh
set -u
OUT=${OUT:-$PWD/gpu-profile-out}
SITE=${GPUC_DIR:-/tmp/gpuc}/site
mkdir -p "$OUT"
{
    grep -m1 "model name" /proc/cpuinfo; echo "cpus $(nproc)"
    nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw --format=csv,noheader 2>&1
} | tee "$OUT/gpu_profile.log"
PY=${GPUP_PY:-python3}
if [ -z "${GPUP_NO_PIP:-}" ] && [ ! -d "$SITE/transformers" ]; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl \
        || { echo "pip install failed"; exit 1; }
fi
export PYTHONPATH=$SITE:$PWD HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/inductor
PLAN=eager:raw_generate,eager:static_direct,profile,eager:continuous_engine,onebyone:continuous_engine,compiled:raw_generate,eager:continuous_direct_streaming,compiled:static_direct,eager:static_engine
# shellcheck disable=SC2086  # GPUP_ARGS: several words
timeout -k 5 "${GPUP_TIMEOUT_S:-170}" "$PY" -m benchmarks.gpu_profile --device "${GPUP_DEVICE:-cuda}" --dtype bfloat16 --batch 32 --new 64 --repeats 1 \
    --plan "$PLAN" ${GPUP_ARGS:-} \
    --budget-s "${GPUP_BUDGET_S:-150}" --min-left-s 15 --out "$OUT/gpu_profile.json" 2>&1 \
    | grep -v -i "warn" | tee -a "$OUT/gpu_profile.log"
exit "${PIPESTATUS[0]}"
