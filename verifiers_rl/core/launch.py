"""Process set-up of a launched run: one function, called before transformers sets up the device and process group.

Building an ``RLConfig`` has no side effect (it is a value); ``prepare_process`` does what a launched process needs
before its process group starts. ``RLConfig`` calls it the first time anything asks for its device, world size or
process index (the HF Trainer does so first thing), and entry points may call it themselves (it is idempotent).
"""

from __future__ import annotations

import contextlib
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch


def env_flag(name: str) -> bool:
    return os.environ.get(name, "").lower() in ("1", "true", "yes")


def launched_world_size() -> int:
    """The number of processes the launcher started (its ``WORLD_SIZE``), without starting a process group."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def launched_rank() -> int:
    """This process's global rank in the launch (its ``RANK``; 0 unlaunched)."""
    return int(os.environ.get("RANK", "0"))


def launched_mixed_precision() -> str:
    """The mixed precision ``accelerate launch`` asked for (its config file's ``mixed_precision`` or its
    ``--mixed_precision``, passed as ``ACCELERATE_MIXED_PRECISION``): "no", "bf16", "fp16" or "fp8"."""
    return os.environ.get("ACCELERATE_MIXED_PRECISION", "no").lower()


def launched_fsdp() -> bool:
    """Whether ``accelerate launch`` asked for FSDP (a config file's ``distributed_type: FSDP`` or ``--use_fsdp``,
    passed as ``ACCELERATE_USE_FSDP``)."""
    return os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"


# A source checkout's root, where accelerate_configs/ lies (site-packages in an installed wheel, which has none).
REPOSITORY = Path(__file__).resolve().parents[2]
DEEPSPEED_CONFIG_FILE = "ACCELERATE_DEEPSPEED_CONFIG_FILE"


@contextlib.contextmanager
def deepspeed_config_found():
    """While TrainingArguments builds Accelerate's DeepSpeed plugin, which opens the launch's ``deepspeed_config_file``
    (``ACCELERATE_DEEPSPEED_CONFIG_FILE``) from the working directory: a relative path missing there but present in
    this repository (how accelerate_configs/*.yaml name accelerate_configs/ds_zero3*.json) stands for that file, so
    a launch from another folder works; one found nowhere is a ValueError naming it. The environment is left as it
    was."""
    name = os.environ.get(DEEPSPEED_CONFIG_FILE, "")
    if not env_flag("ACCELERATE_USE_DEEPSPEED") or not name.endswith(".json") or Path(name).is_file():
        yield
        return
    shipped = REPOSITORY / name
    if Path(name).is_absolute() or not shipped.is_file():
        raise ValueError(f"The accelerate config's deepspeed_config_file {name} does not exist (Accelerate opens it "
                         f"from the working directory, {os.getcwd()}): launch from the folder it is relative to, or "
                         "give its absolute path in the accelerate config.")
    os.environ[DEEPSPEED_CONFIG_FILE] = str(shipped)
    try:
        yield
    finally:
        os.environ[DEEPSPEED_CONFIG_FILE] = name


def prepare_process(args) -> None:
    """Before transformers starts this process's device and process group (``args``: an ``RLConfig``):

    - on CPU under DeepSpeed, skip building DeepSpeed's shared-memory all-reduce op (50-85 s per start on 2 cores;
      only inference all-reduce uses it, training goes through gloo);
    - ``ACCELERATE_USE_CPU=1`` with DeepSpeed becomes ``use_cpu=True`` and leaves the environment: the env flag gives
      the Trainer a plain CPU Accelerator that ignores the DeepSpeed plugin, and the ZeRO-3-partitioned model would
      be wrapped in DDP ("'weight' must be 2-D"); ``use_cpu`` keeps both;
    - a launched CPU run starts its gloo group with ``--ddp_timeout``: transformers passes the timeout to GPU and
      DeepSpeed groups but not to a ``use_cpu`` one, whose collectives would then wait torch's default 30 minutes
      on a peer that stops answering without closing its sockets. The Trainer reuses this group;
    - in workers restarted by torch elastic (``torchrun`` / ``accelerate launch --max_restarts N``), that group
      rendezvouses under a key prefix of its own restart (``restart_store``).
    """
    _skip_deepspeed_cpu_shm_op()
    if env_flag("ACCELERATE_USE_CPU") and env_flag("ACCELERATE_USE_DEEPSPEED"):
        os.environ.pop("ACCELERATE_USE_CPU")
        args.use_cpu = True
    if (args.use_cpu or env_flag("ACCELERATE_USE_CPU")) and launched_world_size() > 1:
        if not torch.distributed.is_initialized():
            from accelerate import PartialState

            timeout = timedelta(seconds=args.ddp_timeout)
            store = restart_store(timeout)
            PartialState(cpu=True, backend=args.ddp_backend, timeout=timeout, **({"store": store} if store else {}))
        if env_flag("ACCELERATE_USE_DEEPSPEED"):
            # DeepSpeed's own view of that group: without it, a model built under zero.Init before the engine
            # starts (TRL's reference model) takes the world size for 1 and fails DeepSpeed's batch-size check.
            import deepspeed

            deepspeed.init_distributed(dist_backend=torch.distributed.get_backend(), auto_mpi_discovery=False)


def restart_count() -> int:
    """How many times torch elastic has restarted this launch's workers (0 in the first attempt, or unlaunched)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def restart_store(timeout: timedelta):
    """The rendezvous store of a restarted worker: the launcher's store under a prefix of this restart; None in a
    first attempt (the usual ``env://`` rendezvous) or when the launcher hosts no store for its workers.

    torch elastic's static rendezvous (the default of ``torchrun`` without ``--standalone``, and of the accelerate
    configs here) keeps ONE store for every attempt, and ``env://`` workers read their process group's keys from it
    without a prefix per attempt. A restarted worker then reads the dead attempt's addresses and fails to connect
    ("Gloo connectFullMesh failed ... Connection refused"), and the restart is wasted. A prefix per restart gives
    each attempt keys of its own, whatever the rendezvous backend.
    """
    count = restart_count()
    if count == 0 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    from torch.distributed import PrefixStore, TCPStore

    store = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), launched_world_size(), is_master=False,
                     timeout=timeout)
    return PrefixStore(f"verifiers_rl/restart_{count}", store)


def _skip_deepspeed_cpu_shm_op() -> None:
    if torch.cuda.is_available() or not env_flag("ACCELERATE_USE_DEEPSPEED"):
        return
    import deepspeed.comm.torch  # noqa: F401  (the attribute of that name is torch itself, hence sys.modules)

    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
