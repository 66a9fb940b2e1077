#!/usr/bin/env bash
# Build the torchrl tier's venv:  bash tests/integrations/torchrl/venv.sh VENV_DIR
#
# torchrl 0.14.1 pins tensordict<0.15 (our .venv has 0.15.x), so the tier has its own venv:
# torch 2.13.0 first (the CPU build on local disk; any other torch pulls multi-GB CUDA wheels),
# then torchrl and tensordict pinned, with this project (editable) and its test extras resolved
# in the same step so that pip keeps tensordict at 0.14.3.  Idempotent: a VENV_DIR/.installed
# newer than pyproject.toml and this script means done; otherwise pip brings the venv up to date.
# Needs only PyPI (no ../shared).
set -euo pipefail
VENV_DIR="${1:?usage: venv.sh VENV_DIR}"
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)"
PYTHON="${PYTHON:-python3}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"

if [[ "$VENV_DIR/.installed" -nt "$REPO/pyproject.toml" && "$VENV_DIR/.installed" -nt "${BASH_SOURCE[0]}" ]]; then
    exit 0
fi
[[ -x "$VENV_DIR/bin/python" ]] || "$PYTHON" -m venv "$VENV_DIR"
PIP=("$VENV_DIR/bin/python" -m pip install -q)
"${PIP[@]}" "$TORCH_SPEC"
"${PIP[@]}" "torchrl==0.14.1" "tensordict==0.14.3" -e "$REPO[test]"
# the pins must have held (a later resolve could have moved tensordict)
"$VENV_DIR/bin/python" - <<'PY'
import importlib.metadata as md
got = {p: md.version(p) for p in ("torchrl", "tensordict")}
assert got == {"torchrl": "0.14.1", "tensordict": "0.14.3"}, got
PY
touch "$VENV_DIR/.installed"
