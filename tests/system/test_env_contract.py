"""`verifiers-rl train` (verifiers_rl.cli.train, which examples/train.py runs) with every built-in environment out of the box (the default model and the tiny one), the
length contract between the trainer's flags and the environment's limits, and clear errors for bad --model paths.

The command's ``main`` runs in this process (one import of torch/transformers for all the runs)."""

import logging
import re

import pytest
import yaml

from verifiers_rl.envs import BUILTINS, SingleTurnEnv, load_environment
from verifiers_rl.envs.limits import LIMIT_FLAGS, LengthContractError, resolve_limits
from verifiers_rl.envs.rubric import Rubric
from verifiers_rl.core.models import resolve_model

from verifiers_rl.cli import train as train_script


# An environment file as a new user writes it: its own limits (384 / 64), unlike the script's quickstart (128 / 16).
ENV_FILE = '''
from verifiers_rl.envs import Rubric, SingleTurnEnv


def load_environment(tokenizer, **kwargs):
    rows = [{"question": "Count the legs of " + ", ".join(["2 spiders"] * 30) + "."}] * 3
    rows.append({"question": "Too long: " + "legs " * 400})
    return SingleTurnEnv(rows, Rubric(), tokenizer, max_seq_len=384, max_new_tokens=64, **kwargs)
'''


@pytest.mark.parametrize("model", ["default", "tiny"])
@pytest.mark.parametrize("env", sorted(BUILTINS))
def test_every_builtin_runs_out_of_the_box(env, model, tmp_path, capsys, caplog, smollm2_model_dir):
    """No length flags: the run takes the environment's limits (before, arithmetic died with SequenceTooLongError
    at 131 > 128 tokens, and calculator refused both models, whose templates show no tools)."""
    argv = ["--env", env, "--max_steps", "2", "--rollouts_per_step", "4", "--num_generations", "2",
            "--print_samples_every", "0", "--output_dir", str(tmp_path / "out")]
    with caplog.at_level(logging.WARNING):
        assert train_script.main(argv + (["--model", "tiny"] if model == "tiny" else [])) == 0
    out = capsys.readouterr().out
    assert [line.split(" | ")[0] for line in out.splitlines() if line.startswith("step ")] == ["step 1/2", "step 2/2"]
    assert (tmp_path / "out" / "model.safetensors").is_file()
    if env == "calculator":  # neither template has tool support: the tools went to the system prompt, with a notice
        assert "the chat template has no tool support" in caplog.text and "tool_mode='text'" in caplog.text


def parse(argv):
    parser = train_script.build_parser()
    return parser, parser.parse_args_and_config(args=argv)  # (ScriptArguments, RLConfig)


def test_flags_given_tells_a_given_flag_from_a_default(tmp_path):
    (tmp_path / "run.yaml").write_text(yaml.safe_dump({"max_completion_length": 16}))
    cases = {
        (): set(),
        ("--max_seq_len", "128"): {"max_seq_len"},  # the quickstart's own value, but given
        ("--config", str(tmp_path / "run.yaml")): {"max_completion_length"},
        ("--config", str(tmp_path / "run.yaml"), "--max_seq_len", "7"): {"max_seq_len", "max_completion_length"},
    }
    for argv, given in cases.items():
        parser, parsed = parse(list(argv))
        assert train_script.flags_given(parser, list(argv), parsed, LIMIT_FLAGS) == given, argv
        assert parser.get_default("max_seq_len") == 128  # the probe put the defaults back
    # One probe reads both halves of the parse: the script's flags (strings, None) and the config's.
    argv = ["--env", "reverse_text", "--eval_env", "arithmetic", "--max_seq_len", "128"]
    parser, parsed = parse(argv)
    names = ("env", "env_args", "eval_env", "num_train_epochs", *LIMIT_FLAGS)
    assert train_script.flags_given(parser, argv, parsed, names) == {"env", "eval_env", "max_seq_len"}
    assert parser.get_default("env") == "reverse_text" and parser.get_default("eval_env") is None


def test_lengths_default_to_the_environment_and_a_disagreeing_flag_fails_before_generating(tmp_path, tokenizer_dir,
                                                                                           caplog, capsys):
    env_file = tmp_path / "my_env.py"
    env_file.write_text(ENV_FILE)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    with caplog.at_level(logging.WARNING):
        env = load_environment(str(env_file), tokenizer=tokenizer)
    assert len(env.dataset) == 3 and "dropped 1 of the 4 rows of its dataset" in caplog.text  # at load, not mid-run
    quickstart = {"max_seq_len": 128, "max_completion_length": 16}
    assert resolve_limits(env, quickstart, set()) == {"max_seq_len": 384, "max_completion_length": 64}
    assert resolve_limits(env, {"max_seq_len": 384, "max_completion_length": 16}, {"max_seq_len"})["max_seq_len"] == 384
    with pytest.raises(LengthContractError, match=r"--max_seq_len=128 disagrees with the environment 'SingleTurnEnv', "
                                                  r"whose max_seq_len is 384. Leave out --max_seq_len"):
        resolve_limits(env, quickstart, {"max_seq_len"})
    with pytest.raises(LengthContractError, match=r"--max_completion_length=16 .* whose max_new_tokens is 64"):
        resolve_limits(env, quickstart, {"max_completion_length"})

    # Through the script: the error comes at start-up (no engine, no generation), one line naming both values.
    with pytest.raises(SystemExit) as stopped:
        train_script.main(["--model", tokenizer_dir, "--env", str(env_file), "--max_seq_len", "128",
                           "--output_dir", str(tmp_path / "out")])
    assert stopped.value.code == 2
    assert re.search("error: --max_seq_len=128 disagrees .* max_seq_len is 384", capsys.readouterr().err)
    assert not (tmp_path / "out").exists()


def test_the_evaluation_environment_keeps_the_length_contract(tmp_path, tokenizer_dir, capsys):
    """--eval_env: a limit it does not state takes the trainer's; a stated one must agree with a length flag given
    (an error at start-up naming --eval_env and --eval_env_args), and is its own when no flag is given."""
    from transformers import AutoTokenizer

    env_file = tmp_path / "my_env.py"
    env_file.write_text(ENV_FILE)
    evaluate = ["--model", tokenizer_dir, "--env", "reverse_text", "--eval_strategy", "steps", "--eval_steps", "1",
                "--output_dir", str(tmp_path / "out")]
    with pytest.raises(SystemExit) as stopped:
        train_script.main(evaluate + ["--eval_env", str(env_file), "--max_seq_len", "128"])
    assert stopped.value.code == 2
    assert re.search(r"error: The evaluation environment \(--eval_env\): --max_seq_len=128 disagrees .* max_seq_len "
                     r"is 384.*--eval_env_args '\{\"max_seq_len", capsys.readouterr().err)
    assert not (tmp_path / "out").exists()

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    no_engine = {"environment": None, "engine": None}  # a live run's: evaluation_inputs builds nothing else

    def eval_env(argv):
        parser = train_script.build_parser()
        script_args, config = parser.parse_args_and_config(args=evaluate + argv)
        given = train_script.flags_given(parser, evaluate + argv, (script_args, config), LIMIT_FLAGS)
        inputs = train_script.evaluation_inputs(parser, script_args, config, tokenizer_dir, tokenizer, no_engine, given)
        return inputs["eval_environment"]

    own = eval_env(["--eval_env", str(env_file)])
    assert (own.max_seq_len, own.max_new_tokens) == (384, 64) and len(own.eval_dataset) == 0
    # A verifiers environment states neither limit: it takes the trainer's (the quickstart's, or the flags given).
    vf_spec = ["--eval_env", "vf:tests.envs.vf_envs"]
    adopted = eval_env(vf_spec)
    assert (adopted.max_seq_len, adopted.max_new_tokens) == (128, 16)
    adopted = eval_env(vf_spec + ["--max_seq_len", "96", "--max_completion_length", "12"])
    assert (adopted.max_seq_len, adopted.max_new_tokens) == (96, 12)
    # ... unless its sampling_args state max_tokens, which must then agree with --max_completion_length.
    stated = vf_spec + ["--eval_env_args", '{"sampling_args": {"max_tokens": 8}}']
    assert eval_env(stated).max_new_tokens == 8
    with pytest.raises(LengthContractError, match=r"--max_completion_length=12 disagrees .* max_new_tokens is 8"):
        eval_env(stated + ["--max_completion_length", "12"])


def test_an_environment_without_a_stated_limit_adopts_the_flag(tokenizer_dir):
    from transformers import AutoTokenizer

    env = SingleTurnEnv([{"question": "hi"}], Rubric(), AutoTokenizer.from_pretrained(tokenizer_dir))
    env.unstated_limits = frozenset({"max_seq_len"})
    resolved = resolve_limits(env, {"max_seq_len": 99, "max_completion_length": 5}, {"max_seq_len"})
    assert resolved == {"max_seq_len": 99, "max_completion_length": env.max_new_tokens} and env.max_seq_len == 99


def test_model_path_that_does_not_exist_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"--model '\./no/such/folder': no such folder, and it is not a "
                                                r"Hugging Face Hub id"):
        resolve_model("./no/such/folder")
    with pytest.raises(FileNotFoundError, match="no such folder"):
        resolve_model(str(tmp_path / "missing"))
    assert resolve_model(str(tmp_path)) == str(tmp_path)  # a folder is passed on as is


@pytest.fixture
def tokenizer_dir(tiny_model_dir):
    return tiny_model_dir


def test_reasoning_gym_trains_two_live_steps_through_the_script(tmp_path, capsys):
    """`--env reasoning_gym:<task>` as the README runs it (short turns and few rows, for time): no length flags, the
    run takes the environment's limits; the rollouts are scored by the task (the tiny model never answers, so 0)."""
    from verifiers_rl.core.rollout import read_rollouts

    argv = ["--model", "tiny", "--env", "reasoning_gym:leg_counting", "--env_args",
            '{"size": 8, "eval_size": 2, "max_new_tokens": 16}', "--max_steps", "2",
            "--rollouts_per_step", "4", "--num_generations", "2", "--print_samples_every", "0",
            "--save_rollouts_path", str(tmp_path / "seen.jsonl"), "--output_dir", str(tmp_path / "out")]
    assert train_script.main(argv) == 0
    assert [line.split(" | ")[0] for line in capsys.readouterr().out.splitlines() if line.startswith("step ")] == [
        "step 1/2", "step 2/2"]
    seen = read_rollouts(tmp_path / "seen.jsonl")
    assert len(seen) == 8 and all(len(r.completion_ids) <= 16 for r in seen)
    assert all(len(r.prompt_ids) + len(r.completion_ids) <= 1024 for r in seen)  # the adapter's default max_seq_len
    assert all("format_reward" in r.metrics for r in seen)
