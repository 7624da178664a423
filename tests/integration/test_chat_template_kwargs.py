"""TRL's ``chat_template_kwargs`` act: the config's variables reach the chat template of a trained rollout's prompt
(TRL's form and an environment given to RLTrainer), a TRL-form reward model's text (as TRL renders it), evaluation
inside training and ``verifiers-rl eval --chat_template_kwargs``; bad values are refused by name.

The tiny model's template is Qwen3-like: ``enable_thinking=False`` writes an empty think block after the generation
prompt (``verifiers_rl.core.models.CHAT_TEMPLATE``), so the kwargs' effect is visible in the prompt ids."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from verifiers_rl import RLConfig, RLTrainer
from verifiers_rl.envs import Rubric, SingleTurnEnv
from verifiers_rl.inference import EmbeddedEngine, SamplingConfig
from verifiers_rl.core.models import CHAT_TEMPLATE
from verifiers_rl.core.rollout import read_rollouts, write_rollouts
from verifiers_rl.rollouts.synthetic import random_rollouts

NO_THINKING = {"enable_thinking": False}
THINK = "<think>\n\n</think>\n\n"  # what the tiny template writes after the generation prompt for NO_THINKING
# A reward model's template that shows the variable in the whole conversation (the generation prompt is not rendered).
MARKED_TEMPLATE = "{% if enable_thinking is defined and enable_thinking is false %}/no_think\n{% endif %}" + CHAT_TEMPLATE


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def config(tmp_path, **overrides) -> RLConfig:
    values = dict(output_dir=str(tmp_path / "out"), use_cpu=True, report_to="none", save_strategy="no", max_steps=1,
                  rollouts_per_step=8, num_generations=4, max_completion_length=4, max_seq_len=96, logging_steps=1,
                  disable_tqdm=True, gradient_checkpointing=False, save_rollouts_path=str(tmp_path / "seen.jsonl"))
    values.update(overrides)
    return RLConfig(**values)


def rendered_ids(tokenizer, prompt, kwargs) -> list[int]:
    text = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True, **(kwargs or {}))
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def reward_model(tiny_model_dir):
    model = AutoModelForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=1)
    reward_tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    reward_tokenizer.chat_template = MARKED_TEMPLATE
    model.config.pad_token_id = reward_tokenizer.pad_token_id
    return model, reward_tokenizer


def first_logit(model, tokenizer, conversation, kwargs) -> float:
    text = tokenizer.apply_chat_template(conversation, tokenize=False, **(kwargs or {}))
    with torch.inference_mode():
        return model(**tokenizer(text, return_tensors="pt", add_special_tokens=False)).logits[0, 0].item()


@pytest.mark.parametrize("kwargs", [None, NO_THINKING])
def test_trl_form_prompts_and_reward_model_texts_are_rendered_with_the_config_kwargs(tiny_model_dir, tokenizer,
                                                                                     tmp_path, kwargs):
    model, reward_tokenizer = reward_model(tiny_model_dir)
    rows = [{"prompt": [{"role": "user", "content": f"Count to {i}."}]} for i in range(4)]
    trainer = RLTrainer(model=tiny_model_dir, reward_funcs=[model], reward_processing_classes=[reward_tokenizer],
                        args=config(tmp_path, chat_template_kwargs=kwargs), train_dataset=Dataset.from_list(rows))
    trainer.train()
    seen = read_rollouts(tmp_path / "seen.jsonl")
    assert len(seen) == 8
    for rollout in seen:
        assert rollout.prompt_ids == rendered_ids(tokenizer, rollout.prompt, kwargs)
        assert tokenizer.decode(rollout.prompt_ids).endswith(THINK) == (kwargs is not None)
        # The reward model read the conversation rendered with the kwargs (TRL's reward-model rendering).
        conversation = rollout.prompt + rollout.completion
        assert rollout.reward == pytest.approx(first_logit(model, reward_tokenizer, conversation, kwargs), abs=1e-4)
        if kwargs is not None:
            assert rollout.reward != pytest.approx(first_logit(model, reward_tokenizer, conversation, None), abs=1e-6)


def toy_env(tokenizer, **kwargs) -> SingleTurnEnv:
    dataset = [{"question": f"q{i}"} for i in range(8)]
    held = [{"question": f"e{i}"} for i in range(2)]
    return SingleTurnEnv(dataset, Rubric([lambda completion: 0.0]), tokenizer, max_new_tokens=4, max_seq_len=64,
                         eval_dataset=held, **kwargs)


def test_the_trainer_renders_its_environment_and_evaluation_with_the_config_kwargs(tiny_model_dir, tokenizer,
                                                                                   tmp_path):
    env = toy_env(tokenizer)
    assert not tokenizer.decode(env.prompt_ids(env.dataset[0].prompt)).endswith(THINK)
    engine = EmbeddedEngine(tiny_model_dir, tokenizer, SamplingConfig(max_new_tokens=4))
    trainer = RLTrainer(tiny_model_dir, config(tmp_path, chat_template_kwargs=NO_THINKING, eval_steps=1, max_seq_len=64),
                        processing_class=tokenizer, environment=env, engine=engine)
    assert env.chat_template_kwargs == NO_THINKING
    trainer.train()
    seen = read_rollouts(tmp_path / "seen.jsonl")
    assert seen and all(r.prompt_ids == rendered_ids(tokenizer, r.prompt, NO_THINKING) for r in seen)
    # Evaluation inside training rolls out the same environment: its prompts carry the kwargs too.
    result = trainer.evaluation.run(engine)
    assert len(result.samples) == 2
    for sample in result.samples:
        assert sample.rollout.prompt_ids == rendered_ids(tokenizer, sample.row.prompt, NO_THINKING)
        assert tokenizer.decode(sample.rollout.prompt_ids).endswith(THINK)


def test_one_place_decides_and_bad_values_are_refused_by_name(tiny_model_dir, tokenizer, tmp_path):
    parsed = RLConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none",
                      chat_template_kwargs='{"enable_thinking": false}')  # the command line's JSON
    assert parsed.chat_template_kwargs == NO_THINKING
    with pytest.raises(ValueError, match=r"--chat_template_kwargs: \['tools'\] are set by the environment's rendering"):
        RLConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", chat_template_kwargs={"tools": []})
    # An environment built with other kwargs than the config's: the config is the one place.
    env = toy_env(tokenizer, chat_template_kwargs={"enable_thinking": True})
    engine = EmbeddedEngine(tiny_model_dir, tokenizer, SamplingConfig(max_new_tokens=4))
    with pytest.raises(ValueError, match=r"already renders with chat_template_kwargs=.*set them in one place, the "
                                         r"config \(--chat_template_kwargs\)"):
        RLTrainer(tiny_model_dir, config(tmp_path, chat_template_kwargs=NO_THINKING), processing_class=tokenizer,
                  environment=env, engine=engine)
    # A replay run has no prompts to render.
    path = tmp_path / "replay.jsonl"
    write_rollouts(path, random_rollouts(2, 4, vocab_size=390, seed=1))
    with pytest.raises(ValueError, match="--chat_template_kwargs acts where environments render prompts; a replay"):
        RLTrainer(tiny_model_dir, config(tmp_path, chat_template_kwargs=NO_THINKING, rollouts_path=str(path),
                                         save_rollouts_path=None), processing_class=tokenizer)


def test_the_eval_cli_renders_with_its_chat_template_kwargs_flag(tiny_model_dir, tmp_path, capsys):
    from verifiers_rl.cli.eval import main

    def prompts(flags: list[str]) -> list[str]:
        out = tmp_path / f"eval{len(flags)}.jsonl"
        assert main(["--model", tiny_model_dir, "--env", "reverse_text", "-n", "2", "--env_args",
                     '{"max_new_tokens": 4}', "--output", str(out), *flags]) == 0
        records = [json.loads(line) for line in out.read_text().splitlines()]
        assert len(records) == 2
        return [tokenizer.decode(record["prompt_ids"]) for record in records]

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert all(p.endswith(THINK) for p in prompts(["--chat_template_kwargs", '{"enable_thinking": false}']))
    assert not any(p.endswith(THINK) for p in prompts([]))
    for text, message in [("{bad", "--chat_template_kwargs is not valid JSON"),
                          ('{"add_generation_prompt": false}', "--chat_template_kwargs: ['add_generation_prompt']")]:
        with pytest.raises(SystemExit):
            main(["--model", tiny_model_dir, "--chat_template_kwargs", text])
        assert message in capsys.readouterr().err
