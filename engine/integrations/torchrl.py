"""trio-rollout as the generation of torchrl's LLM collectors and envs (torchrl 0.14.1).

::

    from torchrl.collectors.llm import LLMCollector
    from torchrl.envs.llm import ChatEnv
    from engine import GenerationHyperparameters, HFBackend, RolloutEngineThread
    from engine.integrations.torchrl import EngineReward, EngineWrapper

    with RolloutEngineThread(HFBackend(path, tok)) as engine:
        policy = EngineWrapper(engine, tokenizer=tok, gconfig=GenerationHyperparameters(max_new_tokens=256))
        env = ChatEnv.from_dataloader(dataloader=loader, batch_size=8, group_repeats=True, repeats=4)
        env = env.append_transform(EngineReward(engine, "rewards.gsm8k:gsm8k_reward", data_keys=["answer"],
                                                done_on_reward=True))
        collector = LLMCollector(env, policy=policy, dialog_turns_per_batch=32, track_policy_version=True)
        for batch in collector:
            train(batch)                                  # batch["log_probs", "response"]: the engine's
            collector.update_policy_weights_(model)       # -> engine.update_weights, version + 1

Tested with **torchrl 0.14.1 and tensordict 0.14.3** (torchrl pins ``tensordict<0.15``: it
has its own venv, ``tests/integrations/torchrl/venv.sh``).  torchrl is imported lazily: this
module imports without it; each name below is loaded on first use.  The seams (torchrl's
source, 0.14.1):

* :class:`EngineWrapper` (``_torchrl_wrapper``): a subclass of
  ``torchrl.modules.llm.TransformersWrapper`` (``modules/llm/policies/transformers_wrapper.py``)
  overriding its two generation steps, ``_generate_from_tokens`` (history and tokens modes)
  and ``_generate_from_text`` (text mode): each policy call is one hop into the engine's trio
  loop that runs every row of the env batch as its own ``agenerate`` task.  torchrl keeps the
  rest (chat template, ``ChatHistory`` re-parse, ``inplace``, ``get_dist``).
* :class:`EngineWeightUpdater` (``_torchrl_weights``): a
  ``torchrl.collectors.WeightUpdaterBase`` (``collectors/weight_update.py``), the weight hook of
  ``LLMCollector`` (``collectors/llm/base.py``): ``collector.update_policy_weights_(weights)``
  becomes ``engine.update_weights(weights, version=policy_version + 1)``; installed
  automatically when ``LLMCollector`` registers itself with an :class:`EngineWrapper`.
* :class:`EngineReward` (``_torchrl_reward``): a ``torchrl.envs.Transform`` scoring in the
  engine's reward pool, where torchrl's own reward transforms score (``_step``, as
  ``envs/llm/reward/gsm8k.py``).

Concurrency: torchrl calls the policy synchronously, once per env step with the whole env
batch; the rows of one step are generated together (the ``hf`` backend batches them).  More
in flight comes from a bigger env batch (or torchrl's ``AsyncEnvPool`` with
``yield_completed_trajectories``), not from threads.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._torchrl_bridge import TorchRLConfig, gconfig_from_generate_kwargs

if TYPE_CHECKING:  # loaded lazily (they import torchrl): see __getattr__
    from ._torchrl_reward import EngineReward, EngineRewardStatistics
    from ._torchrl_weights import EngineWeightUpdater
    from ._torchrl_wrapper import EngineWrapper, EngineWrapperStatistics

__all__ = ["EngineReward", "EngineRewardStatistics", "EngineWeightUpdater", "EngineWrapper",
           "EngineWrapperStatistics", "TORCHRL_VERSION", "TorchRLConfig", "gconfig_from_generate_kwargs"]

#: the torchrl release this adapter is tested with (with tensordict 0.14.3)
TORCHRL_VERSION = "0.14.1"

_LAZY = {
    "EngineReward": "._torchrl_reward",
    "EngineRewardStatistics": "._torchrl_reward",
    "EngineWeightUpdater": "._torchrl_weights",
    "EngineWrapper": "._torchrl_wrapper",
    "EngineWrapperStatistics": "._torchrl_wrapper",
}


def __getattr__(name: str) -> Any:
    where = _LAZY.get(name)
    if where is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        module = importlib.import_module(where, __package__)
    except ImportError as exc:
        if exc.name is not None and exc.name.split(".")[0] in ("torchrl", "tensordict"):
            raise ImportError(f"engine.integrations.torchrl.{name} needs torchrl=={TORCHRL_VERSION} (with "
                              f"tensordict 0.14.3): build its venv with "
                              f"`bash tests/integrations/torchrl/venv.sh .venv-torchrl`") from exc
        raise
    value = getattr(module, name)
    globals()[name] = value
    return value
