"""Evaluation (verifiers_rl/rollouts/evaluation.py, RLTrainer.evaluate): the pass@k estimator, the reduction to metrics,
held-out splits, seeded and batch-independent evaluation rollouts, a run with evaluation ending with the same
parameters as one without (live at k = 0 and k = 1, and replay), and the bad-input errors."""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import statistics
import threading
import time

import pytest
import torch
from transformers import AutoTokenizer

from verifiers_rl.config.rl_config import RLConfig
from verifiers_rl.envs import Rubric, SingleTurnEnv, load_environment
from verifiers_rl.envs.environment import Row
from verifiers_rl.envs.splits import hold_out
from verifiers_rl.rollouts.evaluation import (
    EvalSample,
    EvalSettings,
    EvaluationTimeout,
    evaluate,
    pass_at_k,
    summarize,
)
from verifiers_rl.inference import EmbeddedEngine, SamplingConfig
from verifiers_rl.core.rollout import Rollout, write_rollouts
from verifiers_rl.rollouts.synthetic import random_rollouts
from verifiers_rl.training.trainer import RLTrainer


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


# --- pass@k and the reduction ---------------------------------------------------------------------------------------


def test_pass_at_k_is_the_chance_that_k_of_the_n_samples_hold_a_pass():
    for n in range(1, 7):
        for c in range(n + 1):
            samples = [True] * c + [False] * (n - c)
            for k in range(1, n + 1):
                subsets = list(itertools.combinations(samples, k))
                expected = sum(any(subset) for subset in subsets) / len(subsets)
                assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12), (n, c, k)
            assert pass_at_k(n, c, 1) == pytest.approx(c / n)
    with pytest.raises(ValueError, match="1 <= k <= n"):
        pass_at_k(2, 1, 3)


def _sample(row: int, index: int, reward: float, tokens: int, threshold: float = 1.0) -> EvalSample:
    rollout = Rollout([1, 2], [5] * tokens, [1] * tokens, reward, f"eval-{row}", truncated=tokens == 4,
                      metrics={"exact": float(reward == 1.0), "partial": reward / 2, "reward_errors": 0.0})
    return EvalSample(Row(row, [{"role": "user", "content": str(row)}], answer="x"), index, rollout, reward >= threshold)


def test_summary_metrics_average_rollouts_and_pass_rates_over_prompts():
    # Prompt 0: rewards 1, 0.5, 1 (2 of 3 pass); prompt 1: 0, 0, 0.25 (none pass).
    rewards = {0: [1.0, 0.5, 1.0], 1: [0.0, 0.0, 0.25]}
    samples = [_sample(row, i, r, tokens=2 + i) for row, rs in rewards.items() for i, r in enumerate(rs)]
    metrics = summarize(samples, 3, 1.0, seconds=2.0).metrics()
    assert metrics["eval_reward"] == pytest.approx(2.75 / 6)
    assert metrics["eval_pass@1"] == pytest.approx((2 / 3 + 0) / 2)
    assert metrics["eval_pass@3"] == pytest.approx((1 + 0) / 2)
    assert metrics["eval_rewards/exact"] == pytest.approx(2 / 6)
    assert metrics["eval_rewards/partial"] == pytest.approx(2.75 / 12)
    assert "eval_rewards/reward_errors" not in metrics
    assert metrics["eval_completion_tokens"] == pytest.approx(3.0)  # 2, 3, 4 tokens per prompt
    assert metrics["eval_truncated_fraction"] == pytest.approx(2 / 6)
    assert (metrics["eval_num_prompts"], metrics["eval_samples_per_prompt"]) == (2.0, 3.0)
    # eval_reward_std was the population std; TRL's evaluation logs nanstd (Bessel's correction), as training does.
    assert metrics["eval_reward_std"] == pytest.approx(statistics.stdev([1.0, 0.5, 1.0, 0.0, 0.0, 0.25]))
    assert math.isnan(summarize(samples[:1], 1, 1.0, seconds=1.0).metrics()["eval_reward_std"])  # as TRL's nanstd
    # A lower threshold: 0.5 passes too.
    loose = summarize([_sample(s.row.index, s.sample, s.rollout.reward, 2, threshold=0.5) for s in samples], 3, 0.5, 1.0)
    assert loose.metrics()["eval_pass@1"] == pytest.approx((1 + 0) / 2)


def test_a_mixtures_overall_reward_functions_average_only_the_rollouts_that_have_them():
    # Entry "a" scores with exact, entry "b" with partial; both with shared. The first sample is a's.
    def sample(row: int, env: str, metrics: dict) -> EvalSample:
        rollout = Rollout([1], [5], [1], sum(metrics.values()), f"eval-{row}", metrics=metrics, env=env)
        return EvalSample(Row(row, [{"role": "user", "content": str(row)}]), 0, rollout, False)

    samples = [sample(0, "a", {"exact": 1.0, "shared": 0.25}), sample(1, "a", {"exact": 0.0, "shared": 0.75}),
               sample(2, "b", {"partial": 0.5, "shared": 0.5}), sample(3, "b", {"partial": 0.25, "shared": 1.0}),
               sample(4, "b", {"partial": 0.0, "shared": 0.0})]
    metrics = summarize(samples, 1, 1.0, seconds=1.0).metrics()
    assert metrics["eval_rewards/exact"] == pytest.approx(0.5) == metrics["eval_env/a/rewards/exact"]  # not 1/5
    assert metrics["eval_rewards/partial"] == pytest.approx(0.25) == metrics["eval_env/b/rewards/partial"]
    assert metrics["eval_rewards/shared"] == pytest.approx(2.5 / 5)  # every rollout has it
    assert "eval_env/a/rewards/partial" not in metrics and "eval_env/b/rewards/exact" not in metrics


def _toy_env(tokenizer, rows=10, eval_rows=()):
    dataset = [{"question": f"q{i}", "answer": f"a{i}"} for i in range(rows)]
    held = [{"question": f"e{i}", "answer": f"b{i}"} for i in range(eval_rows)] if eval_rows else None
    return SingleTurnEnv(dataset, Rubric([lambda completion: 0.0]), tokenizer, max_new_tokens=4, max_seq_len=64,
                         eval_dataset=held)


# --- evaluation rollouts --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("blocking", [False, True], ids=["async", "sync"])
def test_an_evaluation_whose_environment_is_stuck_fails_naming_the_timeout(blocking, tiny_model_dir, tokenizer):
    # A reward function that never returns: without the bound the evaluation (and the run) would wait forever. A
    # synchronous one blocks the event loop itself, so the bound must be kept outside it.
    finished, release = [], threading.Event()

    async def stuck(completion, answer):
        if answer == "0":  # row 0 never scores; the others do, each a prompt's samples finishing
            await asyncio.sleep(3600)
        finished.append(answer)
        return 0.0

    def stuck_blocking(completion, answer):
        if answer == "0":
            release.wait(3600)
        finished.append(answer)
        return 0.0

    rows = [{"prompt": [{"role": "user", "content": str(i)}], "answer": str(i)} for i in range(3)]
    env = SingleTurnEnv(rows, Rubric([stuck_blocking if blocking else stuck]), tokenizer, max_new_tokens=2,
                        max_seq_len=64, eval_dataset=rows)
    engine = EmbeddedEngine(tiny_model_dir, tokenizer, SamplingConfig(temperature=1.0))
    try:
        started = time.monotonic()
        # The blocked loop may not have scored the other rows either: how many wait depends on the order.
        waiting = r"[123]" if blocking else "1"
        with pytest.raises(EvaluationTimeout, match=rf"no prompt's samples finished within 1 s \({waiting} of 3 "
                                                    r"prompts waiting\).*--generation_timeout_s"):
            evaluate(env, engine, EvalSettings(samples_per_prompt=2, seed=0, timeout_s=1.0))
        assert time.monotonic() - started < 30
        assert blocking or sorted(finished) == ["1", "1", "2", "2"]
    finally:
        release.set()  # lets the blocked reward function's thread end
        engine.close()
    with pytest.raises(ValueError, match="generation_timeout_s must be > 0"):
        EvalSettings(timeout_s=0.0)


def test_evaluation_is_seeded_batch_independent_and_greedy_at_temperature_zero(tiny_model_dir, tokenizer):
    env = load_environment("reverse_text", tokenizer=tokenizer, num_examples=20, num_eval_examples=6, max_new_tokens=8)
    engine = EmbeddedEngine(tiny_model_dir, tokenizer, SamplingConfig(temperature=1.0))
    ids = lambda result: {(s.row.index, s.sample): s.rollout.completion_ids for s in result.samples}  # noqa: E731
    six = evaluate(env, engine, EvalSettings(num_examples=6, samples_per_prompt=3, seed=1))
    assert len(six.samples) == 18 and ids(evaluate(env, engine, EvalSettings(6, 3, seed=1))) == ids(six)
    # The first two rows' samples do not depend on which other rows share the engine's batch.
    two = ids(evaluate(env, engine, EvalSettings(num_examples=2, samples_per_prompt=3, seed=1)))
    assert two == {key: value for key, value in ids(six).items() if key[0] < 2}
    assert ids(evaluate(env, engine, EvalSettings(6, 3, seed=2))) != ids(six)
    assert len({tuple(s.rollout.completion_ids) for s in six.samples if s.row.index == 0}) > 1  # samples differ
    # Greedy: a prompt's completion does not depend on the seed, so several samples of it would all be the same
    # completion (pass@k = pass@1 at k times the cost): refused.
    greedy = ids(evaluate(env, engine, EvalSettings(num_examples=6, temperature=0.0, seed=1)))
    assert greedy == ids(evaluate(env, engine, EvalSettings(num_examples=6, temperature=0.0, seed=2)))
    with pytest.raises(ValueError, match=r"^--eval_samples_per_prompt 3 at --eval_temperature 0: greedy decoding gives "
                                         r"every sample of a prompt the same completion"):
        EvalSettings(num_examples=6, samples_per_prompt=3, temperature=0.0)
    assert engine.policy_version == 0


def test_a_mixture_entry_evaluates_the_same_samples_as_its_environment_alone(tiny_model_dir, tokenizer):
    """An entry's rows drew their seeds from their place in the mixture's list, so `verifiers-rl eval` of the
    environment and the mixture's eval/env/<name>/ sampled other completions of the same prompts."""
    from verifiers_rl import mixture_of

    reverse = {"num_examples": 4, "num_eval_examples": 3, "max_new_tokens": 8}
    entries = [{"env": "arithmetic", "env_args": {"num_examples": 4, "num_eval_examples": 3}},
               {"env": "reverse_text", "env_args": reverse}]  # second: its rows sit at 3-5 of the mixture's list
    engine = EmbeddedEngine(tiny_model_dir, tokenizer, SamplingConfig(temperature=1.0))
    settings = EvalSettings(num_examples=3, samples_per_prompt=2, seed=1)
    mixed = evaluate(mixture_of(entries, tokenizer), engine, settings)
    alone = evaluate(load_environment("reverse_text", tokenizer=tokenizer, **reverse), engine, settings)
    seen = lambda samples: [(s.rollout.prompt, s.sample, s.rollout.completion_ids) for s in samples]  # noqa: E731
    assert seen(s for s in mixed.samples if s.rollout.env == "reverse_text") == seen(alone.samples)
    assert mixed.by_env["reverse_text"].reward == pytest.approx(alone.reward)


# --- evaluation inside training -------------------------------------------------------------------------------------


def _train(tiny_model_dir, tokenizer, tmp_path, mode: str, evaluating: bool):
    """Three steps (live at k = 0 / 1, or replay with an engine for evaluation); returns the final parameters and the
    logged evaluations."""
    env = load_environment("reverse_text", tokenizer=tokenizer, num_examples=24, num_eval_examples=4, max_new_tokens=8)
    args = RLConfig(
        output_dir=str(tmp_path / f"{mode}-{evaluating}"), use_cpu=True, report_to="none", save_strategy="no",
        logging_steps=1, max_steps=3, learning_rate=1e-2, lr_scheduler_type="constant", rollouts_per_step=8,
        num_generations=4, max_seq_len=128, max_off_policy_steps=1 if mode == "k1" else 0, gradient_checkpointing=False,
        disable_tqdm=True, seed=3, **({"eval_steps": 1, "eval_samples_per_prompt": 2} if evaluating else {}),
    )
    engine = EmbeddedEngine(tiny_model_dir, tokenizer, SamplingConfig(temperature=1.0, max_new_tokens=8),
                            generate_in_loop_thread=mode != "k1")
    if mode == "replay":
        path = tmp_path / "replay.jsonl"
        write_rollouts(path, random_rollouts(6, 4, vocab_size=390, seed=4))
        args.rollouts_path = str(path)
        inputs = {"engine": engine, "eval_environment": env}
    else:
        inputs = {"engine": engine, "environment": env}
    trainer = RLTrainer(tiny_model_dir, args, processing_class=tokenizer, **inputs)
    trainer.train()
    params = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    evals = [entry for entry in trainer.state.log_history if "eval_reward" in entry]
    return params, evals, env


@pytest.mark.parametrize("mode", ["k0", "k1", "replay"])
def test_evaluation_leaves_the_training_trajectory_unchanged(tiny_model_dir, tokenizer, tmp_path, mode):
    without, none, _ = _train(tiny_model_dir, tokenizer, tmp_path, mode, evaluating=False)
    with_eval, evals, env = _train(tiny_model_dir, tokenizer, tmp_path, mode, evaluating=True)
    assert none == []
    assert [entry["step"] for entry in evals] == [1, 2, 3]
    assert all(entry["eval_num_prompts"] == 4 and entry["eval_samples_per_prompt"] == 2 for entry in evals)
    moved = [name for name in without if not torch.equal(without[name], with_eval[name])]
    assert not moved, f"evaluation changed {moved}"
    # The evaluations saw the trained weights (the policy moved, so the same seeded samples scored differently).
    assert len({entry["eval_reward"] for entry in evals}) > 1
    engine = EmbeddedEngine(tiny_model_dir, tokenizer, SamplingConfig(temperature=1.0))
    engine.load_weights(with_eval.items(), version=3)
    final = evaluate(env, engine, EvalSettings(samples_per_prompt=2, seed=3)).metrics()
    assert final["eval_reward"] == evals[-1]["eval_reward"] and final["eval_pass@2"] == evals[-1]["eval_pass@2"]


def test_evaluation_bad_input_is_a_clear_error_when_training_starts(tiny_model_dir, tokenizer, tmp_path):
    def trainer(env, **overrides):
        args = RLConfig(output_dir=str(tmp_path / "bad"), use_cpu=True, report_to="none", save_strategy="no",
                        max_steps=1, rollouts_per_step=4, num_generations=4, max_seq_len=64, eval_steps=1,
                        disable_tqdm=True, **overrides)
        engine = EmbeddedEngine(tiny_model_dir, tokenizer, SamplingConfig(max_new_tokens=4))
        return RLTrainer(tiny_model_dir, args, processing_class=tokenizer, environment=env, engine=engine)

    with pytest.raises(ValueError, match=r"--eval_num_examples 5 is larger than the held-out split of .* \(3 rows\)"):
        trainer(_toy_env(tokenizer, eval_rows=3), eval_num_examples=5)
    with pytest.raises(ValueError, match="has no held-out split to evaluate on.*--eval_env.*--eval_holdout N"):
        trainer(_toy_env(tokenizer))
    env = _toy_env(tokenizer)
    with pytest.raises(ValueError, match=r"--eval_holdout 4: hold the rows out where the environment is loaded"):
        trainer(env, eval_holdout=4, eval_num_examples=4)  # the trainer never edits an environment's rows
    assert len(env.dataset) == 10
    hold_out(env, 4, seed=42)
    trainer(env, eval_holdout=4, eval_num_examples=4)  # holding rows out gives it a split
    assert len(env.dataset) == 6 and len(env.eval_dataset) == 4
    for flag, value, message in [("eval_samples_per_prompt", 0, "eval_samples_per_prompt must be >= 1"),
                                 ("eval_temperature", -1.0, "eval_temperature must be a finite number >= 0"),
                                 ("eval_num_examples", 0, "eval_num_examples must be >= 1")]:
        with pytest.raises(ValueError, match=message):
            RLConfig(output_dir=str(tmp_path / "c"), use_cpu=True, report_to="none", **{flag: value})


def test_evaluation_never_changes_which_rows_train(tokenizer):
    """--eval_holdout moves rows whether or not evaluation runs, so both runs train on the same rows; preparing the
    evaluation changes no row."""
    from verifiers_rl.rollouts.evaluation import prepare

    rows = {}
    for evaluating in (False, True):
        env = _toy_env(tokenizer)
        hold_out(env, 3, seed=1)
        before = [row.index for row in env.dataset]
        args = RLConfig(output_dir="unused", use_cpu=True, report_to="none", eval_holdout=3, seed=1,
                        eval_steps=1 if evaluating else None)
        assert (prepare(args, env, None) is not None) == evaluating
        assert [row.index for row in env.dataset] == before
        rows[evaluating] = [row.index for row in env.dataset]
    assert rows[False] == rows[True] and len(rows[True]) == 7


@pytest.mark.distributed
def test_evaluation_under_zero3_leaves_training_unchanged_and_scores_the_saved_weights(tiny_model_dir, tokenizer, tmp_path):
    """DeepSpeed ZeRO-3, 2 processes, replay: evaluation gathers the shards into the main process's engine, every
    rank gets the metrics, the final weights equal those of the same run without evaluation, and the saved model
    evaluates to what the run logged at its last step."""
    from tests.distributed.eval_run import ENV_ARGS
    from tests.helpers.launches import ROOT, accelerate, launch

    write_rollouts(tmp_path / "r.jsonl", random_rollouts(4, 4, vocab_size=390, seed=6))
    log = tmp_path / "zero3.log"
    result = launch(accelerate("zero3_cpu.yaml"), [str(ROOT / "tests" / "distributed" / "eval_run.py"), "--model",
                    tiny_model_dir, "--rollouts", str(tmp_path / "r.jsonl"), "--out", str(tmp_path / "out")], log)
    assert result.returncode == 0, log.read_text()[-6000:]
    out = tmp_path / "out"
    record = json.loads((out / "eval.json").read_text())
    assert record["num_processes"] == 2
    evals = [entry for entry in record["log_history"] if "eval_reward" in entry]
    assert [entry["step"] for entry in evals] == [1, 2]
    plain, evaluated = torch.load(out / "params_plain.pt"), torch.load(out / "params_eval.pt")
    assert plain.keys() == evaluated.keys() and all(torch.equal(plain[k], evaluated[k]) for k in plain)
    env = load_environment("reverse_text", tokenizer=tokenizer, **ENV_ARGS)
    engine = EmbeddedEngine(str(out / "saved"), tokenizer, SamplingConfig(temperature=1.0))
    final = evaluate(env, engine, EvalSettings(samples_per_prompt=2, seed=0)).metrics()
    assert final["eval_reward"] == evals[-1]["eval_reward"] and final["eval_pass@2"] == evals[-1]["eval_pass@2"]


@pytest.mark.distributed
def test_live_evaluation_under_ddp_runs_on_every_rank_and_leaves_training_unchanged(tiny_model_dir, tmp_path):
    """DDP, 2 processes, live: only the main process holds the generator, yet every rank must take the same
    collective path through the weight sync and evaluate (a split hung the launch). Evaluation draws its own seeds,
    so the final weights equal those of the same live run without evaluation."""
    from tests.helpers.launches import ROOT, accelerate, launch

    log = tmp_path / "ddp_live.log"
    result = launch(accelerate("ddp_cpu.yaml"), [str(ROOT / "tests" / "distributed" / "eval_run.py"), "--model",
                    tiny_model_dir, "--out", str(tmp_path / "out")], log)
    assert result.returncode == 0, log.read_text()[-6000:]
    out = tmp_path / "out"
    record = json.loads((out / "eval.json").read_text())
    assert record["num_processes"] == 2
    assert [entry["step"] for entry in record["log_history"] if "eval_reward" in entry] == [1, 2]
    plain, evaluated = torch.load(out / "params_plain.pt"), torch.load(out / "params_eval.pt")
    assert plain.keys() == evaluated.keys() and all(torch.equal(plain[k], evaluated[k]) for k in plain)
