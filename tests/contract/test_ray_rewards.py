"""Contract tier: the Ray reward pool (reward_backend="ray") on one module-scoped local Ray.

Same policy as the local pool: a hung reward's actor is killed and replaced while
the others finish, retries, the flagged fallback, deterministic errors not
retried, a stateful actor set up once per Ray actor, async rewards in-process,
cancellation, and an engine run on the sim backend end to end.
"""

from __future__ import annotations

import functools
import os
import time

import pytest
import trio

ray = pytest.importorskip("ray")

import reward_fixtures  # noqa: E402
from engine import EngineConfig, SimBackend, SimConfig, open_rollout_engine  # noqa: E402
from engine.datasets import builtin_arith, to_item  # noqa: E402
from engine.errors import RewardError  # noqa: E402
from engine.testing import build_tiny_tokenizer  # noqa: E402
from engine.types import GenerationHyperparameters  # noqa: E402
from rewards import RewardActor, collect_reward_outcomes  # noqa: E402
from engine.ray_cluster import local_job_config  # noqa: E402
from rewards import open_ray_reward_pool  # noqa: E402
from workflows.rlvr import RLVRWorkflow  # noqa: E402

pytestmark = pytest.mark.slow

ARGS = ("prompt", "completion", [1, 2], [3, 4])


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    """One local Ray for the module; the pools find it initialised and leave it running."""
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, job_config=local_job_config(ray))
    yield
    if started:
        ray.shutdown()


def _lines(path) -> list[str]:
    return path.read_text().split() if path.exists() else []


async def _read_pid(fifo) -> int:
    """The pid the hung reward writes into ``fifo`` (fails after 30 s instead of hanging)."""
    fd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # does not wait for a writer
    try:
        with trio.fail_after(30):
            data = b""
            while True:  # until the writer closes the pipe (EOF after its pid)
                await trio.lowlevel.wait_readable(fd)
                chunk = os.read(fd, 64)
                if not chunk and data:
                    break
                data += chunk
        return int(data)
    finally:
        os.close(fd)


def _dead(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


async def test_a_hung_actor_is_killed_and_replaced_while_200_others_finish(tmp_path):
    fifo = tmp_path / "pid.fifo"
    os.mkfifo(fifo)
    async with open_ray_reward_pool(max_workers=4, timeout_seconds=1.0, max_retries=0) as pool:
        results: list = []
        hung: list = []

        async def one(i: int) -> None:
            results.append((await pool.score(reward_fixtures.return_value, *ARGS, value=float(i))).reward)

        async def hang() -> None:
            hung.append(await pool.score(reward_fixtures.announce_pid_then_sleep, *ARGS, fifo=str(fifo)))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(hang)
            hung_pid = await _read_pid(fifo)  # the hung call is running in its actor now
            for i in range(200):
                nursery.start_soon(one, i)
        s = pool.statistics()
        # 4 calls at once need 4 actors: a fresh one replaces the killed one (unless one did already)
        async with trio.open_nursery() as nursery:
            for _ in range(4):
                nursery.start_soon(functools.partial(pool.score, reward_fixtures.sleep_then_return, *ARGS,
                                                     seconds=0.5))
        assert pool.statistics().workers_idle == 4
        actors_started = pool.actors_started
    assert sorted(results) == [float(i) for i in range(200)]
    assert hung[0].is_fallback and hung[0].reward == 0.0 and hung[0].attempts == 1
    assert (s.successes, s.fallbacks, s.timeouts, s.workers_killed, s.errors) == (200, 1, 1, 1, 0)
    assert actors_started == 5
    deadline = time.monotonic() + 10
    while not _dead(hung_pid) and time.monotonic() < deadline:
        await trio.sleep(0.05)  # ray.kill is asynchronous: the raylet ends the process
    assert _dead(hung_pid), "the timed-out actor's process is still alive"


async def test_retries_fallback_flag_and_deterministic_errors(tmp_path):
    async with open_ray_reward_pool(max_workers=2, timeout_seconds=0.5, max_retries=1) as pool:
        log = tmp_path / "timeouts.log"
        with collect_reward_outcomes() as outcomes:
            outcome = await pool.score(reward_fixtures.sleep_forever, *ARGS, log=str(log))
        assert outcome.is_fallback and outcome.attempts == 2 and outcomes == [outcome]
        assert len(_lines(log)) == 2 and len(set(_lines(log))) == 2  # each retry in a fresh actor

        log = tmp_path / "value_error.log"
        with pytest.raises(RewardError, match="ValueError: bad input 42"):
            await pool.score(reward_fixtures.raise_value_error, *ARGS, log=str(log))
        assert len(_lines(log)) == 2  # retried

        log = tmp_path / "key_error.log"
        with pytest.raises(RewardError, match="not retried"):
            await pool.score(reward_fixtures.raise_key_error, *ARGS, log=str(log))
        assert len(_lines(log)) == 1  # deterministic: one attempt

        marker = tmp_path / "crashed"
        outcome = await pool.score(reward_fixtures.crash_once, *ARGS, marker=str(marker))
        assert outcome.reward == 1.0 and outcome.attempts == 2  # the dead actor's call ran again

        with pytest.raises(RewardError, match="returned NoneType"):
            await pool.score(reward_fixtures.return_value, *ARGS, value=None)
        s = pool.statistics()
    assert (s.fallbacks, s.timeouts, s.workers_killed, s.worker_deaths, s.errors) == (1, 2, 2, 1, 3)


async def test_a_stateful_actor_is_set_up_once_per_ray_actor(tmp_path):
    setup_log = tmp_path / "setup.log"
    actor = reward_fixtures.CountingActor(str(setup_log))
    async with open_ray_reward_pool(max_workers=2, timeout_seconds=10.0) as pool:
        await pool.check_reward_fn(actor)
        rewards = []

        async def one() -> None:
            rewards.append((await pool.score(actor, *ARGS)).reward)

        async with trio.open_nursery() as nursery:
            for _ in range(20):
                nursery.start_soon(one)
    pids = _lines(setup_log)
    assert 1 <= len(pids) <= 2 and len(set(pids)) == len(pids)  # once per actor process
    assert sum(r == 1.0 for r in rewards) == len(pids)  # each actor's count starts at 1 ...
    assert max(rewards) >= 20 / len(pids)  # ... and its state survives between calls


async def judge(prompt, completions, prompt_ids, completion_ids, **data) -> float:
    await trio.lowlevel.checkpoint()
    return float(len(completions))


class AsyncJudge(RewardActor):
    async def setup(self) -> None:
        await trio.lowlevel.checkpoint()
        self.setups = getattr(self, "setups", 0) + 1

    async def __call__(self, prompt, completions, prompt_ids, completion_ids, **data) -> float:
        return float(self.setups)


async def test_async_rewards_run_in_process_under_the_policy():
    async with open_ray_reward_pool(max_workers=1, timeout_seconds=5.0) as pool:
        assert (await pool.score(judge, *ARGS)).reward == float(len("completion"))
        actor = AsyncJudge()
        assert [(await pool.score(actor, *ARGS)).reward for _ in range(3)] == [1.0, 1.0, 1.0]
        assert pool.actors_started == 0  # no Ray actor was needed
    assert ray.is_initialized()  # the module's Ray: not started by the pool, so not shut down by it


async def test_cancelling_a_call_kills_its_actor(tmp_path):
    fifo = tmp_path / "pid.fifo"
    os.mkfifo(fifo)
    async with open_ray_reward_pool(max_workers=1, timeout_seconds=60.0) as pool:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(functools.partial(pool.score, reward_fixtures.announce_pid_then_sleep, *ARGS,
                                                 fifo=str(fifo)))
            pid = await _read_pid(fifo)
            nursery.cancel_scope.cancel()
        s = pool.statistics()
        assert (s.cancelled, s.workers_killed, s.busy, s.workers_busy) == (1, 1, 0, 0)
        assert (await pool.score(reward_fixtures.return_value, *ARGS, value=2)).reward == 2.0  # a fresh actor
    deadline = time.monotonic() + 10
    while not _dead(pid) and time.monotonic() < deadline:
        await trio.sleep(0.05)
    assert _dead(pid)


async def test_micro_batching_on_ray():
    async with open_ray_reward_pool(max_workers=2, timeout_seconds=10.0, batch_size=8) as pool:
        results = []

        async def one(i: int) -> None:
            results.append((await pool.score(reward_fixtures.return_value, *ARGS, value=i)).reward)

        async with trio.open_nursery() as nursery:
            for i in range(40):
                nursery.start_soon(one, i)
        assert sorted(results) == [float(i) for i in range(40)]
        assert 1 <= pool.statistics().batches < 40


async def test_bad_options_name_the_field():
    with pytest.raises(ValueError, match="num_gpus"):
        async with open_ray_reward_pool(num_gpus=-1):
            pass
    with pytest.raises(ValueError, match="reward_backend"):
        EngineConfig(reward_backend="slurm")


async def test_engine_run_with_reward_backend_ray():
    tok = build_tiny_tokenizer()
    items = [to_item(row) for row in builtin_arith(4)]
    sim = SimBackend(SimConfig(vocab_size=len(tok), eos_token_id=tok.eos_token_id, first_token_id=0,
                               out_len_median=6, seed=2))
    length = RLVRWorkflow(reward_fixtures.length_reward, GenerationHyperparameters(max_new_tokens=8), tok)
    config = EngineConfig(reward_backend="ray", reward_max_workers=2, reward_timeout_seconds=10.0)
    async with open_rollout_engine(sim, config) as engine:
        assert type(engine.reward_pool).__name__ == "RayRewardPool"
        scored = await engine.rollout_batch(items, length)
        s = engine.statistics()
    assert s.rewards.successes == 4 and s.reward_fallbacks == 0
    expected = [float(len(tok.decode(ids[mask.bool()], skip_special_tokens=True)))
                for ids, mask in zip(scored["input_ids"], scored["loss_mask"])]
    assert scored["rewards"].tolist() == expected


def test_cli_selects_the_ray_backend():
    from engine.cli._run import _engine_config
    from engine.cli._parser import build_parser

    args = build_parser().parse_args(["run", "--reward-backend", "ray", "--ray-address", "ray://head:10001"])
    config = _engine_config(args)
    assert (config.reward_backend, config.reward_ray_address) == ("ray", "ray://head:10001")
