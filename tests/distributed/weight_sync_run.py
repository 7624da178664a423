"""One launch (DeepSpeed ZeRO-3, 2 processes on CPU) of every multi-process weight-sync check.

Writes, for ``tests/training/test_weight_sync.py`` to compare:
- ``initial.pt``: the bucketed gather of the freshly loaded (sharded) model, to compare with the checkpoint;
- ``buckets.pt`` / ``reference.pt``: after one training step, the stream for several bucket sizes and one
  all-at-once gather of the raw parameters;
- ``lora_raw.pt`` / ``lora_merged.pt``: a LoRA model after one step: its raw PEFT parameters and the merged stream;
- ``rank<r>.json``: what each rank saw (gather counts, the engine's weights vs the trainer's, the probe gap, the
  error raised when the engine failed mid-load and how long it took, and whether the next sync worked).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer

from verifiers_rl.config.rl_config import RLConfig
from verifiers_rl.inference import EmbeddedEngine
from verifiers_rl.core.modeling import unwrap
from verifiers_rl.training.trainer import RLTrainer
from verifiers_rl.training.weight_stream import GatherStats
from verifiers_rl.training.distributed import leave_process_group

BUCKET_SIZES = [0, 4096, 65536, 1 << 30]
LORA = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)


class ServerDiedEngine:
    """An engine whose server goes away in the middle of a weight load (reads a few tensors, then raises)."""

    policy_version = 0

    def __init__(self, after: int = 3):
        self.after = after

    def load_weights(self, named_tensors, version):
        for count, _ in enumerate(named_tensors, 1):
            if count == self.after:
                raise ConnectionError("vLLM server at http://127.0.0.1:8000 went away (connection refused)")


def settings(out: Path, name: str, rollouts: str) -> RLConfig:
    return RLConfig(
        output_dir=str(out / "trainer" / name), use_cpu=True, report_to="none", save_strategy="no", logging_steps=1,
        max_steps=1, learning_rate=1e-2, lr_scheduler_type="constant", max_seq_len=64, rollouts_per_step=8,
        rollouts_path=rollouts, micro_batching="padded", gradient_checkpointing=False, disable_tqdm=True, seed=0,
    )


def gather_all(trainer) -> dict[str, torch.Tensor] | None:
    """Every raw parameter, gathered at once (the old way): the reference the streams are compared with."""
    import deepspeed

    params = dict(unwrap(trainer.model_wrapped).named_parameters())
    with deepspeed.zero.GatheredParameters(list(params.values())):
        if trainer.accelerator.is_main_process:
            return {name: p.detach().clone() for name, p in params.items()}
    return None


def collect(trainer, bucket_bytes: int) -> tuple[dict[str, torch.Tensor], GatherStats]:
    stats = GatherStats()
    state = {name: tensor.clone() for name, tensor in trainer.named_weights(bucket_bytes, stats)}
    return state, stats


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--rollouts", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    rank = int(os.environ.get("RANK", "0"))
    is_main = rank == 0
    record: dict = {"rank": rank}
    log = lambda message: print(f"[weight_sync rank {rank}] {message}", file=sys.stderr, flush=True)  # noqa: E731

    # --- full model, tied embeddings -----------------------------------------------------------------------------
    engine = EmbeddedEngine(args.model, tokenizer) if is_main else None
    trainer = RLTrainer(args.model, settings(out, "full", args.rollouts), processing_class=tokenizer, engine=engine)
    record["num_processes"] = trainer.accelerator.num_processes
    record["sharded_at_load"] = all(hasattr(p, "ds_id") for p in trainer.model.parameters())
    initial, stats = collect(trainer, 65536)
    record["initial_buckets"] = stats.buckets
    if is_main:
        torch.save(initial, out / "initial.pt")

    trainer.train()
    log("trained one step")
    reference = gather_all(trainer)
    record["buckets"] = {}
    streams = {}
    for bucket_bytes in BUCKET_SIZES:
        state, stats = collect(trainer, bucket_bytes)
        record["buckets"][str(bucket_bytes)] = {"buckets": stats.buckets, "tensors": stats.tensors,
                                                "gathered_bytes": stats.gathered_bytes}
        streams[str(bucket_bytes)] = state
    if is_main:
        torch.save(streams, out / "buckets.pt")
        torch.save(reference, out / "reference.pt")

    trainer.sync_weights()
    log("synced")
    record["probe_gaps"] = list(trainer._metrics["train"]["weight_sync_probe_gap"])
    if is_main:
        engine_params = dict(engine.model.named_parameters())
        record["engine_version"] = engine.policy_version
        record["engine_equals_trainer"] = all(
            torch.equal(engine_params[name], tensor) for name, tensor in streams["0"].items()
        ) and set(engine_params) == set(streams["0"])

    # --- the engine fails in the middle of a load: every rank raises, promptly --------------------------------
    if is_main:
        trainer.engine = ServerDiedEngine()
    start = time.monotonic()
    try:
        trainer.sync_weights()
        record["failure"] = None
    except Exception as exc:  # noqa: BLE001 - recorded for the test
        record["failure"] = {"type": type(exc).__name__, "message": str(exc), "seconds": time.monotonic() - start}
    log(f"failure: {record['failure']}")
    # The ranks are still in lockstep: the next sync, to a working engine, succeeds everywhere.
    if is_main:
        trainer.engine = engine
    trainer.sync_weights()
    record["recovered"] = True
    del trainer

    # --- LoRA under ZeRO-3 ---------------------------------------------------------------------------------------
    from peft import LoraConfig

    lora_engine = EmbeddedEngine(args.model, tokenizer) if is_main else None
    trainer = RLTrainer(args.model, settings(out, "lora", args.rollouts), processing_class=tokenizer,
                        engine=lora_engine, peft_config=LoraConfig(**LORA))
    trainer.train()
    log("trained LoRA one step")
    raw = gather_all(trainer)
    merged = {}
    for bucket_bytes in (0, 65536):
        state, stats = collect(trainer, bucket_bytes)
        merged[str(bucket_bytes)] = state
        record.setdefault("lora_buckets", {})[str(bucket_bytes)] = stats.buckets
    raw_after = gather_all(trainer)
    trainer.sync_weights()
    record["lora_probe_gaps"] = list(trainer._metrics["train"]["weight_sync_probe_gap"])
    if is_main:
        record["lora_unchanged"] = all(torch.equal(raw[name], raw_after[name]) for name in raw)
        engine_params = dict(lora_engine.model.named_parameters())
        record["lora_engine_equals_merged"] = all(
            torch.equal(engine_params[name], tensor) for name, tensor in merged["0"].items()
        )
        torch.save(raw, out / "lora_raw.pt")
        torch.save(merged, out / "lora_merged.pt")
    (out / f"rank{rank}.json").write_text(json.dumps(record))
    trainer.accelerator.wait_for_everyone()
    log("done")


if __name__ == "__main__":
    main()
    leave_process_group()
