"""The coordinator of a sharded engine: the :class:`~engine.executor.RolloutEngine` API
over N engine processes (shards).

The coordinator keeps everything a trainer sees in one place: task ids, the
policy version, the queue, the global staleness budget, the result buffer,
``prepare_batch``'s pipeline, the failure breaker and the exactly-once
accounting (all inherited from :class:`~engine.executor.RolloutEngine`).  Only
the running of episodes moves out: an admitted episode is dispatched to the live
shard with the fewest episodes in flight, where it runs as an ordinary episode of
that shard's engine (own trio loop, backend client, reward pool).

Admission (AReaL's capacity, :mod:`engine.staleness`) is computed here over the
sum of all shards: ``running`` counts episodes dispatched and not yet returned,
``accepted`` the accepted ones, so ``sum(running) + accepted`` never exceeds
``(eta + v + 1) * B`` and ``sum(running)`` never exceeds ``C``.  The capacity is
split across shards one episode at a time (each admitted episode is a one-shot
credit granted to the least-loaded shard), which rebalances by itself: a slow or
dead shard simply gets less.  Shards keep no queue of their own, so nothing waits
on a busy shard while another is idle.

Exactly once across shards: the coordinator keeps, per shard, the episodes
dispatched and not yet ended.  When a shard dies (its channel ends: SIGKILL,
crash, OOM, a killed Ray actor) those episodes go back to the head of the queue
and run again on a surviving shard (at most ``max_reruns`` times each, then they
end as failed with reason ``"shard_died"``); a result arriving from a shard for
an episode it no longer holds is dropped by task id.  When the last shard dies,
every episode not ended ends as failed (``"shard_died"``) and
:class:`ShardsDiedError` ends the ``async with`` block.  A shard that sends nothing
for ``shard_timeout_s`` (hung) is killed and treated the same way.
"""

from __future__ import annotations

import collections
import logging
import math
import pickle
from dataclasses import replace
from typing import Any

import trio

from .._collated import ITEMS_FIX, check_item
from .._records import Task
from ..backends.base import BackendStatistics
from ..errors import RolloutError, WorkflowError
from ..executor import EngineConfig, EngineStatistics, EpisodeResult, RolloutEngine
from ._protocol import decode_results
from .._portable import dumps
from ._statistics import AdmissionRecord, ShardStatistics, merge_statistics
from ._weights import update_shared_weights, weights_error

__all__ = ["AdmissionRecord", "ShardStartError", "ShardStatistics", "ShardedRolloutEngine", "ShardsDiedError"]

logger = logging.getLogger(f"rollout.{__name__}")


class ShardsDiedError(RolloutError):
    """Every engine shard died; the message names each one and how it ended."""


class ShardStartError(RolloutError, RuntimeError):
    """A shard did not start (a ``RuntimeError``, as before; a ``RolloutError`` so that
    ``rollout run`` reports it in one line)."""


class _Shard:
    def __init__(self, index: int, link: Any, info: dict[str, Any] | None = None) -> None:
        self.index = index
        self.link = link
        self.info = info or {}  # the shard's "ready" message
        self.alive = True
        self.exit: str | None = None
        self.inflight: dict[int, Any] = {}
        self.outbox: list[Any] = []
        self.submits: list[Any] = []
        self.wake = trio.Event()
        self.known: set[int] = set()
        self.admitted = self.ended = self.reruns = self.dropped = 0
        self.by_status: collections.Counter[str] = collections.Counter()  # how its returned episodes ended
        self.counters: tuple[int, ...] = (0, 0, 0, 0)
        self.stats: EngineStatistics | None = None
        self.longest: tuple[float, tuple[Any, ...]] | None = None  # (received at, its tracker's longest running)
        self.calls: dict[int, list[Any]] = {}

    def post(self, message: Any) -> None:
        self.outbox.append(message)
        self.wake.set()


class _CoordinatorBackend:
    """The coordinator's stand-in for ``engine.backend``: the version lives in the
    shards' backends; statistics are merged from their latest snapshots (a dead shard's
    totals count, its gauges do not: :func:`~engine.shards._statistics.merge_statistics`)."""

    kind = "sharded"
    logprob_semantics = "processed"

    def __init__(self) -> None:
        self.version = 0
        self.engine: ShardedRolloutEngine | None = None

    def set_version(self, version: int) -> None:
        self.version = version

    def statistics(self) -> Any:
        engine = self.engine
        reported = [(s.stats.backend, s.alive) for s in engine._shards if s.stats is not None] if engine else []
        if not reported:
            return BackendStatistics(kind="sharded", version=self.version, logprob_semantics=self.logprob_semantics)
        return merge_statistics([snap for snap, _ in reported], alive=[up for _, up in reported])


class ShardedRolloutEngine(RolloutEngine):
    """Created by :func:`engine.shards.open_sharded_engine`; do not instantiate directly.

    The :class:`~engine.executor.RolloutEngine` API (``submit``, ``wait``,
    ``wait_results``, ``wait_for_task``, ``rollout_batch``, ``prepare_batch``,
    ``set_version``, ``update_weights``, ``pause``, ``resume``, ``restore``,
    ``statistics``) with the same semantics; differences:

    * workflows, ``should_accept_fn`` and dataset items must be picklable (they are
      sent to the shards): ``submit`` raises ``WorkflowError`` / ``ValueError``
      naming the object otherwise.
    * ``agenerate`` is the shards' (a workflow gets its shard's engine).
    * ``state_dict`` / ``load_state_dict``: the single engine's format
      (:mod:`engine._checkpoint`), so a state saved by either kind loads into the
      other; episodes dispatched to shards are saved as running (they start over on
      load, as in one engine).
    * Admission also waits while the result buffer is full (finished episodes are
      held by the coordinator, not by the shard that ran them), so at most
      ``buffer_capacity + C`` trajectories are held.
    """

    def __init__(self, nursery: trio.Nursery, shards: list[_Shard], config: EngineConfig, *,
                 dumper: Any = None, max_reruns: int = 2, record_admissions: bool = False,
                 frame_interval_s: float = 0.005, shard_timeout_s: float | None = None) -> None:
        backend = _CoordinatorBackend()
        super().__init__(nursery, backend, None, config, dumper)  # type: ignore[arg-type]
        backend.engine = self
        self._shards = shards
        self._live = list(shards)
        self._specs: dict[tuple[int, int], tuple[int, bytes, Any, Any]] = {}
        self._blobs: dict[int, bytes] = {}
        self._reruns: collections.Counter[int] = collections.Counter()
        self._max_reruns = max_reruns
        self._frame_interval_s = frame_interval_s
        self._shard_timeout_s = math.inf if shard_timeout_s is None else shard_timeout_s
        self._dead_error: ShardsDiedError | None = None
        self._next_call = 0
        self._holding_admission = False  # while a frame of results is taken in: admit once, after it
        self.admission_log: list[AdmissionRecord] | None = [] if record_admissions else None

    # -- what runs only in shards -----------------------------------------------------------------
    async def agenerate(self, req: Any) -> Any:
        raise RuntimeError("a sharded engine generates in its shards: workflows get their shard's engine")

    # -- checkpoints (the single engine's format and code: engine._checkpoint) ---------------------
    def load_state_dict(self, state: dict[str, Any], workflow: Any = None,
                        workflow_kwargs: dict[str, Any] | None = None, should_accept_fn: Any = None) -> list[int]:
        """As :meth:`RolloutEngine.load_state_dict` (a state saved by a sharded or a
        single engine); the re-submitted episodes are dispatched to the shards.

        Raises:
            ValueError: as :meth:`RolloutEngine.load_state_dict`; also a pending
                episode's data cannot be pickled.
            WorkflowError: ``workflow`` or ``should_accept_fn`` cannot be pickled.
            Either before anything is loaded.
        """
        self._checkpoint.check_loadable(state, workflow)
        if state["pending"]:  # what submit would refuse, before the state is half-loaded
            self._spec_key(self._resolve(workflow, workflow_kwargs), should_accept_fn)
            for p in state["pending"]:
                try:
                    dumps(p["data"])
                except Exception as exc:
                    raise ValueError(f"load_state_dict: the data of pending task {p['task_id']} cannot be pickled, "
                                     f"and a sharded engine sends each item to a shard process: {exc}") from exc
        return super().load_state_dict(state, workflow, workflow_kwargs, should_accept_fn)

    # -- submission and dispatch ------------------------------------------------------------------
    def submit(self, data: Any, workflow: Any, workflow_kwargs: dict[str, Any] | None = None,
               should_accept_fn: Any = None, group_size: int = 1, task_id: int | None = None) -> int:
        """As :meth:`RolloutEngine.submit` (``DatasetError`` for a batch); also raises ``WorkflowError`` (the
        workflow or filter cannot be pickled), ``ValueError`` (``data`` cannot be),
        and :class:`ShardsDiedError` (no shard is alive)."""
        if self._dead_error is not None:
            raise self._dead_error
        if self._admission.closed:
            raise trio.ClosedResourceError("the rollout engine is closed")
        if group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {group_size}")
        check_item(data, "submit: data", ITEMS_FIX)
        key = self._spec_key(self._resolve(workflow, workflow_kwargs), should_accept_fn)
        try:
            blob = dumps(data)  # (by value when it names __main__: the shard's __main__ is not the user's)
        except Exception as exc:
            raise ValueError(f"submit: data ({type(data).__name__}) cannot be pickled, and a sharded engine sends "
                             f"each item to a shard process: {exc}") from exc
        task_id = self._ledger.new_task(task_id)
        self._blobs[task_id] = blob
        self._admission.enqueue(_task(task_id, key, data, group_size))
        return task_id

    def _spec_key(self, workflow: Any, should_accept_fn: Any) -> int:
        """The key the shards know ``(workflow, should_accept_fn)`` by (pickled once)."""
        entry = self._specs.get((id(workflow), id(should_accept_fn)))
        if entry is None or entry[2] is not workflow or entry[3] is not should_accept_fn:
            try:
                blob = dumps((workflow, should_accept_fn))  # (a class of the user's script travels by value)
            except Exception as exc:
                culprit = f"the workflow ({type(workflow).__name__})"
                try:
                    dumps(workflow)
                except Exception:
                    pass
                else:  # the workflow pickles: the filter is what cannot
                    culprit = f"should_accept_fn ({getattr(should_accept_fn, '__qualname__', type(should_accept_fn).__name__)})"
                raise WorkflowError(f"a sharded engine sends the workflow and should_accept_fn to its shards, and "
                                    f"{culprit} cannot be pickled (define it at module level): {exc}") from exc
            entry = (len(self._specs), blob, workflow, should_accept_fn)
            self._specs[(id(workflow), id(should_accept_fn))] = entry
        return entry[0]

    def _admit_now(self) -> None:
        """Dispatch queued episodes while the global capacity allows, each to the live
        shard with the fewest in flight (one ``submit`` message per shard per pass;
        one pass per frame of results, not one per result)."""
        if self._holding_admission:
            return
        touched = []
        admission, buffer, log = self._admission, self._buffer, self.admission_log
        staleness, queue = admission.staleness, admission.queue
        if not (queue and not admission.closed and self._live and admission.unpaused.is_set()
                and buffer.rows < buffer.capacity):
            return
        # each admission lowers both terms of the capacity by one (running += 1): computed once per pass
        for _ in range(min(len(queue), staleness.capacity(admission.version))):
            task = admission.admit_next()
            shard = min(self._live, key=lambda s: len(s.inflight))
            shard.inflight[task.task_id] = task
            shard.admitted += 1
            key = task.workflow
            if key not in shard.known:
                shard.known.add(key)
                shard.outbox.append(("workflow", key, self._spec_blob(key)))
            if not shard.submits:
                touched.append(shard)
            shard.submits.append((task.task_id, key, task.group_size, self._blobs[task.task_id]))
            if log is not None:
                log.append(AdmissionRecord(task.task_id, shard.index, admission.version, staleness.accepted,
                                           tuple(len(s.inflight) for s in self._shards)))
        for shard in touched:
            shard.post(("submit", shard.submits))
            shard.submits = []

    def _spec_blob(self, key: int) -> bytes:
        for entry in self._specs.values():
            if entry[0] == key:
                return entry[1]
        raise KeyError(key)

    def _ended(self, result: EpisodeResult, *, was_running: bool) -> None:
        self._blobs.pop(result.task_id, None)  # every way an episode ends comes through here
        self._reruns.pop(result.task_id, None)
        super()._ended(result, was_running=was_running)

    def _take(self, results: list[EpisodeResult]) -> list[EpisodeResult]:
        taken = super()._take(results)
        if self._admission.queue:  # room in the buffer again: admission may have waited for it
            self._admission.wake()
        return taken

    def _refill(self) -> None:
        if self._dead_error is None:
            super()._refill()

    # -- versions, pause, weights -----------------------------------------------------------------
    def set_version(self, version: int) -> None:
        """As :meth:`RolloutEngine.set_version`; the shards get it before any episode
        dispatched after this call."""
        self._broadcast(("version", version))
        super().set_version(version)

    def pause(self) -> None:
        if not self.paused:
            self._broadcast(("pause",))
        super().pause()

    def resume(self) -> None:
        self._broadcast(("resume",))
        super().resume()

    async def update_weights(self, source: Any, *, version: int, mode: str = "abort") -> None:
        """As :meth:`RolloutEngine.update_weights`; dispatch pauses meanwhile.  Where the
        model lives in each shard (``sim``, ``hf``), every live shard updates at once
        (pauses, loads, sets the version, resumes); where every shard's client talks to
        the same servers (:attr:`weights_shared`), the servers load once
        (:mod:`engine.shards._weights`).

        Raises:
            BackendError: a shard's update failed (naming the shard; the version
                stays unless the weights were loaded).
        """
        was_paused = self.paused
        self.pause()
        try:
            if self.weights_shared:
                await update_shared_weights(self, source, version, mode)
                return
            outcomes = await self._call_all("update_weights", (source, version, mode))
            failed = [(i, v) for i, (ok, v) in outcomes.items() if not ok]
            if failed:
                raise weights_error(failed) from min(failed, key=lambda f: f[0])[1]
            super().set_version(version)  # (the shards set theirs inside update_weights)
        finally:
            if not was_paused:
                self.resume()

    @property
    def weights_shared(self) -> bool:
        """Every shard's backend declares ``weights_shared_across_clients`` (its weights
        live in servers all the shards' clients talk to: a weight update loads once)."""
        return bool(self._shards) and all(s.info.get("weights_shared") for s in self._shards)

    def _broadcast(self, message: Any) -> None:
        for shard in self._live:
            shard.post(message)

    async def _call(self, shard: _Shard, method: str, args: tuple[Any, ...] = ()) -> tuple[bool, Any]:
        self._next_call += 1
        slot: list[Any] = [trio.Event(), None]
        shard.calls[self._next_call] = slot
        shard.post(("call", self._next_call, method, args))
        await slot[0].wait()
        result: tuple[bool, Any] = slot[1]
        return result

    async def _call_all(self, method: str, args: tuple[Any, ...] = ()) -> dict[int, tuple[bool, Any]]:
        out: dict[int, tuple[bool, Any]] = {}

        async def one(shard: _Shard) -> None:
            out[shard.index] = await self._call(shard, method, args)

        async with trio.open_nursery() as nursery:
            for shard in list(self._live):
                nursery.start_soon(one, shard)
        return out

    async def refresh_statistics(self) -> EngineStatistics:
        """Ask every live shard for its engine's statistics now, then :meth:`statistics`
        (which otherwise uses snapshots at most ``stats_interval_s`` old)."""
        for index, (ok, value) in (await self._call_all("statistics")).items():
            if ok:
                self._shards[index].stats = value
        return self.statistics()

    async def backend_records(self) -> list[list[Any]]:
        """Each live shard's ``backend.requests`` (e.g. a recording ``SimBackend``), as tuples."""
        outcomes = await self._call_all("backend_records")
        return [outcomes[i][1] if outcomes.get(i, (False,))[0] else [] for i in range(len(self._shards))]

    # -- statistics -------------------------------------------------------------------------------
    def statistics(self) -> EngineStatistics:
        """A frozen snapshot; sync and cheap.  Counts and capacity are the coordinator's
        (exact, global); ``generated_tokens``, ``segments_resumed``,
        ``reward_fallbacks``, ``retokenization_drifts`` are sums over the shards as of
        their latest results (plus what ``load_state_dict`` restored); ``backend``
        sums the shards' latest backend snapshots; ``rewards`` is the shards'
        reward pools merged into one ``RewardPoolStatistics`` (as a single
        engine reports; latency percentiles: the highest shard's; each shard's own in
        :meth:`shard_statistics`).  A shard no longer alive counts with its last
        snapshot's totals and its gauges at 0 (nothing runs there:
        :data:`~engine.shards._statistics.GAUGES`)."""
        base = super().statistics()
        restored = self._ledger.counters()  # (0, or what load_state_dict restored)
        totals = [restored[i] + sum(s.counters[i] for s in self._shards) for i in range(4)]
        return replace(base, generated_tokens=totals[0], segments_resumed=totals[1], reward_fallbacks=totals[2],
                       retokenization_drifts=totals[3],
                       rewards=self._merged_rewards())

    def _merged_rewards(self) -> Any:
        """The shards' reward pool statistics as one (the type a single engine reports):
        totals over every shard, gauges over live ones (:func:`merge_statistics`); None
        before any shard has sent statistics or without reward pools."""
        reported = [(s.stats.rewards, s.alive) for s in self._shards
                    if s.stats is not None and s.stats.rewards is not None]
        if not reported:
            return None
        return merge_statistics([pool for pool, _ in reported], alive=[up for _, up in reported])

    def longest_running(self, top: int) -> tuple[Any, ...] | None:
        """The ``top`` longest-running episodes over the live shards (``EpisodeTiming``,
        longest first; ``seconds`` as of now, tokens and requests as of each shard's
        latest statistics, at most ``stats_interval_s`` old; episodes that ended since
        are left out), or None when the shards do not track episodes
        (``open_sharded_engine(track_episodes=False)``, the default)."""
        now, merged, tracked = trio.current_time(), [], False
        for shard in self._live:
            if shard.longest is None:
                continue
            tracked = True
            received, timings = shard.longest
            merged += [replace(t, seconds=t.seconds + now - received) for t in timings if t.task_id in shard.inflight]
        return tuple(sorted(merged, key=lambda t: -t.seconds)[:top]) if tracked else None

    def shard_statistics(self) -> list[ShardStatistics]:
        """One :class:`ShardStatistics` per shard (index order): what the coordinator
        knows of it (alive or how it ended, episodes dispatched, returned, re-run,
        dropped, and how those it returned ended) and its engine's latest statistics.
        Sync and cheap; the engine figures are up to ``stats_interval_s`` old while
        the shard runs (:meth:`refresh_statistics` asks every shard now)."""
        return [ShardStatistics(s.index, s.link.pid, s.link.kind, s.alive, s.exit, len(s.inflight), s.admitted,
                                s.ended, s.reruns, s.dropped, s.stats, accepted=s.by_status["accepted"],
                                rejected=s.by_status["rejected"], failed=s.by_status["failed"])
                for s in self._shards]

    @property
    def shard_pids(self) -> list[int | None]:
        """The shards' process ids (index order)."""
        return [s.link.pid for s in self._shards]

    # -- the shard channels -----------------------------------------------------------------------
    async def _serve_shard(self, shard: _Shard) -> None:
        """Read the shard's frames until its channel ends, or it sends nothing for
        ``shard_timeout_s`` (hung: it is killed); then, unless closing, treat it as
        dead (its episodes run again elsewhere)."""
        why = None
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._send_forever, shard)
            try:
                while True:
                    messages = None
                    with trio.move_on_after(self._shard_timeout_s) as silence:
                        messages = await shard.link.channel.receive()
                    if silence.cancelled_caught:
                        why = f"it sent nothing for {self._shard_timeout_s:g} s (shard_timeout_s): hung"
                        shard.link.kill()
                        break
                    if messages is None:
                        break
                    for message in messages:
                        self._on_message(shard, message)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError, EOFError,
                    pickle.UnpicklingError) as exc:
                why = f"its channel broke: {type(exc).__name__}: {exc}"
            nursery.cancel_scope.cancel()
        if self._admission.closed:
            return
        with trio.CancelScope(shield=True):
            reason = await shard.link.exit_reason()
        self._on_shard_death(shard, reason if why is None else f"{reason}; {why}")

    async def _send_forever(self, shard: _Shard) -> None:
        last_send = -math.inf
        while True:
            await shard.wake.wait()
            await trio.sleep_until(last_send + self._frame_interval_s)  # under load: one frame per interval
            last_send = trio.current_time()
            shard.wake = trio.Event()
            messages, shard.outbox = shard.outbox, []
            try:
                await shard.link.channel.send(messages)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                return  # the reader sees the channel end

    def _on_message(self, shard: _Shard, message: Any) -> None:
        kind = message[0]
        if kind == "ended":
            shard.counters = message[2]
            self._on_ended(shard, message[1])
        elif kind == "stats":
            shard.stats = message[1]
            if message[2] is not None:  # (open_sharded_engine(track_episodes=True))
                shard.longest = (trio.current_time(), message[2])
        elif kind == "reply":
            slot = shard.calls.pop(message[1], None)
            if slot is not None:
                slot[1] = (message[2], message[3])
                slot[0].set()
        elif kind in ("ready", "bye"):
            pass
        else:
            raise RuntimeError(f"engine shard {shard.index} sent an unknown message {kind!r}")

    def _on_ended(self, shard: _Shard, payload: Any) -> None:
        """Take in one frame of results (admission runs once, after the whole frame)."""
        inflight, buffer = shard.inflight, self._buffer
        self._holding_admission = True
        try:
            for values, trajectory in decode_results(payload):
                task_id, status, _, reason, error_type, error_message, member_errors, elapsed_s = values
                task = inflight.pop(task_id, None)
                if task is None:  # re-dispatched after this shard was given up, or already ended
                    shard.dropped += 1
                    continue
                shard.ended += 1
                result = self._admission.check_staleness(EpisodeResult(
                    task_id, status, trajectory=trajectory, reason=reason, error_type=error_type,
                    error_message=error_message, member_errors=member_errors, data=task.data, elapsed_s=elapsed_s))
                shard.by_status[result.status] += 1
                buffer.deposit(result)
                self._ended(result, was_running=True)
        finally:
            self._holding_admission = False
        self._admit_now()

    def _on_shard_death(self, shard: _Shard, why: str) -> None:
        """Take the dead shard's episodes back (queued again at the head, or failed
        after ``max_reruns``); if no shard is left, end everything and raise."""
        if not shard.alive:
            return
        shard.alive, shard.exit = False, why
        self._live.remove(shard)
        shard.link.kill()  # (a shard whose channel broke may still run: it must not run its episodes twice)
        for slot in shard.calls.values():
            slot[1] = (False, ShardsDiedError(f"engine shard {shard.index} died ({why})"))
            slot[0].set()
        shard.calls.clear()
        lost = list(shard.inflight.values())
        shard.inflight.clear()
        if not self._live:
            self._dead_error = ShardsDiedError(
                "every engine shard died: " + "; ".join(f"shard {s.index} (pid {s.link.pid}) {s.exit}"
                                                         for s in self._shards))
        logger.warning("engine shard %d (pid %s) %s; the %d episodes dispatched to it and not ended %s",
                       shard.index, shard.link.pid, why, len(lost),
                       "run again on the other shards" if self._live else "end as failed")
        again = []
        for task in lost:
            self._admission.requeued(task)
            self._reruns[task.task_id] += 1
            if self._live and self._reruns[task.task_id] <= self._max_reruns:
                again.append(task)
                shard.reruns += 1
            else:
                self._fail_queued(task, f"engine shard {shard.index} died ({why}) while running it"
                                  + ("" if not self._live else f", for the {self._reruns[task.task_id]}th time"))
        self._admission.queue.extendleft(reversed(again))
        if self._dead_error is not None:
            for task in self._admission.drain():
                self._fail_queued(task, "every engine shard died before it ran")
            self._buffer.wake_consumers()
            raise self._dead_error
        self._admit_now()

    def _fail_queued(self, task: Any, why: str) -> None:
        result = EpisodeResult(task.task_id, "failed", reason="shard_died", error_type="ShardsDiedError",
                               error_message=why, data=task.data)
        self._buffer.deposit(result)
        self._ended(result, was_running=False)

    def _end_dispatched(self) -> None:
        """At close: episodes still out on shards end as failed (``"cancelled"``); their
        late results are dropped."""
        for shard in self._shards:
            lost = list(shard.inflight.values())
            shard.inflight.clear()
            for task in lost:
                result = EpisodeResult(task.task_id, "failed", reason="cancelled", error_type="Cancelled",
                                       error_message="the engine closed while the episode ran", data=task.data)
                self._buffer.deposit(result)
                self._ended(result, was_running=True)


def _task(task_id: int, key: int, data: Any, group_size: int) -> Task:
    return Task(task_id, key, data, None, group_size)
