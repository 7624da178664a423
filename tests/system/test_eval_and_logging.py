"""One real run of examples/train.py (tiny model, reverse_text, 4 steps, evaluation every 2, checkpoints every 2,
--report_to tensorboard,trackio, completion tables every 2 steps, output redirected to a file), then:
tensorboard's event files and trackio's local store hold exactly the logged values and the tables of the trained
batches; the log file has no carriage-return bar; ``verifiers-rl eval`` on checkpoint-2 and on the
output folder reproduces the evaluations the run logged at steps 2 and 4; folders without weights are clear
errors."""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from verifiers_rl.cli import eval as eval_cli
from verifiers_rl.rollouts.evaluation import pass_at_k
from verifiers_rl.core.rollout import read_rollouts

from tests.helpers.launches import ROOT, launch_env

ENV_ARGS = {"num_examples": 32, "num_eval_examples": 4, "max_new_tokens": 8}
STEPS, EVERY, PER_STEP = 4, 2, 8


@pytest.fixture(scope="module")
def run(tmp_path_factory, tiny_model_dir):
    work = tmp_path_factory.mktemp("logging")
    env = launch_env({"TRACKIO_DIR": str(work / "trackio"), "HF_HUB_OFFLINE": "1"}, threads=None)
    args = ["--model", tiny_model_dir, "--env", "reverse_text", "--env_args", json.dumps(ENV_ARGS),
            "--max_steps", str(STEPS), "--rollouts_per_step", str(PER_STEP), "--num_generations", "4",
            "--learning_rate", "0.01", "--eval_steps", str(EVERY), "--eval_samples_per_prompt", "2",
            "--report_to", "tensorboard,trackio", "--project", "vrl_test", "--run_name", "logged",
            "--log_completions_steps", str(EVERY), "--save_strategy", "steps", "--save_steps", str(EVERY),
            "--save_rollouts_path", str(work / "seen.jsonl"), "--output_dir", str(work / "out")]
    with (work / "run.log").open("w") as log:
        result = subprocess.run([sys.executable, str(ROOT / "examples" / "train.py"), *args], cwd=work, env=env,
                                stdout=log, stderr=subprocess.STDOUT, timeout=600)
    assert result.returncode == 0, (work / "run.log").read_text()[-6000:]
    return work


def logged(run) -> list[dict]:
    return json.loads((run / "out" / f"checkpoint-{STEPS}" / "trainer_state.json").read_text())["log_history"]


def backend_key(key: str) -> str:
    """transformers' rewrite_logs: what tensorboard, trackio and wandb call a logged key."""
    return "eval/" + key[len("eval_"):] if key.startswith("eval_") else "train/" + key


def batches(run) -> list[list]:
    rollouts = read_rollouts(run / "seen.jsonl")
    return [rollouts[i : i + PER_STEP] for i in range(0, len(rollouts), PER_STEP)]


def test_the_run_logged_training_and_evaluation_metrics(run):
    history = logged(run)
    assert [e["step"] for e in history if "reward" in e] == [1, 2, 3, 4]
    evals = [e for e in history if "eval_reward" in e]
    assert [e["step"] for e in evals] == [2, 4]
    assert all({"eval_pass@1", "eval_pass@2", "eval_rewards/reversal_similarity"} <= set(e) for e in evals)
    assert evals[0]["eval_reward"] != evals[1]["eval_reward"]  # the policy moved between the two


def test_tensorboard_events_hold_every_logged_value_and_the_completion_tables(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util import tensor_util

    (folder,) = (run / "out" / "runs").iterdir()
    events = EventAccumulator(str(folder), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    checked = 0
    for entry in logged(run):
        for key, value in entry.items():
            if key == "step" or not isinstance(value, (int, float)):
                continue
            written = {e.value for e in events.Scalars(backend_key(key)) if e.step == entry["step"]}
            assert float(np.float32(value)) in written, (key, entry["step"], value, written)
            checked += 1
    assert checked > 100
    tables = events.Tensors("completions/text_summary")
    assert [t.step for t in tables] == [2, 4]
    for table in tables:
        text = tensor_util.make_ndarray(table.tensor_proto).item().decode()
        header, _, *lines = text.splitlines()
        assert header == "| step | group | reward | reversal_similarity | prompt | completion |"
        batch = batches(run)[table.step - 1]
        assert len(lines) == len(batch)
        for line, rollout in zip(lines, batch):
            cells = line[2:-2].split(" | ")
            assert cells[:5] == [str(table.step), rollout.group_id, f"{rollout.reward:.4f}",
                                 f"{rollout.metrics['reversal_similarity']:.4f}", rollout.prompt[-1]["content"]]


def test_trackio_store_holds_every_logged_value_and_the_completion_tables(run, monkeypatch):
    import trackio.sqlite_storage as storage

    monkeypatch.setattr(storage, "TRACKIO_DIR", run / "trackio")
    records = storage.SQLiteStorage.get_logs("vrl_test", "logged")
    for entry in logged(run):
        if "train_runtime" in entry:
            continue  # run summaries: trackio's callback leaves them out
        numbers = {backend_key(k): v for k, v in entry.items() if k != "step" and isinstance(v, (int, float))}
        matching = [r for r in records if r.get("train/global_step") == entry["step"] and numbers.keys() <= r.keys()]
        assert len(matching) == 1, (entry, records)
        assert {k: matching[0][k] for k in numbers} == numbers
    tables = [r for r in records if "completions" in r]
    assert [r["train/global_step"] for r in tables] == [2, 4]
    for record in tables:
        rows = record["completions"]["_value"]
        batch = batches(run)[record["train/global_step"] - 1]
        assert [(row["group"], row["reward"], row["prompt"], row["completion"]) for row in rows] == [
            (r.group_id, r.reward, r.prompt[-1]["content"], r.completion[-1]["content"]) for r in batch]


def test_the_log_file_has_lines_and_no_carriage_return_bar(run):
    text = (run / "run.log").read_text()
    assert "\r" not in text
    lines = [line.split(" | ")[0] for line in text.splitlines() if line.startswith(("step ", "eval at step"))]
    assert lines == ["step 1/4", "step 2/4", "eval at step 2", "step 3/4", "step 4/4", "eval at step 4"]


def evaluate_folder(folder: Path, output: Path, capsys) -> tuple[list[dict], str]:
    argv = ["--model", str(folder), "--env", "reverse_text", "--env_args", json.dumps(ENV_ARGS), "-n", "4", "-k", "2",
            "--output", str(output)]
    assert eval_cli.main(argv) == 0
    return [json.loads(line) for line in output.read_text().splitlines()], capsys.readouterr().out


def test_standalone_eval_of_a_checkpoint_and_the_output_folder_reproduces_the_logged_evaluations(run, tmp_path, capsys):
    evals = {e["step"]: e for e in logged(run) if "eval_reward" in e}
    for folder, step in [(run / "out" / "checkpoint-2", 2), (run / "out", 4)]:
        records, table = evaluate_folder(folder, tmp_path / f"{step}.jsonl", capsys)
        assert len(records) == 8 and sorted((r["row"], r["sample"]) for r in records) == [(i, s) for i in range(4) for s in range(2)]
        assert statistics.fmean(r["reward"] for r in records) == evals[step]["eval_reward"]
        by_row = [[r["passed"] for r in records if r["row"] == i] for i in range(4)]
        for k in (1, 2):
            expected = statistics.fmean(pass_at_k(2, sum(p), k) for p in by_row)
            assert expected == evals[step][f"eval_pass@{k}"]
        assert all(r["passed"] == (r["reward"] >= 1.0) and r["answer"] == r["prompt"][-1]["content"][::-1] for r in records)
        for label in ("prompts x samples", "reward", "pass@1", "pass@2", "reversal_similarity", "completion tokens", "time"):
            assert any(line.lstrip().startswith(label) for line in table.splitlines()), (label, table)


def test_folders_without_weights_are_clear_errors(run, tmp_path):
    shards_only = tmp_path / "checkpoint-2"
    shutil.copytree(run / "out" / "checkpoint-2", shards_only)
    (shards_only / "model.safetensors").unlink()
    (shards_only / "global_step2").mkdir()
    with pytest.raises(eval_cli.ModelFolderError, match="ZeRO-3 shards only .*stage3_gather_16bit_weights_on_model_save"):
        eval_cli.main(["--model", str(shards_only)])
    root = tmp_path / "out"
    (root / "checkpoint-4").mkdir(parents=True)
    (root / "checkpoint-10").mkdir()
    with pytest.raises(eval_cli.ModelFolderError,
                       match=r"holds checkpoints; pass one of them, e\.g\. --model .*checkpoint-10"):
        eval_cli.main(["--model", str(root)])
    with pytest.raises(FileNotFoundError, match="no such folder, and it is not a Hugging Face Hub id"):
        eval_cli.main(["--model", str(tmp_path / "missing")])  # models.resolve_model, as examples/train.py says it
    with pytest.raises(ValueError, match=r"-n 5 is larger than the held-out split of reverse_text \(4 rows\)"):
        eval_cli.main(["--model", str(run / "out"), "--env_args", json.dumps(ENV_ARGS), "-n", "5"])


def test_eval_cli_reports_bad_input_in_one_line(tmp_path):
    result = subprocess.run([sys.executable, "-m", "verifiers_rl.cli.eval", "--model", str(tmp_path / "nothing")],
                            env=launch_env(threads=None), capture_output=True, text=True, timeout=300)
    assert result.returncode == 2
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"verifiers-rl eval: error: --model {str(tmp_path / 'nothing')!r}: no such folder, and it is not a Hugging Face Hub id")


@pytest.mark.parametrize("tokenizer, message", [
    ("missing", "--tokenizer '{}': no such folder, and it is not a Hugging Face Hub id"),
    ("empty", "--tokenizer '{}' has no tokenizer (tokenizer.json, tokenizer_config.json, tokenizer.model)."),
    ("~/empty", "--tokenizer '{}' has no tokenizer (tokenizer.json, tokenizer_config.json, tokenizer.model)."),
])
def test_a_tokenizer_that_cannot_be_loaded_is_one_line_naming_tokenizer(tokenizer, message, tiny_model_dir,
                                                                         tmp_path, capsys, monkeypatch):
    # It named --model (which was fine), or came as transformers' five lines about sentencepiece.
    folder = tmp_path / tokenizer
    if tokenizer.startswith("~"):  # the folder under a home directory, named as the user types it
        monkeypatch.setenv("HOME", str(tmp_path))
        (tmp_path / "empty").mkdir()
        folder = tokenizer
    elif tokenizer == "empty":
        folder.mkdir()
    assert eval_cli.cli(["--model", tiny_model_dir, "--tokenizer", str(folder), "-n", "1"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith(
        "verifiers-rl eval: error: " + message.format(folder))


def test_eval_names_its_own_flags_where_the_held_out_split_is_too_small(tiny_model_dir, capsys):
    status = eval_cli.cli(["--model", tiny_model_dir, "--env", "reverse_text", "--env_args",
                           '{"num_eval_examples": 3}', "-n", "4"])
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert status == 2 and last.startswith("verifiers-rl eval: error: -n 4 is larger than the held-out "
                                                       "split of reverse_text (3 rows)"), last
    assert "--holdout N holds out" in last and "--eval_holdout" not in last  # the trainer's flag is not eval's
    assert eval_cli.cli(["--model", tiny_model_dir, "--env", "reverse_text", "--holdout", "5000"]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last == ("verifiers-rl eval: error: --holdout 5000: reverse_text has 1000 training rows; hold out between 1 "
                    "and 999 of them."), last
    # reasoning-gym sizes its held-out split with its own argument, which the hint names.
    assert eval_cli.cli(["--model", tiny_model_dir, "--env", "reasoning_gym:leg_counting", "-n", "500"]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert "reasoning-gym takes --env_args '{\"eval_size\": N}'" in last and "num_eval_examples" not in last, last


def test_eval_waits_vllm_server_timeout_for_a_server_and_refuses_embedded_engine_flags_beside_one(
        tiny_model_dir, caplog, capsys):
    from verifiers_rl.inference.vllm.http import VLLMUnavailableError
    from verifiers_rl.core.engine import free_port

    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    started = time.monotonic()
    with caplog.at_level("WARNING"), pytest.raises(VLLMUnavailableError, match=f"No vLLM server at {url}"):
        eval_cli.main(["--model", tiny_model_dir, "--vllm_server_url", url, "--vllm_server_timeout", "2"])
    waited = time.monotonic() - started
    assert f"Waiting up to 2 s for a vLLM server at {url}" in caplog.text
    assert 2 <= waited < 60  # it polled for the 2 s asked, not the 240 s default
    with pytest.raises(SystemExit):
        eval_cli.parse_args(["--vllm_server_url", url, "--vllm_server_timeout", "-1"])
    assert "error: --vllm_server_timeout must be >= 0, got -1." in capsys.readouterr().err
    # The embedded engine's settings are refused beside a server, not ignored.
    with pytest.raises(SystemExit):
        eval_cli.parse_args(["--vllm_server_url", url, "--dtype", "bfloat16", "--max_batch_size", "8"])
    assert ("error: --dtype bfloat16, --max_batch_size 8 sets the embedded engine, which --vllm_server_url replaces"
            in capsys.readouterr().err)
    with pytest.raises(SystemExit):  # and the server's wait without a server
        eval_cli.parse_args(["--vllm_server_timeout", "5"])
    assert "error: --vllm_server_timeout 5 acts only with --vllm_server_url" in capsys.readouterr().err


def test_eval_refuses_environment_arguments_that_are_not_keywords_or_of_the_wrong_type(tiny_model_dir, capsys):
    with pytest.raises(SystemExit):
        eval_cli.parse_args(["--env_args", "[1]"])
    assert "error: --env_args must be a JSON object of the loader's keyword arguments" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"^--env reverse_text: 'str' object cannot be interpreted as an integer "
                                         r"\(its arguments come from --env_args\)"):
        eval_cli.main(["--model", tiny_model_dir, "--env_args", '{"num_examples": "ten"}'])


@pytest.mark.parametrize("flags, message", [
    (["--temperature", "nan"], "--temperature must be a finite number >= 0, got nan."),
    (["--temperature", "inf"], "--temperature must be a finite number >= 0, got inf."),
    (["--holdout", "-1"], "--holdout must be >= 0, got -1."),
    (["-k", "4", "--temperature", "0"], "-k 4 at --temperature 0: greedy decoding gives every sample of a prompt the "
                                        "same completion, so pass@k would equal pass@1 at k times the cost. Sample (a "
                                        "temperature > 0), or take one sample per prompt."),
    (["--pass_threshold", "nan"], "--pass_threshold must be a finite number, got nan."),
    (["--output", "."], "--output . is a folder: name the file to write the rollouts to."),
    # argparse took a prefix for the whole flag: --temp 0.5 sampled at temperature 0.5.
    (["--temp", "0.5"], "unrecognized arguments: --temp 0.5"),
    (["--num_ex", "2"], "unrecognized arguments: --num_ex 2"),
])
def test_eval_refuses_a_value_naming_its_flag(flags, message, capsys):
    with pytest.raises(SystemExit):
        eval_cli.parse_args(flags)
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1] == f"verifiers-rl eval: error: {message}"
    assert len(lines) == 2, lines  # one usage line above it (argparse's listed every flag), as train's


def test_eval_output_that_cannot_be_written_fails_before_evaluating(tiny_model_dir, tmp_path, capsys, monkeypatch):
    import verifiers_rl.inference.factory as factory

    monkeypatch.setattr(factory, "make_engine", None)  # evaluating would call it: the error must come first
    target = tmp_path / "no_such_folder" / "out.jsonl"
    status = eval_cli.cli(["--model", tiny_model_dir, "--output", str(target)])
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert status == 2 and last == (f"verifiers-rl eval: error: --output {target}: cannot write the file (No such "
                                    "file or directory)."), last


def test_eval_passes_every_env_args_key_to_the_users_loader_and_says_where_it_fails(tiny_model_dir, tmp_path, capsys):
    # A key named like load_environment's own parameters (spec, tool_mode) reaches the loader, not load_environment.
    (tmp_path / "keys_env.py").write_text(
        "from verifiers_rl.envs import Rubric, SingleTurnEnv\n"
        "def load_environment(tokenizer, spec, tool_mode):\n"
        "    raise RuntimeError(f'got {spec} {tool_mode}')\n")
    status = eval_cli.cli(["--model", tiny_model_dir, "--env", str(tmp_path / "keys_env.py"), "--env_args",
                           '{"spec": "s", "tool_mode": "text"}'])
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert status == 2 and last == (f"verifiers-rl eval: error: --env {tmp_path / 'keys_env.py'}: loading it raised "
                                    f"RuntimeError at {(tmp_path / 'keys_env.py').resolve()}:3: got s text"), last


def test_config_takes_backends_comma_separated_and_trl_completion_logging_as_ours(tmp_path):
    from verifiers_rl.config.rl_config import RLConfig

    common = dict(output_dir=str(tmp_path), use_cpu=True, logging_steps=5)
    args = RLConfig(report_to="tensorboard,trackio", log_completions=True, **common)
    assert args.report_to == ["tensorboard", "trackio"]
    # TRL's flag would log its own (here always empty) buffers; ours logs the trained batch every logging_steps.
    assert args.log_completions is False and args.log_completions_steps == 5
    assert RLConfig(report_to="none", eval_steps=3, **common).eval_strategy == "steps"
    with pytest.raises(ValueError, match="log_completions_steps must be >= 0"):
        RLConfig(report_to="none", log_completions_steps=-1, **common)
    # Tables with no backend to show them would go nowhere: refused, naming the flag given (TRL's or ours).
    for flags, named in (({"log_completions_steps": 5}, "--log_completions_steps 5"),
                         ({"log_completions": True}, "--log_completions")):
        with pytest.raises(ValueError, match=rf"^{named} acts only with a --report_to backend that shows tables"):
            RLConfig(report_to="none", **flags, **common)


def test_eval_of_a_lora_adapter_folder_samples_the_merged_model(tiny_model_dir, tmp_path):
    """A peft_config run's save_model writes adapters only; eval samples base + merged adapters, as a merged folder."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    lora = LoraConfig(r=4, lora_alpha=64, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir), lora)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    merged = lambda folder: model.merge_and_unload().save_pretrained(folder)  # noqa: E731
    for folder, save in [("adapters", model.save_pretrained), ("merged", merged)]:
        save(str(tmp_path / folder))
        tokenizer.save_pretrained(str(tmp_path / folder))
    samples = {}
    for folder in ("adapters", "merged", tiny_model_dir):
        out = tmp_path / f"{Path(folder).name}.jsonl"
        eval_cli.main(["--model", str(tmp_path / folder), "--env", "reverse_text", "--env_args", json.dumps(ENV_ARGS),
                       "-k", "2", "--output", str(out)])
        samples[Path(folder).name] = [json.loads(line)["completion_ids"] for line in out.read_text().splitlines()]
    assert samples["adapters"] == samples["merged"] != samples[Path(tiny_model_dir).name]


def test_a_one_episode_batchs_nan_stds_are_left_out_of_the_logs_without_a_warning(tiny_model_dir, tmp_path):
    """A replay of one-rollout groups with --rollouts_per_step 1: reward_std and rewards/<fn>/std are NaN (one
    episode), which TRL logged as None and tensorboard refused with a warning per key and step."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from verifiers_rl.core.rollout import write_rollouts
    from verifiers_rl.rollouts.synthetic import random_rollouts

    rollouts = random_rollouts(num_groups=2, group_size=1, vocab_size=50, seed=0)
    for rollout in rollouts:
        rollout.metrics = {"score": rollout.reward}
    write_rollouts(tmp_path / "ones.jsonl", rollouts)
    args = ["train", "--model", tiny_model_dir, "--rollouts_path", str(tmp_path / "ones.jsonl"), "--max_steps", "2",
            "--rollouts_per_step", "1", "--report_to", "tensorboard", "--output_dir", str(tmp_path / "out")]
    result = subprocess.run([sys.executable, "-m", "verifiers_rl", *args], cwd=tmp_path, capture_output=True,
                            text=True, env=launch_env({"HF_HUB_OFFLINE": "1"}, threads=None), timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    assert 'log a value of "None"' not in result.stdout + result.stderr
    events = EventAccumulator(str(next((tmp_path / "out" / "runs").iterdir())), size_guidance={"scalars": 0})
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/reward", "train/rewards/score/mean"} <= tags
    assert not tags & {"train/reward_std", "train/rewards/score/std"}
