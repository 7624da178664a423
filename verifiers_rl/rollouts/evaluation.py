"""Evaluation: roll out an environment's held-out rows through an engine and reduce them to metrics.

The trainer runs it every ``--eval_steps`` (``RLTrainer.evaluate``); ``verifiers-rl eval`` runs it on a
saved model. Each prompt gets ``samples_per_prompt`` (k) samples; sample i of row r draws its tokens with the seed
``derive_seed(derive_seed(seed, "eval", r), i)`` (r: the row's place in its own environment's split, in a mixture
too), a namespace training never uses, so evaluation neither consumes nor
perturbs any random state of training, and the same weights always give the same evaluation (at any step, and in the
standalone evaluation of a saved checkpoint).

A sample is an episode: one rollout, or all the branches of an episode of several (a verifiers v1 sub-agent's),
which count once, with the episode's one reward, in pass@k and every reward mean.

A sample *passes* when its reward is >= ``pass_threshold`` (default 1.0: a fully correct answer for the 0/1 rewards
of arithmetic and calculator, an exact reversal for reverse_text's partial credit).
"""

from __future__ import annotations

import asyncio
import json
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from verifiers_rl.envs.environment import Environment, Row
from verifiers_rl.envs.rubric import ERRORS_METRIC
from verifiers_rl.envs.splits import split_size_hint
from verifiers_rl.core.engine import check_sequences_fit
from verifiers_rl.core.sampling import derive_seed
from verifiers_rl.core.rollout import Rollout, group_episodes, metric_values
from verifiers_rl.core.settings import settings_from
from verifiers_rl.core.watched import run_watched


class EvaluationTimeout(RuntimeError):
    """No prompt's samples finished within ``EvalSettings.timeout_s`` (--generation_timeout_s)."""


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k estimator from ``n`` samples of which ``c`` pass (Chen et al. 2021, "Evaluating Large
    Language Models Trained on Code"): the probability that k samples drawn without replacement from the n hold a
    pass,

        pass@k = 1 - C(n - c, k) / C(n, k).
    """
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}.")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def greedy_samples(samples_flag: str, temperature_flag: str) -> str:
    """The refusal of several samples per prompt at temperature 0, naming the two flags."""
    return (f"{samples_flag} at {temperature_flag}: greedy decoding gives every sample of a prompt the same "
            "completion, so pass@k would equal pass@1 at k times the cost. Sample (a temperature > 0), or take one "
            "sample per prompt.")


@dataclass
class EvalSettings:
    """``num_examples`` prompts of the held-out split (None: all of it) x ``samples_per_prompt`` samples each, at
    ``temperature`` (None: the engine's; 0: greedy)."""

    num_examples: int | None = field(default=None, metadata={"from": "eval_num_examples"})
    samples_per_prompt: int = field(default=1, metadata={"from": "eval_samples_per_prompt"})
    temperature: float | None = field(default=None, metadata={"from": "eval_temperature"})
    pass_threshold: float = field(default=1.0, metadata={"from": "eval_pass_threshold"})
    seed: int = 0
    # Fails the evaluation when no prompt's samples finish for this long: an environment or the engine is stuck.
    timeout_s: float = field(default=600.0, metadata={"from": "generation_timeout_s"})

    def __post_init__(self):
        if self.num_examples is not None and self.num_examples < 1:
            raise ValueError(f"eval_num_examples must be >= 1, got {self.num_examples}.")
        if self.samples_per_prompt < 1:
            raise ValueError(f"eval_samples_per_prompt must be >= 1, got {self.samples_per_prompt}.")
        if self.temperature is not None and not 0 <= self.temperature < math.inf:
            raise ValueError(f"eval_temperature must be a finite number >= 0 (0 = greedy), got {self.temperature}.")
        if self.temperature == 0 and self.samples_per_prompt > 1:
            raise ValueError(greedy_samples(f"--eval_samples_per_prompt {self.samples_per_prompt}",
                                            "--eval_temperature 0"))
        if not self.timeout_s > 0:
            raise ValueError(f"generation_timeout_s must be > 0, got {self.timeout_s}.")

    @classmethod
    def from_config(cls, args) -> "EvalSettings":
        """From an ``RLConfig``: its ``eval_*`` fields and ``seed`` (each field's "from")."""
        return settings_from(args, cls)


def eval_rows(environment: Environment, num_examples: int | None, flag: str = "--eval_num_examples") -> list[Row]:
    """The first ``num_examples`` rows of the held-out split (all of them for None), the same rows at every
    evaluation."""
    selection = getattr(environment, "eval_selection", None)
    if selection is not None:  # a mixture: each entry's own first rows, checked per entry
        return selection(num_examples, flag)
    rows = environment.eval_dataset
    # The flags that fix it: verifiers-rl eval's (-n) or the trainer's.
    env_flag, holdout_flag = ("--env", "--holdout") if flag == "-n" else ("--eval_env", "--eval_holdout")
    if not rows:
        raise ValueError(
            f"{environment.name} has no held-out split to evaluate on. Evaluate another environment with {env_flag} "
            f"(one built with eval_dataset=...), or hold out training rows with {holdout_flag} N."
        )
    if num_examples is not None and num_examples > len(rows):
        larger = split_size_hint(environment, "--env_args '{}'")
        raise ValueError(
            f"{flag} {num_examples} is larger than the held-out split of {environment.name} ({len(rows)} "
            f"rows). Lower it, or give the environment a larger split ({larger}; {holdout_flag} N holds out N training "
            "rows)."
        )
    return rows if num_examples is None else rows[:num_examples]


@dataclass
class EvalSample:
    """One evaluation episode: sample ``sample`` of held-out row ``row``. ``rollout`` is its (first) branch, whose
    reward is the episode's; ``branches`` the episode's other branches, if it has several."""

    row: Row
    sample: int
    rollout: Rollout
    passed: bool
    branches: list[Rollout] = field(default_factory=list)

    @property
    def rollouts(self) -> list[Rollout]:
        """Every branch of the episode, ``rollout`` first."""
        return [self.rollout, *self.branches]

    def record(self, rollout: Rollout | None = None) -> dict:
        """The record of ``rollout`` (default: ``self.rollout``; the replay format's fields) plus ``row``,
        ``sample``, ``answer`` and ``passed``."""
        return {"row": self.row.index, "sample": self.sample, **json.loads((rollout or self.rollout).to_json()),
                "answer": self.row.answer, "passed": self.passed}

    def records(self) -> list[dict]:
        """``record`` of each branch: one line per rollout, as a replayable file holds them."""
        return [self.record(rollout) for rollout in self.rollouts]


@dataclass
class EvalResult:
    """The reduced evaluation: reward means over every sample (episode), pass@k averaged over prompts, token
    counts and truncation over every rollout (each branch of an episode)."""

    samples: list[EvalSample]
    num_prompts: int
    samples_per_prompt: int
    pass_threshold: float
    reward: float
    reward_std: float
    pass_at: dict[int, float]
    reward_functions: dict[str, float]
    reward_errors: float
    completion_tokens: float
    truncated_fraction: float
    seconds: float
    extra: dict[str, float] = field(default_factory=dict)
    logged_metrics: dict[str, float] = field(default_factory=dict)  # reward functions' log_metric means
    by_env: dict[str, "EvalResult"] = field(default_factory=dict)  # a mixture's entries, each on its own

    def metrics(self, prefix: str = "eval") -> dict[str, float]:
        """Flat metrics named ``{prefix}_...``: every ``report_to`` backend shows them as ``{prefix}/...``
        (``eval/reward``, ``eval/pass@1``, ``eval/pass@4``, ``eval/rewards/<function>``); a mixture's entries
        also under ``{prefix}_env/<name>/...`` (``eval/env/<name>/pass@1``)."""
        values = self._values()
        values.update(samples_per_prompt=float(self.samples_per_prompt), runtime=self.seconds)
        for name, result in self.by_env.items():
            values.update({f"env/{name}/{key}": value for key, value in result._values().items()})
        return {f"{prefix}_{name}": float(v) for name, v in values.items()}

    def _values(self) -> dict[str, float]:
        values = {"reward": self.reward, "reward_std": self.reward_std}
        values.update({f"pass@{k}": v for k, v in self.pass_at.items()})
        values.update({f"rewards/{name}": v for name, v in self.reward_functions.items()})
        values.update(self.logged_metrics)  # under their own names, as TRL logs them
        values.update(reward_errors=self.reward_errors, completion_tokens=self.completion_tokens,
                      truncated_fraction=self.truncated_fraction, num_prompts=float(self.num_prompts))
        return values

    def table(self) -> str:
        """A two-column summary for a terminal."""
        n, k = self.num_prompts, self.samples_per_prompt
        rollouts = [rollout for sample in self.samples for rollout in sample.rollouts]
        branched = "" if len(rollouts) == len(self.samples) else f" episodes ({len(rollouts)} rollouts)"
        rows = [("prompts x samples", f"{n} x {k} = {len(self.samples)}{branched or ' rollouts'}"),
                ("reward", f"{self.reward:.4f} ± {self.reward_std:.4f}")]
        rows += [(f"pass@{j}", f"{v:.4f}") for j, v in self.pass_at.items()]
        rows += [(f"  {name}", f"{v:.4f}") for name, v in self.reward_functions.items()]
        if self.reward_errors:
            rows.append(("reward errors", f"{self.reward_errors:.0f}"))
        total = sum(r.completion_mask.count(1) for r in rollouts)
        rows.append(("completion tokens", f"{self.completion_tokens:.1f} per rollout ({total} in all), "
                                          f"{self.truncated_fraction:.0%} truncated"))
        rate = len(rollouts) / self.seconds if self.seconds > 0 else float("inf")
        rows.append(("time", f"{self.seconds:.1f} s ({rate:.1f} rollouts/s)"))
        rows.append(("pass", f"reward >= {self.pass_threshold:g}"))
        width = max(len(label) for label, _ in rows)
        return "\n".join(f"{label:<{width}}  {value}" for label, value in rows)


def summarize(samples: list[EvalSample], samples_per_prompt: int, pass_threshold: float, seconds: float,
              per_env: bool = True) -> EvalResult:
    """Reduce ``samples`` (``samples_per_prompt`` episodes per row) to an ``EvalResult``; with ``per_env``, the samples of
    each environment of a mixture (``Rollout.env``) are reduced on their own too (``EvalResult.by_env``)."""
    if not samples:
        raise ValueError("Nothing was evaluated.")
    by_env: dict[str, list[EvalSample]] = {}
    for sample in samples:
        if per_env and sample.rollout.env is not None:
            by_env.setdefault(sample.rollout.env, []).append(sample)
    by_row: dict[int, list[EvalSample]] = {}
    for sample in samples:
        by_row.setdefault(sample.row.index, []).append(sample)
    rewards = [s.rollout.reward for s in samples]
    ks = sorted({1, samples_per_prompt})
    pass_at = {
        k: statistics.fmean(pass_at_k(len(group), sum(s.passed for s in group), k) for group in by_row.values())
        for k in ks
    }
    # Over the rollouts that have the function (another entry's, or TRL's None), as training's rewards/<name>/mean.
    functions = {name: statistics.fmean(values) for name, values in metric_values(s.rollout for s in samples).items()
                 if name != ERRORS_METRIC}
    return EvalResult(
        samples=samples,
        num_prompts=len(by_row),
        samples_per_prompt=samples_per_prompt,
        pass_threshold=pass_threshold,
        reward=statistics.fmean(rewards),
        # Bessel's correction (NaN for one sample), as training's reward_std and TRL's evaluation (its nanstd).
        reward_std=statistics.stdev(rewards) if len(rewards) > 1 else math.nan,
        pass_at=pass_at,
        reward_functions=functions,
        reward_errors=float(sum(s.rollout.metrics.get(ERRORS_METRIC, 0.0) for s in samples)),
        completion_tokens=statistics.fmean(r.completion_mask.count(1) for s in samples for r in s.rollouts),
        truncated_fraction=statistics.fmean(float(r.truncated) for s in samples for r in s.rollouts),
        seconds=seconds,
        logged_metrics={name: statistics.fmean(values) for name, values in metric_values([s.rollout for s in samples], "logged_metrics").items()},
        by_env={name: summarize(group, samples_per_prompt, pass_threshold, seconds, per_env=False)
                for name, group in by_env.items()},
    )


async def _rollouts(environment: Environment, engine, rows: list[Row], settings: EvalSettings,
                    on_group: Callable[[int], None]) -> list[EvalSample]:
    async def group(row: Row) -> list[EvalSample]:
        rollouts = await environment.rollout_group(
            engine, row, f"eval-{row.index}", settings.samples_per_prompt,
            seed=derive_seed(settings.seed, "eval", row.seed_index), temperature=settings.temperature,
        )
        episodes = group_episodes(rollouts)  # a multi-branch episode is one sample, with its one reward
        on_group(len(episodes))
        return [EvalSample(row, i, first, first.reward >= settings.pass_threshold, rest)
                for i, (first, *rest) in enumerate(episodes)]

    tasks = [asyncio.ensure_future(group(row)) for row in rows]
    try:
        await asyncio.gather(*tasks)  # a group's error ends the evaluation
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return [sample for task in tasks for sample in task.result()]


def evaluate(environment: Environment, engine, settings: EvalSettings,
             on_group: Callable[[int], None] | None = None) -> EvalResult:
    """Roll out the held-out rows ``settings`` selects through ``engine`` (all at once; the engine batches them) in
    an event loop of its own, and reduce them. ``on_group(n)`` is called as each prompt's n samples finish; when
    none finishes for ``settings.timeout_s``, ``EvaluationTimeout``."""
    rows = eval_rows(environment, settings.num_examples)
    start = time.perf_counter()
    done = [0]

    def rollouts(progress: Callable[[], None]):
        def note(samples: int) -> None:
            done[0] += 1
            progress()
            if on_group is not None:
                on_group(samples)
        return _rollouts(environment, engine, rows, settings, note)

    samples = run_watched(rollouts, settings.timeout_s, lambda: EvaluationTimeout(
        f"Evaluation: no prompt's samples finished within {settings.timeout_s:g} s ({len(rows) - done[0]} of "
        f"{len(rows)} prompts waiting); an environment (its rollout, tools or reward functions) or the engine is "
        "stuck. --generation_timeout_s sets this bound."), name="verifiers_rl-evaluation")
    return summarize(samples, settings.samples_per_prompt, settings.pass_threshold, time.perf_counter() - start)


@dataclass
class TrainingEvaluation:
    """What ``RLTrainer.evaluate`` runs on the main process: the environment, its rows (checked when training
    starts, not at the first evaluation) and the settings."""

    environment: Environment
    settings: EvalSettings

    def check_engine(self, engine) -> None:
        if engine is None:
            raise ValueError(
                "Evaluation needs an inference engine on the main process (examples/train.py builds one; with "
                "RLTrainer pass engine=...)."
            )
        check_sequences_fit(engine, self.environment.max_seq_len)

    def run(self, engine) -> EvalResult:
        self.check_engine(engine)
        return evaluate(self.environment, engine, self.settings)


def prepare(args, environment: Environment | None, eval_environment: Environment | None) -> TrainingEvaluation | None:
    """Check that ``--eval_holdout`` was applied where the environment was loaded (``envs.splits.hold_out``, whether
    or not evaluation runs, so the rows a run trains on never depend on evaluation) and, when ``--eval_strategy`` is
    not "no", the rows evaluation will use. The eval environment defaults to the training environment. Nothing here
    changes an environment."""
    eval_environment = eval_environment or environment
    if args.eval_holdout:
        target = environment or eval_environment
        if target is None:
            raise ValueError("--eval_holdout needs an environment to hold rows out of (--env or --eval_env).")
        if getattr(target, "_verifiers_rl_holdout", None) != (args.eval_holdout, args.seed):
            raise ValueError(
                f"--eval_holdout {args.eval_holdout}: hold the rows out where the environment is loaded, before the "
                f"trainer: verifiers_rl.envs.splits.hold_out(environment, {args.eval_holdout}, seed={args.seed}) "
                "(examples/train.py and verifiers-rl eval do)."
            )
    if args.eval_strategy == "no":
        return None
    return on_demand(args, eval_environment)


def for_evaluate(current: TrainingEvaluation | None, args, eval_environment: Environment | None,
                 eval_dataset=None) -> TrainingEvaluation:
    """What ``RLTrainer.evaluate(eval_dataset)`` runs: the run's evaluation, or without ``--eval_strategy`` one made
    now (HF's evaluate() works without it too); another eval_dataset is refused (its rows are the trainer's)."""
    if eval_dataset is not None:
        raise ValueError("evaluate(eval_dataset=...): RLTrainer evaluates the held-out split it was built with; pass "
                         "eval_dataset= to the trainer (TRL's form) or eval_environment=.")
    return current or on_demand(args, eval_environment)


def on_demand(args, eval_environment: Environment | None) -> TrainingEvaluation:
    """The evaluation of ``eval_environment``'s held-out split with the config's eval settings, its rows checked:
    what ``--eval_strategy`` runs, and what ``RLTrainer.evaluate()`` runs when called without it (as HF's does)."""
    if eval_environment is None:
        raise ValueError(
            "Evaluation (--eval_steps / --eval_strategy, or trainer.evaluate()) needs an environment: pass --eval_env "
            "NAME (a replay run has no training environment to default to)."
        )
    settings = EvalSettings.from_config(args)
    eval_rows(eval_environment, settings.num_examples)
    return TrainingEvaluation(eval_environment, settings)
