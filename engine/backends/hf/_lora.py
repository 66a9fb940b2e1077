"""The ``hf`` backend's LoRA adapters: peft's multi-adapter model over the loaded model.

One adapter name (``lora_name``, default ``"lora"``), one peft adapter per loaded version
(``lora-v0``, ``lora-v1``, ...: :func:`~engine.types.versioned_lora_name`) injected into the
backend's model, the current one active.  peft's active adapter is a property of the model,
so it is switched only when no ``generate`` is computing: on the trio thread before a static
batch starts, or inside a weight sync (every batch stopped, or parked between two decoding
steps).  A retired version (:class:`~engine.backends.lora.AdapterVersions`) is deleted from
the model at such a moment too (:meth:`HFAdapters.drop_retired`), never while a batch of it
computes.

peft is imported only here, and only when an adapter is served (``pip install
'trio-rollout[lora]'``).
"""

from __future__ import annotations

import warnings
from typing import Any

from ...errors import BackendError
from ..lora import AdapterLease, AdapterVersions, AdapterWeights, check_adapter
from ._model import LoadedModel

__all__ = ["HFAdapters", "import_peft"]


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
    """

    def __init__(self, lm: LoadedModel, name: str, *, check_base: bool = True) -> None:
        self.lm = lm
        self.check_base = check_base
        self.versions = AdapterVersions(self._retired, default=name)
        self.config: dict[str, Any] | None = None
        self._peft_model: Any = None
        self._retired_leases: list[AdapterLease] = []

    @property
    def name(self) -> str:
        return self.versions.default

    def _retired(self, lease: AdapterLease) -> None:
        self._retired_leases.append(lease)  # deleted at the next safe moment (drop_retired)

    def base_model_name(self) -> str | None:
        """What the model was loaded from (a folder or hub id), for the base-model check."""
        spec = self.lm.spec if isinstance(self.lm.spec, str) else None
        return spec or getattr(self.lm.model, "name_or_path", None) or None

    # -- blocking (a worker thread; the model is not computing) ----------------------------------
    def load(self, adapter: AdapterWeights, served_name: str) -> None:
        """Inject ``adapter`` into the model as ``served_name`` (not active yet).  Blocking.

        Raises:
            BackendError: peft is missing; the adapter was trained on another base model
                (``check_base``); its tensors do not fit the model (keys or shapes); the
                model is unchanged then.
        """
        peft = import_peft()
        check_adapter(adapter, where="the hf backend", base_model=self.base_model_name(), check_base=self.check_base)
        try:
            config = peft.PeftConfig.from_peft_type(**{**adapter.config, "inference_mode": True})
        except (TypeError, ValueError, KeyError) as exc:
            raise BackendError(f"LoRA adapter: its adapter_config.json is not a peft config peft "
                               f"{peft.__version__} reads: {exc}") from exc
        first = self._peft_model is None
        try:
            if first:
                with warnings.catch_warnings():  # transformers' deprecation, raised inside peft's constructor
                    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
                    self._peft_model = peft.PeftModel(self.lm.model, config, adapter_name=served_name)
            else:
                self._peft_model.add_adapter(served_name, config)
            tensors = {k: v.to(device=self.lm.device) for k, v in adapter.tensors.items()}
            result = peft.set_peft_model_state_dict(self._peft_model, tensors, adapter_name=served_name)
            missing = [k for k in result.missing_keys if f".{served_name}." in k]
            if result.unexpected_keys or missing:
                raise BackendError(f"LoRA adapter does not fit the model: unexpected keys "
                                   f"{list(result.unexpected_keys)[:3]}, missing keys {missing[:3]}")
        except BackendError:
            self._discard(served_name, first)
            raise
        except (RuntimeError, KeyError, ValueError) as exc:  # shape mismatches and the like
            self._discard(served_name, first)
            raise BackendError(f"LoRA adapter does not fit the model: {exc}") from exc
        self.config = dict(adapter.config)

    def _discard(self, served_name: str, first: bool) -> None:
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
        if served_name in model.peft_config:
            model.delete_adapter(served_name)

    # -- the trio thread, no batch computing ---------------------------------------------------
    def activate(self, served_name: str) -> None:
        """Make ``served_name`` the adapter the model computes with (no batch may be
        computing: before a batch starts, or inside a weight sync)."""
        model = self._peft_model
        if model is not None and model.active_adapter != served_name:
            model.set_adapter(served_name)

    def drop_retired(self) -> None:
        """Delete the retired versions nothing holds any more (no batch may be computing)."""
        leases, self._retired_leases = self._retired_leases, []
        for lease in leases:
            ok = True
            try:
                self._peft_model.delete_adapter(lease.served_name)
            except (KeyError, ValueError, AttributeError):
                ok = False
            self.versions.unloaded(lease, ok=ok)
