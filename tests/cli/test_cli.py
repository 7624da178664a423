"""The `verifiers-rl` command as `pip install -e .` installs it: subcommands, the training flags by section, the
generated configuration reference, and a two-process launch through the command that equals one process."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from verifiers_rl.cli import sections
from verifiers_rl.cli.train import ScriptArguments
from verifiers_rl.config.rl_config import RLConfig
from verifiers_rl.config.grpo_fields import markdown_table
from verifiers_rl.core.engine import free_port
from verifiers_rl.core.rollout import write_rollouts
from verifiers_rl.rollouts.synthetic import random_rollouts
from trl import GRPOConfig

from tests.helpers.launches import RAISING_ENV, ROOT, accelerate, launch_env

COMMAND = str(Path(sys.executable).parent / "verifiers-rl")  # the console script beside this venv's python


def run(args: list[str], cwd: Path = ROOT, timeout: float = 300, prefix: list[str] | None = None):
    return subprocess.run((prefix or [COMMAND]) + args, cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_the_command_lists_its_subcommands_and_refuses_an_unknown_one():
    listed = run(["--help"])
    assert listed.returncode == 0
    for command in ("train", "eval", "vllm-serve", "fields", "config"):
        assert f"verifiers-rl {command}" in listed.stdout
    unknown = run(["trian"])
    assert unknown.returncode == 2 and "unknown command 'trian'" in unknown.stderr and "train" in unknown.stderr


def test_fields_and_config_answer_help_and_refuse_other_arguments(capsys):
    from verifiers_rl.cli.main import main

    for command in ("fields", "config"):
        assert main([command, "--help"]) == 0
        assert capsys.readouterr().out.startswith(f"verifiers-rl {command}")
        assert main([command, "--bogus"]) == 2  # config printed the whole reference, as if it had done something
        captured = capsys.readouterr()
        assert captured.out == "" and captured.err.startswith(f"verifiers-rl {command} takes no arguments")
    assert main(["config"]) == 0 and "# Configuration reference" in capsys.readouterr().out
    # A file that cannot be written was a FileNotFoundError traceback.
    assert main(["config", "--write", "/no/such/folder/config.md"]) == 2
    assert capsys.readouterr().err == ("verifiers-rl config: --write /no/such/folder/config.md: cannot write the file "
                                       "(No such file or directory).\n")


def test_vllm_serve_refuses_a_model_path_that_does_not_exist_before_starting_a_server(tmp_path):
    # vLLM would take it for a Hub id and fail in a traceback after starting; 'tiny'/'smollm2' resolve as training's.
    missing = tmp_path / "no_model"
    result = run(["vllm-serve", "--model", str(missing)], timeout=60)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert result.stderr.strip().splitlines()[-1] == (
        f"verifiers-rl vllm-serve: error: --model {str(missing)!r}: no such folder, and it is not a Hugging Face Hub "
        "id ('name' or 'org/name'). Pass a folder holding a saved model (config.json, weights, tokenizer), a Hub id, "
        "'smollm2' or 'tiny'.")


def test_vllm_serve_refuses_a_port_in_use_before_starting_a_server():
    """A server already on the port would answer /health for the new one, and --then's command would be sent to it."""
    import http.server
    import threading

    class Healthy(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):  # no request lines in the test output
            pass

    port = free_port()
    other = http.server.HTTPServer(("127.0.0.1", port), Healthy)
    threading.Thread(target=other.serve_forever, daemon=True).start()
    try:
        result = run(["vllm-serve", "--model", "tiny", "--port", str(port), "--then", sys.executable, "-c",
                      "print('the command ran')"], timeout=120)
    finally:
        other.shutdown()
    assert result.returncode == 1 and "the command ran" not in result.stdout, result.stdout + result.stderr[-2000:]
    assert result.stderr.strip().splitlines()[-1] == (
        f"error: --port {port}: 127.0.0.1:{port} is in use (Address already in use); a server already there would "
        "answer for this one. Stop it, or pick a free --port.")


@pytest.mark.parametrize("flags, message", [
    (["--num-servers", "0"], "--num-servers must be >= 1, got 0"),
    (["--kv-cache-gib", "0"], "--kv-cache-gib must be >= 1, got 0"),
    (["--max-model-len", "0"], "--max-model-len must be >= 1, got 0"),
    (["--startup-timeout-s", "-1"], "--startup-timeout-s must be > 0, got -1.0"),
    (["--port", "70000"], "--port 70000: ports are 0-65535 (0: a free one)."),
    (["--port", "65535", "--num-servers", "2"], "--port 65535 (its 2 servers would end at 65536): ports are 0-65535"),
    (["--port", "0", "--num-servers", "2"], "--port 0 picks a free port for one server; --num-servers 2 takes"),
    (["--then", "no-such-command-here", "--flag"], "--then no-such-command-here: no such command (not on PATH"),
    # The command gets the servers' URLs (and a broadcast's transfer) appended: its own would be overridden, unsaid.
    (["--then", "true", "--vllm_server_url", "http://elsewhere:8000"],
     "--then's command sets --vllm_server_url http://elsewhere:8000, which vllm-serve overrides"),
    (["--weight-transfer", "gloo", "--then", "true", "--vllm-weight-transfer=files"],
     "--then's command sets --vllm-weight-transfer=files, which vllm-serve overrides"),
    # vLLM takes abbreviations too: --po 8001 would have served on 8001 while we waited for --port 8000.
    (["--po", "8001"], "--po abbreviates --port: give the whole flag"),
    (["--max-model=4096"], "--max-model abbreviates --max-model-len: give the whole flag"),
    # argparse kept the last: the server would have listened on 8002.
    (["--port", "8001", "--port=8002"], "--port given twice; argparse would keep the last value: give it once"),
])
def test_vllm_serve_refuses_bad_arguments_by_flag_before_starting_a_server(flags, message, capsys):
    from verifiers_rl.inference.vllm import server

    # A missing venv would be the error if the numbers went through (vLLM would refuse them 10-30 s after starting).
    with pytest.raises(SystemExit) as stopped:
        server.main(["--model", "tiny", "--venv", "/no/venv", *flags])
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert stopped.value.code == 2 and last.startswith(f"verifiers-rl vllm-serve: error: {message}"), last


def test_eval_refuses_a_flag_given_twice(capsys):
    from verifiers_rl.cli.eval import cli

    # argparse kept the last: this evaluated greedily at temperature 0 and said nothing.
    with pytest.raises(SystemExit) as stopped:
        cli(["--model", "tiny", "--temperature", "1", "--temperature=0"])
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert stopped.value.code == 2 and last == ("verifiers-rl eval: error: --temperature given twice; argparse would "
                                                "keep the last value: give it once (a list flag takes its values after "
                                                "one flag)."), last


def test_train_help_shows_the_flags_by_section_in_order():
    result = run(["train", "--help"])
    assert result.returncode == 0, result.stderr[-2000:]
    titles = [f"{title}:" for title in sections.SECTIONS] + [f"{sections.OTHER}:"]
    lines = result.stdout.splitlines()
    positions = [lines.index(title) for title in titles]
    assert positions == sorted(positions), "sections out of order"
    # --config is read before argparse parses the rest; --help lists it all the same, among the command's own.
    command = lines[lines.index("Command:"):positions[0]]
    assert any(line.strip().startswith("--config FILE.yaml") for line in command), command
    loss = lines[positions[list(sections.SECTIONS).index("Loss and optimizer")]:
                 positions[list(sections.SECTIONS).index("Batching")]]
    assert any(line.strip().startswith("--loss_type") for line in loss)
    assert not any(line.strip().startswith("--micro_batching") for line in loss)
    # A --no_NAME flag says what it does, not its positive flag's text with a default of False.
    negative = lines.index("  --no_gradient_checkpointing, --no-gradient-checkpointing")
    assert lines[negative + 1].strip() == "Turn --gradient_checkpointing off.", lines[negative:negative + 3]


def test_every_field_of_ours_is_in_exactly_one_section():
    """A new RLConfig or command field must be placed (it would otherwise fall into the inherited fields' list)."""
    inherited = {f.name for f in fields(GRPOConfig)}
    ours = [f.name for f in fields(RLConfig) if f.init and f.name not in inherited]
    ours += [f.name for f in fields(ScriptArguments)]
    placed = [name for names in sections.SECTIONS.values() for name in names]
    assert len(placed) == len(set(placed)), "a field in two sections"
    assert sorted(set(ours) - set(placed)) == []
    known = {f.name for f in fields(RLConfig)} | {f.name for f in fields(ScriptArguments)}
    assert sorted(set(placed) - known) == [], "a section names a field that does not exist"


def test_docs_config_is_the_code():
    written = (ROOT / "docs" / "config.md").read_text()
    assert written == sections.markdown(), "regenerate it: python -m verifiers_rl.cli.sections --write docs/config.md"
    assert "| `loss_type` | `grpo` |" in written and "`dapo`" in written  # a choice listed from the Literal type
    assert "| `importance_cap` | `2.0` |  | > 0 |" in written  # a range from the field's metadata


def test_fields_prints_the_grpo_config_table():
    result = run(["fields"])
    assert result.returncode == 0 and result.stdout.strip() == markdown_table().strip()


@pytest.mark.distributed
def test_two_processes_through_the_command_equal_one(tmp_path, tiny_model_dir):
    """`verifiers-rl train` in one process and `accelerate launch -m verifiers_rl.cli.train` in two (DDP on CPU)
    train the same replayed batch to the same weights."""
    write_rollouts(tmp_path / "r.jsonl", random_rollouts(4, 4, vocab_size=390, seed=3))
    common = ["--model", tiny_model_dir, "--rollouts_path", str(tmp_path / "r.jsonl"), "--max_steps", "1",
              "--rollouts_per_step", "16", "--per_device_train_batch_size", "4", "--optim", "sgd",
              "--learning_rate", "0.5", "--max_seq_len", "64", "--loss_type", "dr_grpo"]
    one = run(common + ["--output_dir", str(tmp_path / "one")], prefix=[COMMAND, "train"], timeout=600)
    assert one.returncode == 0, one.stderr[-4000:]
    launch = accelerate("ddp_cpu.yaml") + ["-m", "verifiers_rl.cli.train"]
    two = run(common + ["--output_dir", str(tmp_path / "two")], prefix=launch, timeout=600)
    assert two.returncode == 0, two.stderr[-4000:]
    assert "step 1/1" in two.stdout and "[rank1]" in two.stderr  # two processes trained
    before = load_file(Path(tiny_model_dir) / "model.safetensors")
    a, b = load_file(tmp_path / "one" / "model.safetensors"), load_file(tmp_path / "two" / "model.safetensors")
    assert any(not torch.equal(a[k], before[k]) for k in before), "the step changed nothing"
    for name in before:
        torch.testing.assert_close(b[name], a[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.distributed
def test_a_fresh_two_process_run_into_an_output_dir_with_checkpoints_stops_both_ranks_in_a_line(tmp_path,
                                                                                               tiny_model_dir):
    # Rank 0 finds the checkpoints; rank 1 gets its error instead of waiting, and each says it in one line.
    write_rollouts(tmp_path / "r.jsonl", random_rollouts(4, 4, vocab_size=390, seed=3))
    (tmp_path / "out" / "checkpoint-4").mkdir(parents=True)
    launch = accelerate("ddp_cpu.yaml") + ["-m", "verifiers_rl.cli.train"]
    result = run(["--model", tiny_model_dir, "--rollouts_path", str(tmp_path / "r.jsonl"), "--max_steps", "1",
                  "--rollouts_per_step", "16", "--output_dir", str(tmp_path / "out")], prefix=launch, timeout=600)
    assert result.returncode != 0
    lines = result.stderr.splitlines()
    assert f"[rank 0] verifiers-rl train: error: --output_dir {str(tmp_path / 'out')!r} holds checkpoints of an " \
           "earlier run (checkpoint-4)" in result.stderr, result.stderr[-4000:]
    assert any(line.startswith("[rank 1] verifiers-rl train: error: The main process failed: OutputDirInUseError: ")
               for line in lines), result.stderr[-4000:]
    # No rank prints a traceback (the only one is the launcher's ChildFailedError, from accelerate and torch).
    assert not any("verifiers_rl/" in line for line in lines if line.lstrip().startswith("File ")), result.stderr


@pytest.mark.distributed
def test_an_environment_failing_mid_run_under_two_processes_ends_each_rank_in_a_line(tmp_path, tiny_model_dir):
    # The main process generates; its environment's TypeError ends it with the user's line, and rank 1, waiting for
    # that batch, says the main process failed instead of hanging, each in one line and exit status 1.
    path = tmp_path / "talk_env.py"
    path.write_text(RAISING_ENV)
    launch = accelerate("ddp_cpu.yaml") + ["-m", "verifiers_rl.cli.train"]
    result = run(["--model", tiny_model_dir, "--env", str(path), "--max_steps", "1", "--rollouts_per_step", "4",
                  "--num_generations", "2", "--print_samples_every", "0", "--output_dir", str(tmp_path / "out")],
                 prefix=launch, timeout=600)
    assert result.returncode != 0
    lines = result.stderr.splitlines()
    failed = [line for line in lines if line.startswith("[rank 0] verifiers-rl train: error: Batch 0: ")]
    assert failed and "raised TypeError in the environment's code" in failed[0], result.stderr[-4000:]
    assert failed[0].endswith(f"(raised at {path.resolve()}:4)"), failed[0]
    assert any(line.startswith("[rank 1] verifiers-rl train: error: The main process failed: ") for line in lines), \
        result.stderr[-4000:]
    assert not any("verifiers_rl/" in line for line in lines if line.lstrip().startswith("File ")), result.stderr
    # A rank returned 1 (a run that failed, not only a signal): after the barrier both return 1, and the launcher
    # stops the other at the first one's exit, so which rank it reports is a race (rank 1 first under load).
    assert re.search(r"rank +: [01] \(local_rank: [01]\)\n +exitcode +: 1 ", result.stderr), result.stderr[-2000:]


@pytest.mark.distributed
def test_a_zero3_launch_from_another_folder_finds_the_repositorys_deepspeed_config(tmp_path, tiny_model_dir):
    # zero3_cpu.yaml names accelerate_configs/ds_zero3_cpu.json; Accelerate opened it from the working directory, so
    # `accelerate launch --config_file /abs/zero3_cpu.yaml` from elsewhere stopped on every rank before training.
    write_rollouts(tmp_path / "r.jsonl", random_rollouts(4, 4, vocab_size=390, seed=3))
    launch = accelerate("zero3_cpu.yaml") + ["-m", "verifiers_rl.cli.train"]
    launch[launch.index("--config_file") + 1] = str(ROOT / "accelerate_configs" / "zero3_cpu.yaml")
    result = subprocess.run(launch + ["--model", tiny_model_dir, "--rollouts_path", "r.jsonl", "--max_steps", "1",
                                      "--rollouts_per_step", "16", "--output_dir", "out"],
                            cwd=tmp_path, capture_output=True, text=True, timeout=600, env=launch_env())
    assert result.returncode == 0, result.stderr[-4000:]
    assert "step 1/1" in result.stdout and (tmp_path / "out" / "model.safetensors").is_file()


@pytest.mark.distributed
def test_an_error_while_building_under_two_processes_is_a_line_per_rank_naming_it(tmp_path, tiny_model_dir):
    # Each rank loads the environment and fails alike: two identical lines without a rank (and, from argparse's
    # errors, the usage line twice) said neither which rank spoke nor that they were two.
    launch = accelerate("ddp_cpu.yaml") + ["-m", "verifiers_rl.cli.train"]
    result = run(["--model", tiny_model_dir, "--env", "no_such_env", "--output_dir", str(tmp_path / "out")],
                 prefix=launch, timeout=600)
    assert result.returncode != 0
    said = [line for line in result.stderr.splitlines() if "verifiers-rl train: error: " in line]
    assert said and all(re.match(r"\[rank [01]\] verifiers-rl train: error: Unknown environment 'no_such_env'", line)
                        for line in said), result.stderr[-4000:]  # which rank exits first (and ends the other) races
    assert "usage:" not in result.stderr

