"""What can go wrong in one HTTP exchange with a server, classified in one place.

:class:`RemoteCallError` carries the verdict the request machine acts on (retry, eject now,
count against the server's health, access denied); :func:`map_exceptions` maps transport
errors (httpx's ``map_httpcore_exceptions`` habit) and :func:`decode_json` HTTP statuses and
bodies onto it: 408/429/5xx and a truncated body are retryable, 401/403 is access denied
(permanent, server-level), another 4xx is the request's fault.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx

from ...errors import BackendError, BackendTimeoutError

__all__ = ["RemoteCallError", "RemoteTimeoutError", "check_success", "decode_json", "describe", "excerpt", "history", "map_exceptions"]


class RemoteCallError(BackendError):
    """One HTTP exchange with a server failed.

    Attributes:
        url: the server's base URL.
        retryable: a transient fault (worth another attempt, possibly elsewhere).
        server_down: the server could not be reached at all (eject it now).
        server_fault: the fault counts against the server's health (a 4xx does not).
        access_denied: HTTP 401/403: the server refuses *us* (credentials), on every
            request alike; permanent and server-level (the server is ejected for good).
    """

    def __init__(self, message: str, *, url: str = "", retryable: bool = False, server_down: bool = False,
                 server_fault: bool = True, access_denied: bool = False) -> None:
        super().__init__(message)
        self.url = url
        self.retryable = retryable
        self.server_down = server_down
        self.server_fault = server_fault
        self.access_denied = access_denied


class RemoteTimeoutError(RemoteCallError, BackendTimeoutError):
    """An exchange with a server got no answer in time (``attempt_timeout_s``, a control
    call's deadline, an httpx read/write timeout): retryable, and a
    :class:`~engine.errors.BackendTimeoutError` when it is the request's last word."""

    def __init__(self, message: str, *, url: str = "") -> None:
        super().__init__(message, url=url, retryable=True)


@contextmanager
def map_exceptions(url: str) -> Iterator[None]:
    """Translate what one HTTP exchange with ``url`` can raise into :class:`RemoteCallError`.

    The one place where transport errors are classified (httpx ``map_httpcore_exceptions``):
    refused/unreachable -> retryable, server down; timeout (:class:`RemoteTimeoutError`),
    lost connection, OS error -> retryable; any other httpx error (bad URL, protocol misuse) -> not retryable.
    """
    try:
        yield
    except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
        raise RemoteCallError(f"cannot connect to {url}: {describe(exc)}", url=url, retryable=True,
                              server_down=True) from exc
    except httpx.TimeoutException as exc:
        raise RemoteTimeoutError(f"timeout talking to {url}: {describe(exc)}", url=url) from exc
    except (httpx.NetworkError, httpx.RemoteProtocolError) as exc:
        raise RemoteCallError(f"connection to {url} lost: {describe(exc)}", url=url, retryable=True) from exc
    except httpx.HTTPError as exc:
        raise RemoteCallError(f"HTTP error with {url}: {describe(exc)}", url=url, server_fault=False) from exc
    except httpx.InvalidURL as exc:
        raise RemoteCallError(f"invalid URL {url}: {exc}", url=url, server_fault=False) from exc
    except OSError as exc:
        raise RemoteCallError(f"I/O error with {url}: {describe(exc)}", url=url, retryable=True) from exc


def describe(exc: BaseException) -> str:
    """``Type: message`` of an exception (its type alone when the message is empty)."""
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def excerpt(text: str, limit: int = 300) -> str:
    """``text`` on one line, cut at ``limit`` characters (an answer body in an error message)."""
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit] + "..."


def decode_json(response: httpx.Response, url: str, what: str, *, allow_empty: bool = False,
                decode: bool = True) -> Any:
    """Check an HTTP status and decode the JSON body (``decode=False``: the status only).

    Raises:
        RemoteCallError: 408/429/5xx (retryable), 401/403 (``access_denied``: permanent),
            another non-2xx (not retryable, not the server's fault), or a body that is not
            JSON (retryable: a truncated answer).
    """
    status = response.status_code
    if status in (408, 429) or status >= 500:
        raise RemoteCallError(f"{url}{what}: HTTP {status}: {excerpt(response.text)}", url=url, retryable=True)
    if status in (401, 403):
        raise RemoteCallError(f"{url}{what}: HTTP {status} (access denied; check the credentials, e.g. an "
                              f"Authorization header): {excerpt(response.text)}", url=url, access_denied=True)
    if not 200 <= status < 300:
        raise RemoteCallError(f"{url}{what}: HTTP {status}: {excerpt(response.text)}", url=url, server_fault=False)
    if not decode or (allow_empty and not response.content.strip()):
        return None
    try:
        return response.json()
    except ValueError:
        raise RemoteCallError(f"{url}{what}: malformed JSON in the answer: {excerpt(response.text)!r}", url=url,
                              retryable=True) from None


def check_success(url: str, path: str, answer: Any) -> None:
    """An answer ``{"success": false, "message": ...}`` (SGLang, vLLM) is a failure."""
    if isinstance(answer, dict) and answer.get("success") is False:
        raise RemoteCallError(f"{url}{path}: {answer.get('message') or answer.get('error_message') or answer}",
                              url=url)


def history(failures: list[str], keep: int = 3) -> str:
    """The failures of one request for its error message: the last ``keep``, and how many
    came before."""
    if len(failures) <= keep:
        return "; ".join(failures)
    return f"{len(failures) - keep} earlier failure(s); " + "; ".join(failures[-keep:])
