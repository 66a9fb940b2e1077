"""Trainer adapters: trio-rollout as the rollout backend of other RL trainers.

Each module here fits the engine behind one trainer's own seam and imports that
trainer lazily (importing ``engine.integrations`` imports no trainer):

* :mod:`engine.integrations.trl`: Hugging Face TRL's ``GRPOTrainer(rollout_func=...)``
  (the ``trl`` extra: ``pip install "trio-rollout[trl]"``).
* :mod:`engine.integrations.torchrl`: torchrl's ``LLMCollector`` / ``ChatEnv`` with an
  ``EngineWrapper`` policy (torchrl 0.14.1, in a venv of its own: it pins ``tensordict<0.15``).
* :mod:`engine.integrations.verl`: verl 0.9.1's agent loops and agent-loop manager
  (``LLMServerClient``, ``agent_loop_manager_class``, ``checkpoint_manager_class``).
* :mod:`engine.integrations.openrlhf`: OpenRLHF 0.11.2's ``llm_engine`` for its agent
  executors, and ``install()`` for its Ray trainer's engine actors (a venv of its own).
* :mod:`engine.integrations.areal`: AReaL 1.0.4's ``InferenceEngine`` (and ``PPOTrainer``'s
  rollout); AReaL lives in its own venv (``tests/integrations/areal/venv.sh``).
"""

from __future__ import annotations

__all__: list[str] = []
