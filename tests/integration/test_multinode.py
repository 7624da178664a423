"""Two "nodes" on this machine: two `accelerate launch --num_machines 2 --machine_rank r --main_process_ip 127.0.0.1
--main_process_port P` commands started together, as on two machines, with one process each (CPU, gloo), for the
accelerate_configs/multinode_*_cpu.yaml templates.

Replay (DDP and ZeRO-3): a few configurations of tests/distributed/equivalence_run.py take the single-process step,
and each process is where a node's only process must be. Live (DDP and ZeRO-3): the engine and generator live on the
global main process only, the other node trains its share, and each node writes its own part of a checkpoint.
Failures: an environment failing on node 0, node 1's process killed, node 1's process stopped (a peer that vanishes
without closing its sockets): both nodes, or the survivor, exit non-zero with a clear error within a bound, and no
process is left behind.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import psutil
import pytest

from tests.helpers.launches import (EQUIVALENCE_RUNNER as RUNNER, LIVE_RUNNER, ROOT, assert_step_equals_single_process,
                                    launch, launch_env, runner_inputs)
from verifiers_rl.core.engine import free_port

pytestmark = pytest.mark.distributed

# Padded and packed rows, grpo / dr_grpo / token_mean, gradient clipping over both nodes, uneven ranks.
CONFIGS = ["grpo_token_packed64", "dr_grpo_token_padded3", "token_mean_padded2_clip", "grpo_uneven_ranks_padded1"]
# Given to the replay launches: every process's gloo group must carry it (transformers drops it on CPU).
REPLAY_DDP_TIMEOUT_S = 1234
LAUNCH_TIMEOUT_S = 300


@dataclass
class TwoNodeRun:
    """What two node launches did: exit codes (None: still running at the deadline, then killed), when each ended
    (seconds after the start), when the mid-run action fired, the logs, and processes alive after clean-up."""

    returncodes: list[int | None]
    ended_s: list[float | None]
    action_s: float | None
    logs: list[str]
    leftover: list[int] = field(default_factory=list)

    def tail(self, node: int, chars: int = 5000) -> str:
        return self.logs[node][-chars:]


def _alive(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def run_two_nodes(
    config: str,
    node_args: Callable[[int], list[str]],
    logs: Path,
    timeout_s: float = LAUNCH_TIMEOUT_S,
    action: Callable[[list[psutil.Process], list[Path]], bool] | None = None,
    wait_for: tuple[int, ...] = (0, 1),
) -> TwoNodeRun:
    """Start node 0 and node 1 of a 2-machine launch of ``config`` at once; each runs ``node_args(rank)``.

    ``action(node_processes, log_paths)`` is polled while they run until it returns True (a mid-run fault). Every
    process of both launches (launcher, torchrun worker) is tracked while it lives; whatever still runs at the end
    is killed, and ``leftover`` lists what survived even that. The run ends when the nodes in ``wait_for`` have
    exited, or at ``timeout_s``.
    """
    port = str(free_port())
    env = launch_env()
    paths = [logs.with_name(f"{logs.name}.node{rank}.log") for rank in (0, 1)]
    launchers: list[subprocess.Popen] = []
    seen: dict[int, psutil.Process] = {}
    ended: list[float | None] = [None, None]
    action_s = None
    start = time.monotonic()
    try:
        for rank in (0, 1):
            command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", f"accelerate_configs/{config}",
                       "--num_machines", "2", "--machine_rank", str(rank), "--main_process_ip", "127.0.0.1",
                       "--main_process_port", port, *node_args(rank)]
            with paths[rank].open("w") as handle:
                launchers.append(subprocess.Popen(command, cwd=ROOT, env=env, stdout=handle, stderr=subprocess.STDOUT,
                                                  start_new_session=True))
        nodes = [psutil.Process(p.pid) for p in launchers]
        seen.update((node.pid, node) for node in nodes)
        while time.monotonic() - start < timeout_s and any(ended[rank] is None for rank in wait_for):
            for rank, launcher in enumerate(launchers):
                if ended[rank] is None and launcher.poll() is not None:
                    ended[rank] = time.monotonic() - start
            for node in nodes:
                try:
                    seen.update((child.pid, child) for child in node.children(recursive=True))
                except psutil.NoSuchProcess:
                    pass
            if action is not None and action_s is None and action(nodes, paths):
                action_s = time.monotonic() - start
            time.sleep(0.2)
    finally:
        for process in seen.values():
            if _alive(process):
                process.kill()
        for launcher in launchers:
            launcher.wait(timeout=30)
        psutil.wait_procs(list(seen.values()), timeout=10)
    return TwoNodeRun(
        returncodes=[code if ended[rank] is not None else None for rank, code in
                     enumerate(launcher.returncode for launcher in launchers)],
        ended_s=ended,
        action_s=action_s,
        logs=[path.read_text() for path in paths],
        leftover=[pid for pid, process in seen.items() if _alive(process)],
    )


def node_workers(node: psutil.Process) -> list[psutil.Process]:
    """The training processes torchrun started on one node (children of its launcher)."""
    return node.children(recursive=True)


def after_step(step: int, node: int, sig: signal.Signals, victim: int = 1):
    """An action: once node ``node`` logged step ``step``, send ``sig`` to node ``victim``'s training process."""

    def act(nodes: list[psutil.Process], paths: list[Path]) -> bool:
        if f"step {step}/" not in paths[node].read_text():
            return False
        for worker in node_workers(nodes[victim]):
            worker.send_signal(sig)
        return True

    return act


# --- replay: the step equals one process's ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def replay_runs(tmp_path_factory, tiny_model_dir):
    work = tmp_path_factory.mktemp("multinode_replay")
    common = [str(RUNNER), *runner_inputs(work, tiny_model_dir), "--only", *CONFIGS]
    single = launch([sys.executable], [*common, "--out", str(work / "single")], work / "single.log")
    assert single.returncode == 0, (work / "single.log").read_text()[-6000:]
    for backend in ("ddp", "zero3"):
        run = run_two_nodes(f"multinode_{backend}_cpu.yaml",
                            lambda rank: [*common, "--out", str(work / backend), "--ddp_timeout", str(REPLAY_DDP_TIMEOUT_S)],
                            work / backend)
        assert run.returncodes == [0, 0], f"{backend}: {run.returncodes}\n{run.tail(0)}\n--- node 1 ---\n{run.tail(1)}"
        assert not run.leftover
    return work


@pytest.mark.parametrize("backend", ["ddp", "zero3"])
@pytest.mark.parametrize("name", CONFIGS)
def test_two_node_step_equals_single_process_step(replay_runs, initial_parameters, backend, name):
    assert_step_equals_single_process(replay_runs / "single", replay_runs / backend, name, initial_parameters, backend)


def assert_one_process_per_node(ranks: list[dict]) -> None:
    """World size 2 over node ranks 0 and 1, local rank 0 on both; the global main process is node 0's only."""
    for rank, record in enumerate(ranks):
        assert record["env"] == {"RANK": str(rank), "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1",
                                 "GROUP_RANK": str(rank)}
        assert (record["process_index"], record["local_process_index"], record["num_processes"]) == (rank, 0, 2)
        assert record["is_main_process"] == (rank == 0)
        assert record["is_local_main_process"]


@pytest.mark.parametrize("backend", ["ddp", "zero3"])
def test_two_nodes_of_one_process_each_and_both_train(replay_runs, backend):
    for name in CONFIGS:
        ranks = [json.loads((replay_runs / backend / f"{name}.rank{rank}.json").read_text()) for rank in (0, 1)]
        assert_one_process_per_node(ranks)
        # Both nodes trained a share of the batch (uneven ranks included).
        assert all(record["loss_tokens"] > 0 for record in ranks), (name, [r["loss_tokens"] for r in ranks])
        # --ddp_timeout reached the gloo group, which transformers starts without it on CPU (a stopped peer would
        # otherwise hold the other node for torch's default 30 minutes).
        assert all(record["pg_timeout_s"] == REPLAY_DDP_TIMEOUT_S for record in ranks)


# --- live ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["ddp", "zero3"])
def test_live_two_nodes_generate_on_the_global_main_process_only(tiny_model_dir, tmp_path, backend):
    """Each node gets its own --out (two machines without a shared filesystem): what lands where is what each
    node wrote."""
    steps = 3
    outs = [tmp_path / "node0", tmp_path / "node1"]
    run = run_two_nodes(f"multinode_{backend}_cpu.yaml",
                        lambda rank: [str(LIVE_RUNNER), "--model", tiny_model_dir, "--out", str(outs[rank]),
                                      "--k", "1", "--steps", str(steps), "--save"],
                        tmp_path / "live")
    assert run.returncodes == [0, 0], f"{run.tail(0)}\n--- node 1 ---\n{run.tail(1)}"
    assert not run.leftover
    ranks = [json.loads((outs[rank] / f"k1.rank{rank}.json").read_text()) for rank in (0, 1)]
    assert_one_process_per_node(ranks)
    assert [(r["engine"], r["generator"]) for r in ranks] == [(True, True), (False, False)]
    # Node 1 received its own micro-batches every step and trained on them.
    assert all(len(r["loss_tokens"]) == steps and min(r["loss_tokens"]) > 0 for r in ranks), ranks
    record = json.loads((outs[0] / "k1.json").read_text())
    assert record["num_processes"] == 2 and len(record["reward"]) == steps
    assert max(record["staleness_max"]) == 1
    assert f"step {steps}/{steps}" in run.logs[0] and "step 1/" not in run.logs[1]  # progress: global main only

    # Saves: the model, tokenizer, trainer and run state on the main node only; every node writes its RNG state and,
    # under ZeRO-3, its own optimizer and parameter shards (so a resume needs one folder that every node sees).
    checkpoint = f"trainer_k1/checkpoint-{steps}"
    shards = {rank: {f"{checkpoint}/global_step{steps}/zero_pp_rank_{rank}_mp_rank_00_{kind}_states.pt"
                     for kind in ("model", "optim")} if backend == "zero3" else set() for rank in (0, 1)}
    for name in ("model.safetensors", "tokenizer.json", "trainer_state.json", "verifiers_rl_state.json",
                 "rng_state_0.pth", *(["optimizer.pt"] if backend == "ddp" else [])):
        assert (outs[0] / checkpoint / name).is_file(), name
    assert all((outs[0] / shard).is_file() for shard in shards[0]), shards[0]
    assert (outs[0] / "final_k1" / "model.safetensors").is_file()
    node1_files = {str(path.relative_to(outs[1])) for path in outs[1].rglob("*") if path.is_file()}
    # Node 1's part records what it holds in its own manifest (merged folders keep both nodes' records).
    assert node1_files == {f"{checkpoint}/rng_state_1.pth", f"{checkpoint}/verifiers_rl_manifest-1.json",
                           "k1.rank1.json", *shards[1]}


# --- failures -----------------------------------------------------------------------------------------------------


def live_args(tiny_model_dir: str, out: Path, *extra: str) -> Callable[[int], list[str]]:
    return lambda rank: [str(LIVE_RUNNER), "--model", tiny_model_dir, "--out", str(out), "--k", "1", *extra]


def test_environment_failing_on_node0_stops_both_nodes(tiny_model_dir, tmp_path):
    run = run_two_nodes("multinode_ddp_cpu.yaml",
                        live_args(tiny_model_dir, tmp_path / "out", "--steps", "5", "--env",
                                  "tests.live.toy_env:load_failing_environment", "--env_args", '{"fail_after": 40}'),
                        tmp_path / "env", timeout_s=150)
    assert None not in run.returncodes, f"a node hung:\n{run.tail(0)}\n--- node 1 ---\n{run.tail(1)}"
    assert run.returncodes[0] != 0 and run.returncodes[1] != 0
    assert max(run.ended_s) < 120
    assert "the game server went away" in run.logs[0]
    assert "The main process failed:" in run.logs[1] and "the game server went away" in run.logs[1]
    assert not run.leftover


def test_node1_killed_stops_node0_with_a_clear_error(tiny_model_dir, tmp_path):
    run = run_two_nodes("multinode_ddp_cpu.yaml", live_args(tiny_model_dir, tmp_path / "out", "--steps", "2000"),
                        tmp_path / "kill", action=after_step(2, node=0, sig=signal.SIGKILL))
    assert run.action_s is not None, run.tail(0)
    assert run.returncodes[0] is not None, f"node 0 hung after node 1 died:\n{run.tail(0)}"
    assert run.returncodes[0] != 0 and run.returncodes[1] != 0
    assert run.ended_s[0] - run.action_s < 30
    # Both "nodes" run on this machine, so node 0 sees node 1's process gone and names it.
    assert "a collective between the 2 processes failed on process 0: process 1 (pid " in run.logs[0], run.tail(0)
    assert ") died (killed: SIGKILL" in run.logs[0], run.tail(0)
    # How to go on: this run saves no checkpoint, so the note says a new launch starts over.
    assert "no checkpoint in --output_dir" in run.logs[0] and "a new launch starts from the beginning" in run.logs[0]
    assert not run.leftover


def test_node1_stopped_node0_gives_up_after_ddp_timeout(tiny_model_dir, tmp_path):
    """A peer that stops answering without closing its sockets (a machine lost from the network; here a stopped
    process): node 0 waits in a collective until --ddp_timeout, then exits with an error naming that flag."""
    ddp_timeout = 20
    run = run_two_nodes("multinode_ddp_cpu.yaml",
                        live_args(tiny_model_dir, tmp_path / "out", "--steps", "2000", "--timeout_s", "10",
                                  "--ddp_timeout", str(ddp_timeout)),
                        tmp_path / "stop", timeout_s=200, action=after_step(2, node=0, sig=signal.SIGSTOP),
                        wait_for=(0,))
    assert run.action_s is not None, run.tail(0)
    assert run.returncodes[0] is not None, f"node 0 hung on a stopped peer:\n{run.tail(0)}"
    assert run.returncodes[0] != 0
    waited = run.ended_s[0] - run.action_s
    assert ddp_timeout - 2 < waited < ddp_timeout + 40, waited
    # gloo's own words vary with where it waited ("Timed out waiting 20000ms for recv", "Application timeout caused
    # pair closure" in DDP's all-reduce); the note names the flag.
    assert ("a collective between the 2 processes failed on process 0" in run.logs[0]
            and f"--ddp_timeout, now {ddp_timeout} s" in run.logs[0]), run.tail(0)
    assert not run.leftover  # the stopped node 1 was killed at the end


# --- caches shared by nodes -----------------------------------------------------------------------------------------


def test_model_cache_built_by_several_processes_at_once_is_published_whole(tmp_path, monkeypatch):
    """Every process of a launch (every node, with a shared home) may build `--model tiny` at once: each builds in
    its own folder and renames it into place, so none reads half a model; the first to finish wins."""
    import hashlib

    from verifiers_rl.core import models

    monkeypatch.setenv("VERIFIERS_RL_CACHE", str(tmp_path))
    folder = models.default_tiny_model_dir()
    mine = models.build_tiny_model(models._partial(folder))
    theirs = models.build_tiny_model(folder.with_name(f"{folder.name}.partial-othernode-1"), seed=1)
    digest = hashlib.sha256((theirs / "model.safetensors").read_bytes()).hexdigest()
    models._publish(theirs, folder)  # the other process finished first
    models._publish(mine, folder)
    assert sorted(path.name for path in tmp_path.iterdir()) == [folder.name]  # no partial folder left
    assert hashlib.sha256((folder / "model.safetensors").read_bytes()).hexdigest() == digest
    assert models.resolve_model("tiny") == str(folder)
    assert hashlib.sha256((folder / "model.safetensors").read_bytes()).hexdigest() == digest  # reused, not rebuilt
