"""AReaL 1.0.4's own ``PPOTrainer`` training on trio-rollout, on CPU: ``AReaLPPOTrainer``.

Two real GRPO steps in AReaL's SPMD mode (one process, gloo): AReaL's FSDP actor, its
``DistRolloutCoordinator``, its ``RLVRWorkflow`` given as an import string with
``workflow_kwargs`` (as AReaL's examples do), its disk weight updates after every step through
``update_weights_from_disk``'s name-resolve handshake.  Checked on every step's batch, as the
trainer hands it to ``compute_advantages``: the rows' versions are the step (the weights were
synced), the engine's logprobs equal the actor's own ``compute_logp`` within 1e-4 (on step 1
that is only true if the updated weights reached the engine), and the actor's weights changed.
"""

from __future__ import annotations

import pathlib

import pytest

pytest.importorskip("areal", reason="needs the areal venv: make test-integrations")

import torch  # noqa: E402
from areal.api.cli_args import GRPOConfig, load_expr_config  # noqa: E402
from areal.utils import network  # noqa: E402
from areal.utils.hf_utils import load_hf_tokenizer  # noqa: E402
from areal_doubles import AREAL_WARNINGS, max_logp_error, prompts  # noqa: E402
from areal_rewards import token_sum_reward  # noqa: E402
from datasets import Dataset  # noqa: E402

from engine import HFBackend  # noqa: E402
from engine.testing import build_tiny_model  # noqa: E402

torch.set_num_threads(1)

pytestmark = AREAL_WARNINGS

CONFIG = pathlib.Path(__file__).with_name("grpo_cpu.yaml")


@pytest.fixture
def spmd(monkeypatch):
    """One SPMD rank, as ``python -m areal.infra.launcher.local`` sets it up."""
    for name, value in {"AREAL_SPMD_MODE": "1", "WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0",
                        "MASTER_ADDR": "localhost", "MASTER_PORT": str(network.find_free_ports(1)[0])}.items():
        monkeypatch.setenv(name, value)


def _full(tensor):
    return (tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor).detach().clone()


def test_two_grpo_steps_of_areals_trainer_on_the_engine(tmp_path, spmd):
    from engine.integrations.areal import AReaLPPOTrainer  # (imports AReaL's trainer stack: under AREAL_WARNINGS)

    path = build_tiny_model(tmp_path / "tiny", arch="qwen2")  # see test_areal_engine_tests.model_path
    config, _ = load_expr_config(["--config", str(CONFIG), f"actor.path={path}", f"cluster.fileroot={tmp_path}",
                                  f"cluster.name_resolve.nfs_record_root={tmp_path / 'names'}"], GRPOConfig)
    tok = load_hf_tokenizer(path)
    steps = []
    with AReaLPPOTrainer(config, train_dataset=Dataset.from_list(prompts(4, tag="grpo")),
                         backend=lambda: HFBackend(path, tok)) as trainer:
        before = {name: _full(p) for name, p in trainer.actor.model.named_parameters()}
        advantages = trainer.actor.compute_advantages

        def checking(batch):  # the batch of this step, as the trainer hands it on
            generated = torch.cat([g["versions"][g["loss_mask"].bool()] for g in batch])
            steps.append({"versions": set(generated.tolist()), "rows": sum(g["input_ids"].shape[0] for g in batch),
                          "logp_error": max_logp_error(trainer.actor, batch, row_by_row=False),
                          "rollout_version": trainer.rollout.get_version()})
            return advantages(batch)

        trainer.actor.compute_advantages = checking
        trainer.train(workflow="areal.workflow.rlvr.RLVRWorkflow",
                      workflow_kwargs=dict(reward_fn=token_sum_reward, gconfig=config.gconfig, tokenizer=tok))
        after = {name: _full(p) for name, p in trainer.actor.model.named_parameters()}
        stats = trainer.rollout.statistics()
        eval_version = trainer.eval_rollout.get_version()
    assert [s["versions"] for s in steps] == [{0}, {1}]
    assert [s["rows"] for s in steps] == [4, 4]  # batch_size prompts x n_samples, every step
    assert all(s["logp_error"] < 1e-4 for s in steps), steps
    changed = [name for name in before if not torch.equal(before[name], after[name])]
    assert len(changed) == len(before), f"unchanged: {sorted(set(before) - set(changed))}"
    assert stats.version == 2 and eval_version == 2  # two updates, the evaluation engine followed
    assert stats.failed == 0 and stats.accepted == 4
