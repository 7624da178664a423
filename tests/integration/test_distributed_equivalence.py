"""Real multi-process equivalence: one process vs Accelerate DDP (2 processes) vs DeepSpeed ZeRO-3 (2 processes).

Each backend is ONE launch of ``tests/distributed/equivalence_run.py``, which trains every configuration of its
CONFIGS table for one SGD step (two where a configuration says so) from the same tiny model and rollouts file.
The test compares parameters after the step, the logged loss and the number of optimizer/scheduler steps.
"""

from __future__ import annotations

import json
import sys

import pytest
import torch
from safetensors.torch import load_file

from verifiers_rl.core.rollout import episode_key, group_episodes, read_rollouts, write_rollouts
from verifiers_rl.training.batching import BatchingConfig, plan_batch
from verifiers_rl.rollouts.synthetic import random_rollouts

from tests.distributed.equivalence_run import CONFIGS, SHARED_TWINS
from tests.helpers.launches import (EQUIVALENCE_RUNNER as RUNNER, ROOT, accelerate, assert_step_equals_single_process, launch,
                                    load_run, runner_inputs)

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="session")
def runs(tmp_path_factory, tiny_model_dir):
    work = tmp_path_factory.mktemp("equivalence")
    common = runner_inputs(work, tiny_model_dir)
    prefixes = {
        "single": [sys.executable],
        "ddp": accelerate("ddp_cpu.yaml"),
        "zero3": accelerate("zero3_cpu.yaml"),
    }
    for backend, prefix in prefixes.items():
        log = work / f"{backend}.log"
        result = launch(prefix, [str(RUNNER), *common, "--out", str(work / backend)], log)
        assert result.returncode == 0, f"{backend} launch failed:\n{log.read_text()[-6000:]}"
    return work


@pytest.mark.parametrize("backend", ["ddp", "zero3"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_two_process_step_equals_single_process_step(runs, initial_parameters, backend, name):
    assert_step_equals_single_process(runs / "single", runs / backend, name, initial_parameters, backend)


@pytest.mark.parametrize("backend", ["single", "ddp", "zero3"])
@pytest.mark.parametrize("name", list(SHARED_TWINS))
def test_prompt_sharing_gives_the_unshared_update(runs, backend, name):
    """Forwarding each group's prompt once (shared-prefix rows, tree attention) changes neither the parameters after
    the step(s) nor the logged loss and metrics, on one process, DDP and ZeRO-3; and it forwarded fewer tokens."""
    shared_params, shared = load_run(runs / backend, name)
    plain_params, plain = load_run(runs / backend, SHARED_TWINS[name])
    for key, reference in plain_params.items():
        assert float((shared_params[key] - reference).abs().max() / reference.abs().max()) < 1e-5, key
    for got, want in zip(shared["losses"], plain["losses"], strict=True):
        assert abs(got - want) <= 1e-5 * max(abs(want), 1e-3), (got, want)
    for key, values in plain["metrics"].items():
        for got, want in zip(shared["metrics"][key], values, strict=True):
            assert abs(got - want) <= 1e-5 * max(abs(want), 1e-3), (key, got, want)
    assert all(s < p for s, p in zip(shared["tokens"]["tokens_forwarded"], plain["tokens"]["tokens_forwarded"]))
    assert shared["tokens"]["tokens_unique"] == plain["tokens"]["tokens_unique"]


BRANCHING = [name for name, overrides in CONFIGS.items() if overrides.get("rollouts") == "branching"]


@pytest.mark.parametrize("backend", ["ddp", "zero3"])
def test_a_step_of_branching_episodes_trains_every_branch_with_an_episode_on_both_ranks(runs, backend):
    """The branching configurations' one step is every episode of their file (rollouts_per_step counts episodes:
    15, in 20 rollouts): the ranks' loss tokens add up to all 20 branches'; and the padded layout puts an episode's
    branches on both ranks (the advantage each rank applies is the episode's, computed before the split)."""
    rollouts = read_rollouts(runs / "branching.jsonl")
    assert (len(group_episodes(rollouts)), len(rollouts)) == (15, 20) and len(BRANCHING) == 2
    for name in BRANCHING:
        ranks = [json.loads((runs / backend / f"{name}.rank{rank}.json").read_text()) for rank in (0, 1)]
        assert sum(rank["loss_tokens"] for rank in ranks) == sum(sum(r.completion_mask) for r in rollouts), name
    placed = plan_batch(rollouts, BatchingConfig(world_size=2, rows_per_micro_batch=2, max_seq_len=64))
    ranks_of: dict = {}
    for rank, rank_batch in enumerate(placed):
        for micro_batch in rank_batch.micro_batches:
            for position in micro_batch.batch_positions:
                ranks_of.setdefault(episode_key(rollouts[position], position), set()).add(rank)
    assert any(len(ranks) == 2 for ranks in ranks_of.values())


def test_example_script_trains_under_ddp_and_refuses_independent_copies(runs, tiny_model_dir, tmp_path):
    script = ROOT / "examples" / "train.py"
    args = [str(script), "--model", tiny_model_dir, "--rollouts_path", str(runs / "main.jsonl"),
            "--loss_type", "dr_grpo", "--rollouts_per_step", "8", "--max_seq_len", "64", "--max_steps", "2",
            "--report_to", "none", "--save_strategy", "no", "--output_dir", str(tmp_path / "out")]
    ok = launch(accelerate("ddp_cpu.yaml"), args, tmp_path / "ddp.log")
    log = (tmp_path / "ddp.log").read_text()
    assert ok.returncode == 0, log[-6000:]
    assert (tmp_path / "out" / "model.safetensors").is_file() and (tmp_path / "out" / "tokenizer.json").is_file()

    # A MULTI_GPU launch on a CPU-only machine whose script does not select the CPU would train two copies.
    bad = launch(accelerate("ddp_cpu.yaml"), args[:-1] + [str(tmp_path / "bad"), "--use_cpu", "false"],
                 tmp_path / "bad.log", env_extra={"ACCELERATE_USE_CPU": "false"})
    log = (tmp_path / "bad.log").read_text()
    assert bad.returncode != 0
    assert "2 processes were launched but Accelerate sees 1" in log


def test_bad_input_stops_every_rank_with_the_error(runs, tiny_model_dir, tmp_path):
    """A malformed file and an over-long rollout in the second batch (both found at start, before any step): every
    rank exits with the main process's message, promptly, instead of waiting on a collective. (An error found
    mid-run reaching every rank: an environment failing, tests/integration/test_multinode.py.)"""
    malformed = tmp_path / "malformed.jsonl"
    lines = (runs / "main.jsonl").read_text().splitlines()
    malformed.write_text("\n".join(lines[:3] + ['{"prompt_ids": [1, 2], "oops"'] + lines[3:]) + "\n")

    overlong = tmp_path / "overlong.jsonl"
    rollouts = random_rollouts(2, 4, vocab_size=390, seed=3)
    rollouts[5].completion_ids = rollouts[5].completion_ids + [7] * 100
    rollouts[5].completion_mask = rollouts[5].completion_mask + [1] * 100
    rollouts[5].completion_logprobs = rollouts[5].completion_logprobs + [-1.0] * 100
    write_rollouts(overlong, rollouts)

    for path, own_error in [(malformed, "malformed.jsonl:4: not valid JSON"), (overlong, "rollout 6 (group 'g1') has")]:
        args = [str(ROOT / "examples" / "train.py"), "--model", tiny_model_dir, "--rollouts_path", str(path),
                "--rollouts_per_step", "4", "--max_seq_len", "64", "--max_steps", "2", "--logging_steps", "1",
                "--report_to", "none", "--save_strategy", "no", "--output_dir", str(tmp_path / "out")]
        log_path = tmp_path / f"{path.stem}.log"
        result = launch(accelerate("ddp_cpu.yaml"), args, log_path)
        log = log_path.read_text()
        assert result.returncode != 0
        assert own_error in log, log[-4000:]
        assert "The main process failed:" in log, log[-4000:]  # rank 1 got the same error
        assert "step 1/2 | reward" not in log


def test_bf16_under_the_shipped_zero3_cpu_config_trains_in_bf16_and_a_config_fixing_it_off_is_one_line(
        initial_parameters, tiny_model_dir, tmp_path):
    """--bf16 acts under accelerate_configs/zero3_cpu.yaml (its DeepSpeed config leaves bf16 to the flag: DeepSpeed
    keeps bf16 weights, the saved model's); a config that fixes bf16 off beside --bf16 is refused when the trainer is
    built, in one line naming the file, not by HF's traceback on every rank inside train()."""
    write_rollouts(tmp_path / "r.jsonl", random_rollouts(2, 4, vocab_size=390, seed=5))
    args = [str(ROOT / "examples" / "train.py"), "--model", tiny_model_dir,
            "--rollouts_path", str(tmp_path / "r.jsonl"),
            "--rollouts_per_step", "8", "--max_seq_len", "64", "--max_steps", "1", "--learning_rate", "1e-2",
            "--report_to", "none", "--save_strategy", "no", "--bf16", "true"]
    ok = launch(accelerate("zero3_cpu.yaml"), args + ["--output_dir", str(tmp_path / "out")], tmp_path / "ok.log")
    assert ok.returncode == 0, (tmp_path / "ok.log").read_text()[-6000:]
    saved = load_file(tmp_path / "out" / "model.safetensors")
    assert {tensor.dtype for tensor in saved.values()} == {torch.bfloat16}
    assert any(not torch.equal(saved[name], initial_parameters[name].bfloat16()) for name in saved)  # it trained

    ds_config = json.loads((ROOT / "accelerate_configs" / "ds_zero3_cpu.json").read_text())
    ds_config["bf16"] = {"enabled": False}
    (tmp_path / "ds_off.json").write_text(json.dumps(ds_config))
    launch_config = (ROOT / "accelerate_configs" / "zero3_cpu.yaml").read_text()
    (tmp_path / "zero3_off.yaml").write_text(launch_config.replace("accelerate_configs/ds_zero3_cpu.json",
                                                                   str(tmp_path / "ds_off.json")))
    prefix = accelerate("zero3_cpu.yaml")
    prefix[prefix.index("--config_file") + 1] = str(tmp_path / "zero3_off.yaml")
    bad = launch(prefix, args + ["--output_dir", str(tmp_path / "bad")], tmp_path / "bad.log")
    log = (tmp_path / "bad.log").read_text()
    assert bad.returncode != 0 and "[rank0]: Traceback" not in log, log[-6000:]
    line = f"verifiers-rl train: error: {tmp_path / 'ds_off.json'} disagrees with this run's flags (ds bf16.enabled"
    said = {rank for rank in (0, 1) for text in log.splitlines() if text.startswith(f"[rank {rank}] {line}")}
    assert said == {0, 1}, log[-6000:]  # one line from each rank, named
