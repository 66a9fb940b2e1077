"""trio-rollout as verl's rollout: verl's own agent loops generating on the engine.

Tested with **verl 0.9.1** (PyPI wheel; ``tests/integrations/verl``).  The seams used:

* ``LLMServerClient.generate(request_id, *, prompt_ids, sampling_params, ...) -> TokenOutput``
  (``verl/workers/rollout/llm_server.py``): what every agent loop generates through.
  :class:`TrioLLMServerClient` (:mod:`._verl_client`) is one over the engine.
* ``actor_rollout_ref.rollout.agent.agent_loop_manager_class``
  (``verl/trainer/ppo/ray_trainer.py``: ``create(config=, llm_client=, teacher_client=,
  reward_loop_worker_handles=)`` + ``generate_sequences(DataProto) -> DataProto``):
  :class:`TrioAgentLoopManager` (:mod:`._verl_manager`) runs verl's own ``AgentLoopWorker``,
  agent loops (``SingleTurnAgentLoop``, ``ToolAgentLoop``, registered custom ones) and
  post-processing in-process on that client.
* ``actor_rollout_ref.rollout.checkpoint_manager_class`` and
  ``checkpoint_engine.backend`` / ``custom_backend_module`` (``verl/checkpoint_engine/base.py``):
  :class:`TrioCheckpointManager` and :class:`TrioCheckpointEngine` (:mod:`._verl_weights`)
  bring the actor's weights into the engine each step, versioned by ``global_steps``.

The config lines (hydra overrides; :data:`CONFIG_OVERRIDES` holds them, and the tier
composes verl's ``ppo_trainer`` config with them; ``+`` where verl's YAML has no such key,
or hydra refuses the override)::

    actor_rollout_ref.rollout.name=trio
    actor_rollout_ref.rollout.calculate_log_probs=True
    +actor_rollout_ref.rollout.agent.agent_loop_manager_class=engine.integrations.verl.TrioAgentLoopManager
    +actor_rollout_ref.rollout.checkpoint_manager_class=engine.integrations.verl.TrioCheckpointManager
    actor_rollout_ref.rollout.checkpoint_engine.backend=trio
    actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module=engine.integrations.verl
    actor_rollout_ref.model.external_lib=engine.integrations.verl
    +actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.trio.weights_dir=/shared/trio-weights
    +actor_rollout_ref.rollout.custom.trio_rollout.engine=my_project.rollout.make_engine  # optional

Importing this module does not import verl (its names resolve on first use, one line
naming the install when verl is missing), except when verl is already imported, as in
verl's processes importing ``model.external_lib`` / ``custom_backend_module``: then the
``trio`` checkpoint backend and rollout name are registered.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

from ._verl_sampling import ENGINES, EngineEntry, Limits, TrioVerlSettings, to_gconfig, token_output_fields

if TYPE_CHECKING:
    from ._verl_client import TrioLLMServerClient
    from ._verl_manager import AgentLoopFailedError, TrioAgentLoopManager, TrioAgentLoopWorker
    from ._verl_weights import TrioCheckpointEngine, TrioCheckpointManager, TrioReplica, TrioRolloutAdapter

__all__ = [
    "AgentLoopFailedError",
    "CONFIG_OVERRIDES",
    "ENGINES",
    "EngineEntry",
    "Limits",
    "TESTED_VERL_VERSIONS",
    "TrioAgentLoopManager",
    "TrioAgentLoopWorker",
    "TrioCheckpointEngine",
    "TrioCheckpointManager",
    "TrioLLMServerClient",
    "TrioReplica",
    "TrioRolloutAdapter",
    "TrioVerlSettings",
    "to_gconfig",
    "token_output_fields",
]

TESTED_VERL_VERSIONS = ("0.9.1",)

#: The hydra overrides that make verl's PPO trainer roll out with trio-rollout (add
#: ``+actor_rollout_ref.rollout.custom.trio_rollout.engine=pkg.mod.factory`` to build the
#: engine yourself; by default it is the ``hf`` backend on ``actor_rollout_ref.model.path``).
CONFIG_OVERRIDES = (
    "actor_rollout_ref.rollout.name=trio",
    "actor_rollout_ref.rollout.calculate_log_probs=True",
    "+actor_rollout_ref.rollout.agent.agent_loop_manager_class=engine.integrations.verl.TrioAgentLoopManager",
    "+actor_rollout_ref.rollout.checkpoint_manager_class=engine.integrations.verl.TrioCheckpointManager",
    "actor_rollout_ref.rollout.checkpoint_engine.backend=trio",
    "actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module=engine.integrations.verl",
    # a worker builds its rollout class (rollout.name=trio) before it imports custom_backend_module;
    # HFModelConfig imports external_lib first of all (verl/workers/config/model.py)
    "actor_rollout_ref.model.external_lib=engine.integrations.verl",
)

_LAZY = {
    "TrioLLMServerClient": "._verl_client",
    "AgentLoopFailedError": "._verl_manager",
    "TrioAgentLoopManager": "._verl_manager",
    "TrioAgentLoopWorker": "._verl_manager",
    "TrioCheckpointEngine": "._verl_weights",
    "TrioCheckpointManager": "._verl_weights",
    "TrioReplica": "._verl_weights",
    "TrioRolloutAdapter": "._verl_weights",
}

_MISSING = ("engine.integrations.verl needs verl {want} (not importable: {error}); install it with "
            "`pip install verl=={want}` or build the tier's venv: bash tests/integrations/verl/venv.sh .venv-verl")


def __getattr__(name: str) -> Any:
    module_name = _LAZY.get(name)
    if module_name is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    try:
        import verl  # noqa: F401
    except ImportError as exc:
        raise ImportError(_MISSING.format(want=TESTED_VERL_VERSIONS[-1], error=exc)) from None
    module = importlib.import_module(module_name, __package__)
    value = getattr(module, name)
    globals()[name] = value
    return value


if "verl" in sys.modules:  # verl's worker importing custom_backend_module: register the backend now
    from . import _verl_weights  # noqa: F401
