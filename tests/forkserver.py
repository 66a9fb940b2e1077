"""A fork server for the CLI's signal and kill tests.

Importing torch, tensordict and transformers takes a `rollout` process seconds
(more on a busy 2-core machine), which would make tens of interrupted runs take
minutes.  This server imports them once, then forks one child per request; each
child is a real process that runs ``engine.cli.main(argv)`` (what the
``rollout`` console script calls) with fresh default signal dispositions, its own
process group, and stdout/stderr in files, and receives real signals.

Protocol (one JSON object per line on stdin; one reply per line on stdout):

- ``{"argv": [...], "stdout": path, "stderr": path}`` -> ``{"pid": pid}``
- ``{"wait": pid}`` -> ``{"rc": exit status, or -signum when killed}`` (then the
  child's process group, e.g. reward workers left by a SIGKILL, is killed)
"""

from __future__ import annotations

import json
import os
import signal
import sys
import traceback


def _child(req: dict) -> None:
    code = 1
    try:
        os.setpgid(0, 0)
        signal.signal(signal.SIGINT, signal.default_int_handler)  # a fresh interpreter's dispositions
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        for fd, path in ((1, req["stdout"]), (2, req["stderr"])):
            target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(target, fd)
            os.close(target)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)  # never read the server's protocol pipe
        os.close(devnull)
        from engine.cli import main

        code = main(req["argv"])
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def serve() -> None:
    import tensordict  # noqa: F401
    import torch  # noqa: F401
    import transformers  # noqa: F401
    from rich import progress  # noqa: F401
    from transformers import AutoTokenizer  # noqa: F401  (a lazy import of about a second)

    import engine.backends.sim._backend  # noqa: F401
    import engine.cli  # noqa: F401
    import engine.outputs  # noqa: F401
    import engine.testing  # noqa: F401
    import rewards  # noqa: F401
    import workflows.rlvr  # noqa: F401

    def reply(obj: dict) -> None:
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()

    reply({"ready": True})
    for line in sys.stdin:
        req = json.loads(line)
        if "argv" in req:
            pid = os.fork()
            if pid == 0:
                _child(req)
            reply({"pid": pid})
        elif "wait" in req:
            pid = int(req["wait"])
            _, status = os.waitpid(pid, 0)
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            reply({"rc": os.waitstatus_to_exitcode(status)})


if __name__ == "__main__":
    serve()
