"""Watching a run (issue 15): the live view, progress lines, Prometheus metrics, the report.

Unit tier (virtual time): the rich view printed on a recording console shows a
straggler of the sim backend while it runs and after it ends; the plain progress
lines come every ``interval_s``; ``metrics.jsonl``/``episodes.jsonl`` are written.
End-to-end tier: ``rollout run`` off a terminal writes progress lines to stderr;
its ``--metrics-port`` endpoint is scraped during the run (by a reward function in
a worker process) and parsed with prometheus_client's own parser; ``rollout report``
writes its PNGs.
"""

from __future__ import annotations

import io
import json
import socket

import pytest
import trio

from engine.backends.sim import SimBackend, SimConfig
from engine.cli import main
from engine.executor import EngineConfig, open_rollout_engine
from engine.cli._live import plain_line, render, view_mode
from engine.cli._metrics import observe_run, snapshot_metrics
from engine.testing import build_tiny_tokenizer
from engine.types import GenerationHyperparameters
from rewards.gsm8k import gsm8k_reward
from workflows.rlvr import RLVRWorkflow

ITEMS = [{"messages": [{"role": "user", "content": f"question {i}"}], "answer": "#### 1"} for i in range(8)]


def _text(renderable) -> str:
    from rich.console import Console

    console = Console(record=True, width=110, file=io.StringIO(), color_system=None)
    console.print(renderable)
    return console.export_text()


def _sim(**kw):
    tok = build_tiny_tokenizer()
    cfg = SimConfig(vocab_size=len(tok), eos_token_id=tok.eos_token_id, first_token_id=0, per_token_s=0.01,
                    out_len_median=20, **kw)
    return tok, SimBackend(cfg)


def _workflow(tok, n=1):
    gconfig = GenerationHyperparameters(n_samples=n, max_new_tokens=32, seed=3)
    return RLVRWorkflow(gsm8k_reward, gconfig, tok)


async def test_the_live_view_shows_a_straggler_while_it_runs_and_after(autojump_clock, reward_pool, tmp_path):
    tok, backend = _sim(straggler_fraction=0.25, straggler_multiplier=20.0, seed=1)
    async with open_rollout_engine(backend, EngineConfig(max_concurrent_rollouts=8), reward_pool=reward_pool) as engine:
        async with observe_run(engine, total=len(ITEMS), out=tmp_path) as monitor:
            workflow = monitor.track(_workflow(tok, n=2))
            for item in ITEMS:
                engine.submit(item, workflow)
            taken = []
            with trio.move_on_after(1.0):  # normal episodes take 0.2 s, stragglers 4 s
                while True:
                    got = await engine.wait_results(1)
                    monitor.on_results(got)
                    taken += got
            snap = monitor.snapshot()
            stragglers = [e for e in snap.stragglers if e.seconds >= 1.0]
            assert stragglers and snap.running == len(stragglers) == len(ITEMS) - len(taken)
            text = _text(render(snap))
            assert "stragglers: longest running" in text and f"ended {len(taken)}/8" in text
            first = stragglers[0]
            # an episode of 2 samples: the normal sample returned its 20 tokens, the straggler is in flight
            assert (first.tokens, first.requests, first.requests_in_flight) == (20, 1, 1)
            rows = [line.strip("│ ").split() for line in text.splitlines()]
            assert [str(first.task_id), "1.0", "20", "1/1"] in rows
            while len(taken) < len(ITEMS):
                got = await engine.wait_results(1)
                monitor.on_results(got)
                taken += got
            snap = monitor.snapshot()
        assert not snap.stragglers and snap.accepted == 8 and snap.consumed == 16
        slowest = snap.slowest_ended[0]
        assert slowest.seconds == pytest.approx(4.0, abs=0.05) and slowest.tokens == 40
        assert f"#{slowest.task_id} 4.0 s 40 tok" in _text(render(snap))
    samples = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    # (how many samples depends on file writes in threads, which autojump does not wait for)
    assert len(samples) >= 2 and samples[0]["submitted"] == 0 and samples[-1]["accepted"] == 8
    episodes = [json.loads(line) for line in (tmp_path / "episodes.jsonl").read_text().splitlines()]
    assert sorted(e["task_id"] for e in episodes) == list(range(8))
    assert all(e["staleness"] == [0, 0] and e["tokens"] == 40 for e in episodes)


async def test_plain_progress_lines_come_every_interval_then_a_final_one(autojump_clock, reward_pool):
    tok, backend = _sim()
    stream = io.StringIO()
    async with open_rollout_engine(backend, reward_pool=reward_pool) as engine:
        async with observe_run(engine, total=4, out=None, view="plain", interval_s=0.05, stream=stream) as monitor:
            workflow = monitor.track(_workflow(tok))
            for item in ITEMS[:4]:
                engine.submit(item, workflow)
            monitor.on_results(await engine.wait_results(4))
    lines = stream.getvalue().splitlines()
    assert len(lines) == 4 + 1  # 0.2 s of virtual time at one line per 0.05 s, and the final line
    assert all(line.startswith("rollout progress: ") for line in lines)
    assert "in flight 4, waiting 0" in lines[0] and "ended 4/4 (ok 4, rej 0, fail 0)" in lines[-1]
    assert view_mode(quiet=False, stream=io.StringIO()) == "plain" and view_mode(quiet=True) == "off"


async def test_run_view_rich_refreshes_a_live_panel(autojump_clock, reward_pool):
    from rich.console import Console

    tok, backend = _sim()
    console = Console(record=True, width=110, file=io.StringIO(), force_terminal=True, color_system=None)
    async with open_rollout_engine(backend, reward_pool=reward_pool) as engine:
        async with observe_run(engine, total=2, out=None, view="rich", console=console) as monitor:
            workflow = monitor.track(_workflow(tok))
            for item in ITEMS[:2]:
                engine.submit(item, workflow)
            monitor.on_results(await engine.wait_results(2))
    text = console.export_text()
    assert "ended 2/2" in text and "reward workers" in text and "generation ahead" in text


def test_metric_families_and_the_plain_line_carry_the_same_numbers():
    from prometheus_client.exposition import generate_latest
    from prometheus_client.parser import text_string_to_metric_families
    from prometheus_client.registry import CollectorRegistry

    from engine.cli._monitor import EpisodeTiming, RunSnapshot

    snap = RunSnapshot(elapsed_s=3.0, total=10, submitted=10, queued=2, running=3, accepted=4, rejected=1, failed=0,
                       rejected_by_reason={"stale": 1}, failed_by_reason={}, results_waiting=1, generated_tokens=500,
                       tokens_per_s=120.0, version=2, capacity=1, consumer_batch_size=2, eta=1, ahead_versions=1.5,
                       reward_workers_busy=2, reward_max_workers=4, reward_timeouts=1, reward_workers_killed=1,
                       stragglers=(EpisodeTiming(7, 2.5, 30, 1, 1),))

    class One:
        def collect(self):
            return snapshot_metrics(snap)

    registry = CollectorRegistry(auto_describe=False)
    registry.register(One())
    got = {s.name + repr(sorted(s.labels.items())): s.value
           for fam in text_string_to_metric_families(generate_latest(registry).decode()) for s in fam.samples}
    assert got["rollout_episodes_in_flight[]"] == 3 and got["rollout_episodes_waiting[]"] == 2
    assert got["rollout_episodes_ended_total[('reason', 'stale'), ('status', 'rejected')]"] == 1
    assert got["rollout_generation_ahead_versions[]"] == 1.5 and got["rollout_max_head_offpolicyness[]"] == 1
    assert got["rollout_reward_workers_busy[]"] == 2 and got["rollout_reward_timeouts_total[]"] == 1
    assert got["rollout_longest_running_episode_seconds[]"] == 2.5
    line = plain_line(snap)
    assert "in flight 3, waiting 2" in line and "rej 1" in line and "stale x1" in line and "longest #7 2.5 s 30 tok" \
        in line and "reward workers 2/4 busy, 1 timeouts, 1 killed" in line


def _snapshot(**kw):
    from engine.cli._monitor import RunSnapshot

    base = dict(elapsed_s=3.0, total=10, submitted=10, queued=2, running=3, accepted=4, rejected=1, failed=0,
                rejected_by_reason={}, failed_by_reason={}, results_waiting=1, generated_tokens=500, tokens_per_s=120.0,
                version=0, capacity=1, consumer_batch_size=1, eta=None, ahead_versions=7.0, reward_max_workers=2)
    return RunSnapshot(**{**base, **kw})


def _families(snap) -> set[str]:
    return {fam.name for fam in snapshot_metrics(snap)}


def test_without_a_consumer_generation_ahead_is_left_out():
    """Regression (new-user trial): ``rollout run`` without --consumer-batch-size printed
    "ahead 300.0" (accepted + running, the version never moving): a meaningless number."""
    alone = _snapshot(consumer=False)
    assert " ahead " not in plain_line(alone) and "v0 cap 1 | reward workers" in plain_line(alone)
    assert "generation ahead" not in _text(render(alone)) and "no consumer batches" in _text(render(alone))
    assert "rollout_generation_ahead_versions" not in _families(alone)
    consumed = _snapshot(consumer=True, consumer_batch_size=2, ahead_versions=1.5)
    assert "v0 cap 1 ahead 1.5 |" in plain_line(consumed) and "generation ahead" in _text(render(consumed))
    assert "rollout_generation_ahead_versions" in _families(consumed)


def test_reward_workers_still_starting_are_said_to_be_starting_not_busy():
    """Regression (new-user trial): "reward workers 2/2 busy" while they were still starting."""
    starting = _snapshot(reward_workers_starting=2)
    assert "reward workers 2/2 starting, 0 timeouts" in plain_line(starting)
    assert "2/2 starting" in _text(render(starting))
    some = _snapshot(reward_workers_busy=1, reward_workers_starting=1)
    assert "reward workers 1/2 busy, 1 starting, 0 timeouts" in plain_line(some)
    assert "reward workers 1/2 busy, 0 timeouts" in plain_line(_snapshot(reward_workers_busy=1))
    assert "rollout_reward_workers_starting" in _families(starting)


async def test_a_monitor_without_a_consumer_writes_lines_without_ahead(autojump_clock, reward_pool):
    tok, backend = _sim()
    stream = io.StringIO()
    async with open_rollout_engine(backend, reward_pool=reward_pool) as engine:
        async with observe_run(engine, total=2, out=None, view="plain", interval_s=0.05, stream=stream,
                               consumer=False) as monitor:
            workflow = monitor.track(_workflow(tok))
            for item in ITEMS[:2]:
                engine.submit(item, workflow)
            monitor.on_results(await engine.wait_results(2))
    lines = stream.getvalue().splitlines()
    assert lines and not any(" ahead " in line for line in lines), lines
    assert monitor.snapshot().consumer is False


# -- rollout run, end to end -----------------------------------------------------------------------

SCRAPE_REWARD = '''
import os, pathlib, urllib.request

def scrape_reward(prompt, completions, prompt_ids, completion_ids, **data):
    """Scrape the run's metrics endpoint once, from a reward worker, during the run."""
    target = pathlib.Path(os.environ["SCRAPE_TO"])
    if not target.exists():
        url = "http://127.0.0.1:%s/metrics" % os.environ["SCRAPE_PORT"]
        text = urllib.request.urlopen(url, timeout=10).read().decode()
        tmp = target.with_suffix(".tmp")
        tmp.write_text(text)
        tmp.rename(target)
    return 1.0
'''


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_rollout_run_serves_prometheus_metrics_during_the_run_and_logs_progress(tmp_path, capsys, monkeypatch):
    from prometheus_client.parser import text_string_to_metric_families

    reward = tmp_path / "scrape.py"
    reward.write_text(SCRAPE_REWARD)
    port = _free_port()
    monkeypatch.setenv("SCRAPE_PORT", str(port))
    monkeypatch.setenv("SCRAPE_TO", str(tmp_path / "scraped.txt"))
    out = tmp_path / "out"
    code = main(["run", "--backend", "sim", "--dataset", "builtin:arith:6", "--n-samples", "1", "--max-new-tokens",
                 "8", "--reward", f"{reward}:scrape_reward", "--metrics-port", str(port), "--progress-interval",
                 "0.2", "--out", str(out)])
    _, err = capsys.readouterr()
    assert code == 0, err
    families = {f.name: f for f in text_string_to_metric_families((tmp_path / "scraped.txt").read_text())}
    assert families["rollout_episodes_submitted"].samples[0].value == 6  # (the parser drops _total)
    in_flight = families["rollout_episodes_in_flight"].samples[0].value
    waiting = families["rollout_episodes_waiting"].samples[0].value
    ended = sum(s.value for s in families["rollout_episodes_ended"].samples)
    assert in_flight >= 1 and in_flight + waiting + ended + families["rollout_results_waiting"].samples[0].value >= 6
    assert families["rollout_reward_workers_busy"].samples[0].value >= 1  # the scraping reward is running
    with pytest.raises(OSError):  # the endpoint closed with the run
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    progress = [line for line in err.splitlines() if line.startswith("rollout progress: ")]
    assert progress and "ended 6/6 (ok 6, rej 0, fail 0)" in progress[-1], err
    assert not any(" ahead " in line for line in progress)  # no --consumer-batch-size: nothing to be ahead of
    assert f"rollout: metrics at http://127.0.0.1:{port}/metrics" in err  # said even for --metrics-port 0


@pytest.mark.slow
def test_rollout_report_writes_pngs_of_a_run(tmp_path, capsys):
    out = tmp_path / "out"
    code = main(["run", "--backend", "sim", "--dataset", "builtin:arith:8", "--n-samples", "2", "--max-new-tokens",
                 "16", "--consumer-batch-size", "2", "--max-head-offpolicyness", "1", "--sim-per-token-s", "0.002",
                 "--quiet", "--out", str(out)])
    _, err = capsys.readouterr()
    assert code == 0, err
    code = main(["report", str(out), "--out", str(tmp_path / "plots")])
    stdout, err = capsys.readouterr()
    assert code == 0, err
    names = sorted(p.name for p in (tmp_path / "plots").iterdir())
    assert names == sorted(["completion_lengths.png", "reward_distribution.png", "staleness.png", "throughput.png"])
    for name in names:
        data = (tmp_path / "plots" / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    assert stdout.count("wrote ") == 4
    code = main(["report", str(tmp_path)])
    assert code == 2 and "not a rollout run's --out" in capsys.readouterr().err
