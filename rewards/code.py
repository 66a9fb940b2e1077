"""Run model-written Python against tests; the reward is the fraction passed.

:func:`code_reward` (reward signature) extracts the code from a completion
(:func:`extract_code`) and calls :func:`run_code`, which runs it in a separate
``python -I`` process.  The code is untrusted input; what we guarantee:

* **Time.** The process runs in its own session (process group) and is killed
  with ``SIGKILL`` (the whole group) at ``timeout_s`` wall time; it also gets
  ``RLIMIT_CPU`` (``timeout_s + 1`` s of CPU) and ``PR_SET_PDEATHSIG`` so that
  it cannot outlive a reward worker the pool killed.  An infinite loop scores
  the tests passed before it (0 if it is in the code itself or the first test).
* **Memory.** ``RLIMIT_AS`` (``memory_mb``): a memory bomb gets ``MemoryError``
  (or dies), not the machine's memory.  ``RLIMIT_FSIZE`` caps any file it
  writes (``max_file_bytes``), ``RLIMIT_CORE`` is 0.
* **Output.** stdout and stderr are read as they come and only the first
  ``max_output_bytes`` (64 KiB) are kept; the rest is read and dropped, so a
  print loop neither blocks the process nor fills our memory.
* **Files.** It runs in a fresh temporary directory (its cwd, ``HOME`` and
  ``TMPDIR``) that is deleted afterwards.  We write only three files there,
  under fixed names; no path is ever built from the model's output.
* **Environment.** It gets ``PATH``, ``HOME``, ``TMPDIR`` and ``LANG`` only:
  no variable of ours (API keys, tokens) is inherited.  ``-I`` also ignores
  ``PYTHON*`` variables and the user's site directory.

Limits (it is not a security sandbox): the code runs as our user, so it can
read and write whatever our user can (other paths, ``/proc/<pid>/environ`` of
our other processes) and open network connections; it runs in the harness's
interpreter, so it can tamper with the harness and fake a result.  For
adversarial code, run the reward workers in a container or under a separate
user.  The limits are set by the child itself, after the interpreter started
and before any model code is read, instead of in ``preexec_fn`` (which is not
safe when the calling process has threads).

Result protocol: the harness writes ``P <i>`` / ``F <i>`` for each test to a
separate pipe (not stdout, so output capping cannot cut it off).  The
temporary directory is removed by the process that created it: if a reward
worker is killed by the pool mid-run, the directory stays (keep ``timeout_s``
below the pool's ``timeout_seconds``; the default 5 s is).
"""

from __future__ import annotations

import json
import os
import re
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["CodeRunResult", "code_reward", "extract_code", "run_code"]

DEFAULT_TIMEOUT_S = 5.0
DEFAULT_MEMORY_MB = 512
DEFAULT_MAX_OUTPUT_BYTES = 64 * 1024
DEFAULT_MAX_FILE_BYTES = 16 * 1024 * 1024
_MAX_RESULT_BYTES = 1024 * 1024
_READ_CHUNK = 65536
_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)```", re.DOTALL)

# Runs in the child.  Reads the files first, then lowers its limits, then runs
# the model's code; never imports anything after that.
_HARNESS = r'''
import json, os, resource, signal, sys

def _limits(memory, cpu, fsize, parent):
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:
        pass
    if os.getppid() != parent:
        os._exit(70)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
    resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))

def _main():
    fd, memory, cpu, fsize, parent = (int(a) for a in sys.argv[1:6])
    with open("solution.py", encoding="utf-8") as f:
        source = f.read()
    with open("tests.json", encoding="utf-8") as f:
        spec = json.load(f)
    out = os.fdopen(fd, "w", buffering=1)
    _limits(memory, cpu, fsize, parent)
    namespace = {"__name__": "solution", "__builtins__": __builtins__}
    try:
        if spec["setup"]:
            exec(compile(spec["setup"], "setup_code", "exec"), namespace)
        exec(compile(source, "solution.py", "exec"), namespace)
    except BaseException as exc:
        out.write("E %s\n" % type(exc).__name__)
        return
    for index, test in enumerate(spec["tests"]):
        try:
            exec(compile(test, "test_%d" % index, "exec"), dict(namespace))
        except BaseException:
            out.write("F %d\n" % index)
        else:
            out.write("P %d\n" % index)
    out.write("D\n")

_main()
'''


@dataclass(frozen=True)
class CodeRunResult:
    """What :func:`run_code` observed.

    Attributes:
        passed: tests that passed.
        total: tests given.
        timed_out: the process was killed at ``timeout_s``.
        returncode: the process's exit status (negative: killed by a signal).
        output: stdout and stderr interleaved, decoded, at most
            ``max_output_bytes`` bytes before decoding.
        output_truncated: more output was produced than kept.
        error: the exception type that stopped the code itself from loading,
            or None.
    """

    passed: int
    total: int
    timed_out: bool
    returncode: int | None
    output: str
    output_truncated: bool
    error: str | None

    @property
    def fraction(self) -> float:
        """``passed / total`` (0.0 with no tests)."""
        return self.passed / self.total if self.total else 0.0


def extract_code(completion: str) -> str:
    """The code in a completion: the last fenced block tagged ``python``/``py``,
    else the last fenced block, else the whole text."""
    blocks = _FENCE.findall(completion)
    for language, body in reversed(blocks):
        if language.lower() in ("python", "py", "python3"):
            return body
    if blocks:
        return blocks[-1][1]
    return completion


def _positive(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name} must be a positive number, got {value!r}")


def _drain(
    proc: subprocess.Popen, result_fd: int, deadline: float, max_output: int
) -> tuple[bytearray, bool, bytearray, bool]:
    """Read output (capped) and results until the harness is done or the deadline.

    The harness is done when its result pipe closes and the process exits (a
    process it started may still hold stdout open: it is not waited for).
    """
    output, results = bytearray(), bytearray()
    truncated = timed_out = False
    assert proc.stdout is not None
    out_fd = proc.stdout.fileno()

    def keep(chunk: bytes) -> None:
        nonlocal truncated
        room = max_output - len(output)
        if len(chunk) > room:
            truncated = True
        output.extend(chunk[: max(room, 0)])

    with selectors.DefaultSelector() as selector:
        selector.register(out_fd, selectors.EVENT_READ, "out")
        selector.register(result_fd, selectors.EVENT_READ, "res")
        harness_done = False
        while selector.get_map():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                timed_out = not harness_done
                break
            events = selector.select(0 if harness_done else remaining)
            if harness_done and not events:
                break  # the rest of the output is not ours to wait for
            for key, _ in events:
                chunk = os.read(key.fd, _READ_CHUNK)
                if not chunk:
                    selector.unregister(key.fd)
                elif key.data == "out":
                    keep(chunk)
                elif len(results) < _MAX_RESULT_BYTES:
                    results += chunk
            if not harness_done and result_fd not in selector.get_map():
                try:  # the harness closed its results: wait for it to exit
                    proc.wait(timeout=max(deadline - time.monotonic(), 0))
                except subprocess.TimeoutExpired:
                    timed_out = True
                    break
                harness_done = True
    return output, truncated, results, timed_out


def run_code(
    code: str,
    tests: Sequence[str] | str,
    *,
    setup_code: str = "",
    timeout_s: float = DEFAULT_TIMEOUT_S,
    memory_mb: float = DEFAULT_MEMORY_MB,
    max_output_bytes: int = DEFAULT_MAX_OUTPUT_BYTES,
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
) -> CodeRunResult:
    """Run ``code`` then each test (Python source, e.g. ``"assert f(2) == 4"``).

    Each test runs in a copy of the namespace the code (after ``setup_code``)
    left; a test passes if it raises nothing.  See the module docstring for the
    limits.

    Raises:
        ValueError: a limit is not positive, or ``tests`` is not a string or a
            sequence of strings.
    """
    for name, value in (
        ("timeout_s", timeout_s),
        ("memory_mb", memory_mb),
        ("max_output_bytes", max_output_bytes),
        ("max_file_bytes", max_file_bytes),
    ):
        _positive(name, value)
    test_list = [tests] if isinstance(tests, str) else list(tests)
    if not all(isinstance(t, str) for t in test_list):
        raise ValueError("tests must be a string or a sequence of strings")
    with tempfile.TemporaryDirectory(prefix="trio-rollout-code-", ignore_cleanup_errors=True) as tmp:
        with open(os.path.join(tmp, "solution.py"), "w", encoding="utf-8") as f:
            f.write(code)
        with open(os.path.join(tmp, "tests.json"), "w", encoding="utf-8") as f:
            json.dump({"setup": setup_code, "tests": test_list}, f)
        with open(os.path.join(tmp, "harness.py"), "w", encoding="utf-8") as f:
            f.write(_HARNESS)
        read_fd, write_fd = os.pipe()
        env = {"PATH": os.defpath, "HOME": tmp, "TMPDIR": tmp, "LANG": "C.UTF-8"}
        argv = [
            sys.executable, "-I", "-B", "harness.py", str(write_fd),
            str(int(memory_mb * 1024 * 1024)), str(int(timeout_s) + 1),
            str(int(max_file_bytes)), str(os.getpid()),
        ]  # fmt: skip
        try:
            proc = subprocess.Popen(
                argv,
                cwd=tmp,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                pass_fds=(write_fd,),
                start_new_session=True,
            )
        finally:
            os.close(write_fd)
        try:
            output, truncated, results, timed_out = _drain(
                proc, read_fd, time.monotonic() + timeout_s, max_output_bytes
            )
        finally:
            os.close(read_fd)
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # also whatever it started
            except ProcessLookupError:
                pass
            proc.wait()
            assert proc.stdout is not None
            proc.stdout.close()
    passed, error = set(), None
    for line in results.decode("ascii", "replace").splitlines():
        kind, _, rest = line.partition(" ")
        if kind == "P" and rest.isdigit() and int(rest) < len(test_list):
            passed.add(int(rest))
        elif kind == "E":
            error = rest or "error"
    return CodeRunResult(
        passed=len(passed),
        total=len(test_list),
        timed_out=timed_out,
        returncode=proc.returncode,
        output=output.decode("utf-8", "replace"),
        output_truncated=truncated,
        error=error,
    )


def code_reward(
    prompt: Any,
    completions: Any,
    prompt_ids: Any,
    completion_ids: Any,
    tests: Sequence[str] | str | None = None,
    setup_code: str = "",
    timeout_s: float = DEFAULT_TIMEOUT_S,
    memory_mb: float = DEFAULT_MEMORY_MB,
    **data: Any,
) -> float:
    """The fraction of ``tests`` the completion's code passes (0.0 to 1.0).

    Args:
        completions: the generated text; the code is :func:`extract_code`'s.
        tests: Python test snippets (``"assert add(1, 2) == 3"``); if absent,
            the dataset's ``test_list`` (MBPP's name).
        setup_code: run before the code (MBPP's ``test_setup_code`` if absent).
        timeout_s, memory_mb: limits of the run (see :func:`run_code`).

    Raises:
        ValueError: no tests given.
    """
    if tests is None:
        tests = data.get("test_list")
    if tests is None:
        raise ValueError("code_reward needs tests (a 'tests' or 'test_list' field)")
    setup_code = setup_code or data.get("test_setup_code") or ""
    result = run_code(
        extract_code(str(completions)),
        tests,
        setup_code=setup_code,
        timeout_s=timeout_s,
        memory_mb=memory_mb,
    )
    return result.fraction
