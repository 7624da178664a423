"""What a checkpoint adds to the HF Trainer's, so a resumed run continues exactly where the saved one stood.

HF's ``checkpoint-N/`` holds the model, tokenizer, optimizer, scheduler, RNG states and trainer state. Beside them:

- ``verifiers_rl_state.json`` (``RunState``): the rollout source's position (the next batch to train, how many
  optimizer steps the current batch has had), what identifies the run's data and model (checked on resume), and
  the ``--save_rollouts_path`` length at the checkpoint;
- ``curriculum.json`` (a difficulty curriculum only): its state after the batches generated so far, pending ones
  included (each environment's draw cursor, each prompt's recent pass fractions, the prompts set aside);
- ``pending/batch-<b>.jsonl``: batches a live run had generated ahead but not trained yet (sampled by weights older
  than the checkpoint's, so they cannot be regenerated after a resume); under continuous generation one file of the
  finished groups not yet trained, and the state file lists the positions in flight (generated again on resume);
- ``rank_batch-<r>.safetensors`` + ``rank_batch-<r>.json``: each rank's slice of a batch that is part-way through its ``num_iterations`` updates (its
  proximal log-probs come from weights older than the checkpoint's).
- ``reference_model.safetensors`` (``--sync_ref_model`` only): the reference model, which moves towards the policy
  during the run (under LoRA: the reference copy of the adapters).

A checkpoint is written under ``.partial-checkpoint-N/`` and renamed to ``checkpoint-N`` when complete, so a run
killed while saving never leaves a folder that ``--resume_from_checkpoint latest`` would pick.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import logging
import os
import re
import shutil
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from verifiers_rl.config.lora import command_flags
from verifiers_rl.core.errors import CheckpointError, OutputDirInUseError  # noqa: F401  (raised, exported)
from verifiers_rl.core.models import ADAPTER_CONFIG
from verifiers_rl.core.rollout import Rollout, read_rollouts, write_rollouts

logger = logging.getLogger(__name__)

STATE_FILE = "verifiers_rl_state.json"
TRAINER_STATE_FILE = "trainer_state.json"
PENDING_DIR = "pending"
CURRICULUM_FILE = "curriculum.json"
REFERENCE_FILE = "reference_model.safetensors"  # the reference model, when --sync_ref_model moves it
PARTIAL_PREFIX = ".partial-"
STATE_FORMAT = 1
# Config entries that say nothing about the architecture (paths, versions, precision, runtime switches).
_VOLATILE_CONFIG_KEYS = {
    "_name_or_path", "transformers_version", "torch_dtype", "dtype", "use_cache", "_attn_implementation",
    "_attn_implementation_autoset", "architectures", "_commit_hash", "output_attentions", "output_hidden_states",
}


@dataclass
class RunState:
    """The part of a run's state that the HF Trainer does not keep (``verifiers_rl_state.json``)."""

    global_step: int
    next_batch: int  # the batch the next new step trains on
    iteration: int  # optimizer steps taken on the batch before ``next_batch`` (< num_iterations: part-way)
    num_iterations: int
    rollouts_per_step: int
    world_size: int
    zero_stage: int  # 0 when not under DeepSpeed
    model: dict[str, Any]  # the architecture config (``model_signature``)
    source: dict[str, Any]  # {"kind": "replay", "path", "sha256"} or {"kind": "live", "environment", "rows_sha256", ...}
    pending_batches: list[int] = field(default_factory=list)
    # Batch at a time: each pending batch's generation counts (``Batch.stats``: groups kept and dropped, refills,
    # curriculum), logged when it is trained, by batch index (a JSON key).
    pending_stats: dict[str, dict[str, float]] = field(default_factory=dict)
    save_rollouts: dict[str, Any] | None = None  # {"path", "bytes"}: the rollouts file's length at the checkpoint
    # Continuous generation (--groups_in_flight): {"next_position", "in_flight": [[position, retry], ...], "counts"
    # (since the last batch), "dropped_positions"}; its pending groups are one pending batch. None: batch at a time.
    generator: dict[str, Any] | None = None
    format: int = STATE_FORMAT

    def mid_batch(self) -> bool:
        return 0 < self.iteration < self.num_iterations


def model_signature(model) -> dict[str, Any]:
    """The model's architecture: its config without paths, versions and precision (two runs that may share a
    checkpoint have equal signatures)."""
    config = getattr(model, "config", None)
    if config is None:
        return {}
    values = {key: value for key, value in config.to_dict().items() if key not in _VOLATILE_CONFIG_KEYS}
    return json.loads(json.dumps(values, sort_keys=True, default=str))  # as read back from the state file


def rows_sha256(rows) -> str:
    """A fingerprint of an environment's training rows (prompt, answer, info), to tell a changed dataset."""
    digest = hashlib.sha256()
    for row in rows:
        digest.update(json.dumps([row.prompt, row.answer, row.info], sort_keys=True, default=str).encode())
    return digest.hexdigest()


# --- finding a checkpoint -------------------------------------------------------------------------------------------


def resolve_checkpoint(spec: str | bool, output_dir: str | Path) -> Path | None:
    """The checkpoint ``--resume_from_checkpoint`` names: a folder, ``latest`` (or ``True``) for the newest intact
    ``checkpoint-N`` in ``output_dir``, or ``auto``: the same, or None when there is none (start fresh: the same
    command for the first launch and every restart). A damaged newest checkpoint is skipped with a warning naming
    it and its file; a damaged folder named explicitly is refused. Raises ``CheckpointError`` naming what is wrong."""
    word = "latest" if spec is True else str(spec).lower()
    if word in ("latest", "auto"):
        for path in _checkpoints_newest_first(Path(output_dir)):
            problem = _problem(path)
            if problem is None:
                return path
            logger.warning("Skipping %s: %s. Trying an older checkpoint.", path, problem)
        if word == "auto":
            logger.info("--resume_from_checkpoint auto: no intact checkpoint in %s; starting fresh.", output_dir)
            return None
        raise CheckpointError(
            f"--resume_from_checkpoint latest: no intact checkpoint-N folder in --output_dir {str(output_dir)!r}. "
            "Checkpoints are written with --save_strategy steps --save_steps N (and when a run is preempted); "
            "--resume_from_checkpoint auto starts fresh when there is none."
        )
    path = Path(str(spec))
    if not path.is_dir():
        raise CheckpointError(f"--resume_from_checkpoint {str(spec)!r}: no such folder.")
    inside = _checkpoints_newest_first(path)
    if inside and not (path / STATE_FILE).is_file():  # a run's folder, not one of its checkpoints
        raise CheckpointError(
            f"--resume_from_checkpoint {str(spec)!r} is a run's folder, not a checkpoint: name one of its checkpoints "
            f"({inside[0]}), or pass --resume_from_checkpoint latest with --output_dir {str(spec)!r}.")
    problem = _problem(path)
    if problem is not None:
        raise CheckpointError(f"--resume_from_checkpoint {str(path)!r} cannot be resumed from: {problem}.")
    return path


def newest_complete_checkpoint(output_dir: str | Path) -> Path | None:
    """The newest ``checkpoint-N`` of ``output_dir`` with both state files, or None. Cheap (its manifest is not
    checked: a resume does that), for messages written while a run is being torn down."""
    for path in _checkpoints_newest_first(Path(output_dir)):
        if all((path / name).is_file() for name in (TRAINER_STATE_FILE, STATE_FILE)):
            return path
    return None


def check_fresh_output_dir(output_dir: str | Path) -> None:
    """Refuse to start a run afresh in an ``output_dir`` holding checkpoints: its own would overwrite them one by one,
    and --save_total_limit rotation (newest by step) would delete the new run's as the oldest."""
    found = _checkpoints_newest_first(Path(output_dir))
    if found:
        names = found[0].name if len(found) == 1 else f"{found[-1].name} to {found[0].name}"
        raise OutputDirInUseError(
            f"--output_dir {str(output_dir)!r} holds checkpoints of an earlier run ({names}): a new run there would "
            "write over them. Continue that run with --resume_from_checkpoint latest (or auto), or train into "
            "another --output_dir.")


def _checkpoints_newest_first(output_dir: Path) -> list[Path]:
    if not output_dir.is_dir():
        return []
    found = [p for p in output_dir.iterdir() if p.is_dir() and re.fullmatch(r"checkpoint-\d+", p.name)]
    return sorted(found, key=lambda p: int(p.name.split("-")[1]), reverse=True)


def _problem(path: Path) -> str | None:
    """What makes ``path`` unusable (a missing state file, a file that differs from its manifest), or None."""
    missing = [name for name in (TRAINER_STATE_FILE, STATE_FILE) if not (path / name).is_file()]
    if missing:
        return (f"it is not a complete verifiers_rl checkpoint (no {', '.join(missing)}): a run killed while saving "
                f"leaves {PARTIAL_PREFIX}checkpoint-N, never resumed")
    return verify_manifest(path) or _unreadable(path)


def _unreadable(folder: Path) -> str | None:
    """The first file of ``folder`` that does not read as data (JSON or safetensors cut short, where no manifest
    said so; a torch file holding more than tensors, e.g. a crafted pickle), or None. A resume reads these whole;
    here only their headers and pickles (torch files memory-mapped)."""
    from safetensors import SafetensorError, safe_open

    from verifiers_rl import compat

    for path in sorted(folder.rglob("*.json")):
        try:
            json.loads(path.read_bytes())  # bytes: UTF-8 whatever the locale
        except ValueError as error:  # UnicodeDecodeError included
            return f"{path.relative_to(folder)} does not parse as JSON ({error}): cut short?"
    for path in sorted(folder.rglob("*.safetensors")):
        try:
            with safe_open(path, "pt"):
                pass
        except (SafetensorError, OSError) as error:
            return f"{path.relative_to(folder)} does not parse as safetensors ({error}): cut short?"
    for path in sorted([*folder.rglob("*.pt"), *folder.rglob("*.pth")]):  # HF's and DeepSpeed's (global_step*/)
        try:
            compat.load_as_data(path, str(folder), map_location="cpu", mmap=zipfile.is_zipfile(path))
        except CheckpointError as error:
            return str(error)
    return None


# --- what a checkpoint holds ------------------------------------------------------------------------------------------

# One per publishing process (the main one, and the local main of a node without the shared folder): folders merged
# from several nodes keep every node's record.
MANIFEST_PREFIX = "verifiers_rl_manifest"


def manifest_name(process_index: int = 0) -> str:
    return f"{MANIFEST_PREFIX}-{process_index}.json"


def _is_manifest(path: Path) -> bool:
    return path.name.startswith(MANIFEST_PREFIX) and path.suffix == ".json"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_manifest(folder: Path, name: str = manifest_name()) -> None:
    """Record every file of ``folder`` (ours and HF's): relative path, size, SHA-256; written last, when the folder
    is complete, by the process that publishes it."""
    files = {str(p.relative_to(folder)): {"bytes": p.stat().st_size, "sha256": _sha256(p)}
             for p in sorted(folder.rglob("*")) if p.is_file() and not _is_manifest(p)}
    (folder / name).write_text(json.dumps({"format": 1, "files": files}, indent=1, sort_keys=True))


def verify_manifest(folder: Path) -> str | None:
    """None when every file the manifest lists is there with its size and checksum; else what is wrong, naming the
    file. A checkpoint without a manifest (an older version wrote it) passes, with a warning."""
    manifests = sorted(p for p in folder.iterdir() if _is_manifest(p))
    if not manifests:
        logger.warning("%s has no %s-*.json (written before checkpoints recorded their files): not verified.", folder,
                       MANIFEST_PREFIX)
        return None
    files = {}
    for manifest in manifests:
        try:
            files.update(json.loads(manifest.read_text())["files"])
        except (ValueError, KeyError) as error:
            return f"its {manifest.name} is damaged ({error})"
    for name, expected in files.items():
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != expected["bytes"]:
            return f"{name} has {path.stat().st_size} bytes, {expected['bytes']} when it was written (cut short?)"
        if _sha256(path) != expected["sha256"]:
            return f"{name} differs from what was written (its SHA-256 changed)"
    return None


# --- reading and writing --------------------------------------------------------------------------------------------


def save_run_state(folder: Path, state: RunState, pending: dict[int, list[Rollout]],
                   curriculum: dict | None = None, stats: dict[int, dict[str, float]] | None = None) -> None:
    """Write ``state``, the pending batches, their generation counts (``stats``, by batch) and the ``curriculum``'s
    state (when there is one) into ``folder`` (main process)."""
    if curriculum is not None:
        (folder / CURRICULUM_FILE).write_text(json.dumps(curriculum, sort_keys=True))
    if pending:
        (folder / PENDING_DIR).mkdir(exist_ok=True)
        for index, rollouts in pending.items():
            write_rollouts(folder / PENDING_DIR / f"batch-{index}.jsonl", rollouts)
    state.pending_batches = sorted(pending)
    state.pending_stats = {str(index): dict(stats[index]) for index in sorted(pending) if stats and index in stats}
    (folder / STATE_FILE).write_text(json.dumps(dataclasses.asdict(state), indent=1, sort_keys=True))


def load_run_state(folder: Path) -> RunState:
    record = json.loads((folder / STATE_FILE).read_text())
    if record.get("format") != STATE_FORMAT:
        raise CheckpointError(f"{folder / STATE_FILE}: state format {record.get('format')!r}, expected {STATE_FORMAT}.")
    return RunState(**record)


def load_curriculum(folder: Path) -> dict | None:
    """The curriculum state a checkpoint holds, or None (written by a run without a curriculum)."""
    path = folder / CURRICULUM_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def load_pending(folder: Path, state: RunState) -> dict[int, list[Rollout]]:
    return {index: read_rollouts(folder / PENDING_DIR / f"batch-{index}.jsonl") for index in state.pending_batches}


def pending_stats(state: RunState) -> dict[int, dict[str, float]]:
    """The pending batches' generation counts, by batch index (none in a checkpoint written before they were kept)."""
    return {int(index): dict(stats) for index, stats in state.pending_stats.items()}


def check_optimizer_saved(folder: Path) -> None:
    """Raise ``CheckpointError`` when ``folder`` holds no optimizer state (HF's optimizer.pt, FSDP's optimizer_0/ or
    DeepSpeed's global_step*/): HF would resume it with a fresh optimizer and schedule, silently not the saved run."""
    if any(folder.glob("optimizer*")) or any(folder.glob("global_step*")):
        return
    raise CheckpointError(
        f"{folder} holds no optimizer state (written with --save_only_model): a run resumed from it would restart "
        "the optimizer's moments and learning-rate schedule, not continue the saved run. Start a new run from its "
        f"weights (--model {folder}), or save checkpoints to resume without --save_only_model."
    )


# The adapter settings that decide which tensors a checkpoint's adapters hold and what they compute.
_ADAPTER_KEYS = ("peft_type", "r", "lora_alpha", "target_modules", "target_parameters", "modules_to_save", "bias",
                 "use_dora", "use_rslora")


def adapter_signature(config) -> dict[str, Any]:
    """An adapter config's (a peft ``LoraConfig``, or its saved JSON as a dict) ``_ADAPTER_KEYS``, sets as sorted
    lists and enums as their names: a saved one and a built one compare equal when they are the same adapters."""
    values = config if isinstance(config, dict) else config.to_dict()
    signature = {}
    for key in _ADAPTER_KEYS:
        value = values.get(key)
        value = getattr(value, "value", value)
        signature[key] = sorted(value) if isinstance(value, (set, list, tuple)) else value
    return signature


def check_adapters(folder: Path, model) -> None:
    """Raise ``CheckpointError`` when the checkpoint in ``folder`` and this run's ``model`` disagree on LoRA adapters
    (HF would fail opaquely loading it: no checkpoint index, or a size mismatch per tensor)."""
    saved_file = folder / ADAPTER_CONFIG
    saved = adapter_signature(json.loads(saved_file.read_text())) if saved_file.is_file() else None
    configs = getattr(model, "peft_config", None) or {}
    current = adapter_signature(next(iter(configs.values()))) if configs else None
    if saved == current:
        return
    if current is None:
        raise CheckpointError(f"Cannot resume from {folder}: it holds adapters ({saved}), this run trains the whole "
                              "model. Resume it with the same peft_config (RLTrainer(..., peft_config=...); on the "
                              f"command: {command_flags(saved)}), or start a new run.")
    if saved is None:
        raise CheckpointError(f"Cannot resume from {folder}: it holds the whole model, this run trains adapters "
                              f"(peft_config {current}). Resume it without peft_config (on the command: without "
                              "--use_peft), or start a new run.")
    raise CheckpointError(f"Cannot resume from {folder}: its adapters are {saved}, this run's peft_config "
                          f"{current}. Resume it with the same peft_config (on the command: {command_flags(saved)}).")


def check_fits(saved: RunState, current: RunState, folder: Path) -> None:
    """Raise ``CheckpointError`` listing every way the checkpoint in ``folder`` does not fit this run (a run
    resumed from it would not continue the saved run)."""
    problems = []
    if saved.model != current.model:
        keys = sorted(k for k in set(saved.model) | set(current.model) if saved.model.get(k) != current.model.get(k))
        shown = ", ".join(f"{k}: {saved.model.get(k)!r} there, {current.model.get(k)!r} here" for k in keys[:4])
        problems.append(f"the model differs ({shown}; --model)")
    if saved.source.get("kind") != current.source.get("kind"):
        problems.append(
            f"it trained on {saved.source.get('kind')} rollouts, this run on {current.source.get('kind')} "
            "(--rollouts_path / --env)"
        )
    else:
        for key, flag in (("sha256", "--rollouts_path"), ("environment", "--env"), ("rows_sha256", "--env / --env_args"),
                          ("num_generations", "--num_generations"), ("seed", "--seed")):
            if key in saved.source and saved.source[key] != current.source.get(key):
                what = {"sha256": "the rollouts file's contents", "rows_sha256": "the environment's rows"}.get(key, key)
                problems.append(f"{what} differ ({saved.source[key]!r} there, {current.source.get(key)!r} here; {flag})")
    for name, flag in (("rollouts_per_step", "--rollouts_per_step"), ("num_iterations", "--num_iterations")):
        if getattr(saved, name) != getattr(current, name):
            problems.append(f"{name} is {getattr(saved, name)} there, {getattr(current, name)} here ({flag})")
    if saved.zero_stage != current.zero_stage:
        problems.append(f"DeepSpeed ZeRO stage {saved.zero_stage} there, {current.zero_stage} here (the launch config)")
    elif saved.zero_stage and saved.world_size != current.world_size:
        problems.append(
            f"DeepSpeed shards were saved by {saved.world_size} processes, this run has {current.world_size} "
            "(launch with the same number of processes)"
        )
    elif saved.mid_batch() and saved.world_size != current.world_size:
        problems.append(
            f"it stopped part-way through a batch split over {saved.world_size} processes, this run has "
            f"{current.world_size} (launch with the same number of processes)"
        )
    if problems:
        raise CheckpointError(f"Cannot resume from {folder}: " + "; ".join(problems) + ".")


# --- writing a checkpoint atomically --------------------------------------------------------------------------------


def partial_root(output_dir: str | Path, step: int) -> Path:
    """Where checkpoint ``step`` is written before it is complete (HF writes its ``checkpoint-N`` inside)."""
    return Path(output_dir) / f"{PARTIAL_PREFIX}checkpoint-{step}"


def _fsync_tree(folder: Path) -> None:
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            with path.open("rb") as handle:
                os.fsync(handle.fileno())
    _fsync_dir(folder)


def _fsync_dir(folder: Path) -> None:
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def disk_full(error: BaseException, folder: str | Path) -> bool:
    """Whether writing into ``folder`` failed for lack of space: ENOSPC / EDQUOT, its message in another error's text
    (safetensors' SafetensorError), or (torch.save reports a full disk as a RuntimeError of its stream) less than
    1% / 16 MiB left on its device."""
    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    if any(os.strerror(code) in str(error) for code in (errno.ENOSPC, errno.EDQUOT)):
        return True
    usage = shutil.disk_usage(folder)
    return usage.free < max(usage.total // 100, 16 * 2**20) if usage.total > 16 * 2**20 else usage.free < usage.total // 20


def publish(root: Path, final: Path, process_index: int = 0) -> None:
    """Move the complete checkpoint written under ``root`` to ``final`` in one rename (replacing an older folder
    of that name), then remove ``root``. Files are flushed to disk first, so the renamed folder is whole even after
    a machine crash."""
    written = root / final.name
    write_manifest(written, manifest_name(process_index))
    _fsync_tree(written)
    stale = None
    if final.exists():
        stale = final.with_name(f"{PARTIAL_PREFIX}stale-{final.name}")
        shutil.rmtree(stale, ignore_errors=True)
        final.rename(stale)
    written.rename(final)
    _fsync_dir(final.parent)
    shutil.rmtree(root, ignore_errors=True)
    if stale is not None:
        shutil.rmtree(stale, ignore_errors=True)


# --- a rank's slice of a batch part-way through its updates --------------------------------------------------------
# Data, not code: the tensors in a safetensors file, the rest as JSON naming only the dataclasses below. Nothing of a
# checkpoint is unpickled (a pickle can run code when it is loaded).

RANK_BATCH_TENSORS = "rank_batch-{rank}.safetensors"
RANK_BATCH_RECORD = "rank_batch-{rank}.json"


def _record_types() -> dict[str, type]:
    from verifiers_rl.training.batching import BatchStats, MicroBatch, RankBatch
    from verifiers_rl.training.loss import GlobalCounts
    from verifiers_rl.training.prefix import SharedPrefixRows

    return {cls.__name__: cls for cls in (RankBatch, MicroBatch, BatchStats, GlobalCounts, SharedPrefixRows)}


def _to_record(value, tensors: dict, path: str):
    import torch

    if isinstance(value, torch.Tensor):
        tensors[path] = value.detach().cpu().clone().contiguous()  # safetensors refuses tensors sharing memory
        return {"tensor": path}
    if dataclasses.is_dataclass(value):
        fields = {f.name: _to_record(getattr(value, f.name), tensors, f"{path}.{f.name}")
                  for f in dataclasses.fields(value)}
        return {"dataclass": type(value).__name__, "fields": fields}
    if isinstance(value, (list, tuple)):
        return {"list": [_to_record(item, tensors, f"{path}.{i}") for i, item in enumerate(value)]}
    if isinstance(value, dict):
        return {"dict": {str(k): _to_record(v, tensors, f"{path}.{k}") for k, v in value.items()}}
    return {"value": value}


def _from_record(record, tensors: dict, types: dict[str, type], where: str):
    if "tensor" in record:
        return tensors[record["tensor"]]
    if "dataclass" in record:
        cls = types.get(record["dataclass"])
        if cls is None:
            raise CheckpointError(f"{where}: unknown record type {record['dataclass']!r}.")
        return cls(**{k: _from_record(v, tensors, types, where) for k, v in record["fields"].items()})
    if "list" in record:
        return [_from_record(item, tensors, types, where) for item in record["list"]]
    if "dict" in record:
        return {k: _from_record(v, tensors, types, where) for k, v in record["dict"].items()}
    return record["value"]


def save_rank_batch(folder: Path, rank: int, rank_batch) -> None:
    """Keep rank ``rank``'s slice of a batch part-way through its updates (its proximal log-probs came from
    weights older than the checkpoint's, so it cannot be planned again): tensors in safetensors, the rest JSON."""
    from safetensors.torch import save_file

    tensors: dict = {}
    record = _to_record(rank_batch, tensors, "rank_batch")
    save_file(tensors, str(Path(folder) / RANK_BATCH_TENSORS.format(rank=rank)))
    (Path(folder) / RANK_BATCH_RECORD.format(rank=rank)).write_text(json.dumps(record))


def load_rank_batch(folder: Path, rank: int):
    """The slice ``save_rank_batch`` kept for ``rank``, on the CPU (no pickle is read)."""
    from safetensors.torch import load_file

    record_file = Path(folder) / RANK_BATCH_RECORD.format(rank=rank)
    tensors_file = Path(folder) / RANK_BATCH_TENSORS.format(rank=rank)
    for path in (record_file, tensors_file):
        if not path.is_file():
            raise CheckpointError(f"{folder}: {path.name} is missing (the checkpoint stopped part-way through a batch "
                                  "and keeps each rank's slice).")
    try:
        tensors = load_file(str(tensors_file))
        return _from_record(json.loads(record_file.read_text()), tensors, _record_types(), str(record_file))
    except CheckpointError:
        raise
    except Exception as error:  # noqa: BLE001 - safetensors' own errors included: a damaged or crafted file
        raise CheckpointError(f"{folder}: cannot read this rank's batch ({record_file.name}, {tensors_file.name}): "
                              f"{type(error).__name__}: {error}") from error
