"""The ``hf`` backend's LoRA adapters: peft's multi-adapter model over the loaded model.

One adapter name (``lora_name``, default ``"lora"``), one peft adapter *slot* per loaded
version (``lora-v0``, ``lora-v1``, ...: :func:`~engine.types.versioned_lora_name`) injected
into the backend's model, the current one active.  Besides it, *named* adapters
(:meth:`~engine.backends.hf.HFBackend.add_adapter`: ``rollout serve``'s
``/load_lora_adapter``): one immutable version each, in the same :class:`AdapterVersions`
under their own names, sampled by requests that name them; a batch computes with one
adapter, or with none (the base model: peft's adapter layers disabled).  A slot whose version was dropped (no
segment holds it) is kept, one at most, and the next version with the same peft config is
copied into it: peft's ``add_adapter`` walks every module of the model (seconds on a 135M
model on 2 busy cores), a copy moves only the adapter's tensors.  peft's active adapter is a property of the model,
so it is switched only when no ``generate`` is computing: on the trio thread before a static
batch starts, or inside a weight sync (every batch stopped, or parked between two decoding
steps).  A retired version (:class:`~engine.backends.lora.AdapterVersions`) is deleted from
the model at such a moment too (:meth:`HFAdapters.drop_retired`), never while a batch of it
computes.

peft is imported only here, and only when an adapter is served (``pip install
'trio-rollout[lora]'``).  peft's ``low_cpu_mem_usage`` injection (its ``init_empty_weights``)
replaces ``torch.nn.Module.register_parameter`` process-wide while it runs; two injections at
once in two threads (two ``hf`` backends in one process, e.g. one engine per tenant, each
loading an update) interleave their swaps and leave it replaced, so that every parameter
made afterwards, in any model, lands on the meta device (NaN log-probabilities were the
symptom).  So every load here holds one process-wide lock (:data:`_PEFT_LOCK`).
"""

from __future__ import annotations

import threading
import warnings
from typing import Any

from ...errors import BackendError
from ..lora import AdapterLease, AdapterVersions, AdapterWeights, check_adapter
from ._model import LoadedModel

__all__ = ["HFAdapters", "import_peft"]

#: held by every adapter load of every backend in the process (see the module docstring)
_PEFT_LOCK = threading.Lock()


def import_peft() -> Any:
    """``peft``, or a :class:`BackendError` saying how to install it."""
    try:
        import peft
    except ImportError as exc:
        raise BackendError("the hf backend serves LoRA adapters with peft, which is not installed: "
                           "pip install 'trio-rollout[lora]' (or pip install peft)") from exc
    return peft


class HFAdapters:
    """The versions of one adapter name in one :class:`~._model.LoadedModel` (see the
    module docstring).

    Args:
        lm: the backend's loaded model (loaded before the first :meth:`load`).
        name: the adapter name.
        check_base: refuse an adapter whose ``base_model_name_or_path`` names another
            model (:func:`~engine.backends.lora.check_adapter`).

    Attributes:
        versions: the loaded versions and their leases.
        config: the peft config (a dict) of the current version: a later update given as
            a bare state dict reuses it.
        serves_default: the backend's own versioned adapter (``name``) was loaded: requests
            without ``lora_name`` sample it (else the base model).
    """

    def __init__(self, lm: LoadedModel, name: str, *, check_base: bool = True) -> None:
        self.lm = lm
        self.check_base = check_base
        self.versions = AdapterVersions(self._retired, default=name)
        self.config: dict[str, Any] | None = None
        self._peft_model: Any = None
        self._retired_leases: list[AdapterLease] = []
        self._slot_of: dict[str, str] = {}  # served name -> its peft adapter (slot)
        self._free: list[str] = []  # slots whose version was dropped (reused by the next version)
        self._slot_config: dict[str, dict[str, Any]] = {}
        self._slot_params: dict[str, dict[str, Any]] = {}  # slot -> {saved key: its parameter}
        self._slots = 0
        self._layers_on = True  # peft's adapter layers enabled (False: the base model computes)
        self.serves_default = False

    @property
    def name(self) -> str:
        return self.versions.default

    def _retired(self, lease: AdapterLease) -> None:
        self._retired_leases.append(lease)  # deleted at the next safe moment (drop_retired)

    def lease_for(self, lora_name: str | None) -> AdapterLease | None:
        """A lease on what a request with ``lora_name`` samples now: that adapter's current
        version; without one, the backend's own adapter if it serves one, else ``None``
        (the base model).  Give it back with ``versions.release``.

        Raises:
            InvalidRequestError: no adapter of that name (``versions.resolve``).
        """
        if lora_name is None and not self.serves_default:
            return None
        return self.versions.acquire(lora_name)

    def base_model_name(self) -> str | None:
        """What the model was loaded from (a folder or hub id), for the base-model check."""
        spec = self.lm.spec if isinstance(self.lm.spec, str) else None
        return spec or getattr(self.lm.model, "name_or_path", None) or None

    # -- blocking (a worker thread; the model is not computing) ----------------------------------
    def load(self, adapter: AdapterWeights, served_name: str, *, named: bool = False) -> None:
        """Put ``adapter`` into the model as ``served_name`` (not active yet): copied into a
        free slot of the same config, else injected as a new peft adapter.  Blocking.
        ``named``: a named adapter (its config does not become :attr:`config`).

        Raises:
            BackendError: peft is missing; the adapter was trained on another base model
                (``check_base``); its tensors do not fit the model (keys or shapes); the
                model is unchanged then.
        """
        peft = import_peft()
        check_adapter(adapter, where="the hf backend", base_model=self.base_model_name(), check_base=self.check_base)
        with _PEFT_LOCK:
            self._load(peft, adapter, served_name, named=named)

    def _load(self, peft: Any, adapter: AdapterWeights, served_name: str, *, named: bool) -> None:
        key = _config_key(adapter.config)
        slot = next((s for s in self._free if self._slot_config[s] == key), None)
        if slot is not None and self._copy_into(slot, adapter):
            self._free.remove(slot)
        else:
            slot = self._inject(peft, adapter)
            self._slot_config[slot] = key
        self._slot_of[served_name] = slot
        if not named:
            self.config = dict(adapter.config)

    def _copy_into(self, slot: str, adapter: AdapterWeights) -> bool:
        """Copy ``adapter``'s tensors into the free ``slot``; ``False`` when they do not
        have its keys and shapes (then a new slot is made)."""
        import torch

        params = self._slot_params[slot]
        if set(params) != set(adapter.tensors) or any(
                tuple(params[k].shape) != tuple(v.shape) for k, v in adapter.tensors.items()):
            return False
        with torch.no_grad():
            for k, v in adapter.tensors.items():
                params[k].copy_(v)
        return True

    def _inject(self, peft: Any, adapter: AdapterWeights) -> str:
        try:
            config = peft.PeftConfig.from_peft_type(**{**adapter.config, "inference_mode": True})
        except (TypeError, ValueError, KeyError) as exc:
            raise BackendError(f"LoRA adapter: its adapter_config.json is not a peft config peft "
                               f"{peft.__version__} reads: {exc}") from exc
        slot = f"slot{self._slots}"
        first = self._peft_model is None
        try:
            # low_cpu_mem_usage: the new layers are made on the meta device (no random init: the
            # tensors below replace them)
            if first:
                with warnings.catch_warnings():  # transformers' deprecation, raised inside peft's constructor
                    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
                    self._peft_model = peft.PeftModel(self.lm.model, config, adapter_name=slot, low_cpu_mem_usage=True)
                self._layers_on = True  # (the caller re-activates what a parked batch computes with)
            else:
                self._peft_model.add_adapter(slot, config, low_cpu_mem_usage=True)
            tensors = {k: v.to(device=self.lm.device) for k, v in adapter.tensors.items()}
            result = peft.set_peft_model_state_dict(self._peft_model, tensors, adapter_name=slot,
                                                    low_cpu_mem_usage=True)
            missing = [k for k in result.missing_keys if f".{slot}." in k]
            if result.unexpected_keys or missing:
                raise BackendError(f"LoRA adapter does not fit the model: unexpected keys "
                                   f"{list(result.unexpected_keys)[:3]}, missing keys {missing[:3]}")
        except BackendError:
            self._discard(slot, first)
            raise
        except (RuntimeError, KeyError, ValueError) as exc:  # shape mismatches and the like
            self._discard(slot, first)
            raise BackendError(f"LoRA adapter does not fit the model: {exc}") from exc
        named = dict(self._peft_model.named_parameters())
        params = {k: named.get(_slot_key(k, slot)) for k in adapter.tensors}
        # a key of another spelling: the slot is not reused (its empty map fits no adapter)
        self._slot_params[slot] = {} if None in params.values() else params
        self._slots += 1
        return slot

    def _discard(self, slot: str, first: bool) -> None:
        model = self._peft_model
        if model is None:
            return
        if first:  # the only adapter: take the injected layers out again
            self._peft_model = None
            try:
                model.unload()
            except Exception:  # the failure being reported matters more
                pass
            return
        if slot in model.peft_config:
            model.delete_adapter(slot)

    # -- the trio thread, no batch computing ---------------------------------------------------
    def activate(self, served_name: str | None) -> None:
        """Make ``served_name`` the adapter the model computes with, ``None``: the base
        model (no batch may be computing: before a batch starts, inside a weight sync or
        an exclusive change)."""
        model = self._peft_model
        if model is None:
            return
        if served_name is None:
            if self._layers_on:
                model.base_model.disable_adapter_layers()
                self._layers_on = False
            return
        slot = self._slot_of.get(served_name)
        if slot is None:
            return
        if model.active_adapter != slot:
            model.set_adapter(slot)
        if not self._layers_on:
            model.base_model.enable_adapter_layers()
            self._layers_on = True

    def drop_retired(self) -> None:
        """Drop the retired versions nothing holds any more (no batch may be computing):
        their slots are freed, one kept for the next version, the others deleted."""
        leases, self._retired_leases = self._retired_leases, []
        for lease in leases:
            slot = self._slot_of.pop(lease.served_name, None)
            if slot is not None:
                self._free.append(slot)
            self.versions.unloaded(lease, ok=slot is not None)
        while len(self._free) > 1:
            slot = self._free.pop(0)
            self._peft_model.delete_adapter(slot)
            self._slot_config.pop(slot, None)
            self._slot_params.pop(slot, None)


#: config fields that do not change what an adapter computes (a slot is reused across them)
_IGNORED_CONFIG = frozenset({"base_model_name_or_path", "revision", "inference_mode", "peft_version", "auto_mapping"})


def _config_key(config: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in config.items() if k not in _IGNORED_CONFIG}


def _slot_key(saved_key: str, slot: str) -> str:
    """``...q_proj.lora_A.weight`` (saved) -> ``...q_proj.lora_A.<slot>.weight`` (in the model)."""
    head, leaf = saved_key.rsplit(".", 1)
    return f"{head}.{slot}.{leaf}"
