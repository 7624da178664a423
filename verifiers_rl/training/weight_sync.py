"""Weight sync: the trainer's policy into the inference engine after every optimizer step, then a probe.

``EngineWeightSync.sync(version)`` waits for the batches an older version must generate (the exact schedule),
streams the gathered weights into the engine under the generator's batch lock (continuous generation,
``--groups_in_flight``: neither wait nor lock, the engine loads between decode steps while groups are in flight), and
every ``weight_sync_probe_every``-th sync compares the engine's log-probs of a fixed sequence with the trainer's.
Every rank calls it: ZeRO-3 gathers and the probe's forward are collective; an engine error on the main process
reaches every rank once the gathers are done, instead of a hang.
"""

from __future__ import annotations

import contextlib
import logging
import time
import warnings
from typing import Callable

import torch
from transformers import TrainerCallback

from verifiers_rl.config.rl_config import RLConfig
from verifiers_rl.training.distributed import main_process_outcome
from verifiers_rl.rollouts.continuous import ContinuousGenerator
from verifiers_rl.rollouts.generator import AsyncGenerator
from verifiers_rl.core.engine import SupportsPromptLogprobs
from verifiers_rl.core.modeling import default_probe_tolerance, sequence_logprobs
from verifiers_rl.training.weight_stream import (
    GatherStats,
    WeightSyncError,
    WeightSyncWarning,
    compare_logprobs,
    gathered_named_weights,
    probe_token_ids,
    probe_warning,
)

logger = logging.getLogger(__name__)


class EngineWeightSync:
    """Streams the policy into ``engine`` (main process) and probes it.

    ``gather_model()`` is the model to gather from (the DeepSpeed engine under DeepSpeed), ``bare_model()`` the
    unwrapped policy. The probe's forward runs the gathered model under ZeRO-3 (its forward gathers shards on every
    rank), else the bare model on the main process alone. ``log(name, value)`` records a step metric.
    """

    def __init__(self, args: RLConfig, accelerator, engine, generator: AsyncGenerator | ContinuousGenerator | None,
                 tokenizer,
                 gather_model: Callable[[], torch.nn.Module], bare_model: Callable[[], torch.nn.Module],
                 zero3: bool, log: Callable[[str, float], None], timed: Callable[[float], None] = lambda s: None):
        self.args = args
        self.accelerator = accelerator
        self.engine = engine
        self.generator = generator
        self.tokenizer = tokenizer
        self.gather_model = gather_model
        self.bare_model = bare_model
        self.zero3 = zero3
        self.log = log
        self.timed = timed  # told each sync's seconds (the step timer's part)
        self.probe_ids: list[int] | None = None  # the probe's tokens, once the first sync found the engine can be probed
        self.probe_checked = False
        self.syncs = 0  # weight syncs so far (the probe runs on the first and every weight_sync_probe_every-th)

    def named_weights(self, bucket_bytes: int | None = None, stats: GatherStats | None = None):
        """The policy's full weights as a stream of ``(hf_name, tensor)`` on the main process (nothing elsewhere),
        gathered bucket by bucket (``weights.gathered_named_weights``; default bucket ``weight_sync_bucket_mb``).

        Every rank must exhaust it, in lockstep (ZeRO-3 gathers are collective); tensors are valid only until the
        next item is requested.
        """
        if bucket_bytes is None:
            bucket_bytes = int(self.args.weight_sync_bucket_mb * 2**20)
        return gathered_named_weights(self.gather_model(), bucket_bytes, is_main=self.accelerator.is_main_process,
                                      zero3=self.zero3, stats=stats)

    def sync(self, version: int) -> None:
        """Stream the current policy into the engine as ``version``, then probe it (on schedule). Logs
        ``weight_sync_wait_s`` (waiting for older batches and the batch lock), ``weight_sync_s`` (the load) and
        ``weight_sync_probe_s``."""
        start = time.perf_counter()
        generating = self.accelerator.is_main_process and self.engine is not None and self.generator is not None
        # The exact schedule: batches of older versions are generated first (an error there stops every rank).
        main_process_outcome(lambda: self.generator.wait_for_older_batches(version) if generating else None)
        # The batch lock, held through the load AND the probe: no batch mixes two versions, and the probe is not
        # queued behind the next batch's generation (which would serialise k >= 1 into generate-then-train).
        with self.generator.hold_weights() if generating else contextlib.nullcontext():
            loading = time.perf_counter()
            stats = self._load(version)
            probing = time.perf_counter()
            logger.debug("Weight sync to version %d: %s in %.3f s.", version, stats, probing - loading)
            self._probe(version)
            done = time.perf_counter()
        if generating:
            self.generator.weights_updated()
        server_metrics = getattr(self.engine, "server_metrics", None) if generating else None
        for name, value in (server_metrics() if server_metrics else {}).items():  # vllm/<i>/... of several servers
            self.log(name, value)
        self.log("weight_sync_wait_s", loading - start)
        self.log("weight_sync_s", probing - loading)
        self.log("weight_sync_probe_s", done - probing)
        self.timed(done - start)

    def _load(self, version: int) -> GatherStats:
        stats = GatherStats()
        stream = self.named_weights(stats=stats)
        loading = self.accelerator.is_main_process and self.engine is not None
        error: BaseException | None = None
        left = 0
        try:
            if loading:
                self.engine.load_weights(stream, version=version)
        except Exception as exc:  # noqa: BLE001 - raised on every rank below, once every gather is done
            error = exc
        try:
            # The other ranks are still gathering: join every remaining bucket before anything else.
            left = sum(1 for _ in stream)
        except Exception as exc:  # noqa: BLE001 - a merge error, raised after the last gather
            error = error or exc
        if loading and error is None and left:
            error = RuntimeError(
                f"{type(self.engine).__name__}.load_weights returned with {left} of {stats.tensors} tensors unread."
            )

        def outcome() -> None:
            if error is not None:
                raise WeightSyncError(
                    f"Loading policy version {version} into the engine failed: {type(error).__name__}: {error}"
                ) from error

        main_process_outcome(outcome)
        return stats

    def probe_tolerance(self) -> float:
        """The configured tolerance, else one that fits the precision of both sides (the engine's on the main
        process: a bf16 server under a float32 trainer rounds as much as a bf16 trainer)."""
        if self.args.weight_sync_probe_tolerance is not None:
            return float(self.args.weight_sync_probe_tolerance)
        return default_probe_tolerance(
            "bf16" if self.args.bf16 else None, "fp16" if self.args.fp16 else None, getattr(self.engine, "dtype", None)
        )

    def _probe(self, version: int) -> None:
        """Compare the engine's log-probs of a fixed sequence with the trainer's; warn loudly on a gap. Runs at the
        first sync and then at every ``weight_sync_probe_every``-th (the same syncs on every rank)."""
        self.syncs += 1
        if self.args.weight_sync_probe_tokens == 0 or (self.syncs - 1) % self.args.weight_sync_probe_every:
            return
        if not self.probe_checked:
            # Only the main process holds the engine; every rank must agree on running the (collective) forward.
            probed = main_process_outcome(lambda: isinstance(self.engine, SupportsPromptLogprobs))
            self.probe_checked = True
            if probed:
                embedding = self.bare_model().get_input_embeddings()
                # LoRA on the embedding wraps it (peft's lora.Embedding has no num_embeddings)
                vocab = getattr(embedding, "base_layer", embedding).num_embeddings
                self.probe_ids = probe_token_ids(self.tokenizer, self.args.weight_sync_probe_tokens, vocab)
            elif self.accelerator.is_main_process:
                logger.info("The engine %s has no prompt_logprobs: no post-sync probe.", type(self.engine).__name__)
        if self.probe_ids is None:
            return
        ids = self.probe_ids
        trainer_logps = self.trainer_prompt_logprobs(ids)
        tolerance = self.probe_tolerance()

        def check():
            try:
                by_server = engine_logprobs_by_server(self.engine, ids)
            except Exception as exc:
                raise WeightSyncError(
                    f"The post-sync probe of policy version {version} failed: {type(exc).__name__}: {exc}"
                ) from exc
            results = {name: compare_logprobs(trainer_logps, [float(x) for x in logps])
                       for name, logps in by_server.items()}
            if hasattr(self.engine, "record_probe"):  # several servers: each one's gap is logged as its metric
                self.engine.record_probe({name: result.max_gap for name, result in results.items()})
            name, result = max(results.items(), key=lambda item: item[1].max_gap)
            if not result.max_gap <= tolerance:
                message = (f"{name}: " if name else "") + probe_warning(result, version, tolerance)
                logger.warning(message)
                warnings.warn(message, WeightSyncWarning, stacklevel=2)
            return result

        result = main_process_outcome(check)
        self.log("weight_sync_probe_gap", result.max_gap)

    @torch.no_grad()
    def trainer_prompt_logprobs(self, ids: list[int]) -> list[float] | None:
        """The policy's log p(token_t | tokens_<t), t >= 1, at temperature 1 (main process; None elsewhere)."""
        if not self.zero3 and not self.accelerator.is_main_process:
            return None
        # A DDP forward may broadcast buffers, a collective the other ranks would not join: hence the bare model.
        model = self.gather_model() if self.zero3 else self.bare_model()
        was_training = model.training
        model.eval()  # no dropout: the engine's forward has none either
        try:
            logps = sequence_logprobs(model, ids, self.accelerator.device)
        finally:
            model.train(was_training)
        return logps.cpu().tolist() if self.accelerator.is_main_process else None


def engine_logprobs_by_server(engine, ids: list[int]) -> dict[str, list[float]]:
    """The engine's probe log-probs by server name (``MultiServerEngine`` checks each server; one engine: ``""``)."""
    by_server = getattr(engine, "prompt_logprobs_by_server", None)
    return by_server(ids) if by_server is not None else {"": engine.prompt_logprobs(ids)}


class WeightSyncCallback(TrainerCallback):
    """After every optimizer step, the engine gets the new weights (version = the step). A resumed run loads the
    checkpoint's weights before its first batch (``resumed()`` says whether this run resumed)."""

    def __init__(self, sync: Callable[[], None], resumed: Callable[[], bool]):
        self.sync = sync
        self.resumed = resumed

    def on_train_begin(self, args, state, control, **kwargs):
        if self.resumed():
            self.sync()

    def on_step_end(self, args, state, control, **kwargs):
        self.sync()
