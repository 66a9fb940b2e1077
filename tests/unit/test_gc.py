"""Unit tier: the engine's GC settings while open (engine._gc).

Issue 13, class 9: GC tuning is opt-in (``EngineConfig.gc_tuning`` defaults to False), and
closing an engine restores exactly the host's previous state: objects the host froze itself
stay frozen, thresholds the host changed meanwhile are left alone.
"""

from __future__ import annotations

import gc

import pytest

from engine import EngineConfig, SimBackend, SimConfig, open_rollout_engine
from engine._gc import GEN0_THRESHOLD, gc_tuned


@pytest.fixture
def host_gc():
    """Restore the test process's GC state whatever a test does to it."""
    threshold, frozen = gc.get_threshold(), gc.get_freeze_count()
    assert frozen == 0, "the test process should start with nothing frozen"
    yield
    gc.set_threshold(*threshold)
    gc.unfreeze()


class _HostObject:
    pass


def _frozen(obj):
    return not any(o is obj for o in gc.get_objects())  # get_objects skips the permanent generation


def test_gc_settings_apply_while_open_and_are_restored(host_gc):
    before = gc.get_threshold()
    with gc_tuned():
        assert gc.get_threshold()[0] == max(before[0], GEN0_THRESHOLD)
        assert gc.get_freeze_count() > 0
        with gc_tuned():  # nested engines share the settings
            pass
        assert gc.get_threshold()[0] == max(before[0], GEN0_THRESHOLD)
    assert gc.get_threshold() == before
    assert gc.get_freeze_count() == 0
    with gc_tuned(enabled=False):
        assert gc.get_threshold() == before


def test_objects_the_host_froze_stay_frozen(host_gc):
    host_object = _HostObject()
    gc.freeze()  # the host (e.g. a pre-fork server) froze its objects itself
    frozen = gc.get_freeze_count()
    assert frozen > 0
    with gc_tuned():
        assert gc.get_threshold()[0] >= GEN0_THRESHOLD
    assert gc.get_freeze_count() > 0 and _frozen(host_object)  # never unfrozen by us


def test_what_the_host_does_while_open_is_kept(host_gc):
    before = gc.get_threshold()
    with gc_tuned():
        host_object = _HostObject()
        gc.freeze()  # the host freezes its objects while the engine is open
        gc.set_threshold(5000, *before[1:])  # and picks its own threshold
    assert _frozen(host_object)  # its freeze is not undone
    assert gc.get_threshold() == (5000, *before[1:])  # its threshold is not overwritten


async def test_gc_tuning_is_opt_in(reward_pool, host_gc):
    assert EngineConfig().gc_tuning is False
    before = gc.get_threshold()
    async with open_rollout_engine(SimBackend(SimConfig(vocab_size=50)), reward_pool=reward_pool):
        assert gc.get_threshold() == before and gc.get_freeze_count() == 0  # default: the GC is left alone
    async with open_rollout_engine(SimBackend(SimConfig(vocab_size=50)), EngineConfig(gc_tuning=True),
                                   reward_pool=reward_pool):
        assert gc.get_threshold()[0] == max(before[0], GEN0_THRESHOLD)
    assert gc.get_threshold() == before and gc.get_freeze_count() == 0


def test_the_cli_opts_in():
    from engine.cli._run import _engine_config
    from engine.cli._parser import build_parser

    args = build_parser().parse_args(["run", "--backend", "sim"])
    assert _engine_config(args).gc_tuning is True
