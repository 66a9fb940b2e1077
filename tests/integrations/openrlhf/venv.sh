#!/usr/bin/env bash
# The OpenRLHF tier's venv: bash tests/integrations/openrlhf/venv.sh VENV_DIR  (idempotent).
#
# OpenRLHF 0.11.2 declares deepspeed, flash-attn, vllm, ray[default]==2.55.0, transformers==5.15.0
# and ~25 more.  The tier imports only OpenRLHF's rollout side, so it installs openrlhf with
# --no-deps plus what those modules import:
#   openrlhf.utils.agent (the executors)       -> aiohttp; via openrlhf.utils: sympy, pylatexenc, transformers
#   openrlhf.trainer.ppo_utils.samples_generator -> ray, tqdm (and vllm.SamplingParams: the tier gives it a
#                                                   stand-in module, vllm needs CUDA; see _vllm_stand_in.py)
# pinned to OpenRLHF's own pins (transformers==5.15.0, ray==2.55.0), then our project with its
# dependencies under the same pins.  Not installed: deepspeed, flash-attn, vllm (GPU only; the
# trainer's models, loss and weight broadcast import them).
set -euo pipefail
VENV="${1:?usage: venv.sh VENV_DIR}"
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)"
PYTHON="${PYTHON:-python3}"
if [ -f "$VENV/.installed" ]; then exit 0; fi
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install -q)
PINS="$(mktemp)"; trap 'rm -f "$PINS"' EXIT
printf '%s\n' "transformers==5.15.0" "ray==2.55.0" > "$PINS"
"${PIP[@]}" "torch==2.13.0"
"${PIP[@]}" --no-deps "openrlhf==0.11.2"
"${PIP[@]}" -c "$PINS" "transformers==5.15.0" "ray==2.55.0" aiohttp sympy pylatexenc tqdm
"${PIP[@]}" -c "$PINS" -e "$REPO[test]"
touch "$VENV/.installed"
