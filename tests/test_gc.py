"""Unit tier: the engine's GC settings while open (engine._gc)."""

from __future__ import annotations

import gc

from engine import EngineConfig, SimBackend, SimConfig, open_rollout_engine
from engine._gc import GEN0_THRESHOLD, gc_tuned


def test_gc_settings_apply_while_open_and_are_restored():
    before = gc.get_threshold()
    frozen = gc.get_freeze_count()
    with gc_tuned():
        assert gc.get_threshold()[0] == max(before[0], GEN0_THRESHOLD)
        assert gc.get_freeze_count() > frozen
        with gc_tuned():  # nested engines share the settings
            pass
        assert gc.get_threshold()[0] == max(before[0], GEN0_THRESHOLD)
    assert gc.get_threshold() == before
    assert gc.get_freeze_count() == 0
    with gc_tuned(enabled=False):
        assert gc.get_threshold() == before


async def test_engine_gc_tuning_can_be_turned_off(reward_pool):
    before = gc.get_threshold()
    async with open_rollout_engine(SimBackend(SimConfig(vocab_size=50)), EngineConfig(gc_tuning=False),
                                   reward_pool=reward_pool):
        assert gc.get_threshold() == before
    async with open_rollout_engine(SimBackend(SimConfig(vocab_size=50)), reward_pool=reward_pool):
        assert gc.get_threshold()[0] == max(before[0], GEN0_THRESHOLD)
    assert gc.get_threshold() == before
