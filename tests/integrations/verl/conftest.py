"""Fixtures of the verl tier (tests/integrations/verl, its venv: ``venv.sh``).

Nothing here imports verl at module level: in any other venv the tier's modules skip at
their ``importorskip`` line, and this file must still import.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest

try:  # verl's single_controller imports ray's old state API, and ray warns once, at that import
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Ray state API is no longer experimental", DeprecationWarning)
        import ray.experimental.state.api  # noqa: F401
except ImportError:  # not the verl venv: the tier's modules skip
    pass



@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> str:
    from engine.testing import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("verl") / "tiny")


@pytest.fixture(scope="session")
def tok(tiny):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny)


@pytest.fixture(scope="session")
def compose_config(tiny, tmp_path_factory):
    """``compose(*overrides) -> DictConfig``: verl's ``ppo_trainer`` config as its trainer builds
    it (``verl/trainer/main_ppo.py`` is ``@hydra.main(config_path="config", config_name="ppo_trainer")``),
    with the adapter's :data:`CONFIG_OVERRIDES`, the tiny model and the tier's lengths."""
    import verl
    from hydra import compose, initialize_config_dir
    from verl_doubles import PROMPT_LENGTH, RESPONSE_LENGTH

    from engine.integrations.verl import CONFIG_OVERRIDES

    config_dir = str(Path(verl.__file__).parent / "trainer" / "config")
    weights = tmp_path_factory.mktemp("weights")

    def build(*overrides: str, adapter: bool = True):
        base = list(CONFIG_OVERRIDES) if adapter else []
        base += [f"actor_rollout_ref.model.path={tiny}",
                 f"actor_rollout_ref.rollout.prompt_length={PROMPT_LENGTH}",
                 f"actor_rollout_ref.rollout.response_length={RESPONSE_LENGTH}"]
        if adapter:
            base.append(f"+actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.trio.weights_dir={weights}")
        with initialize_config_dir(config_dir=config_dir, version_base=None):
            return compose(config_name="ppo_trainer", overrides=base + list(overrides))

    return build


@pytest.fixture(scope="session")
def backend(tiny, tok):
    from verl_doubles import FlakyHF

    return FlakyHF(tiny, tok, device=os.environ.get("TRIO_ROLLOUT_TEST_DEVICE", "cpu"), dtype="float32")


@pytest.fixture(scope="session")
def engine(backend):
    from engine import EngineConfig, RolloutEngineThread

    with RolloutEngineThread(backend, EngineConfig()) as thread:
        yield thread


@pytest.fixture
def fresh_weights(engine, tiny):
    """The tiny model's own weights back in the engine at version 0 after the test."""
    yield
    engine.update_weights(tiny, version=0)
