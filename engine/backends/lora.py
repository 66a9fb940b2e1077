"""LoRA adapters on every backend: versioned names, leases, adapter files (ours).

A backend that serves a LoRA adapter serves it under a *versioned* name, one per policy
version (AReaL 1.0.4's ``{lora_name}-v{version}``, :func:`~engine.types.versioned_lora_name`):
``engine.update_weights(adapter, version=3)`` loads the adapter as ``lora-v3`` next to the
``lora-v2`` in use, moves traffic to it (the engine sets version 3: every segment sent from
then on samples ``lora-v3`` and its tokens carry version 3), and drops ``lora-v2`` only once
no segment of it is in flight.  Only the adapter travels (a rank-8 adapter of a 135M model
is ~1% of its weights); nothing is ever reloaded in place under a name in use, and a
server's adapter folder is never touched while it is loaded (on vLLM both corrupt or crash
the server: ``shared/docs/TOOLING_NOTES.md``, "LoRA on the vLLM CPU server").

Pieces, shared by the ``hf`` backend (peft, in process) and the remote ones (vLLM's
``/v1/load_lora_adapter``, SGLang's ``/load_lora_adapter``):

* :class:`AdapterVersions`: the loaded versions of each adapter name with their in-flight
  counts.  A segment takes an :class:`AdapterLease` on the current version when it is sent
  (with the version its tokens are tagged with, read at the same moment) and gives it back
  when it returns; a version replaced by a newer one is *retired*, and handed to the
  backend's unload callback when its last lease comes back (at once if it had none).
* :class:`AdapterWeights`: an adapter as a peft config (a plain dict, the contents of
  ``adapter_config.json``) and its tensors, read from a peft model, a peft state dict or
  an adapter folder (:func:`read_adapter`), written to a fresh folder (:func:`write_adapter`).
* The checks with one clear error each: :func:`check_adapter` (rank above the server's
  ``--max-lora-rank``, an adapter trained on another base model).

After ``engine.set_version(v)`` without a weight update (``rollout run
--consumer-batch-size`` bumps versions as a trainer would), tokens carry ``v`` and still
sample the last adapter loaded, exactly as full weights do: the version says which
``update_weights`` the tokens come from when the trainer drives both.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from ..errors import BackendError, InvalidRequestError
from ..types import valid_lora_name, versioned_lora_name

__all__ = [
    "DEFAULT_LORA_NAME",
    "AdapterLease",
    "AdapterVersions",
    "AdapterWeights",
    "LoraStatistics",
    "adapter_rank",
    "check_adapter",
    "check_lora_name",
    "is_adapter_source",
    "read_adapter",
    "same_base_model",
    "write_adapter",
]

#: the adapter name when none is given (served as ``lora-v0``, ``lora-v1``, ...)
DEFAULT_LORA_NAME = "lora"

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_LORA_KEY = re.compile(r"\.lora_(A|B|embedding_A|embedding_B|magnitude_vector)\.")
#: ``...lora_A.<adapter>.weight`` (a peft model's own ``state_dict()``) -> ``...lora_A.weight``
_NAMED_KEY = re.compile(r"\.(lora_(?:A|B|embedding_A|embedding_B|magnitude_vector))\.[^.]+\.(weight|bias)$")


def check_lora_name(owner: str, name: object) -> str:
    """``name`` if it can name an adapter, else :class:`InvalidRequestError` naming ``owner``."""
    if not valid_lora_name(name):
        raise InvalidRequestError(f"{owner}: lora_name must be a non-empty string without spaces or slashes, "
                                  f"got {name!r}")
    return str(name)


# -- leases and versions ------------------------------------------------------------------


@dataclass(frozen=True)
class AdapterLease:
    """One version of a named adapter, as a segment in flight holds it.

    Attributes:
        name: the adapter's base name (``"lora"``).
        version: the policy version it was loaded for.
        served_name: the name the backend serves it under (``"lora-v3"``).
    """

    name: str
    version: int
    served_name: str


@dataclass(frozen=True, kw_only=True)
class LoraStatistics:
    """The adapters of a backend (``BackendStatistics.lora``).

    Attributes:
        default: the adapter name requests without ``lora_name`` sample.
        current: ``{name: served name of its current version}``.
        loaded: served names still loaded, current and retired-but-in-flight (oldest first).
        last_served: ``{name: served name of the version its last request sampled}``, kept
            after the unload (a closed backend's ``loaded`` is empty: this says which
            version served the run).
        in_flight: ``{served name: segments in flight}`` (only nonzero counts).
        loads, unloads: adapter versions loaded and unloaded so far.
        unload_failures: unloads that failed (their folders are kept).
    """

    default: str | None
    current: dict[str, str]
    loaded: tuple[str, ...]
    in_flight: dict[str, int]
    loads: int = 0
    unloads: int = 0
    unload_failures: int = 0
    last_served: dict[str, str] = field(default_factory=dict)


@dataclass(eq=False)
class _Version:
    lease: AdapterLease
    count: int = 0
    retired: bool = False
    handed_over: bool = False  # given to on_retired


class AdapterVersions:
    """The loaded versions of each adapter name and their in-flight counts (see the
    module docstring).  Sync, single-threaded (the trio thread); no I/O.

    Args:
        on_retired: called once per retired version whose last lease came back (or that
            had none when it was retired): the backend unloads it then, and calls
            :meth:`unloaded` when done.
        default: the adapter name requests without ``lora_name`` sample.
    """

    def __init__(self, on_retired: Callable[[AdapterLease], None], *, default: str = DEFAULT_LORA_NAME) -> None:
        self.default = check_lora_name("AdapterVersions", default)
        self._on_retired = on_retired
        self._current: dict[str, _Version] = {}
        self._versions: dict[str, _Version] = {}  # served name -> version, oldest first
        self._last_served: dict[str, str] = {}  # name -> served name of its last lease
        self.loads = 0
        self.unloads = 0
        self.unload_failures = 0

    # -- reading ------------------------------------------------------------------------------
    @property
    def names(self) -> list[str]:
        """Adapter names with a current version."""
        return list(self._current)

    def current(self, name: str | None = None) -> AdapterLease | None:
        """The current version of ``name`` (default: :attr:`default`), ``None`` if none."""
        version = self._current.get(name or self.default)
        return None if version is None else version.lease

    def loaded(self) -> tuple[str, ...]:
        """Served names still loaded (not yet :meth:`unloaded`), oldest first."""
        return tuple(self._versions)

    def in_flight(self, served_name: str) -> int:
        """Segments in flight on ``served_name`` (0 once unloaded or unknown)."""
        version = self._versions.get(served_name)
        return 0 if version is None else version.count

    def resolve(self, lora_name: str | None) -> str:
        """The adapter name a request's ``lora_name`` samples.

        Raises:
            InvalidRequestError: no loaded adapter has that name (the message lists them).
        """
        name = lora_name or self.default
        if name not in self._current:
            served = ", ".join(repr(n) for n in self._current) or "none yet"
            raise InvalidRequestError(f"lora_name {name!r} is not an adapter this backend serves (it serves: "
                                      f"{served}; a request names the adapter's base name, not a versioned one)")
        return name

    # -- changing -------------------------------------------------------------------------------
    def add(self, name: str, version: int) -> AdapterLease:
        """Register ``name`` at ``version`` (already loaded by the backend) as its current
        version; the previous current version is retired (handed to ``on_retired`` now if
        nothing holds it, else when its last lease comes back).

        Raises:
            BackendError: that served name is loaded already (a version is loaded once:
                reloading a name in use is what this module avoids).
        """
        name = check_lora_name("update_weights", name)
        served = versioned_lora_name(name, version)
        if served in self._versions:
            raise BackendError(f"LoRA adapter {served!r} is loaded already: a new adapter needs a new version "
                               f"(update_weights(adapter, version=...) above {version})")
        new = _Version(AdapterLease(name, version, served))
        old = self._current.get(name)
        self._versions[served] = new
        self._current[name] = new
        self.loads += 1
        if old is not None:
            old.retired = True
            self._maybe_hand_over(old)
        return new.lease

    def acquire(self, lora_name: str | None = None) -> AdapterLease:
        """A lease on the current version of ``lora_name`` (default: :attr:`default`), for
        one segment: give it back with :meth:`release`.

        Raises:
            InvalidRequestError: no such adapter (:meth:`resolve`).
        """
        version = self._current[self.resolve(lora_name)]
        version.count += 1
        self._last_served[version.lease.name] = version.lease.served_name
        return version.lease

    def release(self, lease: AdapterLease) -> None:
        """Give back a lease of :meth:`acquire`; the last one of a retired version hands it
        to ``on_retired``."""
        version = self._versions.get(lease.served_name)
        if version is None or version.count <= 0:
            raise RuntimeError(f"AdapterVersions: {lease.served_name!r} released more often than acquired")
        version.count -= 1
        self._maybe_hand_over(version)

    def move(self, lease: AdapterLease, to: AdapterLease) -> AdapterLease:
        """Move one lease to another version (a segment parked in place continues on the
        new adapter: the ``hf`` backend's ``"in_place"`` update); returns the new lease."""
        self._versions[to.served_name].count += 1
        self._last_served[to.name] = to.served_name
        self.release(lease)
        return to

    def unloaded(self, lease: AdapterLease, *, ok: bool = True) -> None:
        """The backend unloaded a retired version (``ok=False``: it failed, and stays out of
        use: it is forgotten all the same, and counted)."""
        if self._versions.pop(lease.served_name, None) is not None:
            if ok:
                self.unloads += 1
            else:
                self.unload_failures += 1

    def retire(self, name: str) -> AdapterLease:
        """Retire the current version of ``name`` with no successor (a named adapter is
        unloaded): ``name`` stops resolving at once (new requests for it fail), the version
        goes to ``on_retired`` when its last lease comes back (now, if it has none).

        Raises:
            InvalidRequestError: ``name`` has no current version (:meth:`resolve`).
        """
        version = self._current.pop(self.resolve(name))
        version.retired = True
        self._maybe_hand_over(version)
        return version.lease

    def retire_all(self) -> list[AdapterLease]:
        """Retire every current version (the backend closes): returns the versions with no
        lease in flight, which the caller unloads now (``on_retired`` is not called for
        them; the others, if any, go to ``on_retired`` when released)."""
        free = []
        for name, version in list(self._current.items()):
            version.retired = True
            del self._current[name]
        for version in self._versions.values():
            if version.retired and not version.handed_over and version.count == 0:
                version.handed_over = True
                free.append(version.lease)
        return free

    def _maybe_hand_over(self, version: _Version) -> None:
        if version.retired and version.count == 0 and not version.handed_over:
            version.handed_over = True
            self._on_retired(version.lease)

    def statistics(self) -> LoraStatistics:
        return LoraStatistics(
            default=self.default, current={n: v.lease.served_name for n, v in self._current.items()},
            loaded=self.loaded(), in_flight={s: v.count for s, v in self._versions.items() if v.count},
            loads=self.loads, unloads=self.unloads, unload_failures=self.unload_failures,
            last_served=dict(self._last_served))


# -- adapter files ---------------------------------------------------------------------------


@dataclass
class AdapterWeights:
    """A LoRA adapter: its peft config and its tensors.

    Attributes:
        config: the contents of ``adapter_config.json`` (``r``, ``lora_alpha``,
            ``target_modules``, ``base_model_name_or_path``, ...), JSON-ready.
        tensors: ``{key: torch.Tensor}`` in the saved form (``...q_proj.lora_A.weight``:
            no adapter name in the keys), ``lora_A`` ``[r, in]``, ``lora_B`` ``[out, r]``.
        folder: the folder it was read from, if any.
    """

    config: dict[str, Any]
    tensors: dict[str, Any] = field(repr=False)
    folder: str | None = None

    @property
    def rank(self) -> int:
        return adapter_rank(self.config)

    @property
    def base_model(self) -> str | None:
        base = self.config.get("base_model_name_or_path")
        return str(base) if base else None

    @property
    def nbytes(self) -> int:
        """Bytes of the tensors (what an update moves)."""
        return sum(int(t.numel()) * int(t.element_size()) for t in self.tensors.values())


def _jsonable(value: Any) -> Any:
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, (set, frozenset)):
        return sorted(_jsonable(v) for v in value)
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    return value


def adapter_folder_problem(path: str | os.PathLike[str]) -> str | None:
    """Why ``path`` is not a peft adapter folder (a phrase to follow the path in a message:
    ``does not exist``, ``is a file, not an adapter folder``, ``is not a LoRA adapter folder
    (no adapter_config.json in it ...)``), or ``None`` when it holds ``adapter_config.json``."""
    folder = Path(path)
    if (folder / ADAPTER_CONFIG).is_file():
        return None
    if not folder.exists():
        return "does not exist"
    if not folder.is_dir():
        return "is a file, not an adapter folder (give the folder that holds adapter_config.json)"
    return f"is not a LoRA adapter folder (no {ADAPTER_CONFIG} in it: what peft's save_pretrained writes)"


def is_adapter_source(source: Any) -> bool:
    """Whether ``source`` is a LoRA adapter: a folder holding ``adapter_config.json``, a peft
    model (anything with ``peft_config``), or a mapping whose keys are all LoRA tensors
    (``lora_A`` / ``lora_B``)."""
    if isinstance(source, (str, os.PathLike)):
        return (Path(source) / ADAPTER_CONFIG).is_file()
    if hasattr(source, "peft_config") and hasattr(source, "active_adapter"):
        return True
    if isinstance(source, AdapterWeights):
        return True
    if isinstance(source, Mapping) and source:
        return all(isinstance(k, str) and _LORA_KEY.search(k) for k in source)
    return False


def _normalize_keys(tensors: Mapping[str, Any]) -> dict[str, Any]:
    return {_NAMED_KEY.sub(r".\1.\2", k): v for k, v in tensors.items()}


def read_adapter(source: Any, *, config: Mapping[str, Any] | None = None) -> AdapterWeights:
    """The adapter ``source`` as :class:`AdapterWeights` (blocking: file reads).

    Args:
        source: an adapter folder (``adapter_config.json`` + ``adapter_model.safetensors``,
            what peft's ``save_pretrained`` writes), a peft model (its active adapter), a
            peft state dict (``get_peft_model_state_dict``'s keys, or a peft model's own
            ``state_dict()`` keys ``...lora_A.<adapter>.weight``; only LoRA keys), or
            :class:`AdapterWeights`.
        config: the peft config of a state dict (a state dict carries none: the backend
            passes its current adapter's).

    Raises:
        BackendError: not an adapter, a folder without weights, or a state dict with no
            config to go with it (the message says what to pass).
    """
    if isinstance(source, AdapterWeights):
        return source
    if isinstance(source, (str, os.PathLike)):
        folder = Path(source)
        if not (folder / ADAPTER_CONFIG).is_file():
            raise BackendError(f"LoRA adapter: {folder} has no {ADAPTER_CONFIG} (not a peft adapter folder)")
        cfg = json.loads((folder / ADAPTER_CONFIG).read_text(encoding="utf-8"))
        weights = folder / ADAPTER_WEIGHTS
        if weights.is_file():
            from safetensors.torch import load_file

            tensors = load_file(str(weights))
        elif (folder / "adapter_model.bin").is_file():
            import torch

            tensors = torch.load(str(folder / "adapter_model.bin"), map_location="cpu", weights_only=True)
        else:
            raise BackendError(f"LoRA adapter: {folder} has no {ADAPTER_WEIGHTS} (nor adapter_model.bin)")
        return AdapterWeights(dict(cfg), _normalize_keys(tensors), str(folder))
    if hasattr(source, "peft_config") and hasattr(source, "active_adapter"):
        from peft import get_peft_model_state_dict

        active = source.active_adapter
        if isinstance(active, (list, tuple)):
            active = active[0]
        cfg = _jsonable(source.peft_config[active].to_dict())
        state = get_peft_model_state_dict(source, adapter_name=active)
        return AdapterWeights(cfg, {k: v.detach() for k, v in state.items()})
    if isinstance(source, Mapping) and is_adapter_source(source):
        if config is None:
            raise BackendError("LoRA adapter: a peft state dict carries no config (rank, alpha, target modules): "
                               "pass the first adapter as a folder or a peft model, later ones may be state dicts")
        return AdapterWeights(dict(config), _normalize_keys({k: v.detach() for k, v in source.items()}))
    raise BackendError(f"LoRA adapter: expected an adapter folder, a peft model or a peft state dict, "
                       f"got {type(source).__name__}")


def write_adapter(adapter: AdapterWeights, folder: str | os.PathLike[str]) -> Path:
    """Write ``adapter`` into the new, empty folder ``folder`` (``adapter_config.json`` and
    ``adapter_model.safetensors``, contiguous CPU tensors); returns its path.  Blocking.

    Raises:
        BackendError: ``folder`` exists and is not empty (a folder is written once).
    """
    from safetensors.torch import save_file

    path = Path(folder)
    if path.exists() and any(path.iterdir()):
        raise BackendError(f"LoRA adapter: {path} is not empty (every version is written to a fresh folder)")
    path.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in adapter.tensors.items()}
    save_file(tensors, str(path / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    (path / ADAPTER_CONFIG).write_text(json.dumps(_jsonable(adapter.config), indent=2, sort_keys=True),
                                       encoding="utf-8")
    return path


def adapter_rank(config: Mapping[str, Any]) -> int:
    """The largest rank of an adapter config: ``r`` and every ``rank_pattern`` value."""
    ranks = [int(config.get("r") or 0)]
    ranks += [int(v) for v in (config.get("rank_pattern") or {}).values()]
    return max(ranks)


def same_base_model(adapter_base: str | None, served: str | None) -> bool:
    """Whether an adapter trained on ``adapter_base`` fits a model served as ``served``
    (a path or hub id): true when either is unknown, when both are the same existing
    folder, or when their last path components agree (``HuggingFaceTB/SmolLM2-135M`` and
    ``/models/SmolLM2-135M``), case-insensitively."""
    if not adapter_base or not served:
        return True
    a, b = str(adapter_base).rstrip("/\\"), str(served).rstrip("/\\")
    if os.path.exists(a) and os.path.exists(b) and os.path.realpath(a) == os.path.realpath(b):
        return True
    return os.path.basename(a).lower() == os.path.basename(b).lower()


def check_adapter(adapter: AdapterWeights, *, where: str, base_model: str | None = None,
                  max_rank: int | None = None, check_base: bool = True) -> None:
    """The checks before an adapter is loaded anywhere, each one clear error.

    Args:
        where: who serves it, for the message (``"vllm server http://..."``, ``"hf backend"``).
        base_model: the served base model (a path or hub id), if known.
        max_rank: the server's ``--max-lora-rank``, if known.
        check_base: compare ``base_model_name_or_path`` with ``base_model``
            (:func:`same_base_model`).

    Raises:
        BackendError: the adapter has no tensors, its rank is above ``max_rank``, or it was
            trained on another base model.
    """
    if not adapter.tensors:
        raise BackendError(f"LoRA adapter: no LoRA tensors in {adapter.folder or 'the adapter'}")
    rank = adapter.rank
    if max_rank is not None and rank > max_rank:
        raise BackendError(f"LoRA adapter of rank {rank} is above the --max-lora-rank {max_rank} of {where}: "
                           f"restart the server with --max-lora-rank {rank} or more, or train a smaller rank")
    if check_base and not same_base_model(adapter.base_model, base_model):
        raise BackendError(f"LoRA adapter was trained on base model {adapter.base_model!r}, but {where} serves "
                           f"{base_model!r}: an adapter only fits the model it was trained on (if it is the same "
                           f"model under another name, set base_model_name_or_path in its {ADAPTER_CONFIG})")
