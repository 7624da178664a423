"""TRL's GRPOTrainer inputs as an environment: a dataset with a ``prompt`` column, and reward functions.

What TRL documents (trl 1.16), and what this does with it:
- ``prompt`` in the standard format (a string, tokenised as TRL does: no chat template, with the special tokens
  the tokenizer adds, e.g. Llama's bos) or the conversational format (a list of messages, rendered with the
  tokenizer's chat template); the completion is then a string or ``[{"role": "assistant", "content": ...}]``, as
  TRL passes it.
- Every other column reaches every reward function by name, one value per completion (repeated over a group).
- A reward function is called as ``f(prompts=..., completions=..., completion_ids=..., trainer_state=...,
  log_metric=..., **columns)`` and returns one number per completion, or ``None`` where it does not apply (TRL's
  multi-task rewards); ``async def`` functions are awaited. It is called once per group (the ``num_generations``
  completions of one prompt; TRL calls it once per generation batch: a function that compares completions across
  prompts sees fewer at a time).
- A reward model: a sequence-classification model (or a hub id / folder of one), scoring the prompt and completion
  rendered as TRL renders them, with its ``reward_processing_class`` (default: its own tokenizer) and the run's
  ``chat_template_kwargs`` (as TRL does); its first logit is the reward.
- ``chat_template_kwargs`` (TRL's config field) reach every rendering of a conversational prompt, the policy's and
  the reward models'; standard (text) prompts have no template to reach, as in TRL.
- ``reward_weights`` (default 1 each): the reward is the weighted sum of the functions' values, ``None`` left out
  (TRL's ``nansum``); a completion no function applies to is an error naming its prompt.
Each function's value is a rollout metric under the function's name (TRL's: its ``__name__``, or the reward
model's id), logged per step as ``rewards/<name>/mean`` and ``rewards/<name>/std``; what a function passes to
``log_metric(name, value)`` is logged under ``name`` itself, the step's mean, as TRL does (each group's values
averaged, then the groups).
"""

from __future__ import annotations

import copy
import inspect
import math
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from verifiers_rl.core.rollout import Rollout
from verifiers_rl.envs.awaitable import gather_or_cancel
from verifiers_rl.envs.environment import Environment, RolloutError, Row, Trajectory
from verifiers_rl.envs.messages import Messages, check_messages, last_assistant_text
from verifiers_rl.core.sampling import Sampler

RESERVED = ("prompts", "completions", "completion_ids", "trainer_state", "log_metric")


def reward_name(func: Any) -> str:
    """TRL's name for a reward function: a model's id (last path part), else the callable's name."""
    config = getattr(func, "config", None)
    if config is not None and getattr(config, "_name_or_path", None):
        return str(config._name_or_path).rstrip("/").split("/")[-1]
    return getattr(func, "__name__", type(func).__name__)


class RewardModel:
    """A sequence-classification model as a reward function (first logit), as TRL scores with one."""

    def __init__(self, model, processing_class=None):
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        if isinstance(model, str):
            model = AutoModelForSequenceClassification.from_pretrained(model, num_labels=1)
        self.model = model.eval()
        self.tokenizer = processing_class or AutoTokenizer.from_pretrained(model.config._name_or_path)
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.__name__ = reward_name(model)
        self.chat_template_kwargs: dict[str, Any] = {}  # the environment's (TRL renders with them here too)

    def texts(self, prompts: list, completions: list) -> list[str]:
        if isinstance(prompts[0], list):  # conversational: the whole conversation through the chat template
            return [self.tokenizer.apply_chat_template(p + c, tokenize=False, **self.chat_template_kwargs)
                    for p, c in zip(prompts, completions)]
        return [p + c for p, c in zip(prompts, completions)]

    def __call__(self, prompts, completions, **_) -> list[float]:
        import torch

        inputs = self.tokenizer(self.texts(prompts, completions), return_tensors="pt", padding=True,
                                padding_side="right", add_special_tokens=False)
        with torch.inference_mode():
            logits = self.model(**inputs.to(self.model.device)).logits
        return logits[:, 0].float().tolist()


class RewardFunctionsEnv(Environment):
    """A dataset and TRL-style reward functions as a single-turn environment (module docstring).

    ``trainer_state()`` returns what reward functions get as ``trainer_state``; left out, the ``TrainerState`` of
    the trainer that takes the environment (``use_trainer_state``; None until then), alone or in a mixture, as a copy
    whose ``global_step`` is the policy version that samples the group: TRL's value (it generates at the step's
    start), and with generation k steps ahead the same in a resumed run as in the uninterrupted one (the live state
    would be read while the trainer steps on).
    """

    def __init__(self, dataset: Iterable[Mapping[str, Any]], reward_funcs: Sequence, tokenizer: Any, *,
                 reward_weights: Sequence[float] | None = None, reward_processing_classes: Sequence | None = None,
                 trainer_state: Callable[[], Any] | None = None, max_new_tokens: int = 256, max_seq_len: int = 1024,
                 eval_dataset: Iterable[Mapping[str, Any]] | None = None, name: str = "trl_dataset",
                 chat_template_kwargs: Mapping[str, Any] | None = None):
        funcs = list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
        if not funcs:
            raise ValueError("reward_funcs is empty: give at least one reward function or reward model.")
        classes = list(reward_processing_classes or [None] * len(funcs))
        if len(classes) != len(funcs):
            raise ValueError(f"{len(funcs)} reward functions but {len(classes)} reward_processing_classes.")
        self.reward_funcs = [self._as_function(f, c) for f, c in zip(funcs, classes)]
        self.reward_names = [reward_name(f) for f in self.reward_funcs]
        if len(set(self.reward_names)) != len(self.reward_names):
            raise ValueError(f"Reward functions need distinct names (their metrics), got {self.reward_names}.")
        weights = [1.0] * len(funcs) if reward_weights is None else [float(w) for w in reward_weights]
        if len(weights) != len(funcs):
            raise ValueError(f"reward_weights has {len(weights)} values for {len(funcs)} reward functions.")
        self.reward_weights = weights
        self._own_trainer_state = trainer_state is not None
        self.trainer_state = trainer_state or (lambda: None)
        dataset = list(dataset)
        eval_rows = list(eval_dataset or ())
        self.conversational = self._format(dataset + eval_rows)
        self._requires_chat_template = self.conversational
        super().__init__(dataset, rubric=None, tokenizer=tokenizer, max_new_tokens=max_new_tokens,
                         max_seq_len=max_seq_len, name=name, eval_dataset=eval_rows or None,
                         chat_template_kwargs=chat_template_kwargs)
        self._chat_template_kwargs_changed()

    def check_completion_room(self) -> None:
        """TRL samples up to max_completion_length tokens whatever the prompt; here prompt + completion fit
        max_seq_len, so a prompt leaving less room would cut its completions short unseen: refused, naming both.
        Rows with no room at all count too (an environment drops them with a warning; TRL would train them)."""
        longest = max(self._prompt_lengths(self._all_rows + self._all_eval_rows))
        if longest + self.max_new_tokens > self.max_seq_len:
            room = self.max_seq_len - longest
            raise ValueError(
                f"max_completion_length={self.max_new_tokens} does not fit max_seq_len={self.max_seq_len} (prompt + "
                f"completion) after the dataset's longest prompt ({longest} tokens): "
                + (f"its completions would be cut at {room} tokens. " if room > 0 else "it leaves no room for one. ")
                + f"Set max_seq_len={longest + self.max_new_tokens} or more (TRL has no such limit), or lower "
                "max_completion_length."
            )

    def use_trainer_state(self, state: Callable[[], Any]) -> None:
        """Reward functions get ``state()`` as ``trainer_state`` (RLTrainer gives its own), unless the constructor
        was given one."""
        if not self._own_trainer_state:
            self.trainer_state = state

    def _state_at(self, version: int | None) -> Any:
        """What reward functions get as ``trainer_state``: the trainer's, as of ``version`` (class docstring); a
        constructor's ``trainer_state()`` as it returns it."""
        state = self.trainer_state()
        if self._own_trainer_state or version is None or not hasattr(state, "global_step"):
            return state
        state = copy.copy(state)
        state.global_step = int(version)
        return state

    def _chat_template_kwargs_changed(self) -> None:
        for func in self.reward_funcs:  # reward models render the conversation with their own tokenizer's template
            if isinstance(func, RewardModel):
                func.chat_template_kwargs = self.chat_template_kwargs

    @staticmethod
    def _as_function(func, processing_class):
        if isinstance(func, str) or _is_module(func):
            return RewardModel(func, processing_class)
        if not callable(func):
            raise TypeError(f"A reward function must be callable, a reward model or a model id; got {func!r}.")
        if processing_class is not None:
            raise ValueError(f"reward_processing_classes: {reward_name(func)!r} is a function; only reward models "
                             "take a processing class (pass None in its place).")
        return func

    @staticmethod
    def _format(records: list) -> bool:
        """True for conversational prompts, False for standard (text); one format per dataset."""
        kinds = {isinstance(r.get("prompt"), list) for r in records if isinstance(r, Mapping)}
        if len(kinds) > 1:
            raise ValueError("The dataset mixes text and conversational prompts: use one format for every row.")
        return kinds == {True}

    # --- rows and prompts ---------------------------------------------------------------------------------------

    def _row(self, index: int, record: Any, system_prompt: str | None, split: str) -> Row:
        where = f"{self.name}: {split} row {index}"
        if not isinstance(record, Mapping) or "prompt" not in record:
            raise ValueError(f"{where} needs a 'prompt' column (TRL's format), got {record!r:.200}.")
        prompt = record["prompt"]
        if self.conversational:
            prompt = check_messages(prompt, f"{where}, 'prompt'")
        elif not isinstance(prompt, str):
            raise TypeError(f"{where}: 'prompt' must be a string or a list of messages, got {type(prompt).__name__}.")
        columns = {key: value for key, value in record.items() if key not in ("prompt", "completion")}
        clash = [key for key in columns if key in RESERVED]
        if clash:
            raise ValueError(f"{where}: columns {clash} clash with the reward functions' own arguments {RESERVED}.")
        return Row(index=index, prompt=prompt, answer=record.get("answer"), info=columns)

    def prompt_ids(self, prompt: Messages | str) -> list[int]:
        if isinstance(prompt, str):  # TRL's standard format: the text with the tokenizer's own bos (TRL's call)
            return self.tokenizer(text=prompt)["input_ids"]
        return super().prompt_ids(prompt)

    # --- rollouts -----------------------------------------------------------------------------------------------

    async def generate(self, sampler: Sampler, prompt, prompt_ids: list[int], state: dict[str, Any]) -> Trajectory:
        budget = min(self.max_new_tokens, self.max_seq_len - len(prompt_ids))
        sample = await sampler.sample(prompt_ids, budget)
        sample.validate(budget)
        text = self.tokenizer.decode(sample.token_ids, skip_special_tokens=True)
        completion = [{"role": "assistant", "content": text}] if self.conversational else text
        return Trajectory(completion=completion, completion_ids=list(sample.token_ids),
                          completion_mask=[1] * len(sample.token_ids), completion_logprobs=list(sample.logprobs),
                          truncated=sample.finish_reason == "length")

    async def rollout(self, sampler: Sampler, row: Row, group_id) -> Rollout:
        version = getattr(sampler, "policy_version", None)
        rollouts = await self._score(row, [await self._unscored(sampler, row, group_id)], version)
        return rollouts[0]

    async def rollout_group(self, sampler: Sampler, row: Row, group_id, n: int, *, seed: int | None = None,
                            temperature: float | None = None) -> list[Rollout]:
        """``n`` rollouts of ``row``, generated concurrently and scored together (one call per reward function)."""
        from verifiers_rl.core.sampling import sampling_for_rollout, set_completion_versions

        async def one(sampling):
            with sampling_for_rollout(sampling):
                rollout = await self._unscored(sampler, row, group_id)
            set_completion_versions(rollout, sampling)
            return rollout

        samplings = self.group_samplings(n, seed, temperature)
        version = getattr(sampler, "policy_version", None)  # the group's first tokens'
        # One that fails cancels the others: the group is retried or dropped whole (Environment.rollout_group).
        return await self._score(row, await gather_or_cancel([one(s) for s in samplings]), version)

    async def _unscored(self, sampler: Sampler, row: Row, group_id) -> Rollout:
        try:
            prompt_ids = self.prompt_ids(row.prompt)
            trajectory = await self.generate(sampler, row.prompt, prompt_ids, {})
        except Exception as error:
            raise RolloutError(f"{self.name} failed on dataset row {row.index}: {type(error).__name__}: {error}") from error
        return Rollout(prompt_ids=prompt_ids, completion_ids=trajectory.completion_ids,
                       completion_mask=trajectory.completion_mask, completion_logprobs=trajectory.completion_logprobs,
                       reward=0.0, group_id=group_id, truncated=trajectory.truncated, prompt=row.prompt,
                       completion=trajectory.completion)

    async def _score(self, row: Row, rollouts: list[Rollout], version: int | None = None) -> list[Rollout]:
        """Every reward function once over ``rollouts`` (one prompt's, sampled from ``version``), then the weighted
        sum, ``None`` left out."""
        count = len(rollouts)
        logged: dict[str, list[float]] = {}
        kwargs = {key: [value] * count for key, value in row.info.items()}
        kwargs.update(prompts=[row.prompt] * count, completions=[r.completion for r in rollouts],
                      completion_ids=[r.completion_ids for r in rollouts], trainer_state=self._state_at(version),
                      log_metric=lambda name, value: logged.setdefault(name, []).append(float(value)))
        try:
            values = await gather_or_cancel([self._call(f, n, kwargs, count)
                                             for f, n in zip(self.reward_funcs, self.reward_names)])
        except Exception as error:
            raise RolloutError(f"{self.name} failed on dataset row {row.index}: {type(error).__name__}: {error}") from error
        for i, rollout in enumerate(rollouts):
            column = [value[i] for value in values]
            if all(v is None for v in column):
                raise RolloutError(
                    f"{self.name}: no reward function applies to completion {i} of dataset row {row.index} (every "
                    f"one of {self.reward_names} returned None): give each row at least one reward."
                )
            rollout.reward = sum(w * v for w, v in zip(self.reward_weights, column) if v is not None)
            # A function that does not apply (None) has no metric for this rollout: the step mean leaves it out.
            rollout.metrics = {name: float(v) for name, v in zip(self.reward_names, column) if v is not None}
            rollout.logged_metrics = {name: statistics.fmean(v) for name, v in logged.items()}
        return rollouts

    @staticmethod
    async def _call(func, name: str, kwargs: dict, count: int) -> list[float | None]:
        accepted = _accepted(func, kwargs)
        result = func(**accepted)
        if inspect.isawaitable(result):
            result = await result
        values = list(result)
        if len(values) != count:
            raise ValueError(f"the reward function {name!r} returned {len(values)} rewards for {count} completions.")
        return [None if value is None else _reward_number(value, name) for value in values]


def _reward_number(value, name: str) -> float:
    """A reward as a float: any number TRL's ``torch.tensor(rewards)`` takes (numpy scalars, 0-d tensors, bools)."""
    try:
        number = None if isinstance(value, (str, bytes)) else float(value)
    except (TypeError, ValueError):
        number = None
    if number is None or not math.isfinite(number):
        raise ValueError(f"the reward function {name!r} returned {value!r}, not a finite number or None.")
    return number


def _is_module(obj) -> bool:
    try:
        import torch

        return isinstance(obj, torch.nn.Module)
    except ImportError:  # pragma: no cover - torch is a dependency
        return False


def _accepted(func, kwargs: dict) -> dict:
    """The arguments ``func`` takes: all with ``**kwargs`` (TRL's convention), else those it names."""
    parameters = inspect.signature(func).parameters.values()
    if any(p.kind is p.VAR_KEYWORD for p in parameters):
        return kwargs
    names = {p.name for p in parameters}
    return {key: value for key, value in kwargs.items() if key in names}
