"""``rollout serve`` as a process: load the model, listen, serve, stop on SIGTERM/SIGINT.

:func:`serve` binds the port first (a busy port is one ``OSError`` naming it, which
:func:`run_serve` prints as one line), prints ``rollout serve: listening on URL`` while the
model loads (``/health`` answers 503), then ``rollout serve: ready on URL``.
:func:`add_serve_parser` and :func:`run_serve` are the ``rollout serve`` sub-command;
:func:`main` is ``python -m engine.serve``.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import ipaddress
import logging
import signal
import sys
from dataclasses import dataclass, field
from typing import Any

import trio

from ..errors import InvalidRequestError, RolloutError, unwrap_single

if sys.version_info < (3, 11):  # pragma: no cover
    from exceptiongroup import BaseExceptionGroup

__all__ = ["ServeConfig", "add_serve_parser", "is_loopback", "main", "run_serve", "serve"]

logger = logging.getLogger("rollout.engine.serve")  # the package's one logging namespace


@dataclass(frozen=True, kw_only=True)
class ServeConfig:
    """Settings of one ``rollout serve`` process.

    ``api_key``: when set, every route (``/health`` too) answers 401 unless the request
    carries ``Authorization: Bearer <api_key>`` (:class:`~engine.serve._http.RequireApiKey`;
    clients: ``rollout run --server-api-key``, ``make_remote_backend(api_key=)``).  Hidden
    from the repr.  Required when ``host`` is not a loopback address (``127.0.0.0/8``,
    ``::1``, ``localhost``): a server reachable from other machines would otherwise let
    anyone generate, pause it, or load weights into it.

    ``lora``: a LoRA adapter folder every request without ``lora_path`` samples
    (``lora_name``, default ``lora``, served as ``lora-v<version>``;
    :class:`~engine.backends.hf.HFBackend`'s ``lora``); ``/update_weights_from_disk`` with an
    adapter folder then loads the next version.

    ``enable_lora`` (implied by ``lora``): SGLang's ``/load_lora_adapter`` and
    ``/unload_lora_adapter`` load and unload adapters by name at run time, which requests
    name in ``lora_path`` (:mod:`engine.serve._lora`; our ``sglang`` client's
    ``lora=``); ``max_lora_rank`` refuses larger ranks (``None``: any).  Needs peft.

    Raises:
        InvalidRequestError: ``host`` is not loopback and ``api_key`` is not set, or
            ``api_key`` is not a non-empty string of visible ASCII characters; ``lora`` is
            not an adapter folder; ``lora_name`` without ``lora``; ``max_lora_rank`` below 1
            or without LoRA enabled.
    """

    model: str | None = None
    host: str = "127.0.0.1"
    port: int = 30000
    device: str | None = None
    dtype: str = "auto"
    max_batch_size: int = 64
    batch_window_s: float = 0.005
    served_model_name: str | None = None
    torch_threads: int | None = None
    seed: int = 0
    api_key: str | None = field(default=None, repr=False)
    lora: str | None = None
    lora_name: str | None = None
    enable_lora: bool = False
    max_lora_rank: int | None = None

    def __post_init__(self) -> None:
        if self.max_lora_rank is not None:
            if isinstance(self.max_lora_rank, bool) or not isinstance(self.max_lora_rank, int) or self.max_lora_rank < 1:
                raise InvalidRequestError(f"--max-lora-rank must be an integer >= 1, got {self.max_lora_rank!r}")
            if not (self.enable_lora or self.lora):
                raise InvalidRequestError("--max-lora-rank limits the adapters /load_lora_adapter loads: give "
                                          "--enable-lora too")
        if self.lora is not None:
            from ..backends.lora import adapter_folder_problem

            problem = adapter_folder_problem(self.lora)
            if problem is not None:
                raise InvalidRequestError(f"--lora {self.lora} {problem}")
        if self.lora_name is not None:
            from ..backends.lora import check_lora_name

            check_lora_name("--lora-name", self.lora_name)
            if self.lora is None:
                raise InvalidRequestError("--lora-name names the adapter of --lora PATH: give --lora too")
        if self.api_key is not None:
            from ..backends.remote import ApiKey

            try:
                ApiKey(self.api_key)
            except InvalidRequestError:
                raise InvalidRequestError("--api-key must be a non-empty string of visible ASCII characters (no "
                                          "spaces, no line breaks)") from None
        elif not is_loopback(self.host):
            raise InvalidRequestError(
                f"--host {self.host} accepts connections from other machines: pass --api-key KEY (every route then "
                "needs Authorization: Bearer KEY; clients send it with rollout run --server-api-key), or listen on "
                "127.0.0.1")


def is_loopback(host: str) -> bool:
    """Whether ``host`` is ``localhost`` or a loopback address (``127.0.0.0/8``, ``::1``);
    anything else (``0.0.0.0``, ``::``, a name) may be reachable from other machines."""
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip().strip("[]")).is_loopback
    except ValueError:
        return False


async def serve(config: ServeConfig, *, task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED) -> None:
    """Run one server until cancelled (or SIGTERM/SIGINT); ``task_status.started(url)`` once ready."""
    import torch

    from ..backends.hf import HFBackend
    from ..models import resolve_model
    from ._app import SGLangServer
    from ._http import open_listeners, serve_asgi

    if config.torch_threads:
        torch.set_num_threads(config.torch_threads)
    torch.manual_seed(config.seed)
    path = await trio.to_thread.run_sync(resolve_model, config.model)
    lora_on = config.enable_lora or config.lora is not None
    if lora_on and importlib.util.find_spec("peft") is None:  # one line now, not at the first load
        raise InvalidRequestError("--enable-lora and --lora serve LoRA adapters with peft, which is not installed: "
                                  "pip install 'trio-rollout[lora]' (or pip install peft)")
    backend = HFBackend(path, device=config.device, dtype=config.dtype, max_batch_size=config.max_batch_size,
                        batch_window_s=config.batch_window_s, lora=config.lora, lora_name=config.lora_name or "lora")
    server = SGLangServer(backend, model_path=str(path), served_model_name=config.served_model_name or str(path),
                          api_key=config.api_key, enable_lora=lora_on, max_lora_rank=config.max_lora_rank)
    server.lora.own_path = config.lora
    sockets = await open_listeners(config.host, config.port)  # a busy port: OSError here, not in a group
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async with trio.open_nursery() as nursery:

            async def stop_on_signal() -> None:
                async for signum in signals:
                    logger.warning("rollout serve: got signal %s, stopping", signum)
                    nursery.cancel_scope.cancel()

            nursery.start_soon(stop_on_signal)
            port = await nursery.start(functools.partial(serve_asgi, server.app, sockets=sockets))
            url = f"http://{config.host}:{port}"
            print(f"rollout serve: listening on {url} (loading {path})", flush=True)
            await nursery.start(server.run)
            print(f"rollout serve: ready on {url}", flush=True)
            task_status.started(url)


def add_serve_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``serve`` sub-command to ``subparsers`` (``rollout serve``)."""
    p = subparsers.add_parser("serve", help="serve a local model behind SGLang's native HTTP API",
                              description="Serve a local model (the hf backend) behind SGLang's /generate API.",
                              allow_abbrev=False)  # whole option names only
    p.add_argument("--model", default=None, help="HF model folder or hub id (default: the built-in SmolLM2-135M)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=30000, help="port (default 30000; 0 = any free port, printed)")
    p.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    p.add_argument("--dtype", default="auto", help="auto (default), float32, bfloat16, float16")
    p.add_argument("--max-batch-size", type=int, default=64, help="requests per generate batch (default 64)")
    p.add_argument("--batch-window-ms", type=float, default=5.0,
                   help="wait this long for more requests before a batch starts (default 5)")
    p.add_argument("--served-model-name", default=None, help="name reported by /v1/models")
    p.add_argument("--torch-threads", type=int, default=None, help="torch intra-op threads")
    p.add_argument("--seed", type=int, default=0, help="torch seed (default 0)")
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help="require Authorization: Bearer KEY on every route (401 otherwise); needed when --host is "
                        "not a loopback address (127.0.0.1, ::1, localhost); clients: rollout run --server-api-key")
    p.add_argument("--lora", default=None, metavar="PATH",
                   help="serve the model with this LoRA adapter (a peft adapter folder; needs peft: pip install "
                        "'trio-rollout[lora]'): requests without lora_path sample it; /update_weights_from_disk with "
                        "an adapter folder loads its next version; implies --enable-lora")
    p.add_argument("--lora-name", default=None, metavar="NAME",
                   help="the --lora adapter's name (default lora; served as NAME-v<version>)")
    p.add_argument("--enable-lora", action="store_true",
                   help="load and unload LoRA adapters by name at run time (SGLang's /load_lora_adapter and "
                        "/unload_lora_adapter; a request names one in lora_path): what rollout run --backend sglang "
                        "--lora PATH needs; needs peft")
    p.add_argument("--max-lora-rank", type=int, default=None, metavar="R",
                   help="refuse adapters of a rank above R (default: any rank)")
    p.set_defaults(handler=run_serve)
    return p


def run_serve(args: argparse.Namespace) -> int:
    """Run ``rollout serve`` from parsed arguments; returns the exit status."""
    if args.port < 0 or args.port > 65535:
        print(f"rollout serve: error: --port must be in [0, 65535], got {args.port}", file=sys.stderr)
        return 2
    if args.max_batch_size < 1 or not (args.batch_window_ms >= 0):
        print("rollout serve: error: --max-batch-size must be >= 1 and --batch-window-ms >= 0", file=sys.stderr)
        return 2
    try:
        config = ServeConfig(model=args.model, host=args.host, port=args.port, device=args.device, dtype=args.dtype,
                             max_batch_size=args.max_batch_size, batch_window_s=args.batch_window_ms / 1000.0,
                             served_model_name=args.served_model_name, torch_threads=args.torch_threads,
                             seed=args.seed, api_key=args.api_key, lora=args.lora, lora_name=args.lora_name,
                             enable_lora=args.enable_lora, max_lora_rank=args.max_lora_rank)
        try:
            trio.run(serve, config)
        except BaseExceptionGroup as group:  # raised inside the server's nursery (e.g. loading the model)
            raise unwrap_single(group) from None
    except (RolloutError, ValueError, OSError) as exc:
        print(f"rollout serve: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        pass
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m engine.serve [options]``: parse, configure logging (a process entry point),
    run; returns the exit status."""
    parser = argparse.ArgumentParser(prog="rollout", allow_abbrev=False)
    add_serve_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["serve", *(sys.argv[1:] if argv is None else argv)])
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    return args.handler(args)
