#!/usr/bin/env bash
# The verl tier's venv: bash tests/integrations/verl/venv.sh VENV_DIR   (idempotent)
#
# verl 0.9.1 exactly as its wheel pins it where the agent loop is concerned: tensordict
# 0.10.0 (verl: >=0.8,!=0.9.0,<=0.10.0; ours: >=0.10) and transformers 5.10.4 (verl:
# >=5.5.3,!=5.6.0,<5.11; ours: >=5.0), so no pin is overridden.  verl itself goes in with
# --no-deps: of its requirements only the ones its agent-loop import chain needs are
# installed (the rest, wandb/tensorboard/peft/pybind11 and ray's [default]
# extra, serve its trainer, dashboards and loggers, not verl.experimental.agent_loop).
set -euo pipefail
VENV=${1:?usage: venv.sh VENV_DIR}
REPO=$(cd "$(dirname "$0")/../../.." && pwd)
[ -f "$VENV/.installed" ] && exit 0
python3 -m venv "$VENV"
PIP="$VENV/bin/python -m pip"
$PIP install -q torch==2.13.0                    # first: the CPU build on local disk
$PIP install -q \
    "tensordict==0.10.0" "transformers==5.10.4" \
    "ray==2.60.0" hydra-core omegaconf "antlr4-python3-runtime==4.9.3" codetiming torchdata pylatexenc \
    orjson cachetools uvicorn fastapi opentelemetry-api datasets accelerate dill packaging "numpy>=2" \
    "pytest>=8" "pytest-trio>=0.8"
# ours, with the pins above kept (pip would otherwise upgrade tensordict/transformers)
$PIP install -q --no-deps -e "$REPO"
$PIP install -q "tensordict==0.10.0" "transformers==5.10.4" \
    "trio>=0.30" "trio-parallel>=1.3" "tokenizers>=0.20" "gguf>=0.10" "httpx>=0.27" "hypercorn>=0.17" \
    "starlette>=0.40" "math-verify>=0.7" "rich>=13" "cloudpickle>=2" pillow prometheus-client tomli-w "openai>=2"
$PIP install -q --no-deps verl==0.9.1            # last: nothing after it re-resolves around its left-out deps
# pip check may report only the four verl requirements left out on purpose (above); any
# version conflict fails the build
problems=$("$VENV/bin/python" -m pip check 2>&1 | grep -vE '^verl 0\.9\.1 requires (peft|pybind11|tensorboard|wandb), which is not installed\.$' || true)
if [ -n "$problems" ] && [ "$problems" != "No broken requirements found." ]; then
    echo "venv.sh: pip check found conflicts:" >&2; echo "$problems" >&2; exit 1
fi
touch "$VENV/.installed"
