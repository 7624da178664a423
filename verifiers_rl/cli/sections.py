"""The training command's flags by section: ``verifiers-rl train --help`` and the generated ``docs/config.md``.

Every field of ``RLConfig`` and of the command's ``ScriptArguments`` belongs to exactly one section (a test keeps it
so); the TrainingArguments / GRPOConfig fields that a run usually sets are placed too, and the rest are listed under
``OTHER``. ``python -m verifiers_rl.cli.sections --write docs/config.md`` regenerates the reference.
"""

from __future__ import annotations

import argparse
import difflib
import functools
import json
import re
import sys
import types
import typing
from dataclasses import MISSING, fields

from trl import TrlParser

from verifiers_rl.core.flags import repeated_flag

SECTIONS: dict[str, tuple[str, ...]] = {
    "Model": ("model", "bf16", "use_cpu", "seed", "gradient_checkpointing", "activation_checkpointing"),
    "LoRA": ("use_peft", "lora_r", "lora_alpha", "lora_dropout", "lora_target_modules", "lora_target_parameters",
             "lora_modules_to_save", "lora_task_type", "use_rslora", "use_dora"),
    "Environment and data": ("env", "env_args", "tool_mode", "rollouts_path", "save_rollouts_path", "max_seq_len",
                             "max_completion_length", "overlong", "chat_template_kwargs"),
    "Generation": ("num_generations", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                   "continuous_batching_rows", "generation_kwargs", "filter_groups", "max_refill_batches", "max_rollout_retries",
                   "max_failed_rollouts_fraction", "generation_timeout_s", "curriculum_easy_above",
                   "curriculum_hard_below", "curriculum_window", "curriculum_pass_reward",
                   "curriculum_set_aside_epochs"),
    "Loss and optimizer": ("loss_type", "beta", "epsilon", "epsilon_high", "scale_rewards",
                           "importance_sampling_level", "importance_correction", "importance_cap",
                           "importance_cap_min", "importance_sequence_log_ratio", "dr_grpo_horizon", "learning_rate",
                           "lr_scheduler_type", "optim", "max_grad_norm", "max_steps", "num_train_epochs"),
    "Batching": ("rollouts_per_step", "per_device_train_batch_size", "gradient_accumulation_steps", "micro_batching",
                 "max_tokens_per_microbatch", "logprob_chunk_size", "share_prompt_training"),
    "Asynchrony and weight sync": ("max_off_policy_steps", "groups_in_flight", "weight_sync_bucket_mb",
                                   "weight_sync_probe_tokens", "weight_sync_probe_every", "weight_sync_probe_tolerance"),
    "vLLM server": ("vllm_server_url", "vllm_server_timeout", "vllm_max_concurrency", "vllm_request_timeout_s",
                    "vllm_max_retries", "vllm_reconnect_timeout_s", "vllm_weights_dir", "vllm_weight_transfer",
                    "vllm_weight_transfer_address"),
    "Checkpoints": ("output_dir", "save_strategy", "save_steps", "save_total_limit", "resume_from_checkpoint",
                    "metric_for_best_model", "greater_is_better", "load_best_model_at_end"),
    "Evaluation": ("eval_env", "eval_env_args", "eval_strategy", "eval_steps", "eval_num_examples",
                   "eval_samples_per_prompt", "eval_temperature", "eval_pass_threshold", "eval_holdout"),
    "Logging": ("logging_steps", "report_to", "run_name", "print_samples_every", "num_completions_to_print",
                "log_completions", "log_completions_steps"),
}
OTHER = "Other TrainingArguments / GRPOConfig fields (docs/trl.md says what each does here)"

# Inherited fields whose upstream help describes TRL's or transformers' trainer, not what the field does here.
HELP_HERE: dict[str, str] = {
    "generation_kwargs": "JSON object of sampling settings, each overriding its field (--temperature the trainer's "
                         "log-prob temperature too): temperature, top_p, top_k, min_p, repetition_penalty, which both "
                         "engines honour exactly; any other key is refused by name.",
    "epsilon_high": "Upper clip of the PPO ratio, 1 + epsilon_high (DAPO's clip-higher: 0.28); default: --epsilon.",
    "save_strategy": "When to write a checkpoint: 'no', 'steps' (every --save_steps), 'epoch', or 'best' (when an "
                     "evaluation finds a new best --metric_for_best_model; needs evaluation). SIGTERM or Ctrl-C "
                     "writes one whatever this says.",
    "save_total_limit": "Most checkpoints kept in --output_dir, the oldest deleted first; the newest (to resume "
                        "from) and the best (--metric_for_best_model) are always kept.",
    "resume_from_checkpoint": "Resume from this checkpoint folder, 'latest' (the newest intact checkpoint-N in "
                              "--output_dir) or 'auto' (latest, or a fresh start where there is none): the resumed "
                              "run ends with the uninterrupted run's parameters.",
    "metric_for_best_model": "The evaluation metric that picks the best checkpoint (--save_strategy best, "
                             "--load_best_model_at_end; rotation keeps it): reward, pass@k, rewards/<function>, "
                             "... as evaluation logs them (an eval/ prefix is allowed). Default with those two: "
                             "reward. Needs evaluation.",
    "greater_is_better": "Whether a larger --metric_for_best_model is better; default: yes unless its name ends in "
                         "loss.",
    "load_best_model_at_end": "At the end, load the best checkpoint's weights (--metric_for_best_model), which the "
                              "final save writes. Needs evaluation, and checkpoints at evaluation steps "
                              "(--save_strategy best, or the same strategy as evaluation and --save_steps a "
                              "multiple of --eval_steps).",
    "eval_steps": "Evaluate every N optimizer steps; given alone, it turns evaluation on (--eval_strategy steps). "
                  "With --eval_strategy steps and no N: every --logging_steps. A float below 1: that fraction of "
                  "the run's steps.",
    "logging_steps": "Log every N optimizer steps (a float below 1: that fraction of the run's steps); each value "
                     "logged is the mean of those steps' values, counts (reward_errors, rollouts_failed, ...) too: "
                     "per step, not summed. Acts only with --logging_strategy steps (the default); beside epoch or "
                     "no: refused.",
    "report_to": "Where to log: tensorboard and trackio (pip install 'verifiers_rl[logging]'; tested), wandb "
                 "('verifiers_rl[wandb]'), several comma-separated, all (every one installed) or none. transformers' "
                 "other integrations (mlflow, ...) are passed on untested; a name that is none of them, or whose "
                 "package is not installed, is refused.",
    "log_completions": "TRL's switch: --log_completions_steps set to --logging_steps (tables of the trained batch "
                       "to the --report_to backends that show them).",
    "num_completions_to_print": "How many sample completions (with rewards) each --print_samples_every print "
                                "shows; default: 3.",
    "gradient_accumulation_steps": "Sizes the default --rollouts_per_step (per_device_train_batch_size x this x "
                                   "processes); a step's micro-batches are always accumulated into one update. "
                                   "Beside a --rollouts_per_step it disagrees with: refused.",
}


class _Formatter(argparse.ArgumentDefaultsHelpFormatter):
    """HF's help formatter, except that a ``--no_NAME`` flag shows no default: it shares its field with ``--NAME``,
    whose default is the field's, and would show False whatever that is."""

    def _get_help_string(self, action: argparse.Action) -> str:
        return action.help if _negates(action) else super()._get_help_string(action)


def _negates(action: argparse.Action) -> bool:
    """Whether ``action`` is HF's ``--no_NAME`` complement of a boolean that defaults to True."""
    return isinstance(action, argparse._StoreFalseAction) and action.option_strings[0].startswith("--no_")


class SectionedParser(TrlParser):
    """TRL's parser (dataclasses -> flags, ``--config`` YAML) whose ``--help`` lists the flags by ``SECTIONS``."""

    # Flags of other commands (TRL's `trl grpo`) that are no flags here, each with why and what to use instead.
    NOT_HERE: dict[str, str] = {}

    def __init__(self, *args, **kwargs):
        # No abbreviations: argparse would take --max_step for --max_steps, and a typo or a prefix would set a flag.
        super().__init__(*args, formatter_class=_Formatter, allow_abbrev=False, **kwargs)
        # Read by parse_args_and_config before argparse sees the rest; declared so that --help lists it.
        self.add_argument("--config", metavar="FILE.yaml", default=argparse.SUPPRESS,
                          help="A YAML mapping of flag names to values (keys as the flags below, without --); "
                               "flags on the command line override it.")

    def add_argument(self, *args, **kwargs):
        if getattr(kwargs.get("type"), "__name__", "") == "string_to_bool" and "nargs" not in kwargs:
            # HF gives a bool | None switch (--bf16) no value of its own: bare --bf16 said "expected one argument".
            kwargs.update(nargs="?", const=True)
        action = super().add_argument(*args, **kwargs)
        action.help = HELP_HERE.get(action.dest, action.help)
        if _negates(action):  # HF gives it the positive flag's text, which reads as the opposite of what it does
            action.help = f"Turn --{action.dest} off."
        allowed = flag_ranges().get(action.dest)
        if allowed is not None and action.help:  # the range validate checks, as docs/config.md lists it
            action.help = f"{action.help} Range: {allowed}."
        self.__dict__.setdefault("added", []).append(action)  # argparse keeps its own list private
        return action

    def parse_args_and_config(self, args=None):
        """TRL's, except that each ``--config`` YAML value is checked and converted as its flag's text would be (a
        wrong one is a ValueError naming the file and the key), ``--config=FILE`` is ``--config FILE``, ``env:``
        is the ``--env`` flag, not TRL's environment variables, and a flag given twice is refused."""
        args = [part for arg in (sys.argv[1:] if args is None else args)
                for part in (arg.split("=", 1) if arg.startswith("--config=") else [arg])]
        if args.count("--config") > 1:
            raise ValueError("--config given twice: name one file (the command line overrides its values).")
        why = repeated_flag(self, args)
        if why:
            raise ValueError(why)
        if "--config" in args:
            at = args.index("--config")
            if at + 1 == len(args):
                raise ValueError("--config needs a file: --config FILE.yaml")
            path = args[at + 1]
            self.set_defaults_with_config(**self._config_values(path, _yaml_config(path)))
            args = args[:at] + args[at + 2:]
        return self.parse_args_into_dataclasses(args=args)

    def _config_values(self, path: str, config: dict) -> dict:
        """The ``--config`` file's values as their flags' parses give them; an unknown key or a value its flag does
        not take is a ValueError naming the file and the key."""
        if "config" in config:
            raise ValueError(f"--config {path}: a config file cannot name another (config: {config['config']}); "
                             "put its settings in this one.")
        actions = {action.dest: action for action in self._actions if action.option_strings and action.nargs != 0}
        unknown = [key for key in config if key not in actions]
        self._refuse_not_here(unknown, f"--config {path}: ")
        if unknown:
            raise ValueError(f"--config {path}: unknown key(s) {', '.join(self._closest(unknown))}; its keys are the "
                             f"flags' names (`{self.prog} --help`).")
        as_is = {name: _taken_as_is(hint) for cls in self.dataclass_types
                 for name, hint in typing.get_type_hints(cls).items()}
        values = {}
        for key, value in config.items():
            try:
                values[key] = _flag_value(actions[key], value, as_is.get(key, set()))
            except ValueError as error:
                raise ValueError(f"--config {path}: {key}: {error}") from None
        return values

    def parse_args_into_dataclasses(self, *args, return_remaining_strings: bool = False, **kwargs):
        """HF's, with an unknown flag refused by name and the flags closest to it (HF lists the leftover strings), and
        a dataclass's refusal (RLConfig's checks name fields as Python does) naming each field as its flag."""
        try:
            *parsed, rest = super().parse_args_into_dataclasses(*args, return_remaining_strings=True, **kwargs)
        except ValueError as error:
            error.args = (as_flags(str(error), self.flag_names()),)  # its type kept: callers tell them apart
            raise
        if return_remaining_strings:
            return (*parsed, rest)
        if rest:
            flags = [word for word in rest if word.startswith("-")]
            self._refuse_not_here(flags)
            raise ValueError(f"unknown flag(s) or value(s): {', '.join(self._closest(flags, '--') or rest)}. "
                             f"`{self.prog} --help` lists every flag.")
        return tuple(parsed)

    def _refuse_not_here(self, flags: list[str], where: str = "") -> None:
        """A ValueError saying why, for the first of ``flags`` (--name, --name=value or a YAML key) in ``NOT_HERE``."""
        for flag in flags:
            name = flag.split("=", 1)[0].lstrip("-").replace("-", "_")
            if name in self.NOT_HERE:
                raise ValueError(f"{where}--{name} is not a flag of {self.prog}: {self.NOT_HERE[name]}.")

    def flag_names(self) -> set[str]:
        """The field names this parser has a flag for (``--name``)."""
        return {action.dest for action in self._actions if f"--{action.dest}" in action.option_strings}

    def _closest(self, names: list[str], prefix: str = "") -> list[str]:
        """Each of ``names`` (flags, or YAML keys without ``prefix``) with the one or two flags closest to it."""
        known = [prefix + action.dest for action in self._actions if action.option_strings]
        return [f"{name} (did you mean {' or '.join(close)}?)" if (close := _close_to(name.split("=")[0], known))
                else name for name in names]

    def format_usage(self) -> str:
        # What an error prints above itself: argparse's would list all ~200 flags there.
        return f"usage: {self.prog} [--config FILE.yaml] [--FLAG VALUE ...]   ({self.prog} --help: every flag)\n"

    def format_help(self) -> str:
        formatter = self.formatter_class(prog=self.prog)
        formatter.add_usage(f"{self.prog} [--config FILE.yaml] [--FLAG VALUE ...]", [], [])
        formatter.add_text(self.description)
        for title, actions in sectioned_actions(self.added):
            formatter.start_section(title)
            formatter.add_arguments(actions)
            formatter.end_section()
        return formatter.format_help()


# A bare field name in a message (not part of a flag, a path, a quoted key, an attribute or a call).
_BARE_NAME = re.compile(r"(?<![\w\-'\"\[./$`])[a-z][a-z0-9_]*(?![\w'\"/`(])")


def as_flags(message: str, flags: set[str]) -> str:
    """``message`` (a field's refusal, worded for ``RLConfig(...)``) with each bare field name of ``flags`` written as
    its flag: every name with an underscore, a one-word name (temperature, seed, bf16) where the message
    begins with it or says ``Unknown <name>`` (elsewhere it may be a plain word)."""
    def flag(match: re.Match) -> str:
        name, before = match.group(), message[:match.start()]
        one_word = "_" not in name and not (before == "" or before.endswith("Unknown "))
        return f"--{name}" if name in flags and not one_word else name

    return _BARE_NAME.sub(flag, message)


def _close_to(name: str, known: list[str]) -> list[str]:
    """The one or two of ``known`` that ``name`` most likely meant: those it begins (an abbreviation), else the
    closest spellings."""
    return [flag for flag in known if flag.startswith(name)][:2] or difflib.get_close_matches(name, known, n=2)


def _yaml_config(path: str) -> dict:
    """The mapping in the ``--config`` file ``path``; a file that cannot be read or holds no mapping is a ValueError
    naming it."""
    from verifiers_rl.core.errors import read_yaml

    config = read_yaml(path, "--config")
    if not isinstance(config, dict):
        raise ValueError(f"--config {path} must hold a YAML mapping of flag names to values, got "
                         f"{type(config).__name__}.")
    return config


# Flags whose command-line text is JSON: a YAML value of the type is taken as that text (the mixture's list as is).
STRUCTURED_TEXT = {"env": (list, "a list of mixture entries"), "eval_env": (list, "a list of mixture entries"),
                   "env_args": (dict, "a mapping"), "eval_env_args": (dict, "a mapping")}
# By the name of the flag's converter (TRL wraps an optional field's, keeping the name).
EXPECTED = {"int": "an integer", "float": "a number", "string_to_bool": "true or false", "str": "a string"}


def _taken_as_is(hint) -> set[type]:
    """Which of list, dict and None a field's type admits: a YAML list, mapping or null is then the value itself."""
    members = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    return {typing.get_origin(member) or member for member in members} & {list, dict, type(None)}


def _flag_value(action: argparse.Action, value, as_is: set[type]):
    """A YAML ``value`` as ``action``'s flag parses its text (``as_is``: ``_taken_as_is`` of its field); one the
    flag would refuse is a ValueError saying what it takes."""
    many = action.nargs in ("+", "*")  # a list field: the command line's several words
    converter = getattr(action.type, "__name__", "value")
    structured, what = STRUCTURED_TEXT.get(action.dest, (None, ""))
    if type(value) in as_is and not (many and isinstance(value, list)):
        return value
    if type(value) is structured:
        return value if structured is list else json.dumps(value)
    items = value if many and isinstance(value, list) else [value]
    try:
        # The text of a list, a mapping or a YAML boolean would be no value of another flag's (True is no integer).
        if any(isinstance(item, (list, dict)) or isinstance(item, bool) and converter != "string_to_bool"
               for item in items):
            raise ValueError
        parsed = [action.type(str(item)) if action.type else item for item in items]
        if action.choices is not None and any(item not in action.choices for item in parsed):
            raise ValueError
    except (ValueError, TypeError, argparse.ArgumentTypeError):
        expected = (f"one of {', '.join(map(str, action.choices))}" if action.choices is not None
                    else EXPECTED.get(converter, f"a {converter}"))
        expected = f"a list of which each is {expected}" if many else f"{expected} or {what}" if what else expected
        note = ""
        if isinstance(value, bool) and (action.choices is not None or converter == "str"):
            note = " (quote it: YAML reads a bare yes, no, on or off as a boolean)"
        elif action.dest == "env" and isinstance(value, dict):
            note = " (env: is the --env flag here, not TRL's environment variables)"
        raise ValueError(f"expected {expected}, got {value!r}{note}.") from None
    return parsed if many else parsed[0]


def sectioned_actions(actions: list[argparse.Action]) -> list[tuple[str, list[argparse.Action]]]:
    """(title, actions) in ``SECTIONS`` order, then ``OTHER``; actions without a field (``--help``) first."""
    by_name: dict[str, list[argparse.Action]] = {}
    for action in actions:  # a boolean defaulting to True has two flags: --name and --no_name
        by_name.setdefault(action.dest, []).append(action)
    placed = {name for names in SECTIONS.values() for name in names}
    out = [("Command", [a for a in actions if a.dest in ("help", "config")])]
    out += [(title, [a for name in names for a in by_name.get(name, ())]) for title, names in SECTIONS.items()]
    out.append((OTHER, [a for a in actions if a.dest not in placed and a.dest not in ("help", "config")]))
    return [(title, found) for title, found in out if found]


@functools.cache  # read by add_argument for each of ~250 flags
def flag_ranges() -> dict:
    """Every checked number's ``Range`` by flag: RLConfig's (what its validate checks) and the LoRA flags'."""
    from verifiers_rl.config.lora import LoraArguments
    from verifiers_rl.config.rl_config import config_ranges
    from verifiers_rl.core.choices import field_ranges

    return {**config_ranges(), **field_ranges(LoraArguments)}


def _range_text(name: str, choices: dict[str, tuple]) -> str:
    if name in choices:
        return ", ".join(f"`{choice}`" for choice in choices[name])
    allowed = flag_ranges().get(name)
    return "" if allowed is None else str(allowed)


def _default_text(value) -> str:
    if value is MISSING:
        return "(required)"
    return f"`{value}`"


def markdown() -> str:
    """``docs/config.md``: every sectioned field with its default, the command's own default where it differs,
    its choices or range, and its help; then the names of the other inherited fields."""
    from verifiers_rl.config.rl_config import RLConfig, _choices
    from verifiers_rl.cli.train import QUICKSTART, ScriptArguments

    all_fields = {f.name: f for cls in (ScriptArguments, RLConfig) for f in fields(cls) if f.init}
    choices = {**_choices(ScriptArguments), **_choices(RLConfig)}
    for f in fields(ScriptArguments):
        if "choices" in f.metadata:
            choices[f.name] = tuple(f.metadata["choices"])
    lines = [
        "# Configuration reference",
        "",
        "Generated from the code by `python -m verifiers_rl.cli.sections --write docs/config.md` (a test keeps it",
        "equal). Every field is a flag of `verifiers-rl train` (`--name value`) and a key of its `--config` YAML;",
        "`RLConfig(name=value)` in Python. *Command default* is the training command's own default where it differs",
        "from the config's (the CPU quickstart's settings); a live run without `--max_steps` or `--num_train_epochs`",
        "stops after 60 steps (a replay trains `--num_train_epochs` passes over its file: 3 unless set),",
        "and on a machine without a GPU the command sets `use_cpu` itself. A field that tunes another setting (the",
        "vLLM client's without `vllm_server_url`, evaluation's without `eval_strategy`/`eval_steps`, the refill",
        "rounds without `filter_groups`, the probe's without `weight_sync_probe_tokens`, the curriculum's without",
        "a threshold, `dr_grpo_horizon` without `loss_type dr_grpo`, `use_bias_correction_kl` without `beta`, the",
        "reference mix's without `sync_ref_model`, the importance caps without a correction and",
        "`importance_sequence_log_ratio` without a sequence-level one, `num_completions_to_print` without",
        "`print_samples_every`, `log_completions_steps` without a `report_to` backend that shows tables,",
        "`greater_is_better` without a best-checkpoint metric, `project`, `trackio_space_id` and `trackio_bucket_id`",
        "without `report_to trackio`,",
        "`max_tokens_per_microbatch` with padded rows and no prompt sharing; in a replay,",
        "what only live generation reads, and the sampling and engine knobs unless evaluation runs) is refused",
        "when that setting is off: it would change nothing.",
        "",
        "A `--config` value must be one its flag's text could give (`max_steps: 1.5` is refused, naming the file and",
        "the key); `env_args` and `eval_env_args` may be YAML mappings, `env` and `eval_env` a mixture's list. A",
        "mapping `env:` (TRL's environment variables) is refused: `env` is the `--env` flag here.",
    ]
    for title, names in SECTIONS.items():
        lines += ["", f"## {title}", "", "| field | default | command default | choices / range | what it does |",
                  "| --- | --- | --- | --- | --- |"]
        for name in names:
            f = all_fields[name]
            default = f.default if f.default_factory is MISSING else f.default_factory()
            command = f"`{QUICKSTART[name]}`" if name in QUICKSTART and QUICKSTART[name] != default else ""
            text = HELP_HERE.get(name) or str(f.metadata.get("help", ""))
            text = " ".join(text.split()).replace("%%", "%").replace("|", "\\|")
            lines.append(f"| `{name}` | {_default_text(default)} | {command} | {_range_text(name, choices)} | {text} |")
    placed = {name for names in SECTIONS.values() for name in names}
    others = sorted(name for name in all_fields if name not in placed and not name.startswith("_"))
    lines += ["", f"## {OTHER}", "", ", ".join(f"`{name}`" for name in others), ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--write"] and len(argv) == 2:
        try:
            with open(argv[1], "w") as handle:
                handle.write(markdown())
        except OSError as error:  # a user's mistake: one line, not a traceback
            print(f"verifiers-rl config: --write {argv[1]}: cannot write the file ({error.strerror}).", file=sys.stderr)
            return 2
        return 0
    if argv in (["-h"], ["--help"]):
        print("verifiers-rl config [--write FILE]: the configuration reference by section (docs/config.md), printed "
              "or written to FILE.")
        return 0
    if argv:  # else ignored: the reference would print as if they had done something
        print(f"verifiers-rl config takes no arguments but --write FILE, got {' '.join(argv)}", file=sys.stderr)
        return 2
    print(markdown())
    return 0


if __name__ == "__main__":
    sys.exit(main())
