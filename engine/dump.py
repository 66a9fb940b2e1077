"""Trajectory dumps: one JSONL record per trajectory under ``DIR/<version>/``.

Fields follow AReaL's rollout dumps: ``task_id``, ``sample_idx``, ``seqlen``,
``prompt_len``, ``head_version`` / ``tail_version`` (oldest / newest policy
version over *generated* tokens only), ``version_rle`` (run-length encoding
``[[version, n_tokens], ...]`` over generated tokens), ``reward``, ``prompt``,
``completion`` (decoded when a tokenizer is given, else ``null``), and
``segments`` (``[[start, end, loss_mask], ...]`` runs over the sequence, which
describe multi-turn masks).  ``<version>`` is the engine's version when the
episode ended.

Episodes only hand a reference to the writer (``record`` is sync and O(1));
decoding and serialisation run in a worker thread and files are appended with
trio's async file I/O, all in the writer task, off the episodes' hot path.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import trio

__all__ = ["TrajectoryDumper", "trajectory_records"]


def _runs(values: list[int]) -> list[list[int]]:
    runs: list[list[int]] = []
    for v in values:
        if runs and runs[-1][0] == v:
            runs[-1][1] += 1
        else:
            runs.append([v, 1])
    return runs


def trajectory_records(result: Any, tokenizer: Any = None) -> list[dict[str, Any]]:
    """JSON-ready records, one per row of an accepted result's trajectory."""
    traj = result.trajectory
    records = []
    for i in range(traj.batch_size[0]):
        real = traj["attention_mask"][i]  # [T] bool
        ids = traj["input_ids"][i][real].tolist()
        mask = traj["loss_mask"][i][real].tolist()
        gen_versions = [v for v, m in zip(traj["versions"][i][real].tolist(), mask) if m]
        segments, start = [], 0
        for (value, n) in _runs(mask):
            segments.append([start, start + n, value])
            start += n
        prompt_len = mask.index(1) if 1 in mask else len(mask)
        record = {
            "task_id": result.task_id,
            "sample_idx": i,
            "seqlen": len(ids),
            "prompt_len": prompt_len,
            "head_version": min(gen_versions) if gen_versions else None,
            "tail_version": max(gen_versions) if gen_versions else None,
            "version_rle": _runs(gen_versions),
            "reward": float(traj["rewards"][i]),
            "prompt": None,
            "completion": None,
            "segments": segments,
        }
        if tokenizer is not None:
            record["prompt"] = tokenizer.decode(ids[:prompt_len], skip_special_tokens=False)
            record["completion"] = tokenizer.decode([t for t, m in zip(ids, mask) if m], skip_special_tokens=False)
        records.append(record)
    return records


class TrajectoryDumper:
    """Collects accepted results and appends their records under ``dump_dir``.

    Args:
        dump_dir: root folder (created on first write).
        tokenizer: decodes prompt/completion text when given.
    """

    def __init__(self, dump_dir: str | Path, tokenizer: Any = None) -> None:
        self.dump_dir = Path(dump_dir)
        self.tokenizer = tokenizer
        self._send, self._recv = trio.open_memory_channel[tuple[int, Any]](math.inf)
        self.records_written = 0

    def record(self, result: Any, version: int) -> None:
        """Queue an accepted result for writing (sync, never blocks)."""
        self._send.send_nowait((version, result))

    def close(self) -> None:
        """No more records; :meth:`run` drains what is queued and returns."""
        self._send.close()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        async with self._recv:
            while True:
                try:
                    batch = [await self._recv.receive()]
                except trio.EndOfChannel:
                    return
                while True:  # take everything queued: one thread hop and one append per version
                    try:
                        batch.append(self._recv.receive_nowait())
                    except (trio.WouldBlock, trio.EndOfChannel):
                        break
                await self._write(batch)

    async def _write(self, batch: list[tuple[int, Any]]) -> None:
        def serialise() -> dict[int, str]:
            lines: dict[int, list[str]] = {}
            for version, result in batch:
                for rec in trajectory_records(result, self.tokenizer):
                    lines.setdefault(version, []).append(json.dumps(rec, ensure_ascii=False))
            return {v: "\n".join(ls) + "\n" for v, ls in lines.items()}

        with trio.CancelScope(shield=True):  # a flush in progress completes
            by_version = await trio.to_thread.run_sync(serialise)
            for version, text in by_version.items():
                folder = trio.Path(self.dump_dir) / str(version)
                await folder.mkdir(parents=True, exist_ok=True)
                async with await trio.open_file(folder / "trajectories.jsonl", "a", encoding="utf-8") as f:
                    await f.write(text)
                self.records_written += text.count("\n")
