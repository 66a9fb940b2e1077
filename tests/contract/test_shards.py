"""Engine shards (issue 16): the coordinator's global staleness budget, exactly-once
accounting across shards, a shard killed mid-run, versions reaching the shards.

Inline shards (same coordinator, shard code and wire format, in this trio loop) run
in virtual time; the process tests spawn real shard processes (marked slow)."""

from __future__ import annotations

import itertools
import json
import os
import re
import signal

import pytest
import trio
import trio.testing

from engine import EngineConfig
from engine.errors import BackendError, WorkflowError
from engine.shards import ShardsDiedError, open_sharded_engine
from engine.shards._protocol import encode_results
from engine.staleness import staleness_capacity
from shard_fixtures import Echo, Poison, assert_global_bound, invariant, sim


# -- global staleness budget (inline shards, virtual time) -------------------------------------------
@pytest.mark.parametrize(("C", "B", "eta"), list(itertools.product([1, 3, 8], [1, 2, 5], [0, 1, 3])))
async def test_global_capacity_is_arealS_over_the_sum_of_shards(C, B, eta, autojump_clock):
    config = EngineConfig(max_concurrent_rollouts=C, consumer_batch_size=B, max_head_offpolicyness=eta)
    async with open_sharded_engine(sim(1.0), config, shards=2, shard_backend="inline",
                                   record_admissions=True) as engine:
        wf = Echo()
        for i in range(40):
            engine.submit({"i": i}, wf)
        await trio.testing.wait_all_tasks_blocked()
        s = engine.statistics()
        expected = min(C, (eta + 1) * B)  # the single engine's first admission (test_admission)
        assert s.running == expected == len(engine.admission_log)
        assert sum(r.running for r in engine.shard_statistics()) == expected
        if expected > 1:
            assert all(r.running >= 1 for r in engine.shard_statistics())  # split across shards
        for version in range(1, 5):  # a trainer: take a batch, bump the version
            await engine.wait_results(B)
            engine.set_version(version)
            s = engine.statistics()
            assert s.capacity == staleness_capacity(max_concurrent=C, consumer_batch_size=B,
                                                    max_head_offpolicyness=eta, version=version,
                                                    running=s.running, accepted=s.accepted)
        invariant(engine.statistics())
        assert assert_global_bound(engine.admission_log, C, B, eta)


async def test_rejections_do_not_count_against_the_global_budget(autojump_clock):
    config = EngineConfig(max_concurrent_rollouts=100, consumer_batch_size=2, max_head_offpolicyness=0)
    async with open_sharded_engine(sim(1.0), config, shards=2, shard_backend="inline",
                                   record_admissions=True) as engine:
        wf = Echo()
        for i in range(4):
            engine.submit({"i": i, "reject": True}, wf)
        for i in range(6):
            engine.submit({"i": i}, wf)
        results = await engine.wait_results(6)
        s = engine.statistics()
        assert (s.rejected, s.accepted, s.queued) == (4, 2, 4)  # the rejected 4 freed their slots
        assert [r.status for r in results].count("rejected") == 4
        engine.set_version(1)
        await engine.wait_results(2)
        assert_global_bound(engine.admission_log, 100, 2, 0)


# -- exactly once across shards (inline) ---------------------------------------------------------------
async def test_a_killed_shard_s_episodes_run_again_and_end_once(autojump_clock):
    async with open_sharded_engine(sim(1.0), EngineConfig(max_concurrent_rollouts=64), shards=2,
                                   shard_backend="inline") as engine:
        wf = Echo()
        ids = [engine.submit({"i": i}, wf) for i in range(100)]
        await trio.testing.wait_all_tasks_blocked()
        doomed = engine._shards[0]
        lost = set(doomed.inflight)
        assert lost
        doomed.link.kill()
        results = await engine.wait_results(100)
        assert sorted(r.task_id for r in results) == ids
        assert {r.status for r in results} == {"accepted"}
        dead, alive = engine.shard_statistics()
        assert (dead.alive, dead.reruns, alive.alive) == (False, len(lost), True)
        assert dead.exit == "was killed"
        # a result from the dead shard arriving after the re-run is dropped by task id
        late = next(r for r in results if r.task_id in lost)
        engine._on_ended(doomed, encode_results([late]))
        s = engine.statistics()
        assert (s.submitted, s.accepted, engine.shard_statistics()[0].dropped) == (100, 100, 1)
        invariant(s)
        assert not engine._blobs and not engine._reruns  # nothing kept for ended episodes


async def test_past_max_reruns_a_dead_shard_s_episodes_fail_as_shard_died(autojump_clock):
    async with open_sharded_engine(sim(1.0), EngineConfig(max_concurrent_rollouts=64), shards=2,
                                   shard_backend="inline", max_reruns=0) as engine:
        ids = [engine.submit({"i": i}, Echo()) for i in range(40)]
        await trio.testing.wait_all_tasks_blocked()
        lost = set(engine._shards[0].inflight)
        engine._shards[0].link.kill()
        results = await engine.wait_results(40)
        assert sorted(r.task_id for r in results) == ids
        failed = {r.task_id for r in results if r.status == "failed"}
        assert failed == lost and {r.reason for r in results if r.status == "failed"} == {"shard_died"}
        assert all("engine shard 0 died (was killed)" in r.error_message for r in results if r.status == "failed")
        s = engine.statistics()
        assert (s.accepted, s.failed_by_reason) == (40 - len(lost), {"shard_died": len(lost)})
        invariant(s)


async def test_the_last_shard_dying_fails_every_episode_once_and_raises(autojump_clock):
    engine = None
    with pytest.raises(ShardsDiedError, match="every engine shard died: shard 0 .* was killed"):
        async with open_sharded_engine(sim(1.0), EngineConfig(max_concurrent_rollouts=4), shards=1,
                                       shard_backend="inline") as engine:
            for i in range(10):
                engine.submit({"i": i}, Echo())
            await trio.testing.wait_all_tasks_blocked()
            engine._shards[0].link.kill()
            await trio.sleep_forever()
    s = engine.statistics()
    assert (s.submitted, s.failed, s.failed_by_reason) == (10, 10, {"shard_died": 10})
    invariant(s)


async def test_unpicklable_workflow_or_data_is_refused_at_submit(autojump_clock):
    import threading

    class Locked(Echo):  # holds a lock: neither pickle nor cloudpickle can send it
        def __init__(self):
            super().__init__()
            self.lock = threading.Lock()

    class LockedFilter:
        def __init__(self):
            self.lock = threading.Lock()

        def __call__(self, traj):
            return True

    async with open_sharded_engine(sim(), EngineConfig(), shards=1, shard_backend="inline") as engine:
        with pytest.raises(WorkflowError, match=r"the workflow \(Locked\) cannot be pickled"):
            engine.submit({}, Locked())
        with pytest.raises(WorkflowError, match=r"should_accept_fn \(.*LockedFilter\) cannot be pickled"):
            engine.submit({}, Echo(), should_accept_fn=LockedFilter())  # (only the filter fails: it is named)
        with pytest.raises(ValueError, match="data .* cannot be pickled"):
            engine.submit({"lock": threading.Lock()}, Echo())
        assert engine.statistics().submitted == 0


async def test_a_lambda_filter_and_a_local_workflow_class_travel_by_value():
    """(Real time: a sync filter runs in a thread, which virtual time would time out.)"""
    async with open_sharded_engine(sim(), EngineConfig(), shards=1, shard_backend="inline") as engine:
        engine.submit({}, type("Local", (Echo,), {})(), should_accept_fn=lambda traj: True)
        [result] = await engine.wait_results(1)
    assert (result.status, result.reason) == ("accepted", None)


def test_bad_options_name_the_field():
    async def open_with(**kwargs):
        async with open_sharded_engine(sim(), **kwargs):
            pass

    with pytest.raises(ValueError, match="shards must be an int >= 1"):
        trio.run(lambda: open_with(shards=0))
    with pytest.raises(ValueError, match="shard_backend must be one of"):
        trio.run(lambda: open_with(shard_backend="threads"))


# -- real processes ------------------------------------------------------------------------------------
@pytest.mark.slow
async def test_two_shard_processes_240_episodes_prepare_batch_and_versions():
    config = EngineConfig(max_concurrent_rollouts=32, consumer_batch_size=8, max_head_offpolicyness=1)
    async with open_sharded_engine(sim(0.002), config, shards=2, record_admissions=True) as engine:
        wf = Echo()
        items = [{"i": i, "reject": i % 10 == 3, "fail": i % 10 == 7} for i in range(240)]
        ids = [engine.submit(item, wf) for item in items]
        ended: list = []
        version = since_step = 0
        while len(ended) < len(ids):  # a trainer: bump the version after each 8 accepted
            got = await engine.wait_results(1)
            ended += got
            since_step += sum(r.status == "accepted" for r in got)
            if since_step == 8:
                since_step, version = 0, version + 1
                engine.set_version(version)
        assert sorted(r.task_id for r in ended) == ids  # each ended exactly once
        reasons = [r.reason or r.status for r in ended]  # a straggler may end stale (eta=1), as in one engine
        counts = {k: reasons.count(k) for k in ("accepted", "stale", "workflow_returned_none", "workflow_error")}
        assert counts["accepted"] + counts["stale"] == 192 and counts["accepted"] > 150
        assert (counts["workflow_returned_none"], counts["workflow_error"]) == (24, 24)
        assert all(r.data is items[r.task_id] for r in ended)  # the coordinator's own item objects
        pids = {int(r.trajectory["shard_pid"][0]) for r in ended if r.trajectory is not None}
        assert pids == set(engine.shard_pids)  # both shards ran episodes
        s = engine.statistics()
        invariant(s)
        assert (s.accepted, s.rejected, s.failed, s.running, s.queued) == (counts["accepted"], 240 - 24 - counts[
            "accepted"], 24, 0, 0)
        assert_global_bound(engine.admission_log, 32, 8, 1)
        # versions propagate: what is generated after set_version carries it, on every shard
        engine.set_version(41)
        batch = await engine.prepare_batch(iter([{"i": i} for i in range(1000)]), wf)
        assert batch.batch_size[0] == 8
        generated = batch["versions"][batch["loss_mask"].bool()]
        assert set(generated.tolist()) == {41}
        stats = await engine.refresh_statistics()
        assert {sh.engine.version for sh in engine.shard_statistics()} == {41}
        assert stats.generated_tokens > 0


@pytest.mark.slow
async def test_a_sigkilled_shard_process_has_its_episodes_rerun_and_counted_once():
    async with open_sharded_engine(sim(0.0), EngineConfig(max_concurrent_rollouts=400), shards=2) as engine:
        wf = Echo()
        ids = [engine.submit({"i": i, "sleep": 0 if i < 20 else 2.0}, wf) for i in range(300)]
        first = await engine.wait_results(20)  # the 20 quick ones; the others run for 2 s more
        victim = engine.shard_statistics()[0]
        assert victim.running > 100  # (C = 400: all 300 were dispatched at once, split evenly)
        os.kill(victim.pid, signal.SIGKILL)
        rest = await engine.wait_results(280)
        results = first + rest
        assert sorted(r.task_id for r in results) == ids
        assert {r.status for r in results} == {"accepted"}
        dead, alive = engine.shard_statistics()
        assert (dead.alive, alive.alive) == (False, True)
        assert dead.exit.startswith("killed by SIGKILL")
        assert dead.summary()["statistics_final"] is False  # its figures are a last snapshot
        assert dead.reruns > 0 and dead.ended + alive.ended == 300
        s = engine.statistics()
        assert (s.submitted, s.accepted, s.failed) == (300, 300, 0)
        invariant(s)


@pytest.mark.slow
async def test_every_shard_process_dying_raises_naming_them():
    engine = None
    with pytest.raises(ShardsDiedError, match=r"shard 0 \(pid \d+\) killed by SIGKILL; shard 1 .*SIGKILL"):
        async with open_sharded_engine(sim(0.05), EngineConfig(max_concurrent_rollouts=8), shards=2) as engine:
            for i in range(20):
                engine.submit({"i": i, "poison": i == 5}, Poison())
            await trio.sleep_forever()
    s = engine.statistics()
    invariant(s)
    assert s.failed_by_reason.get("shard_died", 0) >= 1 and s.running == s.queued == 0


@pytest.mark.slow
def test_rollout_run_shards_2_writes_every_item_once(tmp_path, capsys):
    import json

    from conftest import run_cli

    out = tmp_path / "out"
    code, stdout, err = run_cli(["run", "--backend", "sim", "--dataset", "builtin:arith:30",
                                 "--n-samples", "1", "--group-size", "2", "--consumer-batch-size", "4",
                                 "--max-head-offpolicyness", "1", "--max-new-tokens", "8", "--shards", "2",
                                 "--quiet", "--out", str(out)], capsys)
    assert code == 0, err
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["submitted"], summary["accepted"] + summary["rejected"], summary["failed"]) == (30, 30, 0)
    rows = [json.loads(line) for line in (out / "rollouts.jsonl").read_text().splitlines()]
    assert len(rows) == 2 * summary["accepted"]  # group of 2 per accepted episode
    assert summary["final_version"] >= summary["accepted"] // 4


def test_rollout_run_shards_with_the_hf_backend_loads_a_model_per_shard(tmp_path, capsys):
    """Was refused ("--shards: --backend hf loads the model in this process"): each
    shard process now builds its own HFBackend from an HFBackendFactory."""
    from conftest import run_cli

    out = tmp_path / "o"
    code, _, err = run_cli(["run", "--backend", "hf", "--model", "builtin:tiny", "--shards", "2", "--dataset",
                            "builtin:arith:6", "--max-new-tokens", "4", "--concurrency", "4", "--quiet", "--out",
                            str(out)], capsys)
    assert code == 0, err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["submitted"] == 6 and summary["accepted"] + summary["rejected"] + summary["failed"] == 6
    assert summary["failed"] == 0
    assert [s["kind"] for s in summary["shards"]] == ["process", "process"]
    assert sum(s["ended"] for s in summary["shards"]) == 6
    assert summary["backend_statistics"]["kind"] == "hf"  # the shards' own backends ran the episodes


@pytest.mark.parametrize("shard_gc_tuning", [True, False])
async def test_shard_processes_tune_their_gc_unless_told_not_to_and_this_process_is_untouched(shard_gc_tuning):
    import gc

    from shard_fixtures import GCProbe, sim

    before = (gc.get_threshold(), gc.get_freeze_count())
    async with open_sharded_engine(sim(), EngineConfig(), shards=2, shard_gc_tuning=shard_gc_tuning) as engine:
        for i in range(4):
            engine.submit({"i": i}, GCProbe())
        results = await engine.wait_results(4)
        assert (gc.get_threshold(), gc.get_freeze_count()) == before  # the caller's process: gc_tuning=False
    thresholds = {int(r.trajectory["gc_threshold"][0]) for r in results}
    frozen = {int(r.trajectory["gc_frozen"][0]) > 0 for r in results}
    if shard_gc_tuning:  # (engine._gc: young threshold 10000, the objects alive at open frozen)
        assert thresholds == {10_000} and frozen == {True}
    else:
        assert thresholds == {before[0][0]} and frozen == {False}


def test_hf_backend_factory_pickles_and_builds_an_unopened_backend():
    import pickle

    from engine.backends.hf import HFBackend, HFBackendFactory

    factory = pickle.loads(pickle.dumps(HFBackendFactory("some/model", max_batch_size=3, mode="static")))
    backend = factory()
    assert isinstance(backend, HFBackend) and backend.max_batch_size == 3 and backend.mode == "static"
    assert factory.logprob_semantics == HFBackend.logprob_semantics
    with pytest.raises(TypeError, match="model must be a folder or hub id"):
        HFBackendFactory(object())  # type: ignore[arg-type]
    spread = HFBackendFactory("some/model", devices=["cpu", "meta"])
    assert [spread.device_for(i) for i in (0, 1, 2, None)] == ["cpu", "meta", "cpu", "cpu"]
    assert pickle.loads(pickle.dumps(spread)).devices == ["cpu", "meta"]
    with pytest.raises(TypeError, match="not both"):
        HFBackendFactory("some/model", devices=["cpu"], device="cpu")
    with pytest.raises(ValueError, match="non-empty"):
        HFBackendFactory("some/model", devices=[])


@pytest.mark.parametrize("kind", ["inline", "process"])
async def test_shard_index_is_seen_by_the_backend_factory_and_the_workflows(kind, capfd):
    """Regression (new-user trial): in process shards shard_index() was None (the
    package imported _shard_main, which runs as __main__ there: two context
    variables, and a runpy warning on stderr per shard)."""
    from engine.shards import shard_index
    from shard_fixtures import ShardIndexEcho, record_shard_index

    assert shard_index() is None  # not in a shard
    async with open_sharded_engine(record_shard_index, EngineConfig(), shards=2, shard_backend=kind) as engine:
        for i in range(8):
            engine.submit({"i": i}, ShardIndexEcho())
        results = await engine.wait_results(8)
    seen = {tuple(r.trajectory["shard_index_seen"][0].tolist()) for r in results}
    assert seen == {(0, 0), (1, 1)}  # each shard's own index, in its factory and its episodes
    assert shard_index() is None
    assert "found in sys.modules" not in capfd.readouterr().err


async def test_update_weights_reaches_every_shard_and_a_failure_names_the_shard(autojump_clock):
    from shard_fixtures import weight_sync_sim

    async with open_sharded_engine(weight_sync_sim(1.0), EngineConfig(), shards=2, shard_backend="inline") as engine:
        await engine.update_weights("ckpt-7", version=7)
        assert engine.version == 7 and not engine.paused
        batch = await engine.rollout_batch([{"i": i} for i in range(6)], Echo())
        assert set(batch["versions"][batch["loss_mask"].bool()].tolist()) == {7}
        await engine.refresh_statistics()
        assert [s.engine.version for s in engine.shard_statistics()] == [7, 7]
        with pytest.raises(BackendError, match="update_weights failed on engine shard 0 .and 1 more.: OSError"):
            await engine.update_weights("broken", version=8)
        assert engine.version == 7 and not engine.paused
    async with open_sharded_engine(sim(), EngineConfig(), shards=1, shard_backend="inline") as engine:
        with pytest.raises(BackendError, match="shard 0: BackendError: SimBackend does not support weight updates"):
            await engine.update_weights("ckpt", version=1)


def test_the_package_exports_a_sorted_all():
    import engine.shards

    assert engine.shards.__all__ == sorted(engine.shards.__all__)
    assert all(getattr(engine.shards, name) is not None for name in engine.shards.__all__)


@pytest.mark.slow
async def test_a_shard_that_cannot_start_is_named_with_how_it_ended():
    from shard_fixtures import broken_backend

    with pytest.raises(RuntimeError, match=r"engine shard 0 \(pid \d+\) exited with status 1 before it was ready"):
        async with open_sharded_engine(broken_backend, EngineConfig(), shards=1):
            pass


def test_results_round_trip_through_a_frame_in_columns():
    import torch
    from tensordict import TensorDict

    from engine.executor import EpisodeResult
    from engine.shards._protocol import decode_results, pack_frame, result_record, unpack_frame

    def traj(n: int, reward: float) -> TensorDict:
        return TensorDict({"input_ids": torch.arange(2 * n, dtype=torch.int32).view(2, n),
                           "attention_mask": torch.ones(2, n, dtype=torch.bool),
                           "rewards": torch.tensor([reward, -reward])}, batch_size=[2])

    sent = [EpisodeResult(0, "accepted", trajectory=traj(3, 1.0), elapsed_s=0.5),
            EpisodeResult(1, "failed", reason="workflow_error", error_type="ValueError", error_message="x"),
            EpisodeResult(2, "accepted", trajectory=traj(5, 2.0), member_errors=((1, "backend_error", "E", "m"),)),
            EpisodeResult(3, "accepted", trajectory=TensorDict({"empty": torch.zeros(1, 0)}, batch_size=[1]))]
    messages = unpack_frame(bytearray(pack_frame([("ended", encode_results(sent), (0, 0, 0, 0))])))
    got = [result_record(values, t, data=i) for i, (values, t) in enumerate(decode_results(messages[0][1]))]
    for a, b in zip(sent, got):
        assert (a.task_id, a.status, a.reason, a.error_type, a.member_errors, a.elapsed_s) == (
            b.task_id, b.status, b.reason, b.error_type, b.member_errors, b.elapsed_s)
        assert (a.trajectory is None) == (b.trajectory is None)
        if a.trajectory is not None:
            assert set(a.trajectory.keys()) == set(b.trajectory.keys())
            for k in a.trajectory.keys():
                assert a.trajectory[k].dtype == b.trajectory[k].dtype and torch.equal(a.trajectory[k], b.trajectory[k])
    got[0].trajectory["input_ids"][0, 0] = 7  # writable views, each its own
    assert got[2].trajectory["input_ids"][0, 0] == 0 and got[3].data == 3


async def _dead_on_arrival(index):
    """A stand-in for ``start_local_shard``: a shard process SIGKILLed before it read ``init``."""
    import sys

    from engine.shards import _local

    r, w = os.pipe()
    os.close(w)
    process = await trio.lowlevel.open_process([sys.executable, "-c", "import os; os.kill(os.getpid(), 9)"])
    with trio.CancelScope(shield=True):  # (reaped even when another shard's failure cancels this start)
        await process.wait()  # gone before init is sent: the write end has no reader
    rr, ww = os.pipe()
    os.close(rr)
    return _local.LocalShardLink(process, _local.FrameStream(trio.lowlevel.FdStream(ww), trio.lowlevel.FdStream(r)))


@pytest.mark.slow
async def test_a_shard_that_dies_before_reading_init_is_named_not_a_broken_pipe(monkeypatch):
    """Regression: a shard SIGKILLed during start-up (before it read ``init``) broke the
    coordinator's pipe write, and ``rollout run --shards`` died with a bare BrokenResourceError."""
    from engine.shards import _local

    monkeypatch.setattr(_local, "start_local_shard", _dead_on_arrival)
    with pytest.raises(RuntimeError, match=r"engine shard 0 \(pid \d+\) killed by SIGKILL before it was ready"):
        async with open_sharded_engine(sim(), EngineConfig(), shards=1):
            pass


@pytest.mark.slow
def test_rollout_run_reports_a_shard_that_did_not_start_in_one_line(tmp_path, capsys, monkeypatch):
    """Regression: the start-up RuntimeError reached the terminal as a traceback."""
    from conftest import run_cli
    from engine.shards import _local

    monkeypatch.setattr(_local, "start_local_shard", _dead_on_arrival)
    code, _, err = run_cli(["run", "--backend", "sim", "--shards", "2", "--dataset", "builtin:arith:3", "--quiet",
                            "--out", str(tmp_path / "o")], capsys)
    assert code == 2, err
    assert "Traceback" not in err
    assert re.search(r"^rollout run: error: engine shard \d \(pid \d+\) killed by SIGKILL before it was ready", err, re.M)


async def test_shards_failing_to_start_together_are_one_error_naming_each(monkeypatch):
    """Regression: shards that failed to start in the same moment surfaced as an
    ExceptionGroup (a traceback in ``rollout run``), not as one error."""
    from engine.shards import _local
    from engine.shards._open import ShardStartError

    together = trio.Event()

    async def fails_with_the_other(index):
        await together.wait()  # both wake in the same scheduling batch and raise without a checkpoint
        raise ShardStartError(f"engine shard {index} (pid 0) exited with status 1 before it was ready")

    async def open_it():
        with pytest.raises(ShardStartError, match=r"^engine shard \d .*before it was ready; engine shard \d .*ready$"):
            async with open_sharded_engine(sim(), EngineConfig(), shards=2):
                pass

    monkeypatch.setattr(_local, "start_local_shard", fails_with_the_other)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(open_it)
        await trio.testing.wait_all_tasks_blocked()
        together.set()


_MAIN_SCRIPT = '''
import torch
import trio

from engine import EngineConfig, ModelRequest, SimBackend, SimConfig
from engine.trajectory import trajectory_from_response
from engine.shards import open_sharded_engine, shard_index
from engine.types import GenerationHyperparameters
from workflows import RolloutWorkflow

torch.set_num_threads(1)


class MainWF(RolloutWorkflow):  # defined in the user's script: pickles as __main__.MainWF
    async def arun_episode(self, engine, data):
        resp = await engine.agenerate(ModelRequest(input_ids=[1, 2, 3 + data["i"]],
                                                   gconfig=GenerationHyperparameters(max_new_tokens=2)))
        return trajectory_from_response(resp, float(shard_index()))


def factory():  # the backend factory, also in __main__
    return SimBackend(SimConfig(vocab_size=64, eos_token_id=0, first_token_id=1, out_len_median=2,
                                out_len_sigma=0.0))


async def main():
    async with open_sharded_engine(factory, EngineConfig(), shards=2) as engine:
        for i in range(6):
            engine.submit({"i": i}, MainWF(), should_accept_fn=lambda traj: True)
        results = await engine.wait_results(6)
    print("STATUSES", sorted(str(r.status) for r in results), sorted({float(r.trajectory["rewards"][0]) for r in results}))


trio.run(main)
'''


def test_a_workflow_filter_and_factory_defined_in_the_user_script_run_in_process_shards(tmp_path):
    """Regression (new-user trial): a workflow class defined in the script being run
    (``__main__``) was pickled by reference, and every shard process (whose
    ``__main__`` is engine.shards._shard_main) died loading it: ShardsDiedError.
    Such objects now travel by value (cloudpickle), as rewards do."""
    import subprocess
    import sys
    from pathlib import Path

    script = tmp_path / "train.py"
    script.write_text(_MAIN_SCRIPT)
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(root)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "STATUSES ['accepted', 'accepted', 'accepted', 'accepted', 'accepted', 'accepted'] [0.0, 1.0]" in proc.stdout
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]


@pytest.mark.parametrize("threads", [None, 2])
async def test_torch_threads_reach_the_shard_processes(threads):
    """Regression (new-user trial): rollout run --torch-threads was ignored in shards
    (each shard process set 1 thread whatever the flag)."""
    import torch

    from shard_fixtures import ThreadsProbe

    mine = torch.get_num_threads()
    async with open_sharded_engine(sim(), EngineConfig(), shards=2, torch_threads=threads) as engine:
        for i in range(4):
            engine.submit({"i": i}, ThreadsProbe())
        results = await engine.wait_results(4)
    assert {int(r.trajectory["torch_threads"][0]) for r in results} == {threads or 1}
    assert torch.get_num_threads() == mine  # (this process: untouched)
    with pytest.raises(ValueError, match="torch_threads"):
        async with open_sharded_engine(sim(), EngineConfig(), shards=1, torch_threads=0):
            pass


async def test_statistics_have_the_single_engine_s_types_right_after_opening(autojump_clock):
    """Regression (new-user trial): before the shards' first snapshot, statistics().rewards
    was None and .backend a BackendStatistics(kind="sharded"), where a single engine
    reports its pool's and its backend's at once."""
    from engine import open_rollout_engine

    async with open_rollout_engine(sim(), EngineConfig()) as single:
        expected = type(single.statistics().rewards), type(single.statistics().backend)
    async with open_sharded_engine(sim(), EngineConfig(), shards=2, shard_backend="inline",
                                   stats_interval_s=600.0) as engine:
        s = engine.statistics()
        assert (type(s.rewards), type(s.backend)) == expected and s.backend.kind == "sim"
