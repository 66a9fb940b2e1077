"""Start-up against remote servers (``rollout run --backend sglang|vllm``, the benchmarks):
wait for them, then pick the tokenizer (:func:`open_remote_backend`).

A remote run tokenizes on this side, so its tokenizer must be the one of the model the
servers serve.  It comes from ``model`` (``rollout run --model``) or, without it, from what the servers report
(SGLang ``GET /get_model_info``, vLLM ``GET /v1/models``: :meth:`RemoteBackend.served_models`);
a mismatch is refused at start-up (never the built-in tokenizer, silently):

* servers that report different models: refused;
* no ``model``: the reported model's tokenizer, loaded here (a hub id from the local
  Hugging Face cache, or a path that exists here); refused if none is reported or it
  cannot be loaded here;
* ``model`` and a reported model: the same when the names agree (the whole spec, the
  last path component, or the ``models--org--name`` folder of a Hugging Face cache path)
  and, where the reported model can be loaded here, when both tokenizers have the same
  vocabulary; refused otherwise.

The refusals name ``--model`` and ``--server``, the options of ``rollout run``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ...errors import InvalidRequestError

__all__ = ["choose_tokenizer", "open_remote_backend"]


async def open_remote_backend(kind: str, servers: Sequence[str], *, model: str | None = None,
                              **options: Any) -> tuple[Any, Any, dict[str, Any]]:
    """Build the ``kind`` (``"sglang"`` or ``"vllm"``) backend for ``servers``, wait for a
    healthy server (at most ``startup_timeout_s``), and load the tokenizer of the model it
    serves, or of ``model`` when given (checked against it: see the module docstring).

    Args:
        kind, servers: as :func:`~engine.backends.remote.make_remote_backend`.
        model: a model spec for the tokenizer (:func:`engine.models.resolve_model`), or
            ``None`` for the one the servers report.
        options: passed to :func:`~engine.backends.remote.make_remote_backend`
            (``request_timeout_s``, ``startup_timeout_s``, ``check_logprobs_mode``, ...).

    Returns:
        ``(tokenizer, backend, used)`` where ``used`` names the model, the tokenizer,
        the servers and what each server reported (``served_models``); the backend's
        HTTP client is closed again (an idle backend pickles, for engine shards; it
        reopens on first use).

    Raises:
        BackendError: no server became healthy in time, or every server refused access;
            :class:`~engine.backends.remote.vllm.LogprobsModeError` for a vLLM server
            without ``--logprobs-mode processed_logprobs``.
        InvalidRequestError: a bad option, or the tokenizer cannot be chosen (see the
            module docstring).
    """
    import trio

    from . import make_remote_backend

    backend = make_remote_backend(kind, servers, **options)
    try:
        await backend.wait_ready()
        served = await backend.served_models()
        model, tokenizer = await trio.to_thread.run_sync(choose_tokenizer, model, served)
    finally:  # drop the probe's HTTP client (reopened on first use): an idle backend pickles, for --shards
        with trio.CancelScope(shield=True):
            await backend.aclose()
    used = {"model": model, "tokenizer": str(getattr(tokenizer, "name_or_path", model)),
            "servers": list(servers), "served_models": served}
    return tokenizer, backend, used


def _load(spec: str) -> Any:
    from transformers import AutoTokenizer

    from ...models import resolve_model

    return AutoTokenizer.from_pretrained(resolve_model(spec))


def _names(spec: str) -> set[str]:
    text = spec.strip().rstrip("/\\")
    parts = [p for p in re.split(r"[\\/]+", text) if p]
    names = {text.lower()}
    if parts:
        names.add(parts[-1].lower())
    names.update(p.split("--")[-1].lower() for p in parts if p.startswith("models--"))
    return names


def _same_name(a: str, b: str) -> bool:
    return bool(_names(a) & _names(b))


def choose_tokenizer(model: str | None, served: dict[str, str | None]) -> tuple[str, Any]:
    """``(model name, tokenizer)`` for a remote run (see the module docstring).

    Raises:
        InvalidRequestError: naming ``--model`` or ``--server`` and what disagrees.
    """
    reported = sorted({name for name in served.values() if name})
    if len(reported) > 1:
        raise InvalidRequestError(f"--server: the servers serve different models: {served}")
    theirs = reported[0] if reported else None
    if model is None:
        if theirs is None:
            raise InvalidRequestError("--model is needed: the servers do not say which model they serve "
                                      "(/get_model_info, /v1/models)")
        try:
            return theirs, _load(theirs)
        except (OSError, ValueError) as exc:
            raise InvalidRequestError(f"--model is needed: the servers serve {theirs!r}, whose tokenizer cannot be "
                                      f"loaded here ({_short(exc)}); pass --model with a local copy of it") from None
    tokenizer = _load(model)
    if theirs is None:
        return model, tokenizer
    try:
        their_tokenizer = _load(theirs) if Path(theirs).is_dir() or not _same_name(model, theirs) else None
    except (OSError, ValueError):
        their_tokenizer = None  # e.g. a path on the server's machine
    if their_tokenizer is not None:
        if their_tokenizer.get_vocab() == tokenizer.get_vocab():
            return model, tokenizer
        raise InvalidRequestError(f"--model {model!r}: its tokenizer differs from the one of the model the servers "
                                  f"serve ({theirs!r}); pass --model {theirs!r}")
    if _same_name(model, theirs):
        return model, tokenizer
    raise InvalidRequestError(f"--model {model!r} does not match the model the servers serve ({theirs!r}); "
                              f"pass --model {theirs!r} (or a local copy of it)")


def _short(exc: BaseException, limit: int = 200) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) <= limit else text[:limit] + "..."
