"""Engine shards as Ray actors on a local Ray (issue 16): episodes end exactly once,
and a killed shard actor's episodes run again on the other shard."""

from __future__ import annotations

import pytest

ray = pytest.importorskip("ray")

from engine import EngineConfig  # noqa: E402
from engine.shards import open_sharded_engine  # noqa: E402
from engine.ray_cluster import local_job_config  # noqa: E402
from shard_fixtures import Echo, invariant, sim  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, job_config=local_job_config(ray))
    yield
    if started:
        ray.shutdown()


async def test_ray_actor_shards_run_each_episode_once_and_survive_a_killed_actor():
    config = EngineConfig(max_concurrent_rollouts=200)
    async with open_sharded_engine(sim(0.0), config, shards=2, shard_backend="ray") as engine:
        wf = Echo()
        ids = [engine.submit({"i": i, "sleep": 0 if i < 20 else 2.0}, wf) for i in range(200)]
        first = await engine.wait_results(20)  # the quick ones; the others run for 2 s more
        victim = engine._shards[0]
        assert len(victim.inflight) > 50  # (C = 200: all dispatched at once, split evenly)
        ray.kill(victim.link.actor, no_restart=True)
        results = first + await engine.wait_results(180)
        assert sorted(r.task_id for r in results) == ids
        assert {r.status for r in results} == {"accepted"}
        dead, alive = engine.shard_statistics()
        assert (dead.kind, dead.alive, alive.alive) == ("ray", False, True)
        assert "Ray actor died" in dead.exit and dead.reruns > 0
        pids = {int(r.trajectory["shard_pid"][0]) for r in results}
        assert pids <= {dead.pid, alive.pid} and alive.pid in pids
        s = engine.statistics()
        assert (s.submitted, s.accepted) == (200, 200)
        invariant(s)
