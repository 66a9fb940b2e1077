"""Tests of the built-in rewards: math (math-verify), format, weighted sums, code.

Tier: unit for the pure functions; contract for the code reward (a real
``python -I`` child per run, real short time limits) and for the rewards run in
real spawn worker processes.
"""

from __future__ import annotations

import pickle
import time
from pathlib import Path

import pytest

import reward_fixtures as fx
import rewards
from rewards import code_reward, format_reward, math_reward, open_reward_pool, weighted_sum
from rewards.code import extract_code, run_code
from rewards.format import TagFormat

ARGS = ("q", "", [], [])


# ----------------------------------------------------------------------- math


@pytest.mark.parametrize(
    ("completion", "answer", "reward"),
    [
        ("The answer is \\boxed{0.5}.", "\\frac{1}{2}", 1.0),
        ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),
        ("the answer is 1/2", "$\\frac12$", 1.0),
        ("\\boxed{\\frac{1}{3}}", "\\frac{1}{2}", 0.0),
        ("so the set is $\\{2, 1\\}$", "\\{1, 2\\}", 1.0),
        ("\\boxed{\\{1,3\\}}", "\\{1, 2\\}", 0.0),
        ("the solution is $(1,2]$", "(1, 2]", 1.0),
        ("the solution is $[1,2]$", "(1, 2]", 0.0),
        ("\\boxed{\\dfrac{\\sqrt{2}}{2}}", "\\sqrt{2}/2", 1.0),
        ("\\boxed{(x+1)^2}", "$x^2+2x+1$", 1.0),
        ("so she has 18 eggs", "Janet ... 9 * 2 = 18\n#### 18", 1.0),
        ("I give up.", "\\frac{1}{3}", 0.0),
        ("\\boxed{1}", "", 0.0),
    ],
)
def test_math_reward(completion, answer, reward):
    value = math_reward("q", completion, [], [], answer=answer)
    assert value == reward and type(value) is float


def test_gsm8k_and_math_share_one_gold_answer_rule():
    """rewards.gsm8k and rewards.math read a gold answer the same way (rewards._math_verify, the
    leaf under both; the compatibility re-export of the GSM8K names from rewards.math is gone)."""
    from rewards import gsm8k, math as math_rewards

    assert gsm8k.gsm8k_reward is rewards.gsm8k_reward and gsm8k.extract_answer is rewards.extract_answer
    assert not hasattr(math_rewards, "gsm8k_reward")
    solution = "Janet has 9 * 2 = 18 eggs.\n#### 18\n"
    for completion, reward in (("so 18", 1.0), ("\\boxed{18}", 1.0), ("so 19", 0.0)):
        assert gsm8k.gsm8k_reward("q", completion, [], [], answer=solution) == reward
        assert math_reward("q", completion, [], [], answer=solution) == reward


# --------------------------------------------------------------------- format


@pytest.mark.parametrize(
    ("completion", "reward"),
    [
        ("<think>6 * 3 = 18</think>\nThe answer is 18.", 1.0),
        ("  <think>\nstep\n</think>18", 1.0),
        ("The answer is 18.", 0.0),
        ("<think></think>18", 0.0),  # empty reasoning
        ("<think>6 * 3</think>   ", 0.0),  # no answer
        ("hello <think>6 * 3</think> 18", 0.0),  # text before the block
        ("<think>a</think><think>b</think> 18", 0.0),  # two blocks
        ("<think>6 * 3 18", 0.0),  # unclosed
    ],
)
def test_format_reward(completion, reward):
    assert format_reward(*ARGS[:1], completion, [], []) == reward


def test_tag_format_options():
    answer = TagFormat(answer_tag="answer")
    assert answer.matches("<think>x</think> <answer>18</answer>\n")
    assert not answer.matches("<think>x</think> 18")
    assert not answer.matches("<think>x</think> <answer> </answer>")
    assert not answer.matches("<think>x</think> <answer>1</answer> and <answer>2</answer>")
    in_prompt = TagFormat(open_tag_in_prompt=True)  # Qwen3-style templates
    assert in_prompt.matches("reasoning</think> 18")
    assert not in_prompt.matches("<think>reasoning</think> 18")
    with pytest.raises(ValueError, match="tag"):
        TagFormat(tag="<think>")
    assert pickle.loads(pickle.dumps(answer)).matches("<think>x</think><answer>1</answer>")


def test_weighted_sum_composes_and_pickles():
    combined = weighted_sum([(math_reward, 1.0), (format_reward, 0.25)])
    both = "<think>6 * 3</think> \\boxed{18}"
    assert combined("q", both, [], [], answer="18") == 1.25
    assert combined("q", "\\boxed{18}", [], [], answer="18") == 1.0
    assert combined("q", "<think>x</think> 17", [], [], answer="18") == 0.25
    copy = pickle.loads(pickle.dumps(combined))
    assert copy("q", both, [], [], answer="18") == 1.25
    assert "math_reward" in repr(combined)


def test_weighted_sum_rejects_bad_components():
    async def judge(*args, **kwargs):
        return 1.0

    with pytest.raises(ValueError, match="at least one"):
        weighted_sum([])
    with pytest.raises(ValueError, match="pairs"):
        weighted_sum([math_reward])
    with pytest.raises(ValueError, match="weight"):
        weighted_sum([(math_reward, float("nan"))])
    with pytest.raises(ValueError, match="async"):
        weighted_sum([(judge, 1.0)])
    with pytest.raises(ValueError, match="return_value returned NoneType"):
        weighted_sum([(fx.return_value, 1.0)])(*ARGS, value=None)


async def test_weighted_sum_with_an_actor_runs_in_a_worker(tmp_path):
    log = tmp_path / "setup.log"
    combined = weighted_sum([(fx.CountingActor(str(log)), 2.0), (fx.length_reward, 0.5)])
    async with open_reward_pool(max_workers=1, timeout_seconds=10.0) as pool:
        first = await pool.score(combined, "q", "abcd", [], [])
        second = await pool.score(combined, "q", "abcd", [], [])
    assert (first.reward, second.reward) == (2.0 * 1 + 2.0, 2.0 * 2 + 2.0)
    assert len(log.read_text().split()) == 1  # the component actor was set up once


# ----------------------------------------------------------------------- code

ADD = "def add(a, b):\n    return a + b\n"
ADD_TESTS = ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add('a', 'b') == 'ab'"]


def test_code_reward_passing_solution_in_a_fenced_block():
    completion = f"Here you go:\n```python\n{ADD}```\nDone."
    assert code_reward("q", completion, [], [], tests=ADD_TESTS) == 1.0


def test_code_reward_counts_the_fraction_passed():
    wrong = "def add(a, b):\n    return 0 if a == 1 else a + b\n"
    assert code_reward("q", wrong, [], [], test_list=ADD_TESTS) == pytest.approx(2 / 3)
    assert code_reward("q", "def add(a, b) return", [], [], tests=ADD_TESTS) == 0.0
    with pytest.raises(ValueError, match="tests"):
        code_reward("q", ADD, [], [])


def test_infinite_loop_scores_zero_within_the_time_limit():
    start = time.monotonic()
    result = run_code("def add(a, b):\n    while True:\n        pass\n", ADD_TESTS, timeout_s=1.0)
    elapsed = time.monotonic() - start
    assert result.timed_out and result.passed == 0 and result.fraction == 0.0
    assert elapsed < 1.0 + 2.0


def test_tests_passed_before_a_hang_still_count():
    code = ADD + "def spin():\n    while True:\n        pass\n"
    result = run_code(code, ["assert add(1, 1) == 2", "spin()"], timeout_s=1.0)
    assert result.timed_out and (result.passed, result.total) == (1, 2)


def test_memory_bomb_scores_zero():
    bomb = "blocks = []\nwhile True:\n    blocks.append(bytearray(10 ** 7))\n" + ADD
    start = time.monotonic()
    result = run_code(bomb, ADD_TESTS, memory_mb=256, timeout_s=10.0)
    assert result.fraction == 0.0 and result.error == "MemoryError"
    assert not result.timed_out and time.monotonic() - start < 10.0


def test_huge_output_is_capped_and_does_not_block_the_run():
    chatty = "import sys\nfor _ in range(100_000):\n    print('x' * 100)\n" + ADD
    result = run_code(chatty, ADD_TESTS, max_output_bytes=64 * 1024)
    assert result.output_truncated and len(result.output) == 64 * 1024
    assert result.fraction == 1.0  # the results travel on their own pipe


def test_parent_environment_secrets_are_not_visible(monkeypatch):
    monkeypatch.setenv("TRIO_ROLLOUT_TEST_SECRET", "hunter2")
    spy = "import os\nprint(sorted(os.environ))\nSECRET = os.environ.get('TRIO_ROLLOUT_TEST_SECRET')\n"
    result = run_code(spy, ["assert SECRET is None"])
    assert result.fraction == 1.0
    assert "TRIO_ROLLOUT_TEST_SECRET" not in result.output and "hunter2" not in result.output


def test_runs_in_a_temporary_directory_that_is_removed():
    code = "import os\nopen('scratch.txt', 'w').write('x')\nWHERE = os.getcwd()\nprint(WHERE)\n"
    result = run_code(code, ["assert os.path.exists('scratch.txt')"], setup_code="import os")
    where = Path(result.output.strip())
    assert result.fraction == 1.0 and where.name.startswith("trio-rollout-code-")
    assert not where.exists()


def test_processes_started_by_the_code_are_killed():
    code = (
        "import subprocess, sys\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        "print(child.pid)\n"
    )
    result = run_code(code, ["assert True"], timeout_s=5.0)
    assert result.fraction == 1.0 and not result.timed_out
    child = int(result.output.strip())
    # Orphaned, it is reaped by pid 1 (or stays a zombie where pid 1 does not reap):
    # wait, with a deadline, for SIGKILL to be delivered.
    deadline = time.monotonic() + 5.0
    while process_state(child) not in (None, "Z", "X"):
        assert time.monotonic() < deadline, f"process {child} still running"
        time.sleep(0.02)


def process_state(pid: int) -> str | None:
    """The state letter from /proc/<pid>/stat (R, S, Z, ...), None if gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return None


@pytest.mark.parametrize(
    ("completion", "code"),
    [
        ("```python\nx = 1\n```", "x = 1\n"),
        ("```py\na\n```\ntext\n```python\nb\n```", "b\n"),
        ("```python\nkeep\n```\n```text\nnot code\n```", "keep\n"),
        ("```\nplain\n```", "plain\n"),
        ("x = 1", "x = 1"),
    ],
)
def test_extract_code(completion, code):
    assert extract_code(completion) == code


async def test_code_reward_runs_in_a_worker_process():
    async with open_reward_pool(max_workers=1, timeout_seconds=30.0) as pool:
        outcome = await pool.score(code_reward, "q", ADD, [], [], tests=ADD_TESTS, timeout_s=5.0)
    assert (outcome.reward, outcome.is_fallback) == (1.0, False)


def test_run_code_validates_limits():
    with pytest.raises(ValueError, match="timeout_s"):
        run_code(ADD, ADD_TESTS, timeout_s=0)
    with pytest.raises(ValueError, match="tests"):
        run_code(ADD, [1, 2])
