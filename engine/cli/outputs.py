"""The outputs of ``rollout run``, written as episodes end, and their loaders.

``OUT/`` (``--out``, or the folder given to ``--resume``)::

    rollouts.jsonl               one line per trajectory row, appended (and flushed) as each
                                 episode ends: task_id (= item, the dataset index), sample,
                                 prompt, completion, reward, reward_is_fallback, stop_reason,
                                 prompt_tokens, completion_tokens
    trajectories/shard-000000/   accepted trajectories, one shard per ``shard_episodes``
                                 accepted episodes (or per commit interval), written to a temp
                                 folder and renamed; each is a TensorDict memmap folder
                                 (``TensorDict.load(shard)`` reads it without trio-rollout)
    summary.json                 rewritten atomically at every commit and at exit
    run.json, progress.jsonl     the run's options and its journal (:mod:`engine.cli._journal`)

Rows in ``rollouts.jsonl`` and shards follow completion order;
:func:`load_trajectories` returns dataset order.  Only committed data counts: after
a SIGKILL, rows past the last commit are provisional (``--resume`` removes them and
runs their items again), and the loaders ignore them.

The writer (:class:`RunWriter`) is one trio task: episodes hand it their result
(``record``, sync and O(1)); decoding runs in a worker thread; files are appended
with trio's async file I/O; shards are saved in a worker thread.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio

from ._journal import (JOURNAL, ROLLOUTS, SUMMARY, TMP_PREFIX, TRAJECTORIES, RunState, read_journal,
                       write_json_atomic)

__all__ = ["RunWriter", "load_rollouts", "load_trajectories", "rollout_rows"]


def rollout_rows(result: Any, tokenizer: Any) -> list[dict[str, Any]]:
    """The ``rollouts.jsonl`` rows of an accepted result, one per trajectory row."""
    traj = result.trajectory
    rows = []
    for i in range(traj.batch_size[0]):
        real = traj["attention_mask"][i]  # [T] bool
        ids = traj["input_ids"][i][real]
        gen = traj["loss_mask"][i][real].bool()
        prompt_ids, completion_ids = ids[~gen].tolist(), ids[gen].tolist()
        rows.append({
            "task_id": result.task_id,
            "sample": i,
            "prompt": tokenizer.decode(prompt_ids, skip_special_tokens=False),
            "completion": tokenizer.decode(completion_ids, skip_special_tokens=True),
            "reward": float(traj["rewards"][i]),
            "reward_is_fallback": bool(traj["reward_is_fallback"][i]) if "reward_is_fallback" in traj.keys()
            else False,
            "stop_reason": "length" if bool(traj["is_truncated"][i]) else "stop",
            "prompt_tokens": len(prompt_ids),
            "completion_tokens": len(completion_ids),
            **{key: traj[key][i].item() for key in ("num_turns", "retokenization_drift") if key in traj.keys()},
        })
    return rows


def _encode(results: list[Any], tokenizer: Any) -> list[tuple[bytes, list[float]]]:
    """Per result: its rows as JSONL bytes and [rows, reward_sum, truncated, completion_tokens]."""
    out = []
    for r in results:
        if r.status != "accepted":
            out.append((b"", [0, 0.0, 0, 0]))
            continue
        rows = rollout_rows(r, tokenizer)
        text = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
        out.append((text.encode("utf-8"), [len(rows), sum(x["reward"] for x in rows),
                                           sum(x["stop_reason"] == "length" for x in rows),
                                           sum(x["completion_tokens"] for x in rows)]))
    return out


def _save_shard(folder: Path, name: str, batch: Any) -> None:
    tmp = folder / f"{TMP_PREFIX}{name}"
    shutil.rmtree(tmp, ignore_errors=True)
    batch.memmap(tmp)
    os.rename(tmp, folder / name)  # atomic: a shard folder is complete or absent


class RunWriter:
    """Writes one segment's outputs into a run folder (see the module docstring).

    Args:
        state: the run folder, opened by :func:`engine.cli._journal.open_run_dir`;
            kept up to date with every journal line written.
        tokenizer: decodes ``rollouts.jsonl`` text.
        shard_episodes: accepted episodes per trajectory shard (a commit).
        commit_interval_s: seconds an ended episode waits at most for its commit.
        summary_fields: ``() -> dict`` merged into every summary (run options,
            live engine statistics: ``final_version``, ``reward_fallbacks``, ...).
    """

    def __init__(self, state: RunState, tokenizer: Any, *, shard_episodes: int = 64,
                 commit_interval_s: float = 10.0, summary_fields: Callable[[], dict[str, Any]] = dict) -> None:
        if shard_episodes < 1:
            raise ValueError(f"shard_episodes must be >= 1, got {shard_episodes}")
        if not commit_interval_s > 0:
            raise ValueError(f"commit_interval_s must be > 0, got {commit_interval_s}")
        self.state = state
        self.tokenizer = tokenizer
        self.shard_episodes = shard_episodes
        self.commit_interval_s = commit_interval_s
        self.summary_fields = summary_fields
        self.segment = state.segment
        self._send, self._recv = trio.open_memory_channel[tuple[str, Any]](math.inf)
        self._pending: list[tuple[Any, int, list[float]]] = []  # (result, rollouts end offset, stats)
        self._pending_accepted = 0
        self._pending_since = 0.0
        self._bytes = state.rollouts_bytes
        self._start = time.perf_counter()
        self._started = False
        self.recorded = 0  # results handed to record(), this segment
        self.cancelled = 0
        self.unavailable = 0  # failed backend_unavailable, this segment (no server for the window: exit 75)
        self.summary: dict[str, Any] = {}
        self._done = trio.Event()

    # -- the producer side (sync) -----------------------------------------------------
    def begin(self, submitted: int) -> None:
        """The segment has submitted ``submitted`` episodes (journal ``segment`` line); its
        ``wall_seconds`` count from here (start-up, e.g. loading the model, is reported apart)."""
        self._start = time.perf_counter()
        self._send.send_nowait(("segment", submitted))

    def record(self, result: Any) -> None:
        """An episode ended (any status); its outputs follow."""
        self.recorded += 1
        self.unavailable += result.status == "failed" and result.reason == "backend_unavailable"
        self._send.send_nowait(("result", result))

    def end(self, exit: str) -> None:
        """No more results: commit what is pending, write the ``end`` line
        (``exit``: ``"completed"``, ``"SIGINT"``, ``"SIGTERM"``, ``"backend_unavailable"`` or
        ``"error"``) and the summary."""
        self._send.send_nowait(("end", exit))
        self._send.close()

    async def wait_closed(self) -> None:
        """Until the writer task has written everything (after :meth:`end`)."""
        await self._done.wait()

    # -- the writer task ---------------------------------------------------------------
    @property
    def version(self) -> int:
        return int(self.summary_fields().get("final_version", self.state.version))

    def _wall(self) -> float:
        return time.perf_counter() - self._start

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        out = self.state.out
        try:
            async with await trio.open_file(out / ROLLOUTS, "ab") as rollouts, \
                    await trio.open_file(out / JOURNAL, "ab") as journal:
                self._rollouts, self._journal = rollouts, journal
                task_status.started()
                async with self._recv:
                    while True:
                        deadline = self._pending_since + self.commit_interval_s if self._pending else math.inf
                        msgs: list[tuple[str, Any]] = []
                        with trio.move_on_at(deadline):
                            try:
                                msgs.append(await self._recv.receive())
                            except trio.EndOfChannel:
                                return
                        while True:
                            try:
                                msgs.append(self._recv.receive_nowait())
                            except (trio.WouldBlock, trio.EndOfChannel):
                                break
                        if await self._handle(msgs):
                            return
                        if self._pending and time.perf_counter() >= self._pending_since + self.commit_interval_s:
                            await self._commit()
        finally:
            self._done.set()

    async def _handle(self, msgs: list[tuple[str, Any]]) -> bool:
        """Process messages in order; True after ``end``."""
        i = 0
        while i < len(msgs):
            kind, payload = msgs[i]
            if kind == "segment":
                self._started = True
                await self._append({"kind": "segment", "segment": self.segment, "submitted": payload,
                                    "version": self.version})
                await self._write_summary("running")
                i += 1
            elif kind == "result":
                j = i
                while j < len(msgs) and msgs[j][0] == "result":
                    j += 1
                await self._results([m[1] for m in msgs[i:j]])
                i = j
            else:  # end
                await self._commit()
                if self._started:
                    fields = self.summary_fields()
                    await self._append({"kind": "end", "segment": self.segment, "exit": payload,
                                        "cancelled": self.cancelled, "wall_seconds": self._wall(),
                                        "reward_fallbacks": int(fields.get("reward_fallbacks", 0)),
                                        "version": self.version})
                await self._write_summary(payload)
                return True
        return False

    async def _results(self, results: list[Any]) -> None:
        kept = []
        for r in results:
            if r.status == "failed" and r.reason == "cancelled":
                self.cancelled += 1  # not done: its item runs again on --resume
            else:
                kept.append(r)
        if not kept:
            return
        encoded = await trio.to_thread.run_sync(_encode, kept, self.tokenizer)
        unwritten: list[bytes] = []  # rows reach the file one shard at a time: a kill loses at most one
        for r, (text, stats) in zip(kept, encoded):
            unwritten.append(text)
            self._bytes += len(text)
            if not self._pending:
                self._pending_since = time.perf_counter()
            self._pending.append((r, self._bytes, stats))
            self._pending_accepted += r.status == "accepted"
            if self._pending_accepted >= self.shard_episodes:
                await self._write_rows(unwritten)
                await self._commit()
        await self._write_rows(unwritten)

    async def _write_rows(self, unwritten: list[bytes]) -> None:
        data = b"".join(unwritten)
        unwritten.clear()
        if data:
            await self._rollouts.write(data)
            await self._rollouts.flush()

    async def _commit(self) -> None:
        if not self._pending:
            return
        from ..data import concat_padded_tensors

        accepted = [r.trajectory for r, _, _ in self._pending if r.status == "accepted"]
        shard = None
        if accepted:
            shard = f"shard-{self.state.next_shard:06d}"
            batch = concat_padded_tensors(accepted)
            await trio.to_thread.run_sync(_save_shard, self.state.out / TRAJECTORIES, shard, batch)
        totals = [sum(s[k] for _, _, s in self._pending) for k in range(4)]
        await self._append({
            "kind": "commit", "segment": self.segment, "shard": shard,
            "episodes": [[r.task_id, r.status, r.reason, r.error_type, r.error_message] for r, _, _ in self._pending],
            "rows": totals[0], "reward_sum": totals[1], "truncated": totals[2], "generated_tokens": totals[3],
            "rollouts_bytes": self._pending[-1][1], "wall_seconds": self._wall(), "version": self.version,
        })
        self._pending.clear()
        self._pending_accepted = 0
        await self._write_summary("running")

    async def _append(self, rec: dict[str, Any]) -> None:
        await self._journal.write((json.dumps(rec, ensure_ascii=False) + "\n").encode("utf-8"))
        await self._journal.flush()
        self.state.apply(rec)

    async def _write_summary(self, exit: str) -> None:
        self.summary = self.build_summary(exit)
        await trio.to_thread.run_sync(write_json_atomic, self.state.out / SUMMARY, self.summary)

    def build_summary(self, exit: str) -> dict[str, Any]:
        """Cumulative over the run's segments (see :mod:`engine.cli._journal`)."""
        st = self.state
        live = exit == "running"
        segments = st.segment_records(live=self.segment if live else None)
        fields = self.summary_fields()
        for seg in segments:
            if live and seg["segment"] == self.segment:  # not yet in the journal: the live values
                seg["wall_seconds"] = self._wall()
                seg["reward_fallbacks"] = int(fields.get("reward_fallbacks", 0))
        total = {k: sum(s.get(k, 0) for s in segments)
                 for k in ("submitted", "accepted", "rejected", "failed", "cancelled", "lost", "in_progress")}
        wall = sum(s["wall_seconds"] for s in segments)
        rows = st.rows
        summary = {
            **total,
            "rejected_by_reason": dict(st.rejected_by_reason),
            "failed_by_reason": dict(st.failed_by_reason),
            "failures": list(st.failures),
            "items": st.n_items,
            "items_done": len(st.done),
            "exit": exit,
            "trajectories": rows,
            "reward_fallbacks": sum(s["reward_fallbacks"] for s in segments),
            "reward_mean": st.reward_sum / rows if rows else 0.0,
            "truncation_rate": st.truncated / rows if rows else 0.0,
            "generated_tokens": st.generated_tokens,
            "wall_seconds": wall,
            "generated_tokens_per_second": st.generated_tokens / wall if wall > 0 else 0.0,
            "segments": segments,
        }
        for k, v in fields.items():
            if k != "reward_fallbacks":
                summary.setdefault(k, v)
        return summary


# -- loaders ---------------------------------------------------------------------------
def _shards(out: Path) -> list[Path]:
    traj = out / TRAJECTORIES
    if (out / JOURNAL).exists():
        return [traj / name for name in read_journal(out).shards]
    if (traj / "meta.json").exists():  # the single-folder layout of earlier versions
        return [traj]
    return sorted(p for p in traj.glob("shard-*") if p.is_dir())


def load_trajectories(out: str | Path) -> Any:
    """Every committed shard of a ``rollout run`` folder as one padded batch.

    Args:
        out: the folder given as ``--out`` (or ``--resume``).

    Returns:
        A ``TensorDict`` with batch size ``[N]`` (all accepted trajectory rows) and
        the fields of :data:`engine.data.TRAJECTORY_SCHEMA` plus ``group_id [N]
        int64`` (the dataset index), ``group_size [N] int32`` and
        ``reward_is_fallback [N] bool``, right-padded on the token dim
        (:func:`engine.data.concat_padded_tensors`); rows in dataset order, then
        sample order.  An empty ``TensorDict`` (batch ``[0]``) when nothing was
        committed.

    Raises:
        FileNotFoundError: a committed shard is missing.
        ValueError: shards have different key sets or dtypes.
    """
    import torch
    from tensordict import TensorDict

    from ..data import concat_padded_tensors

    out = Path(out)
    parts = []
    for shard in _shards(out):
        if not shard.is_dir():
            raise FileNotFoundError(f"committed shard {shard} is missing")
        parts.append(TensorDict.load(shard))
    batch = concat_padded_tensors(parts)
    if "group_id" in batch.keys():
        order = torch.argsort(batch["group_id"], stable=True)
        batch = batch[order]
    return batch


def load_rollouts(out: str | Path) -> list[dict[str, Any]]:
    """The committed rows of ``OUT/rollouts.jsonl`` (completion order)."""
    out = Path(out)
    data = (out / ROLLOUTS).read_bytes()
    if (out / JOURNAL).exists():
        data = data[:read_journal(out).rollouts_bytes]
    return [json.loads(line) for line in data.decode("utf-8").splitlines() if line.strip()]
