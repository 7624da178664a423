"""Run state and checkpoints: what the trainer adds to HF's checkpoint, and how a run resumes from one.

``RunCheckpoints`` writes a checkpoint atomically (HF's files and this run's state under ``.partial-checkpoint-N``,
renamed to ``checkpoint-N`` once every rank has written its part) and restores a run from one: the rollout source's
position, the batches generated ahead, each rank's slice of a batch part-way through its updates, and the
``--save_rollouts_path`` file's length, and with ``sync_ref_model`` the reference model (TRL's callback moves it
towards the policy, so a resume needs it as it stood). The file formats are ``checkpoint.py``'s.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Callable

from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints

from verifiers_rl.training.run_state import (
    REFERENCE_FILE,
    CheckpointError,
    RunState,
    check_adapters,
    check_fresh_output_dir,
    check_optimizer_saved,
    disk_full,
    check_fits,
    load_curriculum,
    load_pending,
    load_rank_batch,
    load_run_state,
    model_signature,
    partial_root,
    pending_stats,
    publish,
    resolve_checkpoint,
    rows_sha256,
    save_rank_batch,
    save_run_state,
)
from verifiers_rl.config.rl_config import RLConfig
from verifiers_rl.training.distributed import agreed_max, main_process_outcome
from verifiers_rl.rollouts.continuous import ContinuousGenerator
from verifiers_rl.rollouts.generator import AsyncGenerator
from verifiers_rl.training.step_batches import StepBatches
from verifiers_rl.training.weight_stream import gathered

logger = logging.getLogger(__name__)

_SAVED, _FAILED, _DISK_FULL = 0, 1, 2  # a rank's outcome of writing its part of a checkpoint, agreed by the largest
# In --output_dir: --save_rollouts_path's length when the run started fresh (``start_saved_rollouts``).
ROLLOUTS_START_FILE = "verifiers_rl_rollouts_start.json"


class RunCheckpoints:
    """Checkpoints of one run. ``model`` returns the bare model (its architecture identifies the run);
    ``zero_stage`` is 0 outside DeepSpeed; ``reference`` returns the bare reference model when it changes during
    the run (``sync_ref_model``), else None."""

    def __init__(self, args: RLConfig, accelerator, steps: StepBatches,
                 generator: AsyncGenerator | ContinuousGenerator | None, model: Callable[[], object], zero_stage: int,
                 reference: Callable[[], object | None] = lambda: None):
        self.args = args
        self.reference = reference
        self.accelerator = accelerator
        self.steps = steps
        self.generator = generator
        self.model = model
        self.zero_stage = zero_stage
        self.resumed_from: str | None = None
        self.last_checkpoint: str | None = None
        self._rows_sha256: str | None = None

    def run_state(self, global_step: int) -> RunState:
        """This run's position and identity (main process: only it holds the rollout source)."""
        args = self.args
        if self.generator is not None:
            if self._rows_sha256 is None:
                self._rows_sha256 = rows_sha256(self.generator.rows)
            source = {
                "kind": "live",
                "environment": self.generator.environment.name,
                "rows_sha256": self._rows_sha256,
                "num_generations": args.num_generations,
                "seed": args.seed,
            }
        else:
            replay = self.steps.source
            source = {"kind": "replay", "path": str(getattr(replay, "path", "")), "sha256": getattr(replay, "sha256", None)}
        return RunState(
            global_step=global_step,
            next_batch=self.steps.batch_index,
            iteration=self.steps.iteration,
            num_iterations=args.num_iterations,
            rollouts_per_step=args.rollouts_per_step,
            world_size=self.accelerator.num_processes,
            zero_stage=self.zero_stage,
            model=model_signature(self.model()),
            source=source,
        )

    # --- resuming -----------------------------------------------------------------------------------------------

    def check_fresh(self) -> None:
        """Before a run starts afresh: refuse an --output_dir holding checkpoints (``check_fresh_output_dir``), on
        every rank; then record --save_rollouts_path's length (``start_saved_rollouts``)."""

        def fresh() -> None:
            check_fresh_output_dir(self.args.output_dir)
            self.start_saved_rollouts()

        main_process_outcome(fresh)

    def restore(self, spec, global_step: int) -> str | None:
        """Check the checkpoint ``spec`` names against this run and restore the rollout source's position, the
        batches generated ahead and (part-way through a batch) each rank's slice of it. Errors reach every rank.
        None: ``auto`` found no checkpoint, and the run starts fresh (``start_saved_rollouts``)."""

        def load():
            path = resolve_checkpoint(spec, self.args.output_dir)
            if path is None:
                self.start_saved_rollouts(restart=True)
                return None, None
            saved = load_run_state(path)
            check_fits(saved, self.run_state(global_step), path)
            check_adapters(path, self.model())
            if self.reference() is not None and not (path / REFERENCE_FILE).is_file():
                raise CheckpointError(f"{path} has no {REFERENCE_FILE}: it was written by a run without "
                                      "--sync_ref_model, whose reference model stays the initial one. Resume it "
                                      "without --sync_ref_model, or start a new run.")
            if self.generator is not None:
                continuous = isinstance(self.generator, ContinuousGenerator)
                if saved.generator is not None and not continuous:
                    raise CheckpointError(
                        f"{path} was written under continuous generation (--groups_in_flight "
                        f"{saved.generator.get('groups_in_flight', 'N')}): it keeps finished groups and the prompts "
                        "in flight, not whole batches. Resume it with --groups_in_flight N (N >= 1).")
            check_optimizer_saved(path)  # after the checks naming a setting of this run
            max_steps = self.args.max_steps  # the trainer's (HF's view, num_train_epochs counted in)
            if saved.global_step >= max_steps:  # else the trainer waits for a batch past the run's last one
                raise CheckpointError(
                    f"{path} is at step {saved.global_step} and this run ends at step {max_steps} (--max_steps, or "
                    "--num_train_epochs): nothing is left to train. Raise --max_steps to train on from it, or start "
                    "a new run in another --output_dir.")
            if self.generator is not None:
                # Continuous generation forms its batches anew from the pending groups; batch at a time takes each
                # pending batch back with its generation counts, logged when it is trained.
                extra = {"positions": saved.generator} if continuous else {"stats": pending_stats(saved)}
                self.generator.restore(saved.next_batch, load_pending(path, saved), self._curriculum_of(path),
                                       str(path), **extra)
            self._truncate_saved_rollouts(saved)
            return str(path), saved

        path, saved = main_process_outcome(load)
        if path is None:
            if self.accelerator.is_main_process:
                logger.info("No checkpoint to resume from in %s: starting fresh.", self.args.output_dir)
            return None
        self._load_reference(Path(path) / REFERENCE_FILE)
        rank_batch = load_rank_batch(Path(path), self.accelerator.process_index) if saved.mid_batch() else None
        self.steps.restore(saved.next_batch, saved.iteration, rank_batch)
        self.resumed_from = path
        if self.accelerator.is_main_process:
            logger.info("Resuming from %s at step %d (next batch %d).", path, saved.global_step, saved.next_batch)
        return path

    def _curriculum_of(self, path: Path) -> dict | None:
        """The checkpoint's curriculum state for this run's curriculum (None without one: a saved one is not used)."""
        state = load_curriculum(path)
        if self.generator.curriculum is None:
            if state is not None:
                logger.warning("%s holds a curriculum's state; this run has none (no --curriculum_easy_above / "
                               "--curriculum_hard_below), so every prompt is drawn again.", path)
            return None
        if state is None:
            raise CheckpointError(f"{path} was written by a run without a curriculum: its draws cannot be continued "
                                  "by one. Resume without --curriculum_easy_above / --curriculum_hard_below (and "
                                  "without entries' curriculum:), or start a new run.")
        return state

    def start_saved_rollouts(self, restart: bool = False) -> None:
        """A run starting fresh (main process): record in --output_dir how long ``--save_rollouts_path`` is now. A
        ``restart`` (``auto`` finding no checkpoint: an attempt of this run stopped before its first one) first cuts
        the file back to what an earlier attempt recorded there, so its batches, trained again, appear once; a file
        this --output_dir's run never wrote to is only appended to."""
        target = self.args.save_rollouts_path
        if not target:
            return
        marker = Path(self.args.output_dir) / ROLLOUTS_START_FILE
        size = os.path.getsize(target) if os.path.exists(target) else 0
        record = json.loads(marker.read_text()) if restart and marker.is_file() else None
        if record is not None and record["path"] == os.path.abspath(target) and record["bytes"] < size:
            logger.warning("--resume_from_checkpoint auto starts fresh: --save_rollouts_path %s is cut back to the "
                           "%d bytes it held when an earlier attempt of this run started (no batch appears twice).",
                           target, record["bytes"])
            os.truncate(target, record["bytes"])
            return
        if size:  # another run's rollouts, or this output_dir's earlier run's: replayed together later
            logger.warning("--save_rollouts_path %s already holds %d bytes of rollouts: this run appends its own after "
                           "them.", target, size)
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text(json.dumps({"path": os.path.abspath(target), "bytes": size}))

    def _truncate_saved_rollouts(self, saved: RunState) -> None:
        """``--save_rollouts_path``: drop what the stopped run appended after its checkpoint (those batches are
        trained again), so the file holds every batch once."""
        target = self.args.save_rollouts_path
        record = saved.save_rollouts
        if not target or record is None or os.path.abspath(target) != record["path"]:
            return
        size = os.path.getsize(target) if os.path.exists(target) else 0
        if size < record["bytes"]:
            raise CheckpointError(
                f"--save_rollouts_path {target!r} holds {size} bytes, fewer than the {record['bytes']} it held at the "
                "checkpoint: it was changed since. Pass another --save_rollouts_path."
            )
        os.truncate(target, record["bytes"])

    # --- saving -------------------------------------------------------------------------------------------------

    def save(self, run_dir: str, global_step: int, write_hf: Callable[[str], None],
             best_checkpoint: Callable[[], str | None]) -> str:
        """Write checkpoint ``global_step`` of ``run_dir``: ``write_hf(root)`` writes HF's ``checkpoint-N`` under the
        partial ``root``, this run's state goes beside it, and the folder is renamed to ``checkpoint-N`` in one step
        once every rank has written its part. Then HF's ``save_total_limit`` rotation, which keeps
        ``best_checkpoint()`` (read after ``write_hf``: this step's may be the best). Every rank calls it."""
        final = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{global_step}")
        root = partial_root(run_dir, global_step)
        written = root / os.path.basename(final)
        if self.accelerator.is_local_main_process and root.exists():
            # Left by a run killed while writing this step (a restarted run writes it again): nothing of it may
            # end up in the new checkpoint or its manifest.
            shutil.rmtree(root, ignore_errors=True)
        self.accelerator.wait_for_everyone()
        error, outcome = None, _SAVED
        try:
            write_hf(str(root))
            self._save_run_state(written, global_step)
        except Exception as failed:  # noqa: BLE001 - whatever a save raises (safetensors' SafetensorError too)
            error = failed
            outcome = _DISK_FULL if disk_full(failed, run_dir) else _FAILED
        # Every rank learns that a part failed, and whether a full disk did it (the largest outcome wins).
        agreed = agreed_max(outcome, self.accelerator.device)
        if agreed != _SAVED:
            self._abandon(root, final, error, full=agreed == _DISK_FULL)
        wait = self.accelerator.wait_for_everyone
        wait()
        if self.args.should_save:
            publish(root, Path(final), self.accelerator.process_index)
        wait()
        if self.accelerator.is_local_main_process and written.is_dir():
            publish(root, Path(final), self.accelerator.process_index)  # a node without the main process's folder
        wait()
        if self.args.should_save:
            rotate_checkpoints(run_dir, self.args.save_total_limit, best_checkpoint(), use_mtime=True)
        self.last_checkpoint = final
        return final

    def _abandon(self, root: Path, final: str, error: Exception | None, full: bool) -> None:
        """A rank could not write its part: remove the partial folder (earlier checkpoints stay as they were) and
        stop every rank with an error that says what happened and where (``full``: some rank's disk filled)."""
        if self.accelerator.is_local_main_process:
            shutil.rmtree(root, ignore_errors=True)
        what = ("no space left on the device" if full
                else f"{type(error).__name__}: {error}" if error is not None else "another process failed to write its part")
        newest = self.last_checkpoint or "none yet"
        raise CheckpointError(
            f"Writing {os.path.basename(final)} to {os.path.dirname(final)} failed ({what}); its partial folder is "
            f"removed, earlier checkpoints are untouched (newest written by this run: {newest}). Free space (or fix "
            "the folder) and resume with --resume_from_checkpoint latest."
        ) from error

    def _load_reference(self, file: Path) -> None:
        """Every rank: the reference model as the checkpoint saved it (under ZeRO-3 the main process loads it whole
        and its shards are sent back to every rank)."""
        reference = self.reference()
        if reference is None:
            return
        from safetensors.torch import load_model

        zero3 = self.zero_stage == 3
        with gathered(list(reference.parameters()), zero3, modifier_rank=0):
            if not zero3 or self.accelerator.is_main_process:
                load_model(reference, file)

    def _save_reference(self, folder: Path) -> None:
        """Every rank (ZeRO-3 gathers collectively); the main process writes ``reference_model.safetensors``."""
        reference = self.reference()
        if reference is None:
            return
        from safetensors.torch import save_model

        with gathered(list(reference.parameters()), self.zero_stage == 3):
            if self.accelerator.is_main_process:
                save_model(reference, str(folder / REFERENCE_FILE))

    def _save_run_state(self, folder: Path, global_step: int) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self._save_reference(folder)
        mid_batch = self.steps.mid_batch()
        if mid_batch is not None:
            save_rank_batch(folder, self.accelerator.process_index, mid_batch)
        if self.accelerator.is_main_process:
            state = self.run_state(global_step)
            target = self.args.save_rollouts_path
            if target and os.path.exists(target):
                state.save_rollouts = {"path": os.path.abspath(target), "bytes": os.path.getsize(target)}
            pending, curriculum, stats = {}, None, None
            if isinstance(self.generator, ContinuousGenerator):  # continuous: the positions in flight, taken together
                pending, curriculum, state.generator = self.generator.checkpoint_state()
                state.generator["groups_in_flight"] = self.args.groups_in_flight
            elif self.generator is not None:
                pending, curriculum, stats = self.generator.snapshot()
            save_run_state(folder, state, pending, curriculum, stats)
