"""HF's best-checkpoint settings through our atomic checkpoints: ``metric_for_best_model`` reads our evaluation's
metrics, ``save_strategy best`` saves exactly the steps whose evaluation improved on the best so far, rotation
(``save_total_limit``) keeps the best checkpoint, every ``trainer_state.json`` names its published folder (not the
partial one it was written in), and ``load_best_model_at_end`` ends the run with the best checkpoint's weights.

The evaluation environment's reward is scripted (a value per evaluation, whatever the samples), so which step is best
is known before the run; the training batches are a replay, so nothing else calls the reward."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer

from verifiers_rl.config.rl_config import RLConfig
from verifiers_rl.core.rollout import write_rollouts
from verifiers_rl.envs import Rubric, SingleTurnEnv
from verifiers_rl.inference import EmbeddedEngine, SamplingConfig
from verifiers_rl.rollouts.synthetic import random_rollouts
from verifiers_rl.training.trainer import RLTrainer

EVAL_PROMPTS = 2


def scripted_env(tokenizer, rewards: list[float]) -> SingleTurnEnv:
    """An environment whose n-th evaluation scores every sample ``rewards[n]``."""
    calls = []

    def reward(completion) -> float:
        calls.append(completion)
        return rewards[(len(calls) - 1) // EVAL_PROMPTS]

    rows = [{"question": f"q{i}", "answer": "a"} for i in range(EVAL_PROMPTS)]
    return SingleTurnEnv(rows, Rubric([reward]), tokenizer, max_new_tokens=2, max_seq_len=64, eval_dataset=rows)


def train(model_dir: str, tmp_path: Path, rewards: list[float], **settings) -> RLTrainer:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rollouts = tmp_path / "rollouts.jsonl"
    write_rollouts(rollouts, random_rollouts(len(rewards) * 2, 4, vocab_size=390, seed=5))
    args = RLConfig(output_dir=str(tmp_path / "run"), use_cpu=True, report_to="none", rollouts_path=str(rollouts),
                    rollouts_per_step=8, max_steps=len(rewards), eval_steps=1, learning_rate=1e-2,
                    lr_scheduler_type="constant", gradient_checkpointing=False, disable_tqdm=True, **settings)
    engine = EmbeddedEngine(model_dir, tokenizer, SamplingConfig(temperature=1.0, max_new_tokens=2))
    trainer = RLTrainer(model_dir, args, processing_class=tokenizer, engine=engine,
                        eval_environment=scripted_env(tokenizer, rewards))
    trainer.train()
    return trainer


def folders(run: Path) -> list[str]:
    return sorted(path.name for path in run.glob("checkpoint-*"))


def test_rotation_keeps_the_best_checkpoint_and_the_run_ends_with_its_weights(tiny_model_dir, tmp_path):
    trainer = train(tiny_model_dir, tmp_path, [0.2, 0.9, 0.5, 0.1], save_strategy="steps", save_steps=1,
                    save_total_limit=2, load_best_model_at_end=True, metric_for_best_model="eval/reward")
    run = tmp_path / "run"
    evaluations = [entry["eval_reward"] for entry in trainer.state.log_history if "eval_reward" in entry]
    assert evaluations == [0.2, 0.9, 0.5, 0.1]
    # The newest (to resume from) and the best; rotation deleted the others.
    assert folders(run) == ["checkpoint-2", "checkpoint-4"]
    assert trainer.state.best_model_checkpoint == str(run / "checkpoint-2")
    for name in folders(run):
        state = json.loads((run / name / "trainer_state.json").read_text())
        assert state["best_model_checkpoint"] == str(run / "checkpoint-2") and state["best_global_step"] == 2
    best, last = (load_file(run / name / "model.safetensors") for name in ("checkpoint-2", "checkpoint-4"))
    final = {name: p.detach() for name, p in trainer.model.named_parameters()}
    assert all(torch.equal(final[name], best[name]) for name in best)
    assert not all(torch.equal(best[name], last[name]) for name in best)  # the last step's weights were others


@pytest.mark.parametrize("rewards, saved", [([0.2, 0.9, 0.5, 0.95], [1, 2, 4]), ([0.5, 0.4, 0.3], [1])])
def test_save_strategy_best_saves_the_steps_whose_evaluation_improved(tiny_model_dir, tmp_path, rewards, saved):
    trainer = train(tiny_model_dir, tmp_path, rewards, save_strategy="best")
    assert trainer.args.metric_for_best_model == "reward"  # unset: the evaluation's mean reward
    assert folders(tmp_path / "run") == [f"checkpoint-{step}" for step in saved]
    assert trainer.state.best_model_checkpoint == str(tmp_path / "run" / f"checkpoint-{saved[-1]}")


def test_a_best_metric_the_evaluation_does_not_log_is_refused_naming_the_ones_it_does(tiny_model_dir, tmp_path):
    from verifiers_rl.core.errors import BestMetricError

    with pytest.raises(BestMetricError, match=r"^--metric_for_best_model rewards/nope: the evaluation logs no metric "
                                              r"of that name; it logs .*pass@1, .*reward, .*rewards/reward"):
        train(tiny_model_dir, tmp_path, [0.2, 0.9], save_strategy="best", metric_for_best_model="rewards/nope")
    # A name it logs (the reward function's, as tensorboard shows it) is taken.
    (tmp_path / "ok").mkdir()
    trainer = train(tiny_model_dir, tmp_path / "ok", [0.2, 0.9], save_strategy="best",
                    metric_for_best_model="eval/rewards/reward")
    assert trainer.state.best_metric == 0.9
