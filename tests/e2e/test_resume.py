"""End-to-end tier: interrupted and resumed ``rollout run`` (real processes, real
signals, the sim backend, real reward worker processes).

Runs are children of a fork server (``tests/fixtures/forkserver.py``: torch is imported
once, so a run starts in well under a second) and are interrupted at points drawn
from a seeded RNG, synchronised on output progress (the journal's segment line,
then the k-th new row of ``rollouts.jsonl``), never on fixed sleeps.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engine.cli import load_rollouts, load_trajectories

ROOT = Path(__file__).resolve().parents[2]
N_SAMPLES = 2
SHARD = 4


class ForkServer:
    def __init__(self, logs: Path) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               "OMP_NUM_THREADS": "1"}
        self.logs = logs
        self.proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "fixtures" / "forkserver.py")], cwd=ROOT, env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert json.loads(self.proc.stdout.readline()) == {"ready": True}
        self.n = 0

    def _ask(self, obj: dict) -> dict:
        self.proc.stdin.write(json.dumps(obj) + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def start(self, argv: list[str]) -> tuple[int, Path]:
        self.n += 1
        err = self.logs / f"{self.n}.err"
        pid = self._ask({"argv": argv, "stdout": str(self.logs / f"{self.n}.out"), "stderr": str(err)})["pid"]
        return pid, err

    def wait(self, pid: int, timeout: float = 60.0) -> int:
        deadline = time.monotonic() + timeout
        while _alive(pid):
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                self._ask({"wait": pid})
                pytest.fail(f"run {pid} did not end within {timeout} s")
            time.sleep(0.005)
        return self._ask({"wait": pid})["rc"]

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)
        self.proc.stdout.close()


def _alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie waiting for the server's waitpid is not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.fixture(scope="module")
def forkserver(tmp_path_factory):
    server = ForkServer(tmp_path_factory.mktemp("forkserver-logs"))
    yield server
    server.close()


def _journal(out: Path) -> list[dict]:
    path = out / "progress.jsonl"
    if not path.exists():
        return []
    lines = []
    for line in path.read_bytes().split(b"\n"):
        try:
            lines.append(json.loads(line))
        except ValueError:
            break
    return lines


def _rows_on_disk(out: Path) -> int:
    try:
        return (out / "rollouts.jsonl").read_bytes().count(b"\n")
    except FileNotFoundError:
        return 0


def _run_args(n_items: int, out: Path, resume: bool) -> list[str]:
    where = ["--resume", str(out)] if resume else ["--out", str(out)]
    return ["run", "--backend", "sim", "--dataset", f"builtin:arith:{n_items}", "--n-samples", str(N_SAMPLES),
            "--max-new-tokens", "16", "--concurrency", "8", "--sim-per-token-s", "0.002", "--shard-episodes",
            str(SHARD), "--quiet", "--reward-timeout", "60", *where]


def _interrupt(server: ForkServer, argv: list[str], out: Path, segment: int, after_rows: int, signum: int,
               timeout: float = 60.0) -> tuple[int, str, bool]:
    """Start a run; once its segment has started and ``after_rows`` new rows are on
    disk, send ``signum``.  Returns (exit status, stderr, whether it was signalled)."""
    rows_before = _rows_on_disk(out)
    pid, err = server.start(argv)
    deadline = time.monotonic() + timeout
    signalled = False
    while _alive(pid) and time.monotonic() < deadline:
        started = any(r.get("kind") == "segment" and r["segment"] == segment for r in _journal(out))
        if started and _rows_on_disk(out) - rows_before >= after_rows:
            os.kill(pid, signum)
            signalled = True
            break
        time.sleep(0.002)
    rc = server.wait(pid, timeout)
    return rc, err.read_text(), signalled


def _check_consistent(out: Path, n_items: int, *, final: bool) -> dict:
    """Journal, shards, rows and summary agree; no item is done twice."""
    journal = _journal(out)
    items = [e[0] for r in journal if r["kind"] == "commit" for e in r["episodes"]]
    assert len(items) == len(set(items)), "an item was committed twice"
    accepted = {e[0] for r in journal if r["kind"] == "commit" for e in r["episodes"] if e[1] == "accepted"}
    rows = load_rollouts(out)
    keys = [(r["task_id"], r["sample"]) for r in rows]
    assert len(keys) == len(set(keys)) and {r["task_id"] for r in rows} == accepted
    batch = load_trajectories(out)
    assert batch.batch_size[0] == len(rows) == N_SAMPLES * len(accepted)
    if rows:
        assert batch["group_id"].tolist() == sorted(t for t, _ in keys)
        assert int(batch["loss_mask"].sum()) == sum(r["completion_tokens"] for r in rows)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["items_done"] == len(items) and summary["items"] == n_items
    assert summary["accepted"] == len(accepted) and summary["trajectories"] == len(rows)
    assert summary["submitted"] == sum(summary[k] for k in ("accepted", "rejected", "failed", "cancelled", "lost",
                                                            "in_progress"))
    for key in ("submitted", "accepted", "rejected", "failed", "cancelled", "lost"):
        assert summary[key] == sum(seg[key] for seg in summary["segments"]), key
    if final:
        assert sorted(items) == list(range(n_items)), "each item exactly once"
        assert summary["exit"] == "completed" and summary["in_progress"] == 0
        committed = max((r["rollouts_bytes"] for r in journal if r["kind"] == "commit"), default=0)
        assert (out / "rollouts.jsonl").stat().st_size == committed
        assert not [p for p in (out / "trajectories").iterdir() if p.name.startswith(".tmp-")]
    return summary


@pytest.mark.slow
def test_sigterm_at_random_points_then_resume_gives_each_item_exactly_once(forkserver, tmp_path):
    rng = random.Random(20240613)
    n_items, out = 320, tmp_path / "out"
    segments = interrupted = 0
    for k in range(20):
        rc, err, signalled = _interrupt(forkserver, _run_args(n_items, out, resume=k > 0), out, segments,
                                        after_rows=rng.randrange(0, 24), signum=signal.SIGTERM)
        assert "Traceback" not in err and "ExceptionGroup" not in err, err
        segments += any(r["kind"] == "segment" and r["segment"] == segments for r in _journal(out))
        if signalled and rc == 143:
            interrupted += 1
            assert len(err.strip().splitlines()) == 1 and "SIGTERM" in err and f"--resume {out}" in err, err
            summary = _check_consistent(out, n_items, final=False)
            assert summary["exit"] == "SIGTERM" and summary["in_progress"] == 0
            # items left, not the episodes every interrupted segment cancelled (summed: > items left)
            done = summary["items_done"]
            assert f"{done}/{n_items} items done, {n_items - done} left (cancelled or not started)" in err, err
        else:
            assert rc == 0, (rc, err)
    assert interrupted >= 15, f"only {interrupted} of 20 runs were interrupted mid-run"
    rc, err, _ = _interrupt(forkserver, _run_args(n_items, out, resume=True), out, segments, after_rows=10 ** 9,
                            signum=signal.SIGTERM)
    assert rc == 0, err
    # (on a loaded machine the last interrupted run may already have finished every item, and a
    # resume with nothing left to do starts no segment: count the final run's like the others')
    segments += any(r["kind"] == "segment" and r["segment"] == segments for r in _journal(out))
    summary = _check_consistent(out, n_items, final=True)
    assert summary["cancelled"] > 0 and summary["lost"] == 0, summary["segments"]
    assert len(summary["segments"]) == segments
    # the done line: accepted of the items, then all submissions with the repeats named; the others are one per item
    again = summary["cancelled"] + summary["lost"]
    printed = (forkserver.logs / f"{forkserver.n}.out").read_text()
    assert (f"{summary['accepted']}/{n_items} items accepted ({summary['submitted']} episodes submitted, {again} "
            "again after an interruption)") in printed, printed
    assert summary["submitted"] - again == n_items


@pytest.mark.slow
def test_sigkill_loses_at_most_the_shard_being_filled_and_resume_recovers_it(forkserver, tmp_path):
    rng = random.Random(7)
    n_items, out = 120, tmp_path / "out"
    lost_total = 0
    for k in range(6):
        rc, err, signalled = _interrupt(forkserver, _run_args(n_items, out, resume=k > 0), out, k,
                                        after_rows=rng.randrange(2 * N_SAMPLES, 16 * N_SAMPLES), signum=signal.SIGKILL)
        assert signalled and rc == -signal.SIGKILL, (rc, err)
        committed = {e[0] for r in _journal(out) if r["kind"] == "commit" for e in r["episodes"]}
        on_disk = {json.loads(line)["task_id"] for line in (out / "rollouts.jsonl").read_text().splitlines()
                   if line.endswith("}")}
        lost = on_disk - committed  # ended and written, but not committed: the shard being filled
        assert len(lost) <= SHARD, lost
        lost_total += len(lost)
        shards = {p.name for p in (out / "trajectories").iterdir()}
        named = {r["shard"] for r in _journal(out) if r["kind"] == "commit" and r["shard"]}
        assert named <= shards and len(shards - named) <= 1  # at most one shard (or temp folder) past the commit
    assert lost_total > 0, "no kill landed between two commits; the test lost its point"
    rc, err, _ = _interrupt(forkserver, _run_args(n_items, out, resume=True), out, 6, after_rows=10 ** 9,
                            signum=signal.SIGKILL)
    assert rc == 0, err
    summary = _check_consistent(out, n_items, final=True)
    assert [s["exit"] for s in summary["segments"]] == ["killed"] * 6 + ["completed"]
    assert summary["lost"] > 0
    assert sorted(p.name for p in (out / "trajectories").iterdir()) == sorted(
        r["shard"] for r in _journal(out) if r["kind"] == "commit" and r["shard"])


@pytest.mark.slow
def test_sigint_exits_130_with_one_line_and_a_summary(forkserver, tmp_path):
    out = tmp_path / "out"
    rc, err, signalled = _interrupt(forkserver, _run_args(200, out, resume=False), out, 0, after_rows=4,
                                    signum=signal.SIGINT)
    assert signalled and rc == 130, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("rollout: interrupted by SIGINT") and "Traceback" not in err
    summary = _check_consistent(out, 200, final=False)
    assert summary["exit"] == "SIGINT" and summary["cancelled"] > 0
    assert summary["accepted"] >= 2  # what completed was written
    assert summary["segments"][0]["exit"] == "SIGINT"


def test_resume_refuses_other_options_and_fresh_runs_refuse_an_unfinished_folder(tmp_path, capsys):
    from engine.cli import main

    out = tmp_path / "out"
    out.mkdir()
    (out / "run.json").write_text(json.dumps({"format": 1, "options": {"dataset": "builtin:arith:8", "limit": None,
                                                                       "n_samples": 2}, "n_items": 8,
                                              "fingerprint": "x"}))
    (out / "progress.jsonl").write_text('{"kind": "segment", "segment": 0, "submitted": 8, "version": 0}\n')
    assert main(["run", "--backend", "sim", "--resume", str(out), "--n-samples", "3", "--quiet"]) == 2
    assert "--n-samples 3 differs from the run's --n-samples 2" in capsys.readouterr().err
    assert main(["run", "--backend", "sim", "--out", str(out), "--quiet"]) == 2
    assert "holds an unfinished run (0 of 8 items done); continue it with --resume" in capsys.readouterr().err
    assert main(["run", "--backend", "sim", "--resume", str(tmp_path / "nothing"), "--quiet"]) == 2
    assert "no run to resume there" in capsys.readouterr().err


def test_resume_keeps_the_runs_workflow_reward_and_sim_options(tmp_path, capsys):
    """Regression (new-user trial): ``--resume`` forgot --workflow, --reward and --sim-*,
    so a multi_turn run continued as rlvr with the default reward."""
    from engine.cli import main

    reward = tmp_path / "my_reward.py"
    reward.write_text("def one(prompt, completions, prompt_ids, completion_ids, **data):\n    return 1.0\n")
    out = tmp_path / "run"
    argv = ["run", "--backend", "sim", "--dataset", "builtin:arith:3", "--n-samples", "1", "--max-new-tokens", "8",
            "--workflow", "multi_turn", "--reward", f"{reward}:one", "--sim-per-token-s", "0.001", "--quiet",
            "--out", str(out)]
    assert main(argv) == 0, capsys.readouterr().err
    saved = json.loads((out / "run.json").read_text())
    text = json.dumps(saved)
    assert "multi_turn" in text and "my_reward.py:one" in text and "0.001" in text
    assert main(["run", "--resume", str(out), "--quiet"]) == 0  # nothing left: the run's own options
    summary = json.loads((out / "summary.json").read_text())
    assert summary["workflow"] == "multi_turn" and summary["reward_mean"] == 1.0
    assert main(["run", "--resume", str(out), "--workflow", "rlvr", "--quiet"]) == 2
    assert "--workflow rlvr differs from the run's --workflow multi_turn" in capsys.readouterr().err
