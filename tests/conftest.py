"""Shared fixtures.  Tests run in pytest-trio's trio mode (pyproject)."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

# Tiers: unit/ (in-process), contract/ (fake and real servers, worker processes, Ray),
# conformance/ (one backend contract over every backend), e2e/ (the CLI, real models,
# signals).  fixtures/ holds the importable helpers (fake servers, reward functions
# that worker processes import by name): on sys.path for every tier, and inherited by
# spawned worker processes.
sys.path.insert(0, str(Path(__file__).resolve().parent / "fixtures"))

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

torch.set_num_threads(1)

#: Where the ``hf`` backend tests put their tiny models (``TRIO_ROLLOUT_TEST_DEVICE``, default
#: ``cpu``; ``cuda`` on a GPU machine).  Passed explicitly with ``dtype="float32"``: the backend's
#: own default would move a test's float32 model to bfloat16 on CUDA wherever CUDA is available.
HF_TEST_DEVICE = os.environ.get("TRIO_ROLLOUT_TEST_DEVICE", "cpu")


#: opt-in tiers against real servers: marker -> what the flag runs.  Without the flag their
#: tests are skipped; with it they run and FAIL (never skip) when the server cannot be started.
OPT_IN_TIERS = {
    "vllm": "the tier against a real vLLM CPU server (its venv: $TRIO_ROLLOUT_VLLM_VENV, default .venv-vllm)",
    "router": "the tier against a real sglang-router (its venv: $TRIO_ROLLOUT_ROUTER_VENV, default .venv-router)",
}


def pytest_addoption(parser):
    for tier, what in OPT_IN_TIERS.items():
        parser.addoption(f"--{tier}", action="store_true", default=False,
                         help=f"run {what}: tests marked {tier}; they FAIL when that venv or its tools are missing")


def pytest_collection_modifyitems(config, items):
    for tier in OPT_IN_TIERS:
        if config.getoption(f"--{tier}"):
            continue
        skip = pytest.mark.skip(reason=f"opt-in tier: pass --{tier} to run {OPT_IN_TIERS[tier]}")
        for item in items:
            if item.get_closest_marker(tier) is not None:  # (not item.keywords: a parameter id "vllm" is one)
                item.add_marker(skip)


#: trainer tiers (tests/integrations/<trainer>/ -> the package it needs): each runs in its own
#: venv (``make test-integrations``).  In a venv without the trainer the tier is not collected
#: at all (its conftest.py would shadow this one for ``from conftest import ...``), and the
#: session says which tiers it left out and how to run them.
INTEGRATION_TIERS = {"areal": "areal", "verl": "verl", "openrlhf": "openrlhf", "torchrl": "torchrl"}
_TIERS_LEFT_OUT: set[str] = set()


def pytest_ignore_collect(collection_path, config):
    parts = collection_path.parts
    for i in range(len(parts) - 2):
        if parts[i] == "tests" and parts[i + 1] == "integrations" and parts[i + 2] in INTEGRATION_TIERS:
            tier = parts[i + 2]
            if importlib.util.find_spec(INTEGRATION_TIERS[tier]) is None:
                _TIERS_LEFT_OUT.add(tier)
                return True
            return None
    return None


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if _TIERS_LEFT_OUT:
        terminalreporter.write_line(
            f"trainer tiers not run in this venv: {', '.join(sorted(_TIERS_LEFT_OUT))} "
            "(each has its own venv: run them with `make test-integrations`)")


@pytest.fixture
def reward_pool():
    """Rewards computed in-process (:class:`engine.testing.InProcessRewardPool`)."""
    from engine.testing import InProcessRewardPool

    return InProcessRewardPool()


def run_cli(args, capsys):
    """Run ``rollout`` in-process: ``(exit code, stdout, stderr)``."""
    from engine.cli import main

    try:
        code = main(args)
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err
