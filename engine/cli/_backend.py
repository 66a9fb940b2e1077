"""``rollout run``'s inference side: the tokenizer and backend named by its options
(:func:`setup_backend`) and the engine over them, one process or ``--shards N``
(:func:`open_engine`)."""

from __future__ import annotations

import argparse
from typing import Any

import trio

__all__ = ["API_KEY_ENV", "SHARD_STATS_INTERVAL_S", "STRAGGLERS", "lora_options", "open_engine", "server_api_key",
           "setup_backend", "tokenizer_and_backend"]

#: How often a shard sends its statistics (open_sharded_engine's stats_interval_s): a
#: live shard is never silent longer, so --shard-timeout must exceed it.
SHARD_STATS_INTERVAL_S = 0.5
STRAGGLERS = 5  # longest-running episodes each shard reports for the live view (RunMonitor top)


def tokenizer_and_backend(args: argparse.Namespace) -> tuple[Any, Any]:
    """Load the tokenizer and build the backend named by ``--backend``."""
    import torch
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    from ..models import resolve_model

    hf_logging.disable_progress_bar()  # ours is the only progress bar

    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    torch.manual_seed(args.seed)
    if args.backend == "hf":
        from ..backends.hf import HFBackend

        path = resolve_model(args.model)
        tokenizer = AutoTokenizer.from_pretrained(path)
        lora = lora_options(args)
        if args.shards:  # each shard process loads its own copy (an HFBackend cannot be pickled)
            from ..backends.hf import HFBackendFactory

            gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0  # more than one: a GPU per shard
            return tokenizer, HFBackendFactory(path, devices=[f"cuda:{i}" for i in range(gpus)] if gpus > 1 else None,
                                               max_batch_size=args.concurrency, **lora)
        return tokenizer, HFBackend(path, tokenizer, max_batch_size=args.concurrency, **lora)
    if args.model is None:
        from ..models._tiny import build_tiny_tokenizer

        tokenizer = build_tiny_tokenizer()
    else:
        tokenizer = AutoTokenizer.from_pretrained(resolve_model(args.model))
    from ._options import sim_backend

    return tokenizer, sim_backend(args, tokenizer)  # --sim-* options


async def setup_backend(args: argparse.Namespace) -> tuple[Any, Any, dict[str, Any]]:
    """``(tokenizer, backend, used)``: ``used`` names the model, tokenizer and servers."""
    if getattr(args, "lora_name", None) is not None and getattr(args, "lora", None) is None:
        from ..errors import InvalidRequestError

        raise InvalidRequestError("--lora-name names the adapter of --lora PATH: give --lora too")
    if getattr(args, "lora", None) is not None:
        from ..errors import InvalidRequestError

        if args.backend == "sim":
            raise InvalidRequestError("--lora needs a model to adapt: --backend hf, vllm or sglang (the sim backend "
                                      "has no weights)")
        if args.shards and args.backend != "hf":
            raise InvalidRequestError("--lora with --shards on a remote backend is not supported: each shard's client "
                                      "would load the adapter under the same name; run one process (no --shards)")
    if args.backend in ("sglang", "vllm"):  # waits for the servers, asks them for their model
        from ..backends.remote import RemoteCallError, open_remote_backend
        from ..backends.remote.vllm import LogprobsModeError, SeededSamplingError
        from ..errors import BackendError
        from ._deadlines import remote_deadlines

        key = server_api_key(args)
        try:
            return await open_remote_backend(args.backend, args.server, model=args.model,
                                             request_timeout_s=args.request_timeout,
                                             startup_timeout_s=args.startup_timeout, api_key=key,
                                             **remote_deadlines(args),  # --no-server-timeout, --attempt-timeout
                                             **lora_options(args))  # --lora, --lora-name
        except LogprobsModeError as exc:  # its fix names a Python switch the CLI has not
            raise exc.with_fix(_CLI_LOGPROBS_FIX) from None
        except SeededSamplingError as exc:  # likewise (rollout run always sends seeds)
            raise exc.with_fix(_CLI_SEEDED_FIX) from None
        except RemoteCallError as exc:
            if exc.access_denied:  # every server refused access at start-up: say how to pass the key
                raise BackendError(f"{exc}; {_access_hint(key is not None)}") from None
            raise
    tokenizer, backend = await trio.to_thread.run_sync(tokenizer_and_backend, args)
    model = args.model or ("builtin:smollm2" if args.backend == "hf" else None)
    name = getattr(tokenizer, "name_or_path", None)
    return tokenizer, backend, {"model": model, "tokenizer": str(name) if name else "builtin:tiny-tokenizer",
                                "servers": []}


def lora_options(args: argparse.Namespace) -> dict[str, Any]:
    """The backend arguments of ``--lora PATH`` and ``--lora-name NAME`` (none without ``--lora``)."""
    if getattr(args, "lora", None) is None:
        return {}
    from ..backends.lora import DEFAULT_LORA_NAME

    return {"lora": args.lora, "lora_name": args.lora_name or DEFAULT_LORA_NAME}


def open_engine(args: argparse.Namespace, backend: Any, config: Any, tokenizer: Any) -> Any:
    """``open_rollout_engine``, or with ``--shards N`` ``open_sharded_engine``."""
    if not args.shards:
        from ..executor import open_rollout_engine

        return open_rollout_engine(backend, config, tokenizer=tokenizer)
    from ..shards import open_sharded_engine

    return open_sharded_engine(backend, config, shards=args.shards, shard_backend=args.shard_backend,
                               ray_address=args.ray_address if args.shard_backend == "ray" else None,
                               tokenizer=tokenizer, stats_interval_s=SHARD_STATS_INTERVAL_S,
                               shard_timeout_s=args.shard_timeout, track_episodes=STRAGGLERS,
                               torch_threads=args.torch_threads)


#: How a ``rollout run`` user fixes a vLLM CPU server with chunked prefill (the CLI seeds every request).
_CLI_SEEDED_FIX = ("restart the server with --no-enable-chunked-prefill (rollout run seeds every request from --seed, "
                   "so that a run repeats)")

#: How a ``rollout run`` user fixes a vLLM server's logprobs mode (the CLI cannot skip the check).
_CLI_LOGPROBS_FIX = ("restart the server with --logprobs-mode processed_logprobs and VLLM_SERVER_DEV_MODE=1 "
                     "(dev mode lets it report its mode on /server_info); rollout run has no option to skip this "
                     "check")


# -- API key (--server-api-key, ROLLOUT_SERVER_API_KEY) -------------------------------------

#: the environment variable ``--server-api-key`` defaults to
API_KEY_ENV = "ROLLOUT_SERVER_API_KEY"


def server_api_key(args: argparse.Namespace) -> Any:
    """The :class:`~engine.backends.remote.ApiKey` of ``--server-api-key``, else of
    ``$ROLLOUT_SERVER_API_KEY`` (empty: none), else ``None``.

    Raises:
        InvalidRequestError: the key is not a string of visible ASCII characters (the
            message names where it came from, never the key).
    """
    import os

    from ..backends.remote import ApiKey
    from ..errors import InvalidRequestError

    flag = getattr(args, "server_api_key", None)
    value = flag if flag is not None else os.environ.get(API_KEY_ENV) or None
    if value is None:
        return None
    try:
        return ApiKey(value)
    except InvalidRequestError:
        where = "--server-api-key" if flag is not None else API_KEY_ENV
        raise InvalidRequestError(f"{where}: the API key must be visible ASCII characters only (no spaces or line "
                                  "breaks)") from None


def _access_hint(key_given: bool) -> str:
    if key_given:
        return (f"the servers refuse the key given with --server-api-key (or {API_KEY_ENV}): pass the key they were "
                "started with (their --api-key)")
    return (f"the servers need an API key: pass the key they were started with (their --api-key) with "
            f"--server-api-key KEY or the environment variable {API_KEY_ENV}")
