"""Helpers for the OpenAI-client, proxy and math-agent tests: a backend that
answers with crafted texts and records what it received and sampled."""

from __future__ import annotations

import json

from engine import MockBackend, ModelResponse
from engine.testing import TINY_EOS_ID

CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                       "required": ["expression"]},
    },
}


def tool_call_text(name: str, arguments: dict) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


class ScriptedBackend(MockBackend):
    """Answers request ``k`` with ``script[k]`` (text, tokenized, then ``<|im_end|>``
    unless the budget cuts it: stop reason ``"length"``); after the script, with
    ``default``.  ``log`` keeps ``(input_ids, ModelResponse)`` per request."""

    def __init__(self, tokenizer, script=(), default="ok", logprob=-0.5):
        super().__init__(self._answer)
        self.tokenizer = tokenizer
        self.script = list(script)
        self.default = default
        self.logprob = logprob
        self.log: list[tuple[list[int], ModelResponse]] = []

    async def _answer(self, request, budget):
        k = len(self.log)
        text = self.script[k] if k < len(self.script) else self.default
        ids = self.tokenizer.encode(text, add_special_tokens=False) + [TINY_EOS_ID]
        out = ids[:budget]
        resp = ModelResponse(input_tokens=list(request.input_ids), output_tokens=out,
                             output_logprobs=[self.logprob - 0.01 * i for i in range(len(out))],
                             output_versions=[self.version] * len(out),
                             stop_reason="stop" if len(out) == len(ids) else "length")
        self.log.append((list(request.input_ids), resp))
        return resp
