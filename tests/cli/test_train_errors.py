"""``verifiers-rl train`` refuses, in one line naming the flag (exit status 2, no traceback), what the run would not
read or cannot load: an environment flag beside a replay or without evaluation, --env_args that is not a JSON object,
an argument the loader refuses or has the wrong type for, a mixture entry's curriculum beside continuous generation."""

from __future__ import annotations

import json
import shutil
import socket
from pathlib import Path

import pytest

from verifiers_rl.cli.train import main

from tests.helpers.launches import RAISING_ENV, with_flags
from tests.helpers.model_folders import a_model_in_a_subfolder

SMALL = ["--max_steps", "1", "--rollouts_per_step", "4", "--num_generations", "2", "--print_samples_every", "0"]


def refusal(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as stopped:
        main(argv)
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and "Traceback" not in err, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("verifiers-rl train: error: "), last
    return last.removeprefix("verifiers-rl train: error: ")


def given(flags: list[str], tmp_path) -> list[str]:
    """``flags`` as the command takes them: ["--config", "YAML text"] becomes a file in ``tmp_path`` that it names."""
    if flags[0] != "--config":
        return flags
    (tmp_path / "run.yaml").write_text(flags[1])
    return ["--config", str(tmp_path / "run.yaml")]


@pytest.mark.parametrize("flags, message", [
    (["--rollouts_path", "r.jsonl", "--env_args", '{"num_examples": 8}'], "--env_args {\"num_examples\": 8} is not "
     "used by this run: --env is not loaded: a replay of --rollouts_path generates nothing"),
    (["--rollouts_path", "r.jsonl", "--env", "arithmetic"], "--env arithmetic is not used by this run"),
    (["--rollouts_path", "r.jsonl", "--tool_mode", "text"], "--tool_mode text is not used by this run: a replay"),
    (["--rollouts_path", "r.jsonl", "--eval_steps", "1", "--eval_env", "arithmetic", "--env", "calculator"],
     "--env calculator is not used by this run"),
    (["--eval_env", "arithmetic"], "--eval_env arithmetic is not used by this run: no evaluation runs"),
    (["--eval_steps", "1", "--eval_env_args", '{"num_examples": 3}'], "--eval_env_args {\"num_examples\": 3} is not "
     "used by this run: it is --eval_env's"),
    (["--env_args", "[1, 2]"], "--env_args must be a JSON object of the loader's keyword arguments"),
    (["--rollouts_path", "r.jsonl", "--top_p", "0.5"], "--top_p 0.5 acts only with an inference engine"),
])
def test_a_flag_the_run_would_not_read_is_refused_before_anything_loads(flags, message, tmp_path, capsys):
    assert refusal(["--model", "tiny", "--output_dir", str(tmp_path), *SMALL, *flags], capsys).startswith(message)


@pytest.mark.parametrize("steps", ["3", "10"])  # 10: the field's default, refused too when given
def test_logging_steps_beside_another_logging_strategy_is_refused(steps, tmp_path, capsys):
    # HF reads logging_steps only with --logging_strategy steps: it was accepted and logged nothing differently.
    argv = ["--model", "tiny", "--output_dir", str(tmp_path), *SMALL, "--logging_strategy", "epoch",
            "--logging_steps", steps]
    assert refusal(argv, capsys) == (f"--logging_steps {steps} acts only with --logging_strategy steps, not epoch: "
                                     "it would change nothing. Set --logging_strategy steps, or leave --logging_steps "
                                     "out.")
    assert main(["--model", "tiny", "--output_dir", str(tmp_path), *SMALL, "--logging_strategy", "no"]) == 0


@pytest.mark.parametrize("evaluation", [[], ["--eval_steps", "1", "--eval_num_examples", "2", "--eval_env", "arithmetic"]])
def test_a_tool_mode_no_environment_reads_is_refused(evaluation, tiny_model_dir, tmp_path, capsys):
    # Only tool environments read --tool_mode (tests/envs/test_tools.py: calculator does); neither of these has tools.
    argv = ["--model", tiny_model_dir, "--output_dir", str(tmp_path), *SMALL, "--env", "reverse_text", "--tool_mode",
            "text", *evaluation]
    assert refusal(argv, capsys).startswith("--tool_mode text is not used by this run: no environment it loads "
                                            "renders tools")


@pytest.mark.parametrize("env_args, message", [
    ({"num_examples": "ten"}, "--env reverse_text: 'str' object cannot be interpreted as an integer (its "
                              "arguments come from --env_args)"),
    ({"bogus": 1}, "Environment 'reverse_text' takes no argument 'bogus'"),
])
def test_an_argument_the_environment_cannot_take_is_one_line(env_args, message, tiny_model_dir, tmp_path, capsys):
    argv = ["--model", tiny_model_dir, "--output_dir", str(tmp_path), *SMALL, "--env_args", json.dumps(env_args)]
    assert refusal(argv, capsys).startswith(message)


def test_an_eval_mixtures_weights_and_curriculum_are_refused(tiny_model_dir, tmp_path, capsys):
    # Evaluation rolls out every entry's held-out rows: a weight or curriculum steers nothing there.
    mixture = [{"env": "reverse_text", "weight": 5, "curriculum": {"easy_above": 0.5}}, {"env": "arithmetic"}]
    argv = ["--model", tiny_model_dir, "--output_dir", str(tmp_path), *SMALL, "--eval_steps", "1",
            "--eval_num_examples", "2", "--eval_env", json.dumps(mixture)]
    assert refusal(argv, capsys).startswith("--eval_env entries' curriculum and weight steer training's draws")


def test_a_mixture_entrys_curriculum_beside_continuous_generation_is_refused(tiny_model_dir, tmp_path, capsys):
    # Continuous generation has no curriculum: the entry's thresholds were dropped before.
    mixture = [{"env": "reverse_text", "curriculum": {"easy_above": 0.9}}, {"env": "arithmetic"}]
    argv = ["--model", tiny_model_dir, "--output_dir", str(tmp_path), *SMALL, "--env", json.dumps(mixture),
            "--groups_in_flight", "2"]
    assert refusal(argv, capsys).startswith("--groups_in_flight 2 (continuous generation) does not combine with a "
                                            "curriculum (--env entries' curriculum: thresholds)")


@pytest.mark.parametrize("layout, message", [
    (None, "no such folder, and it is not a Hugging Face Hub id"),
    ([], "has no model weights: no weight files"),
    (["checkpoint-3/"], "has no model weights: it holds checkpoints; pass one of them, e.g. --model "),
    (["config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"], "has no model weights"),
    (["config.json", "model.safetensors"], "has no tokenizer (tokenizer.json, tokenizer_config.json, "
                                           "tokenizer.model); train from a folder that has one."),
])
def test_a_model_folder_that_holds_no_model_is_one_line(layout, message, tiny_model_dir, tmp_path, capsys):
    # These came as a FileNotFoundError or OSError traceback, or transformers' five lines about sentencepiece.
    folder = tmp_path / "model"
    for name in layout or []:
        if name.endswith("/"):
            (folder / name).mkdir(parents=True)
        else:
            folder.mkdir(exist_ok=True)
            shutil.copy(f"{tiny_model_dir}/{name}", folder / name)
    if layout == []:
        folder.mkdir()
    argv = ["--model", str(folder), "--output_dir", str(tmp_path / "out"), *SMALL]
    line = refusal(argv, capsys)
    assert line.startswith(f"--model {str(folder)!r}") and message in line, line


def test_a_model_in_a_subfolder_trains_with_its_own_tokenizer(tiny_model_dir, tmp_path):
    # Refused as "no model weights" (the folder's top was checked), and the tokenizer came from the top.
    root = a_model_in_a_subfolder(tiny_model_dir, tmp_path / "repo")
    main(["--model", str(root), "--model_init_kwargs", '{"subfolder": "sub"}', "--output_dir", str(tmp_path / "out"),
          *SMALL])
    assert (tmp_path / "out" / "chat_template.jinja").read_text() == (root / "sub" / "chat_template.jinja").read_text()


def test_a_hub_id_that_cannot_be_loaded_is_one_line(monkeypatch, tmp_path, capsys):
    # Offline (as HF_HUB_OFFLINE=1 makes it) the Hub is not asked; transformers' error came as an OSError traceback.
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    argv = ["--model", "no-such-org/no-such-model", "--output_dir", str(tmp_path / "out"), *SMALL]
    assert refusal(argv, capsys).startswith("--model 'no-such-org/no-such-model' is not a folder here, and loading "
                                            "it as a Hugging Face Hub id failed: ")


@pytest.mark.parametrize("flags, message", [
    (["--num_generations", "3"], "--num_generations 3 is not used by this run: a replay of --rollouts_path takes its "
                                 "groups from the file"),
    (["--max_completion_length", "8"], "--max_completion_length 8 is not used by this run: a replay of "
                                       "--rollouts_path without evaluation samples nothing"),
])
def test_generation_sizes_beside_a_replay_are_refused(flags, message, tmp_path, capsys):
    argv = ["--model", "tiny", "--output_dir", str(tmp_path), "--rollouts_path", "r.jsonl", "--max_steps", "1", *flags]
    assert refusal(argv, capsys).startswith(message)


def test_engine_knobs_beside_a_replay_are_refused_by_the_command_which_builds_no_engine():
    from verifiers_rl.config.rl_config import RLConfig

    # RLTrainer's caller may hand it an engine beside a replay (its weights synced, evaluated): the config takes them.
    config = RLConfig(output_dir="/tmp/unused", report_to="none", rollouts_path="r.jsonl", top_p=0.5,
                      generation_timeout_s=100.0)
    assert (config.top_p, config.generation_timeout_s) == (0.5, 100.0)
    with pytest.raises(ValueError, match=r"^--top_p 0.5 acts only with an inference engine: live generation or "
                                         r"evaluation; a replay of --rollouts_path without evaluation builds none"):
        config.check_engine_knobs()


@pytest.mark.parametrize("flags, message", [
    (["--groups_in_fligt", "3"], "unknown flag(s) or value(s): --groups_in_fligt (did you mean --groups_in_flight?)"),
    (["--max_stepz=2", "--nosuch"],
     "unknown flag(s) or value(s): --max_stepz=2 (did you mean --max_steps or --save_steps?), --nosuch."),
    (["--env", "[]"], "--env: a mixture is a non-empty list of entries"),
    (["--loss_type", "foo"], "argument --loss_type/--loss-type: invalid choice: 'foo'"),
])
def test_a_usage_error_is_two_lines_not_the_usage_of_every_flag(flags, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as stopped:
        main(["--model", "tiny", "--output_dir", str(tmp_path), *SMALL, *flags])
    lines = capsys.readouterr().err.strip().splitlines()
    assert stopped.value.code == 2 and lines[-1].startswith(f"verifiers-rl train: error: {message}"), lines[-3:]
    # argparse's errors print the usage above them: one line here, not the ~200 flags (--help lists them).
    assert len([line for line in lines if "WARNING" not in line]) <= 2, lines


@pytest.mark.parametrize("flags, message", [
    (["--generation_kwargs", "notjson"], "--generation_kwargs must be a dict (a JSON object on the command line), got "
                                         "'notjson'."),
    (["--eval_num_examples", "0"], "--eval_num_examples must be >= 1, got 0."),
    (["--temperature", "0"], "--temperature must be > 0, got 0.0."),
    (["--seed", "-1"], "--seed must be >= 0, got -1."),
    (["--top_p", "2"], "--top_p must be in (0, 1], got 2.0."),
    (["--ddp_timeout", "10"], "--ddp_timeout (10 s) must exceed --generation_timeout_s (600 s)"),
    (["--importance_cap_min", "3"], "--importance_cap_min must satisfy 0 <= --importance_cap_min < --importance_cap."),
    (["--generation_kwargs", '{"seed": 1}'], "--generation_kwargs['seed'] is refused: each rollout's seed derives "
                                             "from --seed. Accepted keys: 'temperature', 'top_p', "),
    (["--vllm_importance_sampling_mode", "foo"], "Unknown --vllm_importance_sampling_mode 'foo'; expected one of"),
    (["--pad_to_multiple_of", "8"], "--pad_to_multiple_of='8' has no effect in verifiers_rl"),
    (["--reward_weights", "nan"], "--reward_weights must be a list of finite numbers"),
    (["--model_init_kwargs", "notjson"], "--model_init_kwargs must be a dict of keyword arguments (a JSON object on "
                                         "the command line), got 'notjson'."),  # a TypeError traceback at the engine
    (["--generation_kwargs", "{bad"], "--generation_kwargs is not valid JSON (Expecting property name enclosed in "
                                      "double quotes: line 1 column 2 (char 1)): {bad"),  # named no flag
    (["--max_steps", "-1", "--num_train_epochs", "0"], "--num_train_epochs=0.0 of "),  # RLTrainer's check
    # HF's max_steps overrides it: the run trained 1 step and said nothing.
    (["--max_steps", "1", "--num_train_epochs", "2"], "--num_train_epochs 2.0 is not used by this run: --max_steps 1 "
                                                      "sets the run's length"),
    # transformers ignores a revision beside a local folder: the folder's files trained, not the revision.
    (["--model_init_kwargs", '{"revision": "v2"}'], "--model_init_kwargs revision 'v2' acts only on a Hub id, and "),
    (["--resume_from_checkpoint", ""], "--resume_from_checkpoint is empty; pass a checkpoint folder, 'latest' or "
                                       "'auto', or leave it out to start afresh."),  # it started afresh
])
def test_a_fields_refusal_names_the_flag_as_typed(flags, message, tmp_path, capsys):
    # RLConfig's checks name a field as Python does (generation_kwargs); the command names its flag.
    argv = with_flags(["--model", "tiny", "--output_dir", str(tmp_path), *SMALL], flags)
    assert refusal(argv, capsys).startswith(message)


def test_a_fields_refusal_keeps_its_python_wording_outside_the_command(tmp_path):
    from verifiers_rl.cli.sections import as_flags
    from verifiers_rl.config.rl_config import RLConfig

    with pytest.raises(ValueError, match=r"^eval_num_examples must be >= 1, got 0\.$"):
        RLConfig(output_dir=str(tmp_path), report_to="none", eval_num_examples=0)
    # Only names of flags, outside quotes, paths and attributes; a one-word name only where it begins the message.
    text = ("seed and max_steps: 'max_steps', a/max_steps, config.max_steps, max_stepsx, max_steps(), the seed, "
            "no_flag, bf16 autocast")
    assert as_flags(text, {"seed", "max_steps", "bf16"}) == (
        "--seed and --max_steps: 'max_steps', a/max_steps, config.max_steps, max_stepsx, max_steps(), the seed, "
        "no_flag, bf16 autocast")


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc, where nothing can be created")
@pytest.mark.parametrize("flag, path, what", [("--output_dir", "/proc/x/run", "the folder"),
                                              ("--save_rollouts_path", "/proc/x.jsonl", "the file")])
def test_a_path_the_run_cannot_create_is_refused_naming_its_flag(flag, path, what, tmp_path, capsys):
    # --output_dir failed at the trainer with a bare "[Errno 2] ..."; --save_rollouts_path, after a step, a traceback.
    argv = with_flags(["--model", "tiny", "--output_dir", str(tmp_path), *SMALL], [flag, path])
    line = refusal(argv, capsys)
    assert line.startswith(f"{flag} {path}: cannot create or write {what} (") and "pass a path" in line, line


def test_an_empty_output_dir_is_refused_naming_it(tmp_path, capsys):
    # It said "[Errno 2] No such file or directory: ''" at the trainer, after the model and environment loaded.
    argv = ["--model", "tiny", *SMALL, "--output_dir", ""]
    assert refusal(argv, capsys) == "--output_dir is empty; pass a folder (. for the working one)."


def test_the_probe_of_a_path_leaves_nothing_behind(tmp_path):
    from verifiers_rl.core.paths import probe_writable

    probe_writable(tmp_path / "a" / "b" / "seen.jsonl", is_file=True)
    probe_writable(tmp_path / "c" / "d", is_file=False)
    (tmp_path / "kept.jsonl").write_text("a line\n")
    probe_writable(tmp_path / "kept.jsonl", is_file=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept.jsonl"]
    assert (tmp_path / "kept.jsonl").read_text() == "a line\n"


@pytest.mark.parametrize("name, flags, why", [
    ("load_in_4bit", ["--load_in_4bit"], "bitsandbytes quantization needs CUDA and is not supported"),
    ("load_in_8bit", ["--load-in-8bit", "true"], "bitsandbytes quantization needs CUDA and is not supported"),
    ("bnb_4bit_quant_type", ["--bnb_4bit_quant_type", "fp4"], "bitsandbytes quantization"),
    ("use_bnb_nested_quant", ["--use_bnb_nested_quant"], "bitsandbytes quantization"),
    ("bnb_4bit_quant_storage", ["--bnb_4bit_quant_storage", "uint8"], "bitsandbytes quantization"),
    ("model_name_or_path", ["--model_name_or_path", "tiny"], "it is TRL's name for --model: pass --model "),
    ("model_revision", ["--model_revision=v1"], "download the revision (hf download MODEL --revision REV --local-dir"),
    ("dtype", ["--dtype", "bfloat16"], "the weights train in float32; --bf16 turns bf16 mixed precision on"),
    ("torch_dtype", ["--torch_dtype", "bfloat16"], "the weights train in float32; --bf16"),
    ("attn_implementation", ["--attn_implementation", "eager"], "pass it in --model_init_kwargs "),
    ("dataset_name", ["--dataset_name", "trl-lib/tldr"], "this command trains on an environment (--env) or a rollout"),
    ("reward_funcs", ["--reward_funcs", "accuracy_reward"], "rewards come from the environment's rubric (--env)"),
    ("logging_dir", ["--logging_dir", "logs"], "transformers 5 has no such argument"),
    ("model_name_or_path", ["--config", "model_name_or_path: tiny"], "it is TRL's name for --model"),
])
def test_trl_script_flags_are_refused_by_name_with_what_to_use(name, flags, why, tmp_path, capsys):
    # `trl grpo` takes them; the command said only "unknown flag(s)". The quantization flags: no CUDA, no bitsandbytes.
    line = refusal(["--model", "tiny", "--output_dir", str(tmp_path), *SMALL, *given(flags, tmp_path)], capsys)
    assert f"--{name} is not a flag of verifiers-rl train: {why}" in line, line


def test_every_flag_of_trls_grpo_command_is_ours_or_refused_by_name():
    from dataclasses import fields

    from trl import DatasetMixtureConfig, ModelConfig, ScriptArguments
    from trl.scripts.grpo import GRPOScriptArguments

    from verifiers_rl.cli.train import TRL_SCRIPT_FLAGS, build_parser

    ours = build_parser().flag_names()
    theirs = {f.name for cls in (ModelConfig, ScriptArguments, GRPOScriptArguments, DatasetMixtureConfig)
              for f in fields(cls)}
    assert sorted(theirs - ours - set(TRL_SCRIPT_FLAGS)) == []  # a TRL upgrade's new flag gets its line
    assert not set(TRL_SCRIPT_FLAGS) & ours


@pytest.mark.parametrize("rank, printed", [("0", True), ("1", False)])
def test_help_under_a_launch_of_two_processes_is_printed_once(rank, printed, monkeypatch, capsys):
    # accelerate launch sets each process's RANK and WORLD_SIZE (a real 2-process launch takes longer than this test
    # may): every rank printed the ~250 flags; now rank 0 alone does, and every rank exits 0.
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", rank)
    with pytest.raises(SystemExit) as stopped:
        main(["--help"])
    out = capsys.readouterr().out
    assert stopped.value.code == 0 and ("--max_steps" in out) is printed, out[:300]


@pytest.mark.parametrize("flag, whole", [("--max_step", "--max_steps"), ("--temp", "--temperature")])
def test_an_abbreviated_flag_is_refused_not_taken_for_the_flag_it_begins(flag, whole, tmp_path, capsys):
    # argparse took a prefix for the whole flag: --max_step 2 trained 2 steps, and a typo set whichever flag it began.
    argv = ["--model", "tiny", "--output_dir", str(tmp_path), *SMALL, flag, "2"]
    assert refusal(argv, capsys).startswith(f"unknown flag(s) or value(s): {flag} (did you mean {whole}?)")


@pytest.mark.parametrize("flags, message", [
    (["--learning_rate", "1e-5", "--max_steps", "1", "--learning_rate=1e-3"], "--learning_rate given twice; "),
    (["--max_steps", "1", "--max-steps", "2"], "--max_steps given twice (as --max_steps, then --max-steps); "),
    (["--report_to", "none", "--report_to", "tensorboard"], "--report_to given twice; "),
])
def test_a_flag_given_twice_is_refused_not_its_last_value_taken(flags, message, tmp_path, capsys):
    # argparse kept the last value and said nothing: --learning_rate 1e-5 ... --learning_rate=1e-3 trained at 1e-3.
    argv = ["--model", "tiny", "--output_dir", str(tmp_path), *SMALL[2:], *flags]
    assert refusal(argv, capsys) == message + ("argparse would keep the last value: give it once (a list flag takes "
                                               "its values after one flag).")


def test_a_list_flags_values_and_a_config_value_the_command_line_overrides_are_one_use(tmp_path):
    from verifiers_rl.cli.train import build_parser

    (tmp_path / "run.yaml").write_text("max_steps: 3\n")
    script_args, config = build_parser().parse_args_and_config(
        ["--config", str(tmp_path / "run.yaml"), "--max_steps", "2", "--output_dir", str(tmp_path), "--use_peft",
         "--lora_target_modules", "q_proj", "v_proj"])
    assert config.max_steps == 2 and script_args.lora_target_modules == ["q_proj", "v_proj"]


@pytest.mark.parametrize("argv, bf16", [(["--bf16"], True), (["--bf16", "false"], False), (["--bf16", "true"], True),
                                        ([], None)])
def test_bf16_is_a_switch_as_fp16_is(argv, bf16):
    # HF gives a bool | None field no value of its own (bare --bf16 said "expected one argument"); unset, the launch's
    # mixed precision decides (None).
    from verifiers_rl.cli.train import build_parser

    assert build_parser().parse_known_args(["--model", "tiny", *argv])[0].bf16 is bf16


@pytest.mark.parametrize("name, switch, instead", [
    ("do_train", ["--do_train"], "training always runs"),
    ("do_eval", ["--do-eval", "false"], "evaluation runs with --eval_strategy steps or epoch, or --eval_steps N"),
    ("do_predict", ["--config", "do_predict: true"], "nothing predicts on a test set here"),
])
def test_a_switch_for_scripts_is_refused_by_the_command_which_reads_none(name, switch, instead, tmp_path, capsys):
    # TrainingArguments' do_* are for a script of one's own to read: the command accepted them and did nothing.
    line = refusal(["--model", "tiny", "--output_dir", str(tmp_path), *SMALL, *given(switch, tmp_path)], capsys)
    assert line.startswith(f"--{name} does nothing here: it is a switch for a script of your own to read") \
        and instead in line, line


def test_the_script_switches_keep_their_defaults_when_not_given(tmp_path):
    from verifiers_rl.cli.train import build_parser

    _, config = build_parser().parse_args_and_config(args=["--output_dir", str(tmp_path), "--eval_steps", "2"])
    assert (config.do_train, config.do_eval, config.do_predict) == (False, True, False)  # do_eval: HF's, evaluating


@pytest.mark.parametrize("text, message", [
    ("model: tiny\nmax_stepz: 2\nnosuch: 1\n", "unknown key(s) max_stepz (did you mean max_steps or save_steps?), "
                                               "nosuch; its keys are the flags' names"),
    ("model: tiny\n  max_steps: [2\n", "is not valid YAML: mapping values are not allowed here"),
    ("- model\n- tiny\n", "must hold a YAML mapping of flag names to values, got list."),
    (None, "cannot read the file (No such file or directory)."),
    ("config: other.yaml\n", "a config file cannot name another (config: other.yaml)"),
])
def test_a_config_file_that_cannot_be_used_is_one_line_naming_it(text, message, tmp_path, capsys):
    path = tmp_path / "run.yaml"
    if text is not None:
        path.write_text(text)
    last = refusal(["--config", str(path), "--output_dir", str(tmp_path)], capsys)
    assert last.startswith(f"--config {path}") and message in last, last


@pytest.mark.parametrize("text, message", [
    ("max_steps: [2, 3]", "max_steps: expected an integer, got [2, 3]."),
    ("max_steps: true", "max_steps: expected an integer, got True."),
    ("seed: 1.5", "seed: expected an integer, got 1.5."),
    ("num_generations: 2.0", "num_generations: expected an integer, got 2.0."),
    ("groups_in_flight: 1.5", "groups_in_flight: expected an integer, got 1.5."),
    ("temperature: [0.5]", "temperature: expected a number, got [0.5]."),
    ("use_cpu: 3", "use_cpu: expected true or false, got 3."),
    ("loss_type: [grpo]", "loss_type: expected one of grpo, dr_grpo, token_mean, seq_mean_token_sum, dapo, bnpo, got "
                          "['grpo']."),
    ("share_prompt_training: off", "share_prompt_training: expected one of auto, on, off, got False (quote it: YAML "
                                   "reads a bare yes, no, on or off as a boolean)."),
    ("reward_weights: [1, a]", "reward_weights: expected a list of which each is a number, got [1, 'a']."),
    ("env_args: [1]", "env_args: expected a string or a mapping, got [1]."),
    # TRL reads a mapping env: as environment variables to set; here env: is --env, and nothing promises those.
    ("env: {CUDA_VISIBLE_DEVICES: 0}", "env: expected a string or a list of mixture entries, got "
                                       "{'CUDA_VISIBLE_DEVICES': 0} (env: is the --env flag here, not TRL's "
                                       "environment variables)."),
])
def test_a_config_value_its_flag_would_not_take_is_one_line_naming_the_file_and_key(text, message, tmp_path, capsys):
    path = tmp_path / "run.yaml"
    path.write_text(f"model: tiny\n{text}\n")
    assert refusal(["--config", str(path), "--output_dir", str(tmp_path)], capsys) == f"--config {path}: {message}"


@pytest.mark.parametrize("text, name, value", [
    ("max_steps: 3", "max_steps", 3),
    ("temperature: 1", "temperature", 1.0),
    ("learning_rate: 1.0e-5", "learning_rate", 1e-5),
    ("bf16: false", "bf16", False),
    ("loss_type: dr_grpo", "loss_type", "dr_grpo"),
    ("share_prompt_training: 'off'", "share_prompt_training", "off"),
    ("reward_weights: [1, 0.5]", "reward_weights", [1.0, 0.5]),
    ("report_to: [tensorboard]", "report_to", ["tensorboard"]),
    ("generation_kwargs: {top_p: 0.9}", "top_p", 0.9),
    ("eval_env: null", "eval_env", None),
    ("env_args: {num_examples: 8}", "env_args", '{"num_examples": 8}'),
    ("eval_env_args: {num_examples: 8}", "eval_env_args", '{"num_examples": 8}'),
    ("env_args: '{\"num_examples\": 8}'", "env_args", '{"num_examples": 8}'),
    ("env: [{env: reverse_text}, {env: arithmetic}]", "env", [{"env": "reverse_text"}, {"env": "arithmetic"}]),
    ("use_peft: true", "use_peft", True),
    ("lora_target_modules: [q_proj, v_proj]", "lora_target_modules", ["q_proj", "v_proj"]),
    ("lora_dropout: 0", "lora_dropout", 0.0),
])
@pytest.mark.parametrize("config_flag", [["--config", "{}"], ["--config={}"]])
def test_a_config_value_its_flag_takes_is_parsed_as_the_flag_would(text, name, value, config_flag, tmp_path):
    from verifiers_rl.cli.train import build_parser

    path = tmp_path / "run.yaml"
    path.write_text(f"model: tiny\n{text}\n")
    script_args, config = build_parser().parse_args_and_config(
        args=[word.format(path) for word in config_flag] + ["--output_dir", str(tmp_path)])
    parsed = getattr(script_args, name) if hasattr(script_args, name) else getattr(config, name)
    assert parsed == value and type(parsed) is type(value), parsed
    assert script_args.model == "tiny"


@pytest.mark.parametrize("flags, yaml, batch", [
    ([], "", 16),  # the command's own default
    (["--gradient_accumulation_steps", "2", "--per_device_train_batch_size", "4"], "", 8),
    ([], "gradient_accumulation_steps: 3\nper_device_train_batch_size: 4", 12),
    (["--gradient_accumulation_steps", "2"], "rollouts_per_step: 16", 16),  # 8 x 2 agrees with the one given
])
def test_gradient_accumulation_steps_sizes_the_batch_the_command_was_not_given(flags, yaml, batch, tmp_path):
    # It met the command's default of 16 and was refused for disagreeing with a --rollouts_per_step never given.
    from verifiers_rl.cli.train import build_parser

    (tmp_path / "run.yaml").write_text(f"model: tiny\n{yaml}\n")
    _, config = build_parser().parse_args_and_config(
        args=["--config", str(tmp_path / "run.yaml"), "--output_dir", str(tmp_path), *flags])
    assert config.rollouts_per_step == batch and type(config.rollouts_per_step) is int


def test_gradient_accumulation_steps_beside_a_batch_it_disagrees_with_is_one_line(tmp_path, capsys):
    assert refusal(["--model", "tiny", "--output_dir", str(tmp_path), "--rollouts_per_step", "16",
                    "--gradient_accumulation_steps", "3", "--per_device_train_batch_size", "2"], capsys).startswith(
        "--gradient_accumulation_steps 3 sizes the batch: --per_device_train_batch_size 2 x "
        "--gradient_accumulation_steps x 1 process = 6 rollouts, but --rollouts_per_step is 16")


def test_config_without_its_file_is_one_line(tmp_path, capsys):
    assert refusal(["--output_dir", str(tmp_path), "--config"], capsys) == "--config needs a file: --config FILE.yaml"


def test_config_given_twice_is_one_line(tmp_path, capsys):
    # The second file was an unknown flag before --config was declared (for --help), and then a namespace too many.
    path = tmp_path / "run.yaml"
    path.write_text("model: tiny\n")
    argv = ["--output_dir", str(tmp_path), "--config", str(path), f"--config={path}"]
    assert refusal(argv, capsys) == "--config given twice: name one file (the command line overrides its values)."


@pytest.mark.parametrize("source, line, error", [
    ("def load_environment(**kwargs):\n    return int('12a')\n", 2, "ValueError"),  # the user's bug, not a usage error
    ("def load_environment(**kwargs):\n    raise RuntimeError('no rows')\n", 2, "RuntimeError"),
    ("def load_environment(**kwargs)\n    return 1\n", 1, "SyntaxError"),
    ("import no_such_module_xyz\n", 1, "ModuleNotFoundError"),
    ("def load_environment(**kwargs):\n    return {}['rows']\n", 2, "KeyError"),
])
@pytest.mark.parametrize("flag", ["--env", "--eval_env"])
def test_an_environment_file_that_fails_to_load_is_one_line_saying_where(source, line, error, flag, tiny_model_dir,
                                                                          tmp_path, capsys):
    path = tmp_path / "broken_env.py"
    path.write_text(source)
    evaluation = ["--eval_steps", "1", "--eval_num_examples", "2"] if flag == "--eval_env" else []
    argv = ["--model", tiny_model_dir, "--output_dir", str(tmp_path), *SMALL, flag, str(path), *evaluation]
    last = refusal(argv, capsys)
    assert last.startswith(f"{flag} {path}: loading it raised {error} at {path.resolve()}:{line}: "), last
    assert "--env_args" not in last  # none were given: no hint that they are wrong


def test_an_environment_file_that_does_not_exist_is_one_line(tiny_model_dir, tmp_path, capsys):
    argv = ["--model", tiny_model_dir, "--output_dir", str(tmp_path), *SMALL, "--env", "missing_env.py"]
    assert refusal(argv, capsys) == "--env missing_env.py: Environment file 'missing_env.py' does not exist."


def test_a_tokenizer_in_env_args_is_refused_the_loader_gets_the_policys(tiny_model_dir, tmp_path, capsys):
    argv = ["--model", tiny_model_dir, "--output_dir", str(tmp_path), *SMALL, "--env_args", '{"tokenizer": "gpt2"}']
    assert refusal(argv, capsys).startswith("Environment 'reverse_text': 'tokenizer' cannot be one of its arguments "
                                            "(--env_args): the policy's tokenizer is passed")


def test_an_environment_failing_mid_run_ends_it_in_one_line_with_the_users_line(tiny_model_dir, tmp_path, capsys):
    path = tmp_path / "talk_env.py"
    path.write_text(RAISING_ENV)
    argv = ["--model", tiny_model_dir, "--output_dir", str(tmp_path / "out"), *SMALL, "--env", str(path),
            "--max_rollout_retries", "2"]
    assert main(argv) == 1  # a run that failed, not a usage error
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert "Traceback" not in err and last.startswith("verifiers-rl train: error: Batch 0: "), err[-3000:]
    assert "raised TypeError in the environment's code (not retried" in last  # once, not --max_rollout_retries more
    assert last.endswith(f"(raised at {path.resolve()}:4)"), last


def test_a_fresh_run_into_an_output_dir_holding_checkpoints_is_refused(tiny_model_dir, tmp_path, capsys):
    # Its checkpoints would overwrite the earlier run's, and rotation (newest by step) would delete its own first.
    out = tmp_path / "out"
    for step in (2, 10):
        (out / f"checkpoint-{step}").mkdir(parents=True)
    assert main(["--model", tiny_model_dir, "--output_dir", str(out), *SMALL]) == 1
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last == (f"verifiers-rl train: error: --output_dir {str(out)!r} holds checkpoints of an earlier run "
                    "(checkpoint-2 to checkpoint-10): a new run there would write over them. Continue that run with "
                    "--resume_from_checkpoint latest (or auto), or train into another --output_dir."), last
    assert sorted(path.name for path in out.iterdir()) == ["checkpoint-10", "checkpoint-2"]  # nothing written


def test_a_resume_that_does_not_fit_is_one_line(tiny_model_dir, tmp_path, capsys):
    # A CheckpointError raised in train() came with a traceback (only an --output_dir in use was a line).
    argv = ["--model", tiny_model_dir, "--output_dir", str(tmp_path / "out"), *SMALL]
    assert main([*argv, "--resume_from_checkpoint", str(tmp_path / "nowhere")]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err, err[-3000:]
    assert err.strip().splitlines()[-1] == (f"verifiers-rl train: error: --resume_from_checkpoint "
                                            f"{str(tmp_path / 'nowhere')!r}: no such folder.")


def test_no_vllm_server_at_the_url_is_one_error_line(capsys, tmp_path):
    # A connection refused at once (nothing listens on the port): the start-up check raised a VLLMError traceback.
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    message = refusal(["--model", "tiny", *SMALL, "--vllm_server_url", f"http://127.0.0.1:{port}",
                       "--vllm_server_timeout", "0", "--output_dir", str(tmp_path / "run")], capsys)
    assert message.startswith(f"No vLLM server at http://127.0.0.1:{port}") and "vllm-serve" in message, message


@pytest.mark.parametrize("flags, message", [
    (["--lora_r", "8"], "--lora_r 8: it acts only with --use_peft (LoRA); add --use_peft, or leave it out"),
    (["--use_peft", "false", "--use_dora", "--lora_alpha", "8"], "--lora_alpha 8, --use_dora: they act only with "
                                                                   "--use_peft (LoRA)"),
    (["--use_peft", "--lora_r", "0"], "--lora_r must be >= 1, got 0."),
    (["--use_peft", "--lora_alpha", "0"], "--lora_alpha must be > 0, got 0."),
    (["--use_peft", "--lora_dropout", "1"], "--lora_dropout must be < 1, got 1.0."),
    (["--use_peft", "--lora_dropout", "-0.1"], "--lora_dropout must be >= 0, got -0.1."),
    (["--use_peft", "--lora_task_type", "SEQ_CLS"], "--lora_task_type SEQ_CLS is not trained here"),
    (["--use_peft", "--lora_target_modules", "all-linear", "q_proj"], "--lora_target_modules all-linear q_proj: "
                                                                      "all-linear stands alone"),
    # peft skipped a name that matched nothing as long as another did: the adapters went elsewhere than asked.
    (["--use_peft", "--lora_target_modules", "q_proj", "q_prj"], "--lora_target_modules q_prj: no module of the "
                                                                 "model is named so (its layers LoRA adapts: "
                                                                 "down_proj, embed_tokens, gate_proj, k_proj"),
    (["--use_peft", "--lora_target_modules", "self_attn"], "--lora_target_modules self_attn: "
                                                           "model.layers.0.self_attn is a LlamaAttention, which LoRA "
                                                           "does not adapt"),
    (["--use_peft", "--lora_modules_to_save", "nrm"], "--lora_modules_to_save nrm: no module of the model is named "
                                                      "so"),
    # TRL's disable_dropout zeroes every dropout after peft wrapped the model: the adapters' was ignored.
    (["--use_peft", "--lora_dropout", "0.1", "--disable_dropout"], "--lora_dropout 0.1 is not used with "
                                                                   "--disable_dropout"),
    (["--use_peft", "--lora_target_parameters", "mlp.down_proj.weight"], "--lora_target_parameters needs "
                                                                         "--lora_dropout 0"),
    (["--use_peft", "--lora_dropout", "0", "--lora_target_parameters", "mlp.down_proj.wieght"],
     "--lora_target_parameters mlp.down_proj.wieght: no parameter of the model is named so"),
    # The tiny model ties lm_head to embed_tokens: training either apart made the weight sync probe fail every step.
    (["--use_peft", "--lora_target_modules", "q_proj", "embed_tokens"], "--lora_target_modules embed_tokens "
                                                                        "(peft_config's target_modules): the model "
                                                                        "ties model.embed_tokens and lm_head"),
    (["--use_peft", "--lora_modules_to_save", "lm_head"], "--lora_modules_to_save lm_head (peft_config's "
                                                          "modules_to_save): the model ties model.embed_tokens and "
                                                          "lm_head (tie_word_embeddings)"),
    # TRL refused it inside the trainer, naming its target_modules rather than the flag.
    (["--use_peft", "--lora_target_modules", "q_proj", "lm_head"], "--lora_target_modules lm_head: the output layer, "
                                                                   "whose log-probs the trainer computes from its "
                                                                   "weight directly"),
    (["--use_peft", "--lora_dropout", "0", "--lora_target_parameters", "embed_tokens.weight"],
     "--lora_target_parameters embed_tokens.weight (peft_config's target_parameters): the model ties"),
])
def test_lora_flags_out_of_range_unmatched_or_without_use_peft_are_one_line(flags, message, tiny_model_dir,
                                                                           tmp_path, capsys):
    argv = ["--model", tiny_model_dir, "--output_dir", str(tmp_path), *SMALL, *flags]
    assert refusal(argv, capsys).startswith(message)
