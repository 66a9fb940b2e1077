"""Trainer adapters: trio-rollout as the rollout backend of other RL trainers.

Each module here fits the engine behind one trainer's own seam and imports that
trainer lazily (importing ``engine.integrations`` imports no trainer):

* :mod:`engine.integrations.trl`: Hugging Face TRL's ``GRPOTrainer(rollout_func=...)``
  (the ``trl`` extra: ``pip install "trio-rollout[trl]"``).
* :mod:`engine.integrations.areal`: AReaL 1.0.4's ``InferenceEngine`` (and ``PPOTrainer``'s
  rollout); AReaL lives in its own venv (``tests/integrations/areal/venv.sh``).
"""

from __future__ import annotations

__all__: list[str] = []
