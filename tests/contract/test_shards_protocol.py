"""The coordinator <-> shard wire (issue 16): results travel by layout, one buffer per
field; a frame of results is taken in with one admission pass; the pipes are widened."""

from __future__ import annotations

import os

import pytest
import torch
import trio
from tensordict import TensorDict

from engine import EngineConfig
from engine.executor import EpisodeResult
from engine.shards._coordinator import ShardedRolloutEngine, _Shard
from engine.shards._protocol import FLAT, ROWS, SHAPED, decode_results, encode_results, pack_frame, unpack_frame
from shard_fixtures import Echo, invariant

torch.set_num_threads(1)


def _row(t: int, reward: float) -> TensorDict:
    """An RLVR-shaped trajectory: [1, T] token fields, [1] per-episode fields."""
    return TensorDict({"input_ids": torch.arange(t, dtype=torch.int32).view(1, t),
                       "logprobs": torch.linspace(-1, 0, t).view(1, t),
                       "attention_mask": torch.ones(1, t, dtype=torch.bool),
                       "rewards": torch.tensor([reward]),
                       "is_truncated": torch.tensor([reward > 1])}, batch_size=[1])


def _through_a_frame(results: list[EpisodeResult]) -> list[tuple[tuple, object]]:
    messages = unpack_frame(bytearray(pack_frame([("ended", encode_results(results), (0, 0, 0, 0))])))
    return decode_results(messages[0][1])


def test_every_layout_dtype_and_shape_comes_back_as_sent():
    group = TensorDict({"input_ids": torch.arange(8, dtype=torch.int64).view(2, 4),
                        "logprobs": torch.randn(2, 4).to(torch.bfloat16),  # no numpy dtype: sent as bytes
                        "rewards": torch.tensor([1.0, -1.0])}, batch_size=[2])
    reordered = TensorDict({"rewards": torch.tensor([3.0]), "input_ids": torch.ones(1, 2, dtype=torch.int32)},
                           batch_size=[1])
    nested = TensorDict({"rewards": torch.tensor([4.0]), "meta": TensorDict({"x": torch.zeros(1)}, [1])}, [1])
    sent = [EpisodeResult(0, "accepted", trajectory=_row(3, 1.0), elapsed_s=0.25),
            EpisodeResult(1, "failed", reason="workflow_error", error_type="ValueError", error_message="x"),
            EpisodeResult(2, "accepted", trajectory=group, member_errors=((1, "backend_error", "E", "m"),)),
            EpisodeResult(3, "accepted", trajectory=_row(5, 2.0)),
            EpisodeResult(4, "accepted", trajectory=reordered),
            EpisodeResult(5, "accepted", trajectory=nested),
            EpisodeResult(6, "accepted", trajectory=_row(0, 0.5))]
    metas, layouts, buffers = encode_results(sent)
    assert len(layouts) == 3  # the two RLVR rows (and the empty one) share one
    assert layouts[0][3] == (ROWS, ROWS, ROWS, FLAT, FLAT) and layouts[1][3] == (SHAPED, SHAPED, FLAT)
    assert layouts[0][4][0] == [3, 5, 0] and layouts[0][2] == [(1,), (1,), (1,)]
    assert len(buffers) == 5 + 3 + 2
    got = _through_a_frame(sent)
    assert [v[0] for v, _ in got] == [r.task_id for r in sent]
    for r, (values, traj) in zip(sent, got):
        assert values[1] == r.status and values[3:] == (r.reason, r.error_type, r.error_message, r.member_errors,
                                                         r.elapsed_s)
        if r.trajectory is None:
            assert traj is None
            continue
        assert traj.batch_size == r.trajectory.batch_size
        assert list(traj.keys()) == list(r.trajectory.keys())
        for k, v in r.trajectory.items(include_nested=True, leaves_only=True):
            assert traj[k].dtype == v.dtype and traj[k].shape == v.shape and torch.equal(traj[k], v), k
    got[0][1]["input_ids"][0, 0] = 7  # writable views, each its own
    assert got[3][1]["input_ids"][0, 0] == 0


class _Link:
    kind, pid, channel = "test", None, None


async def test_a_frame_of_results_is_taken_in_with_one_admission_pass():
    """One ``submit`` message per shard per frame (it was one per result), and the global
    accounting stays exact."""
    async with trio.open_nursery() as nursery:
        shard = _Shard(0, _Link())
        engine = ShardedRolloutEngine(nursery, [shard], EngineConfig(max_concurrent_rollouts=8))
        ids = [engine.submit({"i": i}, Echo()) for i in range(20)]
        engine._admit_now()
        first = [m for m in shard.outbox if m[0] == "submit"]
        assert [len(m[1]) for m in first] == [8] and engine.statistics().running == 8
        shard.outbox.clear()
        running = list(shard.inflight)
        engine._on_ended(shard, encode_results([EpisodeResult(t, "accepted", trajectory=_row(4, 1.0))
                                                for t in running[:5]]))
        submits = [m for m in shard.outbox if m[0] == "submit"]
        assert [[s[0] for s in m[1]] for m in submits] == [ids[8:13]]
        s = engine.statistics()
        assert (s.accepted, s.running, s.queued) == (5, 8, 7)
        invariant(s)
        results = await engine.wait_results(5)
        assert [r.data for r in results] == [{"i": i} for i in range(5)]  # the coordinator's items, put back
        nursery.cancel_scope.cancel()


@pytest.mark.skipif(not hasattr(__import__("fcntl"), "F_GETPIPE_SZ"), reason="Linux pipe sizes")
def test_shard_pipes_are_widened_where_the_platform_allows():
    import fcntl

    from engine.shards._local import PIPE_BYTES, _widen

    r, w = os.pipe()
    try:
        _widen(w)
        with open("/proc/sys/fs/pipe-max-size") as f:
            allowed = int(f.read())
        assert fcntl.fcntl(w, fcntl.F_GETPIPE_SZ) >= min(PIPE_BYTES, allowed)
    finally:
        os.close(r)
        os.close(w)
