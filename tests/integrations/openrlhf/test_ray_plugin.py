"""OpenRLHF tier: OpenRLHF 0.11.2's Ray rollout path on trio-rollout engine actors.

:func:`engine.integrations.openrlhf.install` replaces ``openrlhf.trainer.ray.create_vllm_engines``;
the engines it returns (Ray actors of ``TrioRolloutActor``, the tiny model, the agent from an
``--train.agent_func_path`` file) then serve OpenRLHF's own ``SamplesGenerator._generate_vllm``
(dispatch, load balancing, ``ray.wait``, rows -> ``Experience``), and receive a weight broadcast
sent as ``ActorPPOTrainer._broadcast_param`` sends it with ``--vllm.sync_with_ray
--vllm.sync_backend gloo`` (its module imports DeepSpeed, so the trainer side is written out
here: ``init_collective_group`` as rank 0, then per ``named_parameters()`` entry
``update_weight.remote(name, dtype, shape, empty_cache=last)`` + ``collective.broadcast``).
"""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest

pytest.importorskip("openrlhf", reason="needs the openrlhf venv: make test-integrations")
ray = pytest.importorskip("ray", reason="needs the openrlhf venv: make test-integrations")

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from engine.testing import build_tiny_model  # noqa: E402

from _openrlhf_support import openrlhf_logprobs, samples_generator  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::ResourceWarning",
                                        "ignore::FutureWarning")  # Ray's own, at start-up and shutdown

MAX_LEN = 80
AGENT = '''
import torch
from openrlhf.utils.agent import AgentInstanceBase, MultiTurnAgentExecutor


class AgentInstance(AgentInstanceBase):
    def __init__(self, *args, **kwargs):
        self.turn = 0

    async def step(self, states, **kwargs):
        self.turn += 1
        return {"rewards": torch.tensor(float(len(states["label"]))), "environment_feedback": "\\nok\\n",
                "done": self.turn >= 2}


class AgentExecutor(MultiTurnAgentExecutor):
    def __init__(self):
        super().__init__(AgentInstance)
'''


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    path = build_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0)
    agent = tmp_path_factory.mktemp("agent") / "agent.py"
    agent.write_text(AGENT)
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}})
    try:
        yield path, str(agent)
    finally:
        ray.shutdown()


def test_openrlhf_samples_generator_and_weight_broadcast_on_trio_engines(cluster, monkeypatch):
    path, agent = cluster
    module = samples_generator(monkeypatch)  # imports openrlhf.trainer.ray (the vllm stand-in: _openrlhf_support)
    import openrlhf.trainer.ray as orl_ray

    from engine.integrations.openrlhf import OpenRLHFRayOptions, install

    uninstall = install(OpenRLHFRayOptions(backend_kwargs={"device": "cpu", "dtype": "float32"}))
    try:
        # what train_ppo_ray.train passes (no --vllm.enable_sleep; correction on: processed logprobs)
        engines = orl_ray.create_vllm_engines(2, 1, path, 0, False, False, True, MAX_LEN, None, None, False,
                                              "processed_logprobs", agent_func_path=agent, remote_rm_url=None)
    finally:
        uninstall()
    assert orl_ray.create_vllm_engines.__module__ == "openrlhf.trainer.ray.vllm_engine"  # put back
    tok = AutoTokenizer.from_pretrained(path)
    args = SimpleNamespace(rollout=SimpleNamespace(n_samples_per_prompt=2, batch_size=3),
                           vllm=SimpleNamespace(enable_sleep=False),
                           algo=SimpleNamespace(dynamic_filtering_enable=False,
                                                advantage=SimpleNamespace(is_correction_level="token")))
    gen = module.SamplesGenerator(SimpleNamespace(args=args), None, None, tok, engines)
    prompts = [f"prompt number {i}" for i in range(3)]
    labels = ["a" * (i + 1) for i in range(3)]
    batches = iter([(None, prompts, labels, [None] * 3)])
    kwargs = dict(temperature=1.0, max_len=MAX_LEN, max_new_tokens=12, n_samples_per_prompt=2)
    experiences, consumed, exhausted = gen._generate_vllm(batches, num_prompts=3, dynamic_filtering=False, **kwargs)
    assert consumed == 3 and len(experiences) == 6
    by_prompt = {}
    for exp in experiences:  # arrive per prompt (ray.wait order), each prompt's 2 rows together
        by_prompt.setdefault(exp.prompts[0], []).append(exp)
    assert sorted(by_prompt) == prompts and all(len(v) == 2 for v in by_prompt.values())
    for exp in experiences:
        label = labels[prompts.index(exp.prompts[0])]
        assert exp.labels == [label] and exp.rewards.item() in (len(label), 2 * len(label))  # 1 or 2 turns
        assert exp.rollout_log_probs.shape == exp.action_mask.shape
    assert all(ray.get(e.get_num_unfinished_requests.remote()) == 0 for e in engines)

    # -- the weight broadcast, as ActorPPOTrainer sends it with --vllm.sync_with_ray --vllm.sync_backend gloo
    @ray.remote(num_cpus=0)
    class Rank0:
        def __init__(self, model_dir):
            import torch
            from transformers import AutoModelForCausalLM

            self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
            with torch.no_grad():
                for p in self.model.parameters():
                    p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(3)))

        def join(self, world_size):
            import ray.util.collective as collective

            collective.init_collective_group(world_size=world_size, rank=0, backend="gloo", group_name="openrlhf")

        def broadcast_to_vllm(self, engines):
            import ray
            import ray.util.collective as collective

            params = list(self.model.named_parameters())
            for count, (name, param) in enumerate(params, start=1):
                refs = [e.update_weight.remote(name, dtype=param.dtype, shape=param.shape,
                                               empty_cache=count == len(params)) for e in engines]
                collective.broadcast(param.data, 0, group_name="openrlhf")
                ray.get(refs)
            return {n: p.detach().clone() for n, p in self.model.state_dict().items()}

    trainer = Rank0.remote(path)
    world = len(engines) + 1
    refs = [e.init_process_group.remote("127.0.0.1", 0, i + 1, world, "openrlhf", backend="gloo", use_ray=True)
            for i, e in enumerate(engines)]
    ray.get([trainer.join.remote(world), *refs])
    trained_state = ray.get(trainer.broadcast_to_vllm.remote(engines))
    assert [ray.get(e.get_version.remote()) for e in engines] == [1, 1]

    trained = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    trained.load_state_dict(trained_state)
    params = module.SamplingParams(temperature=1.0, top_p=1.0, top_k=-1, max_tokens=10, min_tokens=0,
                                   skip_special_tokens=False, logprobs=1)
    for engine in engines:
        rows = ray.get(engine.generate_responses.remote("after the update", "b", params, MAX_LEN, tok, num_samples=2))
        for row in rows:
            exp = gen._process_response_into_experience(row, max_len=MAX_LEN)
            on = exp.action_mask[0].bool()
            versions = {v for v, m in zip(row["rollout_versions"][1:], on.tolist()) if m}
            assert versions == {1}
            diff = (openrlhf_logprobs(trained, exp, 1.0)[0] - exp.rollout_log_probs[0])[on].abs().max().item()
            assert diff < 1e-4
    stats = [ray.get(e.statistics.remote()) for e in engines]
    assert [s.weight_syncs for s in stats] == [1, 1] and sum(s.samples for s in stats) == 6 + 4
    for e in engines:
        ray.get(e.close.remote())
    assert "vllm" in sys.modules  # the stand-in, removed again by monkeypatch at teardown
