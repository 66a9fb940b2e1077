"""``hf``: a local transformers model served by a batcher inside the backend (CPU, or CUDA).

Two batchers over one loaded model::

    _model.py       LoadedModel: load, tokenizer, stop ids, context, read/load weights;
                    the request rules both batchers share
    _jobs.py        the job queue (one GenerationJob per segment) and the Batcher interface
    _gate.py        the weight-sync gate; abort/hold flags and parking of a generate thread
    _static.py      StaticBatcher: one left-padded ``generate`` per batch, in a worker thread
    _continuous.py  ContinuousBatcher: transformers' continuous batching, bridged to trio
    _images.py      ``image_data`` -> the model's image inputs (static mode)
    _backend.py     HFBackend (generate, WeightSync, statistics) and HFStatistics

``generate`` puts the segment on the backend's own job queue and awaits the reply; the
batcher runs inside :meth:`HFBackend.open` (loading the model first).  Static mode: the
batcher takes every request queued at the moment it becomes free (up to
``max_batch_size``), groups them by sampling parameters, and runs one static,
left-padded ``model.generate`` per group in a worker thread.  Each row stops at its own
budget or at its first stop token; a withdrawn (cancelled) row is stopped at the next token
through a stopping criterion.  Continuous mode: :mod:`engine.backends.hf._continuous`.

Sampling and seeds (ours): every row of a batch samples with its own
``torch.Generator``, seeded with its request's ``gconfig.seed`` (or a random
seed), by inverse CDF over the processed distribution; ``generate`` itself runs
greedy over the one token left.  So seeded requests are batched like any other,
the same seed gives the same tokens whatever the batch, and torch's global RNG
is never used (it belongs to the host, e.g. a trainer in the same process).

Priorities: ``ModelRequest.priority`` is ignored (both batchers take jobs in arrival order);
a scheduling policy orders segments here only through the engine's own dispatch bound
(``EngineConfig.scheduling_max_segments``, docs/guide/scheduling.md).

Context length: a prompt at or over the model's ``max_position_embeddings`` is
refused (:class:`InvalidRequestError` naming ``input_ids``) and the budget is
clamped so that prompt + output never exceeds it, as ``rollout serve`` does.

Logprobs: ``output_logprobs[i]`` is ``log_softmax`` of the *processed* scores at
the sampled token, i.e. of the distribution that was actually sampled (after
temperature, top-k and top-p), captured at each decoding step by a logits
processor placed after the warpers.  With ``temperature=1``,
no top-k/top-p, or greedy decoding this equals the model's raw next-token
log-probability (what a teacher-forced forward pass gives).  Every backend of this
package reports this kind (SGLang by default; vLLM with ``--logprobs-mode
processed_logprobs``, which the ``vllm`` backend checks).

Versions: every token of a segment carries ``self.version`` (told by the engine) read
before the segment starts (AReaL PR #1569); after an in-place weight update, tokens
decoded with the new weights carry the update's version.

Weight updates (:class:`~engine.backends.base.WeightSync`: ``pause``, ``update_weights``,
``resume``; ``engine.update_weights`` drives them), two modes:

* ``"abort"``: the running batch stops at its next decoding step; unfinished
  rows return ``stop_reason="abort"`` with their partial tokens, the weights
  load, and after ``resume`` the engine re-sends prompt + partial output
  (re-prefilled with the new weights).
* ``"in_place"``: the running batch parks between two decoding steps, the
  weights are copied into the same parameters, and decoding continues after
  ``resume`` (the KV cache of earlier tokens keeps the old weights' keys/values, as
  SGLang's in-place pause does).

No new batch starts while paused.

Images: a model with a ``vision_config`` (an image-text-to-text model such as Llava or
Qwen2-VL) is loaded with ``AutoModelForImageTextToText``, and its processor with
``AutoProcessor``.  A request's ``image_data`` (base64 image files, AReaL's field) is
decoded with PIL in the generate thread (:mod:`._images`) and turned into the model's
image inputs by the request's ``processor`` (else the backend's):
``processor.image_processor(images)``,
whose outputs (``pixel_values``, ``image_grid_thw``, ...) of every image request of a
batch are concatenated in row order and passed to ``generate``; the prompt ids must
already hold the expanded image tokens (what the processor's text side produces, e.g.
:class:`workflows.vision_rlvr.VisionRLVRWorkflow`).  Text-only and image requests share
batches.
"""

from ._backend import HFBackend, HFBackendFactory, HFStatistics

__all__ = ["HFBackend", "HFBackendFactory", "HFStatistics"]
