"""A finished rank leaves the process group and exits 0: gloo's workers are idle before the interpreter shuts down.

Before ``wait_for_idle_gloo_workers`` a finished rank sometimes aborted at exit ("terminate called without an active
exception", exit -6; about 1 launch in 12 of ``tests/distributed/equivalence_run.py`` on a loaded 2-core machine): a
gloo worker released a collective's tensors after the interpreter had begun to shut down (core dump: the worker in
``AsyncBarrierWork`` -> ``AsyncAllgatherWork`` destructors taking the GIL). Real 2-process gloo launches here.
"""

from __future__ import annotations

import json
import subprocess
import sys

from tests.helpers.launches import launch_env
from verifiers_rl.training.distributed import _thread_states
from verifiers_rl.core.engine import free_port

RANK = """
import json, os, sys, torch, torch.distributed as dist
from verifiers_rl.training.distributed import GLOO_WORKER_THREAD, _thread_states, leave_process_group
dist.init_process_group("gloo")
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4))  # holds the group past its destruction
for _ in range(20):  # collectives whose outputs Python drops at once: the workers hold their last references
    dist.all_gather([torch.empty(1000) for _ in range(2)], torch.ones(1000))
idle = leave_process_group()
states = _thread_states(GLOO_WORKER_THREAD)
with open(os.path.join(sys.argv[1], f"rank{os.environ['RANK']}.json"), "w") as handle:  # not stdout: ranks interleave
    json.dump({"idle": idle, "states": states}, handle)
"""


def test_a_finished_rank_waits_for_gloos_workers_and_exits_cleanly(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    env = launch_env()
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                             "--master_port", str(free_port()), str(script), str(tmp_path)],
                            env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    for rank in (0, 1):
        # The workers outlive destroy_process_group (DDP holds the group), so there is something to wait for; a
        # torch that renamed them would make the wait a no-op: 0 found fails here.
        record = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert record["idle"] >= 1 and record["states"] == ["S"] * record["idle"], record


def test_thread_states_reads_this_process():
    assert _thread_states("no such thread name") == []
    with open("/proc/self/comm") as handle:
        assert "R" in _thread_states(handle.read().strip())  # the reading thread runs
