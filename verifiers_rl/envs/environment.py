"""Environment: a dataset of tasks, a rollout procedure and a Rubric. It knows nothing about training."""

from __future__ import annotations

import copy
import logging
import numbers
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from verifiers_rl.core.rollout import Rollout
from verifiers_rl.core.choices import RESERVED_TEMPLATE_KWARGS, check_chat_template_kwargs  # noqa: F401
from verifiers_rl.envs.awaitable import gather_or_cancel
from verifiers_rl.envs.messages import Messages, check_messages
from verifiers_rl.envs.rubric import Rubric
from verifiers_rl.core.sampling import (RolloutSampling, Sampler, derive_seed, sampling_for_rollout,
                                        set_completion_versions)

logger = logging.getLogger(__name__)


# apply_chat_template arguments the renderers set themselves: chat_template_kwargs cannot carry them.




def check_limit(name: str, limit: str, value: Any, minimum: int) -> None:
    """Refuse a limit that is no int >= ``minimum`` (--env_args may bring a null, a string or a fraction)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:  # numpy's ints too
        raise ValueError(f"{name}: {limit} must be an int >= {minimum}, got {value!r}.")


class RolloutError(RuntimeError):
    """A rollout failed; the message names the environment and the dataset row."""


class RolloutRefused(RolloutError):
    """A rollout the trainer cannot train as it is (e.g. a verifiers v1 episode of several branches). Its shape is a
    function of the group's seeds, so the generator does not retry it as if it were flaky: the same seeds would
    refuse it again."""


@dataclass
class Row:
    """One task: the prompt as chat messages, plus the optional ``answer`` and ``info`` the rubric receives."""

    index: int
    prompt: Messages
    answer: Any = None
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def seed_index(self) -> int:
        """The index evaluation derives this row's seeds from: its place in its own environment's split."""
        return self.index


@dataclass
class Trajectory:
    """What a rollout procedure produced before scoring: the completion as messages (for rewards and logs) and as
    tokens (for training). Mask 1 marks the model's tokens, 0 the environment's (whose log-probs are 0.0)."""

    completion: Messages
    completion_ids: list[int]
    completion_mask: list[int]
    completion_logprobs: list[float]
    truncated: bool


class Environment(ABC):
    """Base class: owns the dataset and the rubric, renders prompts with the tokenizer's chat template and turns
    a ``generate`` procedure into ``Rollout`` records.

    ``dataset`` is a list of dict rows (or a ``datasets.Dataset``) with ``prompt`` (chat messages) or ``question``
    (a string, sent as a user message), and optional ``answer`` and ``info`` (a dict). ``system_prompt``, when
    given, is put before every prompt that does not start with a system message. ``max_new_tokens`` bounds each
    model turn and ``max_seq_len`` the whole sequence (prompt + completion); a trainer run from
    ``examples/train.py`` takes its ``--max_seq_len`` and ``--max_completion_length`` from them. Rows whose rendered
    prompt leaves no room for a completion token within ``max_seq_len`` are dropped here, with a warning giving
    their count (an error if no row remains). ``eval_dataset`` (same row format, optional) is the held-out split
    evaluation uses: rows the training run never trains on. ``chat_template_kwargs`` are passed to every rendering
    of the chat template (``use_chat_template_kwargs``, which the trainer and ``verifiers-rl eval`` call
    with the run's ``--chat_template_kwargs``).
    """

    # Limits this environment does not state itself; it takes the trainer's (``adopt_limits``). Adapters of other
    # libraries' environments set this, e.g. to {"max_seq_len"} for an environment without a sequence limit.
    unstated_limits: frozenset[str] = frozenset()
    # Prompts are chat messages rendered by the template; an environment of plain-text prompts sets this False.
    _requires_chat_template = True
    # Whether ``render`` passes ``chat_template_kwargs`` to the template. A subclass that defines its own ``render``
    # is taken not to (``use_chat_template_kwargs`` refuses them) until it sets this True itself.
    renders_chat_template_kwargs = True

    def __init_subclass__(cls, **kwargs: Any):
        super().__init_subclass__(**kwargs)
        if "render" in vars(cls) and "renders_chat_template_kwargs" not in vars(cls):
            cls.renders_chat_template_kwargs = False

    def __init__(
        self,
        dataset: Iterable[Mapping[str, Any]],
        rubric: Rubric,
        tokenizer: Any,
        *,
        system_prompt: str | None = None,
        max_new_tokens: int = 256,
        max_seq_len: int = 1024,
        name: str | None = None,
        eval_dataset: Iterable[Mapping[str, Any]] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ):
        self.name = name or type(self).__name__
        check_limit(self.name, "max_new_tokens", max_new_tokens, 1)
        check_limit(self.name, "max_seq_len", max_seq_len, 2)
        if self._requires_chat_template and getattr(tokenizer, "chat_template", None) is None:
            raise ValueError(f"{self.name}: the tokenizer has no chat template, so prompts cannot be rendered.")
        self.rubric = rubric
        self.tokenizer = tokenizer
        self.chat_template_kwargs = self._reachable(chat_template_kwargs)
        self.max_new_tokens = max_new_tokens
        self.max_seq_len = max_seq_len
        self._all_rows = [self._row(index, record, system_prompt, "dataset") for index, record in enumerate(dataset)]
        if not self._all_rows:
            raise ValueError(f"{self.name}: the dataset is empty; an environment needs at least one row.")
        self._all_eval_rows = [self._row(index, record, system_prompt, "eval_dataset")
                               for index, record in enumerate(eval_dataset or ())]
        self._keep_fitting_rows()

    def adopt_limits(self, max_seq_len: int | None = None, max_new_tokens: int | None = None) -> None:
        """Take the trainer's limits for those in ``unstated_limits`` (the rows are filtered again)."""
        if max_seq_len is not None:
            self.max_seq_len = max_seq_len
        if max_new_tokens is not None:
            self.max_new_tokens = max_new_tokens
        self._keep_fitting_rows()

    def use_chat_template_kwargs(self, kwargs: Mapping[str, Any] | None) -> None:
        """Render every chat template of this environment (prompts, tool turns, the bridges between turns) with
        ``kwargs``: TRL's ``chat_template_kwargs``, e.g. ``{"enable_thinking": False}`` for Qwen3. The trainer and
        the evaluation entry points call this with the run's config, so the config is the one place that decides
        them: an environment built with other kwargs (its ``chat_template_kwargs`` argument) refuses, and so does
        one whose own ``render`` does not pass them on (``renders_chat_template_kwargs``). The rows are filtered
        again (prompt lengths may change)."""
        kwargs = self._reachable(kwargs)
        if kwargs == self.chat_template_kwargs:
            return
        if self.chat_template_kwargs:
            raise ValueError(
                f"{self.name} already renders with chat_template_kwargs={self.chat_template_kwargs}, but the run's "
                f"chat_template_kwargs are {kwargs}: set them in one place, the config (--chat_template_kwargs)."
            )
        self.chat_template_kwargs = kwargs
        self._chat_template_kwargs_changed()
        self._keep_fitting_rows()

    def _reachable(self, kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
        """``kwargs`` checked (``check_chat_template_kwargs``), refused when this class's ``render`` ignores them."""
        kwargs = check_chat_template_kwargs(kwargs)
        if kwargs and not self.renders_chat_template_kwargs:
            raise ValueError(
                f"{self.name}: chat_template_kwargs={kwargs} cannot reach its prompts: {type(self).__qualname__} "
                "renders them with its own render(). Leave chat_template_kwargs unset, or render with "
                "self.apply_chat_template (which passes them) and set renders_chat_template_kwargs = True."
            )
        return kwargs

    def _chat_template_kwargs_changed(self) -> None:
        """Hook: pass the new ``chat_template_kwargs`` on to the renderers a subclass keeps (before rows re-render)."""

    def _keep_fitting_rows(self) -> None:
        self.dataset = self._fitting(self._all_rows, "dataset")
        if not self.dataset:
            raise ValueError(
                f"{self.name}: no row of the dataset fits max_seq_len={self.max_seq_len}: every rendered prompt is "
                f"{min(self._prompt_lengths(self._all_rows))} tokens or longer. Raise the environment's max_seq_len "
                "(e.g. --env_args '{\"max_seq_len\": ...}')."
            )
        self.eval_dataset = self._fitting(self._all_eval_rows, "eval_dataset")

    def _fitting(self, rows: list[Row], split: str) -> list[Row]:
        """The rows whose prompt leaves room for at least one completion token within max_seq_len."""
        kept = [row for row, length in zip(rows, self._prompt_lengths(rows)) if length < self.max_seq_len]
        if len(kept) < len(rows):
            logger.warning(
                "%s: dropped %d of the %d rows of its %s whose rendered prompt leaves no room for a completion "
                "within max_seq_len=%d.",
                self.name,
                len(rows) - len(kept),
                len(rows),
                split,
                self.max_seq_len,
            )
        return kept

    def _prompt_lengths(self, rows: list[Row]) -> list[int]:
        return [len(self.prompt_ids(row.prompt)) for row in rows]

    def _row(self, index: int, record: Any, system_prompt: str | None, split: str) -> Row:
        where = f"{self.name}: {split} row {index}"
        if not isinstance(record, Mapping):
            raise TypeError(f"{where} is a {type(record).__name__}; expected a dict with 'prompt' or 'question'.")
        if record.get("prompt") is not None:
            prompt = check_messages(record["prompt"], f"{where}, 'prompt'")
        elif isinstance(record.get("question"), str):
            prompt = [{"role": "user", "content": record["question"]}]
        elif "question" in record:
            raise TypeError(f"{where}: 'question' must be a string, got {type(record['question']).__name__} "
                            f"{record['question']!r:.80}.")
        else:
            raise ValueError(
                f"{where} needs 'prompt' (a list of chat messages) or 'question' (a string); it has keys {sorted(record)}."
            )
        if system_prompt is not None and (not prompt or prompt[0]["role"] != "system"):
            prompt.insert(0, {"role": "system", "content": system_prompt})
        info = record.get("info") or {}
        if not isinstance(info, Mapping):
            raise TypeError(f"{where}: 'info' must be a dict, got {type(info).__name__}.")
        return Row(index=index, prompt=prompt, answer=record.get("answer"), info=dict(info))

    def render(self, messages: Messages, add_generation_prompt: bool) -> str:
        """The chat template applied to ``messages`` (as text)."""
        return self.apply_chat_template(messages, add_generation_prompt)

    def apply_chat_template(self, messages: Messages, add_generation_prompt: bool, **extra: Any) -> str:
        """The tokenizer's chat template over ``messages`` as text, with this environment's ``chat_template_kwargs``
        (``extra``: other ``apply_chat_template`` arguments, e.g. ``tools``)."""
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                                  **extra, **self.chat_template_kwargs)

    def prompt_ids(self, prompt: Messages) -> list[int]:
        """The token ids of ``prompt`` rendered for the model's first turn."""
        return self.encode(self.render(prompt, add_generation_prompt=True))

    def encode(self, text: str) -> list[int]:
        # No special tokens added: a chat template writes its own (bos included) into the text.
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    @abstractmethod
    async def generate(
        self, sampler: Sampler, prompt: Messages, prompt_ids: list[int], state: dict[str, Any]
    ) -> Trajectory:
        """Produce the completion of ``prompt`` (whose template rendering is ``prompt_ids``) with ``sampler``."""

    async def rollout(self, sampler: Sampler, row: Row, group_id: str | int) -> Rollout:
        """Roll ``row`` out once and score it. Any failure is raised as a RolloutError naming the environment and row."""
        try:
            prompt_ids = self.prompt_ids(row.prompt)
            if len(prompt_ids) >= self.max_seq_len:
                raise ValueError(
                    f"the prompt is {len(prompt_ids)} tokens, leaving no room within max_seq_len={self.max_seq_len}"
                )
            # ``state`` is shared by the rollout procedure and the reward functions; ``turn`` counts model turns.
            # Its own prompt, answer and info: one that changes them (a game's board) leaves the dataset row as it was.
            prompt, answer, info = copy.deepcopy((row.prompt, row.answer, row.info))
            state: dict[str, Any] = {"answer": answer, "info": info, "turn": 0}
            trajectory = await self.generate(sampler, prompt, prompt_ids, state)
            score = await self.rubric.score(prompt, trajectory.completion, answer, state, info)
        except Exception as error:
            kind = RolloutRefused if isinstance(error, RolloutRefused) else RolloutError  # a refusal stays one
            raise kind(
                f"{self.name} failed on dataset row {row.index}: {type(error).__name__}: {error}"
            ) from error
        return Rollout(
            prompt_ids=prompt_ids,
            completion_ids=trajectory.completion_ids,
            completion_mask=trajectory.completion_mask,
            completion_logprobs=trajectory.completion_logprobs,
            reward=score.reward,
            group_id=group_id,
            truncated=trajectory.truncated,
            metrics=score.metrics,
            reward_errors=dict(score.errors),
            prompt=row.prompt,
            completion=trajectory.completion,
        )

    async def rollout_group(
        self,
        sampler: Sampler,
        row: Row,
        group_id: str | int,
        n: int,
        *,
        seed: int | None = None,
        temperature: float | None = None,
    ) -> list[Rollout]:
        """``n`` concurrent rollouts of ``row`` sharing ``group_id``; one that raises cancels the others.

        With ``seed``, rollout i samples its model calls with seeds derived from ``(seed, i)`` (``RolloutSampling``):
        the group's tokens are then a function of the seed and the weights alone. ``temperature`` overrides the
        engine's (evaluation).
        """
        samplings = self.group_samplings(n, seed, temperature)
        # The group is retried or dropped whole: its other rollouts, left running, would hold the engine's rows and
        # the environment's resources unseen.
        return await gather_or_cancel([self._rollout_under(s, sampler, row, group_id) for s in samplings])

    def group_samplings(self, n: int, seed: int | None, temperature: float | None) -> list[RolloutSampling]:
        """The sampling settings of a group's ``n`` rollouts: rollout i's seed is ``derive_seed(seed, i)``."""
        if n < 1:
            raise ValueError(f"{self.name}: a group needs at least one rollout, got n={n}.")
        return [RolloutSampling(None if seed is None else derive_seed(seed, i), temperature) for i in range(n)]

    async def _rollout_under(self, sampling: RolloutSampling, sampler: Sampler, row: Row, group_id) -> Rollout:
        # Inside the rollout's own task (gather made one), so the setting is this rollout's alone.
        with sampling_for_rollout(sampling):
            rollout = await self.rollout(sampler, row, group_id)
        set_completion_versions(rollout, sampling)  # the versions its model calls recorded, turn by turn
        return rollout
