"""``rollout serve``: a local model (the ``hf`` backend) behind SGLang's native HTTP API.

::

    rollout serve --model /path/to/hf-model --port 30000        # or: python -m engine.serve ...
    rollout run --backend sglang --server http://127.0.0.1:30000 --server http://host2:30000

Users without SGLang run N of these (one per GPU or machine) and point the ``sglang``
backend at them; tests use them as real server processes on 127.0.0.1.  ``--port 0`` picks
a free port; the process prints ``rollout serve: listening on URL`` when the socket is open
(``/health`` answers 503 while the model loads) and ``rollout serve: ready on URL`` once it
serves.  SIGTERM/SIGINT stop it cleanly.

Routes (SGLang wire format, ``SERVERS_AND_MODELS.md`` §1; bodies of ``/generate``:
:mod:`engine.backends.sglang_wire`, shared with the ``sglang`` client):

- ``POST|PUT /generate``: one prompt as ``input_ids`` (or ``text``), ``sampling_params``,
  ``rid``, ``return_logprob``; answers ``text``, ``output_ids`` and ``meta_info`` with
  ``finish_reason``, ``weight_version`` and ``output_token_logprobs``
  (``[logprob, token_id, null]``, processed semantics like the ``hf`` backend).  No streaming,
  no batches.  A client that disconnects aborts its request.  Other ``GenerateReqInput``
  fields are accepted at their neutral (falsy) value, since an sglang-router re-sends them all.
  ``image_data`` (a base64 image file or a list of them, as SGLang takes) reaches the ``hf``
  backend, which reads it with the model folder's processor (an image-text-to-text model;
  a text-only model answers 400 naming ``image_data``).
- ``POST /abort_request`` ``{"rid"}`` (exact or prefix match) or ``{"abort_all": true}``:
  the request answers at once with ``finish_reason`` ``abort`` and **no tokens** (the ``hf``
  backend does not hand back a withdrawn row's partial output; SGLang's "abort before
  prefill" looks the same).
- ``POST /pause_generation`` ``{"mode": "abort"|"retract"|"in_place"}``: new requests wait
  and the model pauses (:class:`~engine.backends.base.WeightSync`): ``abort`` (default) stops
  the running batch, whose requests answer ``abort`` *with their partial tokens*, and answers
  requests not yet decoding ``abort`` with none (a client re-sends both after the pause);
  ``retract`` and ``in_place`` park the running batch between two decoding steps.
  ``POST /continue_generation`` resumes.
- ``POST /load_lora_adapter`` ``{"lora_name", "lora_path"}`` and ``POST /unload_lora_adapter``
  ``{"lora_name"}`` (``--enable-lora``, implied by ``--lora``; ``--max-lora-rank``): an adapter
  loaded under a name (read from its folder once), sampled by ``/generate`` bodies whose
  ``lora_path`` names it; an unload answers at once, the requests in flight on it finish on
  it, new ones answer 404.  SGLang's answers (``{"success", "error_message",
  "loaded_adapters"}``; 400 with one line when a load fails); ``/get_server_info`` reports
  ``enable_lora``, ``max_lora_rank`` and ``loaded_lora_adapters``, ``/v1/models`` lists the
  adapters.  The name -> adapter registry and the ``--lora`` adapter: :mod:`engine.serve._lora`.
- ``POST /update_weights_from_disk`` ``{"model_path", "abort_all_requests", "weight_version",
  "keep_pause"}``: holds new requests; unless already paused, aborts running ones
  (``abort_all_requests``) or lets them finish, and pauses the model; loads the
  checkpoint's state dict into the model (``HFBackend.update_weights``), sets the version
  (to ``weight_version`` when it is an integer, else +1), resumes.  ``model_path`` must be
  a folder on the server's machine with ``config.json`` and ``model.safetensors`` (or
  ``model.safetensors.index.json``); anything else (a hub id, a file, pickled ``.bin``
  weights) answers 400 ``{"success": false, "message"}`` before anything is paused.  ``POST
  /update_weight_version``.
- ``GET /health`` (also ``/health_generate``), ``/get_model_info`` (``/model_info``),
  ``/get_server_info`` (``/server_info``), ``/get_weight_version``, ``/get_load``,
  ``/v1/models``; ``GET|POST /flush_cache`` (a no-op).  Unknown routes answer 404 and
  wrong methods 405, as ``{"detail": ...}``.

API key.  ``--api-key KEY`` (:class:`ServeConfig` ``api_key``) makes every route, ``/health``
included, answer 401 ``{"error": "Unauthorized"}`` unless the request carries
``Authorization: Bearer KEY`` (compared in constant time); clients send it with ``rollout
run --server-api-key`` or ``make_remote_backend(..., api_key=)``.  A ``--host`` that is not a
loopback address (``127.0.0.0/8``, ``::1``, ``localhost``) is refused without one: the routes
generate, pause, and load weights.

Requests reach the model exactly as the engine sends them: one ``backend.generate`` per
request (the engine's one dispatch path), cancelled on abort or disconnect.  The server
owns its backend's policy version (``set_version``).

Modules: ``_app`` (:class:`SGLangServer`: the routes and the server's state, a Starlette
app), ``_lora`` (the LoRA adapters it serves), ``_http`` (hypercorn's trio worker, listening sockets, cancel-on-disconnect, and
:func:`serve_http` for plain ``HTTPRequest -> HTTPResponse`` handlers such as the test
suite's fake servers), ``_server`` (the process: config, signals, the CLI).
"""

from __future__ import annotations

__all__ = [
    "HTTPRequest",
    "HTTPResponse",
    "RequestRejected",
    "SGLangServer",
    "ServeConfig",
    "add_serve_parser",
    "json_response",
    "main",
    "open_listeners",
    "run_serve",
    "serve",
    "serve_asgi",
    "serve_http",
]

# lazy (PEP 562): ``rollout``'s parser needs add_serve_parser, not Starlette and hypercorn
_LAZY = {
    "SGLangServer": "engine.serve._app",
    **{name: "engine.serve._http" for name in ("HTTPRequest", "HTTPResponse", "RequestRejected", "json_response",
                                                "open_listeners", "serve_asgi", "serve_http")},
    **{name: "engine.serve._server" for name in ("ServeConfig", "add_serve_parser", "main", "run_serve", "serve")},
}

from ..lazy import lazy_exports  # noqa: E402

__getattr__, __dir__ = lazy_exports(globals(), _LAZY)
