#!/usr/bin/env bash
# tests/integrations/areal/venv.sh VENV_DIR     (default: .venv-areal)
#
# Idempotent.  Builds the CPU virtualenv of the AReaL tier (tests/integrations/areal): AReaL 1.0.4
# with the part of its dependency set its executor, workflows, OpenAI client and trainer modules
# import, plus this project (editable, --no-deps) and the dependencies of ours AReaL's pins allow.
#
# AReaL's declared set is not installed: it is ~80 top-level packages (ray[default], litellm[proxy],
# openhands, wandb, swanlab, ...) and pins torch<2.11.  areal goes in with --no-deps, then only
# what its import chain needs (found by trial: import, read the ImportError, add).  torch is pinned
# to 2.13.0 and must be the CPU build: by default it comes from the local wheel folder pip is
# configured with (find-links), never from an index, so pip cannot pull a multi-GB CUDA build.
# Elsewhere point pip at a CPU wheel: TORCH_PIP_ARGS="--index-url https://download.pytorch.org/whl/cpu".
#
# Env: PYTHON (default python3; 3.11 or 3.12), TORCH_PIP_ARGS (default --no-index).
set -euo pipefail

VENV="${1:-.venv-areal}"
PY="${PYTHON:-python3}"
AREAL_VERSION=1.0.4
TORCH_VERSION=2.13.0
TORCH_PIP_ARGS="${TORCH_PIP_ARGS:---no-index}"
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)"

# What AReaL 1.0.4's import chain needs (areal/__init__ pulls in areal.infra: ray, openai, numba, ...),
# its OpenAI-agents workflows (openai-agents) and its trainer (areal.trainer: peft for the FSDP
# engine; wandb, swanlab, trackio, tensorboardX imported by its stats logger, all left disabled)
AREAL_PKGS=(aiohttp httpx requests colorlog tenacity flask torchdata numpy lark uvloop pyyaml hydra-core
            omegaconf transformers tokenizers ray numba pillow orjson einops aiofiles openai pydantic
            datasets math-verify psutil pybase64 msgspec regex tabulate fastapi uvicorn pyzmq zstandard
            openai-agents peft wandb swanlab trackio tensorboardX)
# Ours (pyproject dependencies) that AReaL's pins allow, and the test runner.
OUR_PKGS=(trio trio-parallel tensordict cloudpickle rich accelerate gguf safetensors
          pytest pytest-trio hypothesis)

check() {
  "$VENV/bin/python" - <<'PYEOF'
import importlib.metadata as md
assert md.version("areal") == "1.0.4", md.version("areal")
import torch
assert torch.__version__.startswith("2.13.0") and torch.version.cuda is None, torch.__version__
import areal.infra.workflow_executor, areal.infra.remote_inf_engine  # noqa: E401
import areal.workflow.rlvr, areal.workflow.multi_turn, areal.api.reward_api, areal.api.cli_args  # noqa: E401
import areal.experimental.openai, areal.workflow.openai.math_agent  # noqa: E401  (the agents)
import areal.trainer.rl_trainer, areal.engine.fsdp_engine  # noqa: E401  (PPOTrainer, its FSDP actor)
import torchdata.stateful_dataloader  # noqa: F401
import engine.integrations.areal  # noqa: F401  (this project, editable)
PYEOF
}

if [ -f "$VENV/.installed" ] && check >/dev/null 2>&1; then
  echo "areal venv: $VENV already set up (areal $AREAL_VERSION, torch $TORCH_VERSION CPU)"
  exit 0
fi

"$PY" -c 'import sys; v = sys.version_info[:2]; assert (3, 11) <= v < (3, 13), "AReaL 1.0.4 needs Python 3.11/3.12, got %s.%s" % v'
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
rm -f "$VENV/.installed"
pipq() {  # pip, minus the expected noise (areal's unmet pins are expected: it goes in --no-deps)
  "$VENV/bin/python" -m pip --disable-pip-version-check "$@" \
    2> >(grep -v -E "is ignored: it is neither a file nor a directory|dependency resolver|areal 1\.0\.4 requires|^$" >&2)
}

CONS="$(mktemp /tmp/areal-venv-constraints.XXXXXX)"
trap 'rm -f "$CONS"' EXIT
# Versions as tested (transformers, hydra-core, omegaconf, math-verify inside AReaL's own pins).
cat > "$CONS" <<CONSEOF
torch==$TORCH_VERSION
transformers==5.3.0
tokenizers==0.22.2
huggingface_hub==1.33.0
hydra-core==1.4.0.dev1
omegaconf==2.4.0.dev2
math-verify==0.8.0
aiohttp==3.14.5
httpx==0.28.1
requests==2.34.2
colorlog==6.12.0
tenacity==9.2.1
flask==3.1.3
torchdata==0.11.0
numpy==2.4.6
lark==1.3.1
uvloop==0.23.0
pyyaml==6.0.4
ray==2.60.0
numba==0.68.1
llvmlite==0.50.0
pillow==12.3.0
rich==13.9.4
openai-agents==0.24.0
peft==0.18.1
wandb==0.31.0
swanlab==0.6.12
trackio==0.43.0
tensorboardX==2.6.5
zstandard==0.25.0
datasets==5.2.0
orjson==3.13.0
einops==0.8.2
aiofiles==25.1.0
openai==3.57.0
CONSEOF

t0=$(date +%s)
# 1) torch from the local wheel only (no index: no CUDA build can be chosen), then its small deps
# shellcheck disable=SC2086
pipq install -q --no-deps $TORCH_PIP_ARGS "torch==$TORCH_VERSION" || {
  echo "areal venv: could not install a CPU torch==$TORCH_VERSION with TORCH_PIP_ARGS='$TORCH_PIP_ARGS';" \
       "set TORCH_PIP_ARGS to a CPU wheel index (never let pip pull the CUDA build)" >&2
  exit 1
}
pipq install -q -c "$CONS" "torch==$TORCH_VERSION"
"$VENV/bin/python" -W ignore -c "import torch; assert torch.version.cuda is None, 'refusing: CUDA torch build'"
# 2) areal without its dependency set, then what its import chain needs, then ours
pipq install -q --no-deps "areal==$AREAL_VERSION"
pipq install -q -c "$CONS" "${AREAL_PKGS[@]}" "${OUR_PKGS[@]}"
# 3) this project, editable, without its dependency set (transformers stays at AReaL's 5.3.0)
pipq install -q --no-deps -e "$REPO"
check
echo "areal venv: ready in $VENV ($(( $(date +%s) - t0 )) s, $(du -sh "$VENV" | cut -f1))"
touch "$VENV/.installed"
