"""TRL's GRPOTrainer form: RLTrainer(model=..., reward_funcs=[...], args=..., train_dataset=...) trains with only the
import changed: standard and conversational prompts, extra columns, None rewards, async functions, a reward model."""

from __future__ import annotations

import json
import math

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForSequenceClassification, AutoTokenizer
from trl import GRPOConfig

from verifiers_rl import RLConfig, RLTrainer
from verifiers_rl.envs.adapters.trl_dataset import RewardFunctionsEnv
from verifiers_rl.core.rollout import read_rollouts

CALLS: list[dict] = []


def letters_like_target(completions, target, **kwargs):
    """Standard signature: completions plus a dataset column, aligned with the completions."""
    CALLS.append({"target": list(target), "state": kwargs["trainer_state"], "n": len(completions)})
    return [letters(c, t) for c, t in zip(completions, target)]


def letters(completion, target: str) -> float:
    text = completion if isinstance(completion, str) else completion[-1]["content"]
    return sum(ch in target for ch in text) / (1 + len(text))


async def only_math(prompts, completions, task, **kwargs):
    """Multi-task: None where the row is not a math row (TRL's convention); async."""
    return [float(len(c if isinstance(c, str) else c[-1]["content"]) % 3) if kind == "math" else None
            for c, kind in zip(completions, task)]


def rows(conversational: bool) -> list[dict]:
    out = []
    for i in range(8):
        text = f"Spell the word number {i} backwards."
        prompt = [{"role": "user", "content": text}] if conversational else text
        out.append({"prompt": prompt, "target": "abcdef"[i % 6:], "task": "math" if i % 2 else "spelling"})
    return out


def config(tmp_path, **overrides) -> RLConfig:
    values = dict(output_dir=str(tmp_path / "out"), use_cpu=True, report_to="none", save_strategy="no", max_steps=2,
                  per_device_train_batch_size=8, num_generations=4, max_completion_length=8, max_seq_len=96,
                  logging_steps=1, disable_tqdm=True, gradient_checkpointing=False, learning_rate=1e-3,
                  save_rollouts_path=str(tmp_path / "seen.jsonl"))
    values.update(overrides)
    return RLConfig(**values)


@pytest.mark.parametrize("conversational", [True, False])
def test_a_trl_script_trains_with_only_the_import_changed(tiny_model_dir, tmp_path, conversational):
    CALLS.clear()
    trainer = RLTrainer(
        model=tiny_model_dir,
        reward_funcs=[letters_like_target, only_math],
        args=config(tmp_path, reward_weights=[1.0, 0.5]),
        train_dataset=Dataset.from_list(rows(conversational)),
    )
    trainer.train()
    seen = read_rollouts(tmp_path / "seen.jsonl")
    assert len(seen) == 16 and trainer.state.global_step == 2
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    by_prompt = {json.dumps(r["prompt"]): r for r in rows(conversational)}
    for rollout in seen:
        row = by_prompt[json.dumps(rollout.prompt)]
        text = (tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=False)
                if conversational else row["prompt"])  # standard format: the text itself, as TRL does
        # The template writes its own special tokens; a text prompt gets the tokenizer's (as TRL's call).
        assert rollout.prompt_ids == tokenizer(text, add_special_tokens=not conversational)["input_ids"]
        assert isinstance(rollout.completion, list if conversational else str)
        expected = letters(rollout.completion, row["target"])
        math_value = None if row["task"] != "math" else float(
            len(rollout.completion if isinstance(rollout.completion, str) else rollout.completion[-1]["content"]) % 3)
        assert rollout.reward == pytest.approx(expected + (0.5 * math_value if math_value is not None else 0.0))
        assert rollout.metrics["letters_like_target"] == pytest.approx(expected)
        assert ("only_math" in rollout.metrics) == (math_value is not None)  # None: no metric for that rollout
    # Called once per group (4 completions of one prompt), the column aligned, the trainer's state passed.
    assert all(call["n"] == 4 and len(set(call["target"])) == 1 for call in CALLS)
    # TRL's trainer_state, as of the weights that sampled the group: both batches are version 0's (k = 1).
    assert all(type(c["state"]) is type(trainer.state) and c["state"].global_step == 0 for c in CALLS)
    assert CALLS[-1]["state"].max_steps == trainer.state.max_steps == 2
    logged = [entry for entry in trainer.state.log_history if "reward" in entry]
    assert "rewards/letters_like_target/mean" in logged[0] and "rewards/only_math/std" in logged[0]
    assert "completions/mean_length" in logged[0]


def test_a_trl_form_dataset_trains_as_a_mixture_entry_beside_a_built_in(tiny_model_dir, tmp_path):
    """mixture_of takes a TRL-form environment (a dataset and reward functions) as an entry beside reverse_text: its
    rollouts' rewards are its functions recomputed, its functions get this trainer's state, and evaluation's overall
    value of a function only the TRL entry has is that entry's."""
    from verifiers_rl import mixture_of
    from verifiers_rl.inference.factory import build_engine

    CALLS.clear()
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    spelling = RewardFunctionsEnv(Dataset.from_list(rows(True)), [letters_like_target, only_math], tokenizer,
                                  reward_weights=[1.0, 0.5], max_new_tokens=8, max_seq_len=96)
    args = config(tmp_path, rollouts_per_step=16, eval_strategy="steps", eval_steps=2, eval_holdout=2)
    mixture = mixture_of([{"env": spelling, "name": "spelling"},
                          {"env": "reverse_text", "env_args": {"num_examples": 8, "max_new_tokens": 8, "max_seq_len": 96}}],
                         tokenizer, holdout=2, seed=args.seed)
    engine = build_engine(args, tiny_model_dir, tokenizer)
    trainer = RLTrainer(tiny_model_dir, args, processing_class=tokenizer, environment=mixture, engine=engine)
    try:
        trainer.train()
    finally:
        engine.close()
    seen = read_rollouts(tmp_path / "seen.jsonl")
    assert len(seen) == 32 and {r.env for r in seen} == {"spelling", "reverse_text"}
    by_prompt = {json.dumps(r["prompt"]): r for r in rows(True)}
    for rollout in (r for r in seen if r.env == "spelling"):
        row = by_prompt[json.dumps(rollout.prompt)]
        text = rollout.completion[-1]["content"]
        math_value = float(len(text) % 3) if row["task"] == "math" else None
        assert rollout.metrics["letters_like_target"] == letters(rollout.completion, row["target"])
        assert rollout.metrics.get("only_math") == math_value
        assert rollout.reward == pytest.approx(letters(rollout.completion, row["target"]) + 0.5 * (math_value or 0.0))
    # TRL's trainer_state inside a mixture: the trainer's, as of the version that sampled the group.
    assert CALLS and all(type(call["state"]) is type(trainer.state) for call in CALLS)
    assert {call["state"].global_step for call in CALLS} <= {0, 1, 2}
    evaluated = next(entry for entry in trainer.state.log_history if "eval_reward" in entry)
    assert evaluated["eval_env/spelling/num_prompts"] == evaluated["eval_env/reverse_text/num_prompts"] == 2
    assert evaluated["eval_rewards/letters_like_target"] == evaluated["eval_env/spelling/rewards/letters_like_target"]


def test_normalize_then_sum_trains_the_standardised_objectives(tiny_model_dir, tmp_path):
    from verifiers_rl.training.batching import normalize_then_sum_advantages

    trainer = RLTrainer(model=tiny_model_dir, reward_funcs=[letters_like_target, only_math],
                        args=config(tmp_path, max_steps=1, reward_weights=[1.0, 0.5],
                                    multi_objective_aggregation="normalize_then_sum"),
                        train_dataset=Dataset.from_list(rows(False)))
    planned = []
    plan = trainer.steps.plan
    trainer.steps.plan = lambda index: planned.append(plan(index)) or planned[-1]  # records what was trained
    trainer.train()
    seen = read_rollouts(tmp_path / "seen.jsonl")
    values = [[r.metrics.get(name, float("nan")) for name in ("letters_like_target", "only_math")] for r in seen]
    expected = normalize_then_sum_advantages(values, [1.0, 0.5], [r.group_id for r in seen])
    trained = {mb.batch_positions[int(mb.seq_index[row, 0])]: float(mb.advantages[row][mb.loss_mask[row] > 0][0])
               for mb in planned[0][0].micro_batches for row in range(mb.input_ids.shape[0])
               if mb.loss_mask[row].any()}
    assert trained and all(trained[i] == pytest.approx(expected[i], abs=1e-6) for i in trained)
    assert any(math.isnan(v) for row in values for v in row), "a function that does not apply to some rows"
    with pytest.raises(ValueError, match="normalize_then_sum standardises each of TRL-style reward_funcs"):
        RLTrainer(tiny_model_dir, config(tmp_path, multi_objective_aggregation="normalize_then_sum"),
                  rollout_source=[])


def test_a_reward_model_scores_like_its_first_logit(tiny_model_dir, tmp_path):
    model = AutoModelForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=1)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    model.config.pad_token_id = tokenizer.pad_token_id
    trainer = RLTrainer(model=tiny_model_dir, reward_funcs=model, args=config(tmp_path, max_steps=1),
                        train_dataset=Dataset.from_list(rows(True)), reward_processing_classes=[tokenizer])
    trainer.train()
    for rollout in read_rollouts(tmp_path / "seen.jsonl")[:4]:
        text = tokenizer.apply_chat_template(rollout.prompt + rollout.completion, tokenize=False)
        with torch.inference_mode():
            logit = model(**tokenizer(text, return_tensors="pt", add_special_tokens=False)).logits[0, 0].item()
        assert rollout.reward == pytest.approx(logit, abs=1e-4)


def test_bad_input_is_refused_by_name(tiny_model_dir, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    with pytest.raises(TypeError, match="RLTrainer needs an RLConfig, got GRPOConfig: .*RLConfig as GRPOConfig"):
        RLTrainer(model=tiny_model_dir, reward_funcs=letters_like_target, train_dataset=rows(True),
                  args=GRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none"))
    with pytest.raises(ValueError, match="mixes text and conversational prompts"):
        RewardFunctionsEnv(rows(True)[:2] + rows(False)[:2], letters_like_target, tokenizer)
    with pytest.raises(ValueError, match="reward_weights has 2 values for 1 reward functions"):
        RewardFunctionsEnv(rows(True), [letters_like_target], tokenizer, reward_weights=[1.0, 2.0])
    with pytest.raises(ValueError, match="clash with the reward functions' own arguments"):
        RewardFunctionsEnv([{"prompt": "hi", "completions": 1}], [letters_like_target], tokenizer)
    with pytest.raises(ValueError, match="sync_ref_model=True` while `beta=0.0`"):  # TRL's own check
        RLTrainer(tiny_model_dir, config(tmp_path, sync_ref_model=True), reward_funcs=[letters_like_target],
                  train_dataset=rows(True))
    with pytest.raises(ValueError, match="reward_weights weights TRL-style reward_funcs"):
        RLTrainer(tiny_model_dir, config(tmp_path, reward_weights=[1.0]), rollout_source=[])
    # TRL samples max_completion_length tokens whatever the prompt; max_seq_len 40 would cut the longest one's short.
    longest = max(len(tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=True,
                                                    return_dict=True)["input_ids"]) for r in rows(True))
    with pytest.raises(ValueError, match=rf"max_completion_length=64 does not fit max_seq_len=40 .* longest prompt "
                                         rf"\({longest} tokens\): its completions would be cut at {40 - longest} tokens. "
                                         rf"Set max_seq_len={longest + 64} or more"):
        RLTrainer(model=tiny_model_dir, reward_funcs=[letters_like_target], train_dataset=rows(True),
                  args=config(tmp_path, max_completion_length=64, max_seq_len=40))
    # A prompt with no room at all was dropped with a warning (TRL trains it), though the longest that fits is refused.
    long_row = {"prompt": [{"role": "user", "content": "word " * 60}], "target": "a", "task": "math"}
    too_long = len(tokenizer.apply_chat_template(long_row["prompt"], add_generation_prompt=True, tokenize=True,
                                                 return_dict=True)["input_ids"])
    assert too_long > 96
    with pytest.raises(ValueError, match=rf"longest prompt \({too_long} tokens\): it leaves no room for one. "
                                         rf"Set max_seq_len={too_long + 8} or more"):
        RLTrainer(model=tiny_model_dir, reward_funcs=[letters_like_target], train_dataset=rows(True) + [long_row],
                  args=config(tmp_path))
    # As HF's Trainer: evaluation without eval_dataset named --eval_env, a flag this form has not got.
    with pytest.raises(ValueError, match=r"^eval_strategy='steps' evaluates the held-out rows, and this trainer has "
                                         r"none: pass eval_dataset=\.\.\. \(TRL's form\), or hold out"):
        RLTrainer(model=tiny_model_dir, reward_funcs=[letters_like_target], train_dataset=rows(True),
                  args=config(tmp_path, eval_steps=1))
    with pytest.raises(ValueError, match="--logging_steps 5 acts only with --logging_strategy steps, not epoch"):
        RLTrainer(model=tiny_model_dir, reward_funcs=[letters_like_target], train_dataset=rows(True),
                  args=config(tmp_path, logging_strategy="epoch", logging_steps=5))
    # HF's named eval datasets: its keys were read as rows ("row 0 needs a 'prompt' column, got 'easy'").
    with pytest.raises(ValueError, match=r"eval_dataset as a dict of named datasets \(easy, hard; .*mixture_of"):
        RLTrainer(model=tiny_model_dir, reward_funcs=[letters_like_target], train_dataset=rows(True),
                  eval_dataset={"easy": rows(True)[:2], "hard": rows(True)[2:4]}, args=config(tmp_path))


def test_a_group_without_any_applicable_reward_stops_with_the_row(tiny_model_dir, tmp_path):
    from verifiers_rl.rollouts.generator import GenerationError

    def never(completions, **_):
        return [None] * len(completions)

    trainer = RLTrainer(model=tiny_model_dir, reward_funcs=[never], args=config(tmp_path, max_steps=1),
                        train_dataset=rows(True))
    with pytest.raises(GenerationError, match=r"no reward function applies to completion 0 of dataset row \d+"):
        trainer.train()


def test_the_trl_style_example_script_runs_as_shipped(tiny_model_dir, tmp_path):
    import re
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).parents[2] / "examples" / "trl_grpo.py"
    result = subprocess.run([sys.executable, str(script), "--model", tiny_model_dir, "--max_steps", "2",
                             "--output_dir", str(tmp_path / "out")], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    rewards = [float(x) for x in re.findall(r"^step \d/2 \| reward ([\d.]+)", result.stdout, re.M)]
    assert len(rewards) == 2 and all(0.0 <= r <= 1.5 for r in rewards)  # exact (<= 1) + 0.5 x shares_letters (<= 1)


def test_the_trl_style_example_script_refuses_an_abbreviated_flag(tiny_model_dir, tmp_path):
    # argparse took --max_step for --max_steps, as the command's parsers did.
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).parents[2] / "examples" / "trl_grpo.py"
    result = subprocess.run([sys.executable, str(script), "--model", tiny_model_dir, "--max_step", "1",
                             "--output_dir", str(tmp_path / "out")], capture_output=True, text=True, timeout=600)
    assert result.returncode == 2 and result.stderr.strip().endswith("unrecognized arguments: --max_step 1"), \
        result.stderr[-3000:]


def length_reward(completions, log_metric, **kwargs):
    """Logs a metric of its own besides its reward, as TRL's log_metric documents."""
    for completion in completions:
        log_metric("reply_chars", float(len(completion)))
    return [0.1 * len(completion) for completion in completions]


def test_trl_positional_order_and_trls_metric_names(tiny_model_dir, tmp_path):
    # TRL's positional order: GRPOTrainer(model, reward_funcs, args, train_dataset).
    trainer = RLTrainer(tiny_model_dir, [length_reward], config(tmp_path), Dataset.from_list(rows(False)))
    trainer.train()
    seen = read_rollouts(tmp_path / "seen.jsonl")
    logged = [entry for entry in trainer.state.log_history if "reward" in entry]
    assert len(logged) == 2 and len(seen) == 16
    tokens = 0
    for entry, batch in zip(logged, (seen[:8], seen[8:])):
        assert entry["reply_chars"] == pytest.approx(sum(len(r.completion) for r in batch) / 8)  # under its own name
        assert "rewards/reply_chars/mean" not in entry and "rewards/length_reward/mean" in entry
        tokens += sum(len(r.prompt_ids) + len(r.completion_ids) for r in batch)
        assert entry["num_tokens"] == tokens  # TRL's running count of prompt and completion tokens
        assert entry["completions/clipped_ratio"] == pytest.approx(sum(r.truncated for r in batch) / 8)
        groups = [[r.reward for r in batch if r.group_id == g] for g in {r.group_id for r in batch}]
        assert entry["frac_reward_zero_std"] == pytest.approx(sum(len(set(g)) == 1 for g in groups) / len(groups))
        assert {"clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "clip_ratio/low_min",
                "clip_ratio/high_max", "completions/mean_terminated_length"} <= set(entry)
    assert trainer.state.num_input_tokens_seen == tokens
    with pytest.raises(TypeError, match=r"TRL's GRPOTrainer order.*multiple values for argument 'args'"):
        RLTrainer(tiny_model_dir, [length_reward], config(tmp_path), args=config(tmp_path))


def test_a_reward_sees_the_step_that_sampled_its_group_and_a_resumed_run_sees_the_same(tiny_model_dir, tmp_path):
    # Read live, trainer_state.global_step depended on timing at k = 1: batch 3 scored with step 2 in one run, 3 in
    # the run resumed from checkpoint-2 (a reward reading the step broke the bitwise resume).
    def steps_seen(out, resume=None):
        CALLS.clear()
        RLTrainer(model=tiny_model_dir, reward_funcs=[letters_like_target], train_dataset=rows(True),
                  args=config(tmp_path, output_dir=str(tmp_path / out), max_steps=4, max_off_policy_steps=1,
                              save_strategy="steps", save_steps=2)).train(resume_from_checkpoint=resume)
        return [call["state"].global_step for call in CALLS]

    # Two groups a batch; batch b is sampled by step max(0, b - 1)'s weights.
    assert steps_seen("full") == [0, 0, 0, 0, 1, 1, 2, 2]
    assert steps_seen("resumed", str(tmp_path / "full" / "checkpoint-2")) == [2, 2]  # batch 2 was in the checkpoint


def test_evaluate_after_train_and_without_an_eval_strategy_as_trl(tiny_model_dir, tmp_path):
    """trainer.evaluate() as a TRL user calls it: after train() (the trainer's own engine, with the trained weights)
    and with an eval_dataset but no eval_strategy (HF evaluates it on demand); each equals the run's logged
    evaluation."""
    def trainer(**overrides):
        CALLS.clear()
        return RLTrainer(model=tiny_model_dir, reward_funcs=[letters_like_target], train_dataset=rows(True),
                         eval_dataset=rows(True)[:4], args=config(tmp_path, learning_rate=0.05, **overrides))

    def values(metrics):
        return {k: v for k, v in metrics.items() if k not in ("eval_runtime", "epoch", "step")}

    scheduled = trainer(eval_strategy="steps", eval_steps=2)
    initial = values(scheduled.evaluate())
    scheduled.train()
    logged = values(next(e for e in scheduled.state.log_history if "eval_reward" in e and e["step"] == 2))
    assert logged != initial  # the trained weights sample other completions
    assert values(scheduled.evaluate()) == logged
    on_demand = trainer()
    on_demand.train()
    assert values(on_demand.evaluate()) == logged
    with pytest.raises(ValueError, match=r"evaluate\(eval_dataset=...\).*pass eval_dataset= to the trainer"):
        on_demand.evaluate(eval_dataset=rows(True)[:2])


def test_a_standard_prompt_is_tokenised_as_trl_does_with_a_bos_adding_tokenizer(tiny_model_dir):
    """TRL tokenises a text prompt with the tokenizer's special tokens (Llama's bos); a tokenizer that adds one."""
    from types import SimpleNamespace

    from trl import GRPOTrainer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir, add_bos_token=True, bos_token="<|im_end|>")
    environment = RewardFunctionsEnv(rows(False), [letters_like_target], tokenizer)
    texts = [row["prompt"] for row in rows(False)]
    trls, _, _ = GRPOTrainer._tokenize_prompts(SimpleNamespace(processing_class=tokenizer), texts)
    assert [environment.prompt_ids(text) for text in texts] == trls
    assert all(ids[0] == tokenizer.bos_token_id for ids in trls)  # the case this checks: a bos TRL adds


def test_the_engine_samples_the_model_model_init_kwargs_choose(tiny_model_dir, tmp_path):
    """model_init_kwargs choose what TRL loads (here a subfolder beside another model): the engine's first batch is
    sampled by the same weights (IS ratio 1 at k = 0), not by the folder's other model."""
    import shutil

    from transformers import AutoModelForCausalLM

    shutil.copytree(tiny_model_dir, tmp_path / "models" / "chosen")
    other = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    torch.manual_seed(1)
    for parameter in other.parameters():
        parameter.data.normal_(0.0, 0.5)
    other.save_pretrained(tmp_path / "models")
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(tmp_path / "models")
    (tmp_path / "models" / "chat_template.jinja").write_text("OTHER {{ messages }}")  # the chosen's tokenizer is used
    trainer = RLTrainer(model=str(tmp_path / "models"), reward_funcs=[letters_like_target], train_dataset=rows(True),
                        args=config(tmp_path, max_steps=1, max_off_policy_steps=0,
                                    model_init_kwargs={"subfolder": "chosen"}))
    chosen = tmp_path / "models" / "chosen" / "chat_template.jinja"
    assert trainer.processing_class.chat_template == chosen.read_text()
    trainer.train()
    assert trainer.state.log_history[0]["is_ratio"] == pytest.approx(1.0, abs=1e-4)


def numpy_reward(completions, target, **kwargs):
    """numpy scalars, as a reward computed with numpy comes out (TRL's torch.tensor(rewards) takes them)."""
    import numpy as np

    return [np.float32(letters(c, t)) for c, t in zip(completions, target)]


def tensor_reward(completions, **kwargs):
    """A tensor of rewards, one per completion."""
    return torch.tensor([float(len(c[-1]["content"]) % 2) for c in completions])


def test_rewards_as_numpy_scalars_or_a_tensor_train_as_trl_takes_them(tiny_model_dir, tmp_path):
    from verifiers_rl.rollouts.generator import GenerationError

    trainer = RLTrainer(model=tiny_model_dir, reward_funcs=[numpy_reward, tensor_reward], train_dataset=rows(True),
                        args=config(tmp_path, max_steps=1))
    trainer.train()
    by_prompt = {json.dumps(r["prompt"]): r for r in rows(True)}
    for rollout in read_rollouts(tmp_path / "seen.jsonl"):
        text = rollout.completion[-1]["content"]
        expected = letters(rollout.completion, by_prompt[json.dumps(rollout.prompt)]["target"]) + len(text) % 2
        assert rollout.reward == pytest.approx(expected, abs=1e-6)  # the first in float32

    def text_reward(completions, **kwargs):
        return ["0.5"] * len(completions)

    trainer = RLTrainer(model=tiny_model_dir, reward_funcs=[text_reward], train_dataset=rows(True),
                        args=config(tmp_path, max_steps=1))
    with pytest.raises(GenerationError, match="the reward function 'text_reward' returned '0.5', not a finite number"):
        trainer.train()
