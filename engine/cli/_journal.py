"""The run folder of ``rollout run``: its options, its progress journal, resuming.

``OUT/`` holds (the data files are described in :mod:`engine.cli.outputs`):

- ``run.json``: the options that define the run (:data:`LOCKED_OPTIONS`) and how it
  executes (:data:`KEPT_OPTIONS`), the number of dataset items and a fingerprint of
  them; written atomically when the run starts, and again by a ``--resume`` that
  gives a kept option a new value (it is the run's from then on: ``config.toml``
  and every later ``--resume`` agree).
- ``progress.jsonl``: the journal, one JSON object per line, appended and flushed:

  - ``{"kind": "segment", "segment": s, "submitted": n, "version": v}``: segment
    ``s`` (0 for the first run, +1 per ``--resume``) submitted ``n`` episodes;
  - ``{"kind": "commit", "segment": s, "shard": "shard-000017" | null,
    "episodes": [[item, status, reason, error_type, error_message], ...], "rows": r,
    "reward_sum": x, "truncated": t, "generated_tokens": g, "rollouts_bytes": b,
    "wall_seconds": w, "version": v}``: these episodes ended (``item`` is the
    dataset index; ``status`` accepted, rejected or failed) and are durable;
  - ``{"kind": "end", "segment": s, "exit": "completed" | "SIGINT" | "SIGTERM" |
    "backend_unavailable" | "error", "cancelled": c, "reward_fallbacks": f, "wall_seconds": w,
    "version": v}`` (``backend_unavailable``: episodes failed for want of a server).
- ``.lock``: held (``flock``) by the process running in the folder.

Commit protocol.  The rows of an ended episode are appended to ``rollouts.jsonl``
at once; every ``shard_episodes`` accepted episodes (or ``commit_interval_s``
seconds) the accepted trajectories are saved to ``trajectories/.tmp-shard-N/``,
renamed to ``shard-N/``, and then the commit line is appended.  The commit line is
the commit point: what lies past the last complete one (rows past
``rollouts_bytes``, a shard no commit names, a torn last line) is provisional.
Readers ignore it, ``--resume`` removes it and runs those items again, so a
SIGKILL loses at most the episodes of the shard being filled.  (Files are flushed,
not fsynced: a kill of the process loses nothing committed; a power cut may.)

Resume.  An item whose episode ended accepted, rejected or failed (any reason but
``cancelled`` and those of :data:`RERUN_REASONS`) is done and never runs again; the
others (not started, cancelled by a signal, lost to a kill, failed for want of a
server) run in the next segment.  Each item therefore ends done exactly once over any
number of interruptions, and the counts of the segments add up: ``submitted ==
accepted + rejected + failed + cancelled + lost (+ in_progress)`` (an episode that failed
``backend_unavailable`` is counted failed in its segment, and its item runs again).
"""

from __future__ import annotations

import collections
import hashlib
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Set as AbstractSet
from typing import Any

__all__ = ["KEPT_OPTIONS", "LOCKED_OPTIONS", "RERUN_REASONS", "RunState", "locked_options", "open_run_dir", "read_journal", "resolve_resume_options",
           "write_json_atomic"]

#: Options that define a run's items and what their episodes mean; ``--resume``
#: takes them from ``run.json`` and refuses different values.
LOCKED_OPTIONS = ("dataset", "limit", "backend", "model", "n_samples", "group_size", "max_new_tokens",
                  "temperature", "seed", "consumer_batch_size", "max_head_offpolicyness",
                  # how the dataset's rows become items (engine.datasets._hf)
                  "split", "subset", "shuffle", "epochs", "prompt_key", "answer_key", "messages_key",
                  "system_prompt", "prompt_template", "skip_bad_rows",
                  # what an episode runs and how it is scored
                  "workflow", "workflow_kwargs", "reward", "reward_timeout",
                  # the policy's LoRA adapter: a resumed part without it would sample the base model
                  "lora", "lora_name")


#: Options of how a run executes (not what its episodes mean): saved in ``run.json``
#: too; ``--resume`` takes them from there unless given again; a value given again wins
#: and replaces the saved one (:func:`open_run_dir`), for every later ``--resume`` too.
KEPT_OPTIONS = ("concurrency", "shards", "shard_backend", "shard_timeout", "reward_backend", "scheduling",
                "scheduling_max_segments")


def locked_options(args: Any) -> list[str]:
    """:data:`LOCKED_OPTIONS` plus the simulated server's ``--sim-*`` options (the run's shape)."""
    return [*LOCKED_OPTIONS, *sorted(k for k in vars(args) if k.startswith("sim_"))]

RUN_FILE, JOURNAL, ROLLOUTS, SUMMARY, TRAJECTORIES, LOCK = (
    "run.json", "progress.jsonl", "rollouts.jsonl", "summary.json", "trajectories", ".lock")
SHARD_PREFIX, TMP_PREFIX = "shard-", ".tmp-"
DONE_STATUSES = ("accepted", "rejected", "failed")
#: Failure reasons of infrastructure, not of the item: committed (counted failed, with the
#: reason) but not done, so that ``--resume`` runs the item again.
RERUN_REASONS = ("backend_unavailable", "backend_timeout")  # no server / a server that never answered


def write_json_atomic(path: Path, obj: Any) -> None:
    """Write ``obj`` as JSON to ``path`` via a temp file and ``os.replace``."""
    tmp = path.with_name(f"{TMP_PREFIX}{path.name}")
    with tmp.open("w", encoding="utf-8") as f:
        f.write(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")
    os.replace(tmp, path)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def resolve_resume_options(args: Any, explicit: AbstractSet[str]) -> None:
    """For ``--resume DIR``: set ``args.out`` to DIR and every locked option to the
    value saved in ``DIR/run.json``.

    Raises:
        ValueError: DIR holds no run, ``--out`` names another folder, or an option
            given on the command line differs from the run's (names the option).
    """
    out = Path(args.resume)
    if "out" in explicit and Path(args.out).resolve() != out.resolve():
        raise ValueError(f"--resume {out} and --out {args.out} name different folders (--resume writes into its own)")
    args.out = out
    try:
        run = json.loads((out / RUN_FILE).read_text(encoding="utf-8"))
        saved = run["options"]
    except FileNotFoundError:
        raise ValueError(f"--resume {out}: no run to resume there (no {RUN_FILE})") from None
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"--resume {out}: {RUN_FILE} is unreadable ({exc})") from None
    for name in locked_options(args):
        if name not in saved:
            continue
        if name in explicit and getattr(args, name) != saved[name]:
            given, then = ("(unset)" if v is None else v for v in (getattr(args, name), saved[name]))
            raise ValueError(f"--resume {out}: {_flag(name)} {given} differs from the run's {_flag(name)} {then} "
                             "(it would change the items or what they mean)")
        setattr(args, name, _from_run_cwd(saved[name], run.get("cwd")) if name in _PATH_OPTIONS else saved[name])
    for name in KEPT_OPTIONS:
        if name in saved and name not in explicit and hasattr(args, name):
            setattr(args, name, saved[name])


#: Locked options that may name a file relative to the directory the run was started from.
_PATH_OPTIONS = ("dataset", "model", "reward", "workflow", "lora")


def _from_run_cwd(value: Any, cwd: Any) -> Any:
    """``value`` (a path, or ``path.py:name``) made absolute against the run's start
    directory ``cwd`` when it is relative and exists there, so that ``--resume``
    works from any directory; anything else (builtin:..., a module, a hub id) as is."""
    if not isinstance(value, str) or not isinstance(cwd, str) or not value:
        return value
    path, sep, name = value.rpartition(":") if value.rpartition(":")[0].endswith(".py") else (value, "", "")
    if Path(path).is_absolute() or not (Path(cwd) / path).exists():
        return value
    return f"{Path(cwd) / path}{sep}{name}"


def fingerprint(items: list[Any]) -> str:
    """A short hash of the dataset items (detects a dataset file edited between runs)."""
    h = hashlib.sha256()
    for item in items:
        h.update(json.dumps(item, sort_keys=True, default=repr).encode())
        h.update(b"\n")
    return h.hexdigest()[:16]


@dataclass
class RunState:
    """What the journal says about a run folder (cumulative over its segments).

    Attributes:
        done: dataset index -> status, for every item whose episode is committed.
        shards: committed shard folder names, in commit order.
        segments: per-segment counts (``submitted``, ``accepted``, ``rejected``,
            ``failed``, ``cancelled``, ``lost``, ``exit``, ``wall_seconds``, ...).
        segment: the number the next segment gets.
        journal_bytes: length of the valid prefix of the journal.
        rollouts_bytes: committed length of ``rollouts.jsonl``.
    """

    out: Path
    n_items: int = 0
    done: dict[int, str] = field(default_factory=dict)
    shards: list[str] = field(default_factory=list)
    segments: dict[int, dict[str, Any]] = field(default_factory=dict)
    failures: list[dict[str, Any]] = field(default_factory=list)
    rejected_by_reason: collections.Counter[str] = field(default_factory=collections.Counter)
    failed_by_reason: collections.Counter[str] = field(default_factory=collections.Counter)
    rows: int = 0
    reward_sum: float = 0.0
    truncated: int = 0
    generated_tokens: int = 0
    journal_bytes: int = 0
    rollouts_bytes: int = 0
    version: int = 0
    lock_fd: int | None = None

    @property
    def segment(self) -> int:
        return max(self.segments, default=-1) + 1

    @property
    def next_shard(self) -> int:
        return max((int(s[len(SHARD_PREFIX):]) for s in self.shards), default=-1) + 1

    def _seg(self, s: int) -> dict[str, Any]:
        return self.segments.setdefault(s, {"segment": s, "submitted": 0, "accepted": 0, "rejected": 0, "failed": 0,
                                            "cancelled": 0, "exit": None, "wall_seconds": 0.0,
                                            "reward_fallbacks": 0})

    def apply(self, rec: dict[str, Any]) -> None:
        """Fold one journal record in."""
        seg = self._seg(int(rec["segment"]))
        self.version = int(rec.get("version", self.version))
        kind = rec["kind"]
        if kind == "segment":
            seg["submitted"] = int(rec["submitted"])
        elif kind == "commit":
            for item, status, reason, error_type, error_message in rec["episodes"]:
                if not (status == "failed" and reason in RERUN_REASONS):
                    self.done[int(item)] = status
                seg[status] += 1
                if status == "rejected":
                    self.rejected_by_reason[reason] += 1
                elif status == "failed":
                    self.failed_by_reason[reason] += 1
                    self.failures.append({"task_id": item, "reason": reason, "error_type": error_type,
                                          "error_message": error_message})
            if rec.get("shard"):
                self.shards.append(rec["shard"])
            self.rows += int(rec["rows"])
            self.reward_sum += float(rec["reward_sum"])
            self.truncated += int(rec["truncated"])
            self.generated_tokens += int(rec["generated_tokens"])
            self.rollouts_bytes = int(rec["rollouts_bytes"])
            seg["wall_seconds"] = float(rec["wall_seconds"])
        elif kind == "end":
            seg.update(exit=rec["exit"], cancelled=int(rec["cancelled"]), wall_seconds=float(rec["wall_seconds"]),
                       reward_fallbacks=int(rec["reward_fallbacks"]))

    def segment_records(self, live: int | None = None) -> list[dict[str, Any]]:
        """Per-segment counts; a segment with no ``end`` line (other than ``live``)
        was killed: its episodes that were not committed are ``lost``."""
        out = []
        for s, seg in sorted(self.segments.items()):
            rec = dict(seg)
            ended = rec["accepted"] + rec["rejected"] + rec["failed"] + rec["cancelled"]
            if s == live:
                rec["exit"] = "running"
                rec["in_progress"] = rec["submitted"] - ended
                rec["lost"] = 0
            else:
                rec["exit"] = rec["exit"] or "killed"
                rec["lost"] = rec["submitted"] - ended
            out.append(rec)
        return out


def read_journal(out: Path) -> RunState:
    """Replay ``OUT/progress.jsonl`` (its valid prefix: complete JSON lines up to
    the first torn or unreadable one) into a :class:`RunState`."""
    state = RunState(out)
    try:
        data = (out / JOURNAL).read_bytes()
    except FileNotFoundError:
        data = b""
    pos = 0
    while True:
        end = data.find(b"\n", pos)
        if end < 0:
            break
        try:
            rec = json.loads(data[pos:end])
            state.apply(rec)
        except (ValueError, KeyError, TypeError):
            break  # a torn or foreign line: the valid prefix ends here
        pos = end + 1
    state.journal_bytes = pos
    try:
        state.n_items = int(json.loads((out / RUN_FILE).read_text(encoding="utf-8"))["n_items"])
    except (FileNotFoundError, ValueError, KeyError, TypeError):
        pass
    return state


def _lock(out: Path) -> int:
    fd = os.open(out / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        import fcntl

        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except ImportError:  # no flock on this platform: no guard
        pass
    except OSError:
        os.close(fd)
        raise ValueError(f"{out} is in use by another rollout run") from None
    return fd


def _clear_outputs(out: Path) -> None:
    for name in (RUN_FILE, JOURNAL, ROLLOUTS, SUMMARY):
        (out / name).unlink(missing_ok=True)
    shutil.rmtree(out / TRAJECTORIES, ignore_errors=True)


def _repair(state: RunState) -> None:
    """Drop what lies past the last commit (see the module docstring)."""
    out = state.out
    with (out / JOURNAL).open("ab") as f:
        f.truncate(state.journal_bytes)
    rollouts = out / ROLLOUTS
    size = rollouts.stat().st_size if rollouts.exists() else 0
    if size < state.rollouts_bytes:
        raise ValueError(f"{rollouts} has {size} bytes but the journal committed {state.rollouts_bytes}: "
                         "the folder was modified; it cannot be resumed")
    with rollouts.open("ab") as f:
        f.truncate(state.rollouts_bytes)
    traj = out / TRAJECTORIES
    traj.mkdir(exist_ok=True)
    committed = set(state.shards)
    for entry in traj.iterdir():
        if entry.name.startswith((SHARD_PREFIX, TMP_PREFIX)) and entry.name not in committed:
            shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
    missing = [s for s in state.shards if not (traj / s).is_dir()]
    if missing:
        raise ValueError(f"{traj}: committed shards are missing ({', '.join(missing[:3])}): "
                         "the folder was modified; it cannot be resumed")


def _keep_options(out: Path, run: dict[str, Any], options: dict[str, Any]) -> None:
    """Save in ``run.json`` the :data:`KEPT_OPTIONS` a ``--resume`` runs with, when
    they differ from the saved ones (an option given again on ``--resume``)."""
    kept = {name: options[name] for name in KEPT_OPTIONS if name in options}
    saved = run.get("options") or {}
    if any(name not in saved or saved[name] != value for name, value in kept.items()):
        write_json_atomic(out / RUN_FILE, {**run, "options": {**saved, **kept}})


def open_run_dir(out: Path, options: dict[str, Any], items: list[Any], *, resume: bool) -> RunState:
    """Take the run folder for this process (sync; run it in a thread).

    A fresh run writes ``run.json`` and empty outputs; it replaces the outputs of
    a finished run in ``out`` but refuses an unfinished one.  A resumed run checks
    the dataset fingerprint, saves the :data:`KEPT_OPTIONS` of ``options`` in
    ``run.json`` (those given again replace the run's) and repairs the folder to
    its last commit.

    Raises:
        ValueError: ``out`` holds an unfinished run (fresh run), the dataset
            changed (resume), the folder is in use or was modified.
        OSError: ``out`` cannot be created or written.
    """
    out.mkdir(parents=True, exist_ok=True)
    fd = _lock(out)
    try:
        if resume:
            run = json.loads((out / RUN_FILE).read_text(encoding="utf-8"))
            if run.get("fingerprint") != fingerprint(items) or run.get("n_items") != len(items):
                raise ValueError(f"--resume {out}: the dataset {options.get('dataset')!r} changed since the run "
                                 f"started ({len(items)} items now, {run.get('n_items')} then, or other content)")
            _keep_options(out, run, options)
            state = read_journal(out)
            _repair(state)
        else:
            if (out / RUN_FILE).exists():
                prior = read_journal(out)
                if prior.segments and len(prior.done) < prior.n_items:  # (a run that never started is replaced)
                    raise ValueError(f"{out} holds an unfinished run ({len(prior.done)} of {prior.n_items} items "
                                     f"done); continue it with --resume {out}, or choose another --out")
            _clear_outputs(out)
            write_json_atomic(out / RUN_FILE, {"format": 1, "options": options, "n_items": len(items),
                                               "fingerprint": fingerprint(items), "cwd": os.getcwd()})
            for name in (JOURNAL, ROLLOUTS):
                (out / name).write_bytes(b"")
            (out / TRAJECTORIES).mkdir()
            state = RunState(out)
        state.n_items = len(items)
    except BaseException:
        os.close(fd)
        raise
    state.lock_fd = fd
    return state
