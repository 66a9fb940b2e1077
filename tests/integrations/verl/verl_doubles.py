"""Helpers of the verl tier: a backend that fails on demand, verl's generation batch, the
teacher-forced recomputation of the logprobs, a tool parser and a streaming reward.

Imported only by the tier's modules (after their ``importorskip("verl")``).
"""

from __future__ import annotations

import json

import numpy as np
import torch
import trio
from verl.experimental.agent_loop.tool_parser import FunctionCall, ToolParser
from verl.protocol import DataProto
from verl.utils.torch_functional import logprobs_from_logits

from engine import HFBackend
from engine.errors import BackendError


#: ppo_trainer lengths of the tier (tokens): the tiny model's ChatML prompts are ~30 bytes
PROMPT_LENGTH = 48
RESPONSE_LENGTH = 12


class FlakyHF(HFBackend):
    """The hf backend, whose next ``fail`` generate calls raise :class:`BackendError`; with
    ``gate = N`` each request first waits (60 s at most) until N requests are in it at once."""

    fail = 0
    gate = 0
    peak = 0

    async def generate(self, request, budget):
        if self.fail:
            self.fail -= 1
            raise BackendError("injected: the server dropped the request")
        if self.gate:
            self._inside = getattr(self, "_inside", 0) + 1
            self.peak = max(self.peak, self._inside)
            if self.peak >= self.gate:
                self._open.set()
            try:
                with trio.fail_after(60):
                    await self._open.wait()
            finally:
                self._inside -= 1
        return await super().generate(request, budget)

    def close_gate(self, n: int) -> None:
        self.gate, self.peak, self._open = n, 0, trio.Event()


def messages(i: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"question {i}?"}]


def generation_batch(n_prompts: int, n: int = 2, *, step: int = 0, validate: bool = False, **columns) -> DataProto:
    """verl's ``gen_batch`` as ``RayPPOTrainer.fit`` builds it: dataset rows (``raw_prompt``,
    ``index``, the given columns), then ``repeat(rollout.n, interleave=True)``."""
    raw = np.empty(n_prompts, dtype=object)
    raw[:] = [messages(i) for i in range(n_prompts)]
    non_tensors = {"raw_prompt": raw, "index": np.arange(n_prompts)}
    for key, values in columns.items():
        arr = np.empty(n_prompts, dtype=object)
        arr[:] = list(values)
        non_tensors[key] = arr
    batch = DataProto.from_dict(non_tensors=non_tensors, meta_info={"global_steps": step, "validate": validate})
    return batch.repeat(n, interleave=True)


def load_model(source, state=None):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    if state is not None:
        model.load_state_dict(state)
    return model.eval()


def recompute_logprobs(model, out: DataProto, temperature: float = 1.0) -> torch.Tensor:
    """The actor's logprobs of ``out``'s responses, teacher-forced: one forward of
    ``input_ids`` with verl's ``attention_mask`` / ``position_ids``, logits of the positions
    before each response token divided by ``temperature``, verl's ``logprobs_from_logits``
    (as verl's FSDP actor without remove-padding).  ``[B, response_length]`` float32."""
    b = out.batch
    response_length = b["responses"].size(1)
    with torch.no_grad():
        logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"],
                       position_ids=b["position_ids"]).logits
    logits = logits[:, -response_length - 1:-1, :] / temperature
    return logprobs_from_logits(logits, b["responses"])


def perturbed_state(model, seed: int = 1, scale: float = 0.5) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: v + scale * torch.randn(v.shape, generator=g) for k, v in model.state_dict().items()}


@ToolParser.register("trio_test_first_turn")
class FirstTurnToolParser(ToolParser):
    """A tool parser (verl's extension point, ``rollout.multi_turn.format``) that reads the
    first assistant turn of each sample as a call of ``lookup(key=<sample's first token>)``
    and every later turn as a final answer: the random tiny model then takes a tool turn.
    Its stop tokens (ids 150-260, injected by ``ToolAgentLoop`` into the sampling params)
    end each turn after a few tokens, as a real model's end-of-call token would."""

    def __init__(self, tokenizer) -> None:
        super().__init__(tokenizer)
        self.turns = 0

    @property
    def stop_token_ids(self) -> list[int]:
        return list(range(150, 261))

    async def extract_tool_calls(self, responses_ids, tools=None):
        self.turns += 1
        text = self.tokenizer.decode(responses_ids)
        if self.turns > 1:
            return text, []
        return text, [FunctionCall(name="lookup", arguments=json.dumps({"key": str(responses_ids[0])}))]


class RewardHandle:
    """Duck-types one of verl's streaming reward workers (a Ray actor handle:
    ``await handle.compute_score.remote(data)``): the score of a row is its own
    ``ground_truth`` column, so a shifted row would show; ``fail_on`` makes the first call
    for that ground truth raise."""

    def __init__(self, fail_on: float | None = None) -> None:
        self.fail_on = fail_on
        self.calls = 0
        self.compute_score = self  # handle.compute_score.remote(...)

    async def _score(self, data: DataProto) -> dict:
        self.calls += 1
        truth = float(data.non_tensor_batch["ground_truth"][0])
        if truth == self.fail_on:
            self.fail_on = None
            raise RuntimeError("injected: the reward failed once")
        return {"reward_score": truth, "reward_extra_info": {"acc": truth}}

    def remote(self, data: DataProto):
        return self._score(data)
