"""Classic verifiers environments (verifiers 0.2-0.3, the Environments Hub's API) trained unchanged.

``VerifiersEnv`` wraps a ``vf.Environment`` (``SingleTurnEnv``, ``MultiTurnEnv``, ``ToolEnv``, ``ReasoningGymEnv``,
a Hub module's ``load_environment()``...) as a verifiers_rl ``Environment``: its dataset (``get_dataset``) is the
training split and its ``eval_dataset`` the held-out one; each group runs the environment's own ``rollout``
(its turns, tools and stop conditions) against an ``EngineClient`` over our engine, then its rubric's
``score_group`` (group-level reward functions included), as verifiers' ``run_group`` does. Each rollout's
trajectory becomes one ``Rollout``: the first turn's prompt ids, then per turn the environment's tokens (mask 0)
and the sampled tokens with their log-probs (mask 1).

Like prime-rl's orchestrator (which ran ``run_group`` against a vLLM token client and stitched each trajectory's
steps into samples), but in process: the n rollouts of a group run in their own tasks under their own
``RolloutSampling``, so a group's tokens are a function of the seed and the weights.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, field
from typing import Any

from verifiers_rl.envs.awaitable import gather_or_cancel
from verifiers_rl.core.rollout import Rollout
from verifiers_rl.envs.environment import Environment, RolloutError, Row
from verifiers_rl.envs.rubric import Rubric
from verifiers_rl.core.sampling import RolloutSampling, Sampler, sampling_for_rollout, set_completion_versions
from verifiers_rl.envs.tools import current_tool_mode

logger = logging.getLogger(__name__)

INSTALL = 'pip install -e ".[verifiers]"  (or: pip install verifiers==0.3.1)'
DEFAULT_MAX_SEQ_LEN = 1024
DEFAULT_MAX_NEW_TOKENS = 256


def import_verifiers():
    """``verifiers`` with its classic API (0.2-0.3), or a clear error naming the extra."""
    try:
        import verifiers as vf

        vf.Environment  # noqa: B018 - 0.4 removed the classic API: this is what fails there
    except (ModuleNotFoundError, AttributeError) as error:
        raise ModuleNotFoundError(
            f"verifiers environments need the optional extra [verifiers] (the classic API, verifiers 0.2-0.3): "
            f"{INSTALL}"
        ) from error
    return vf


@dataclass
class VerifiersRow(Row):
    """A dataset row, with the verifiers rollout input it came from."""

    vf_input: dict[str, Any] = field(default_factory=dict)


def describe_error(error: BaseException) -> str:
    """``Type: message`` of an error and of the errors it was raised from (verifiers wraps model errors)."""
    parts, seen = [], set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        parts.append(f"{type(error).__name__}: {error}" if str(error) else type(error).__name__)
        error = error.__cause__ or error.__context__
    return " <- ".join(parts)


def calls_left_unrun(state: Any) -> bool:
    """Whether ``max_turns`` ended the rollout after a model turn whose tool calls never ran (verifiers' stop condition
    ``max_turns_reached`` fires before its ToolEnv's ``no_tools_called`` would run them): cut by a limit, truncated
    as our ``ToolEnv`` marks it (``max_turns_truncates``). A max_turns end without pending calls is an ordinary end."""
    from verifiers_rl.envs.adapters.verifiers_client import plain_message

    if state.get("stop_condition") != "max_turns_reached" or not state.get("trajectory"):
        return False
    last_turn = state["trajectory"][-1].get("completion") or []
    return bool(last_turn) and bool(plain_message(last_turn[-1]).get("tool_calls"))


class VerifiersEnv(Environment):
    """A classic ``vf.Environment`` as a verifiers_rl Environment (module docstring).

    Limits: ``max_seq_len`` defaults to the environment's ``max_seq_len`` and ``max_new_tokens`` (per model turn)
    to its ``sampling_args["max_tokens"]``; where the environment states neither, 1024 and 256 hold until the
    trainer's flags replace them (``unstated_limits``). Sampling (temperature, seed) is the trainer's: the
    environment's own ``sampling_args`` other than ``max_tokens`` do not reach the engine.

    An environment whose rubric provides its own advantages (``provides_advantages``) is refused: the trainer
    computes advantages from rewards (``--scale_rewards``).
    """

    renders_chat_template_kwargs = True  # its EngineClient's ToolRenderers pass them on

    def __init__(
        self,
        vf_env: Any,
        tokenizer: Any,
        *,
        max_seq_len: int | None = None,
        max_new_tokens: int | None = None,
        tool_mode: str | None = None,
        name: str | None = None,
        model_name: str = "verifiers_rl-policy",
    ):
        import_verifiers()
        name = name or getattr(vf_env, "env_id", None) or type(vf_env).__name__
        if vf_env.provides_advantages:
            raise ValueError(
                f"{name}: its rubric provides its own advantages (provides_advantages), which verifiers_rl cannot "
                "train on yet: the trainer computes advantages from the rewards (--scale_rewards)."
            )
        self.vf_env = vf_env
        self.model_name = model_name
        self.tool_mode = tool_mode or current_tool_mode(name)  # tools may come with a rollout's state
        sampling_args = dict(getattr(vf_env, "sampling_args", None) or {})
        stated_new = sampling_args.get("max_tokens") or sampling_args.get("max_completion_tokens")
        self.unstated_limits = frozenset(
            limit for limit, value in (("max_seq_len", vf_env.max_seq_len), ("max_new_tokens", stated_new))
            if value is None
        )
        ignored = sorted(set(sampling_args) - {"n", "extra_body", "max_tokens", "max_completion_tokens"})
        if ignored:
            logger.warning("%s: its sampling_args %s are not used; the trainer's sampling settings are.", name, ignored)
        self.tools = [self._schema(tool) for tool in (vf_env.tool_defs or [])]
        try:
            train = vf_env.get_dataset()
        except ValueError as error:
            raise ValueError(f"{name}: the verifiers environment has no training dataset ({error}).") from error
        held_out = vf_env.build_eval_dataset()
        self._client_args = dict(tokenizer=tokenizer, tool_mode=self.tool_mode, name=name, renderers={},
                                 tool_mode_given=tool_mode is not None)
        super().__init__(
            list(train),
            Rubric(),  # unused: the verifiers environment's own rubric scores
            tokenizer,
            max_seq_len=max_seq_len or vf_env.max_seq_len or DEFAULT_MAX_SEQ_LEN,
            max_new_tokens=max_new_tokens or stated_new or DEFAULT_MAX_NEW_TOKENS,
            name=name,
            eval_dataset=list(held_out) if held_out is not None else None,
        )

    @staticmethod
    def _schema(tool: Any) -> dict[str, Any]:
        from verifiers_rl.envs.adapters.verifiers_client import tool_schema

        return tool_schema(tool)

    def client(self, sampler: Sampler):
        """A ``vf.Client`` sampling from ``sampler`` within this environment's limits."""
        from verifiers_rl.envs.adapters.verifiers_client import EngineClient

        return EngineClient(sampler, max_seq_len=self.max_seq_len, max_new_tokens=self.max_new_tokens,
                            **self._client_args)

    def _row(self, index: int, record: Any, system_prompt: str | None, split: str) -> VerifiersRow:
        from verifiers_rl.envs.adapters.verifiers_client import plain_messages

        record = dict(record)
        info = record.get("info") or {}
        if isinstance(info, str):
            info = json.loads(info)  # verifiers stores info as JSON text in some datasets, and parses it the same way
        plain = {"prompt": plain_messages(record["prompt"]), "answer": record.get("answer"), "info": info}
        row = super()._row(index, plain, system_prompt, split)
        return VerifiersRow(**asdict(row), vf_input=record)

    def render(self, messages, add_generation_prompt: bool) -> str:
        return self.client(None).renderer(self.tools).render(messages, add_generation_prompt)

    def _chat_template_kwargs_changed(self) -> None:
        # New renderers (the cached ones render with the old kwargs), shared by every client made from now on.
        self._client_args.update(chat_template_kwargs=self.chat_template_kwargs, renderers={})

    async def generate(self, sampler, prompt, prompt_ids, state):
        raise NotImplementedError("VerifiersEnv runs the verifiers environment's own rollout (rollout_group).")

    async def rollout(self, sampler: Sampler, row: Row, group_id: str | int) -> Rollout:
        (rollout,) = await self.rollout_group(sampler, row, group_id, 1)
        return rollout

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
        """``n`` rollouts of ``row`` by the verifiers environment, scored together by its rubric (its
        ``run_group``), each sampling under its own ``RolloutSampling(derive_seed(seed, i), temperature)``."""
        client = self.client(sampler)
        samplings = self.group_samplings(n, seed, temperature)
        states = await gather_or_cancel([self._vf_rollout(s, client, row) for s in samplings])  # one fails: all stop
        rubric = self.vf_env.rubric
        try:
            if self.vf_env.score_rollouts:
                await rubric.score_group(states)
            else:
                await rubric.dummy_score_group(states)
            for state in states:
                await rubric.cleanup(state)
        except Exception as error:
            raise RolloutError(
                f"{self.name}: the verifiers rubric failed on dataset row {row.index}: {describe_error(error)}"
            ) from error
        rollouts = [self._to_rollout(state, row, group_id) for state in states]
        for rollout, sampling in zip(rollouts, samplings):
            set_completion_versions(rollout, sampling)  # the versions its model calls recorded, turn by turn
        return rollouts

    async def _vf_rollout(self, sampling: RolloutSampling, client, row: VerifiersRow):
        # Inside the rollout's own task (gather made one): the environment's model calls inherit this setting.
        with sampling_for_rollout(sampling):
            sampling_args = {"max_tokens": self.max_new_tokens}
            try:
                state = await self.vf_env.rollout(dict(row.vf_input), client, self.model_name, sampling_args)
            except Exception as error:
                raise RolloutError(
                    f"{self.name} failed on dataset row {row.index}: {describe_error(error)}"
                ) from error
        if state.get("error") is not None:
            raise RolloutError(f"{self.name} failed on dataset row {row.index}: {describe_error(state['error'])}")
        return state

    def _to_rollout(self, state: Any, row: Row, group_id: str | int) -> Rollout:
        """One trajectory as one token sequence: turn k's prompt must extend turn k-1's prompt and sample."""
        from verifiers_rl.envs.adapters.verifiers_client import plain_messages

        steps = state["trajectory"]
        where = f"{self.name} on dataset row {row.index}"
        if not steps:
            raise RolloutError(f"{where}: the rollout has no model turn (stop condition {state.get('stop_condition')}).")
        prompt_ids = list(steps[0]["tokens"]["prompt_ids"])
        ids: list[int] = []
        mask: list[int] = []
        logprobs: list[float] = []
        for turn, step in enumerate(steps):
            tokens = step["tokens"]
            so_far = prompt_ids + ids
            if list(tokens["prompt_ids"][: len(so_far)]) != so_far:
                raise RolloutError(f"{where}: model turn {turn + 1}'s prompt does not extend the turns before it.")
            environment_ids = list(tokens["prompt_ids"][len(so_far) :])
            ids += environment_ids + list(tokens["completion_ids"])
            mask += [0] * len(environment_ids) + [int(m) for m in tokens["completion_mask"]]
            logprobs += [0.0] * len(environment_ids) + [float(x) for x in tokens["completion_logprobs"]]
        truncated = bool(state.get("is_truncated") or state.get("timed_out") or steps[-1]["is_truncated"]
                         or calls_left_unrun(state))
        return Rollout(
            prompt_ids=prompt_ids,
            completion_ids=ids,
            completion_mask=mask,
            completion_logprobs=logprobs,
            reward=float(state["reward"]),
            group_id=group_id,
            truncated=truncated,
            metrics={key: float(value) for key, value in (state.get("metrics") or {}).items()},
            prompt=row.prompt,
            completion=plain_messages(state.get("completion") or []),
        )
