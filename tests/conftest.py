"""Shared fixtures.  Tests run in pytest-trio's trio mode (pyproject)."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

torch.set_num_threads(1)


def pytest_addoption(parser):
    parser.addoption("--vllm", action="store_true", default=False,
                     help="run the opt-in tier against a real vLLM CPU server (tests marked vllm); its tests "
                          "FAIL when the vLLM venv or the tools are missing")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--vllm"):
        return
    skip = pytest.mark.skip(reason="opt-in tier: pass --vllm to run it against a real vLLM CPU server")
    for item in items:
        if "vllm" in item.keywords:
            item.add_marker(skip)


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
