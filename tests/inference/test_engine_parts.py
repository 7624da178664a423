"""The embedded engine's parts on their own: per-loop request batching, and atomic staged weight loads."""

from __future__ import annotations

import asyncio

import pytest
import torch

from verifiers_rl import compat
from verifiers_rl.inference.embedded.request_batcher import RequestBatcher
from verifiers_rl.inference.embedded.staged_weights import StagedWeights


def test_concurrent_requests_of_a_loop_run_as_batches_of_at_most_max_batch_size():
    calls = []

    def run(requests):
        calls.append([r.prompt_ids[0] for r in requests])
        return [r.prompt_ids[0] * 10 for r in requests]

    batcher = RequestBatcher(run, max_batch_size=3, in_loop_thread=True)

    async def main():
        return await asyncio.gather(*(batcher.submit([i], 4, 1.0, None) for i in range(7)))

    assert asyncio.run(main()) == [i * 10 for i in range(7)]
    assert calls == [[0, 1, 2], [3, 4, 5], [6]] and batcher.pending() == 0


def test_an_error_reaches_every_caller_of_its_batch_and_later_batches_still_run():
    def run(requests):
        if any(r.prompt_ids == [1] for r in requests):
            raise RuntimeError("the model fell over")
        return ["ok"] * len(requests)

    batcher = RequestBatcher(run, max_batch_size=2)

    async def main():
        first = await asyncio.gather(*(batcher.submit([i], 4, 1.0, None) for i in range(2)), return_exceptions=True)
        second = await batcher.submit([5], 4, 1.0, None)
        return first, second

    first, second = asyncio.run(main())
    assert all(isinstance(e, RuntimeError) and "fell over" in str(e) for e in first) and second == "ok"
    with pytest.raises(ValueError, match="max_batch_size must be >= 1"):
        RequestBatcher(run, max_batch_size=0)


def test_cpython_loops_say_whether_callbacks_are_ready():
    async def probe():
        loop = asyncio.get_running_loop()
        loop.call_soon(lambda: None)
        busy = compat.loop_is_idle(loop)
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        return busy, compat.loop_is_idle(loop)

    assert asyncio.run(probe()) == (False, True)


def test_a_failed_load_changes_nothing_and_a_good_one_swaps_everything(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    weights = StagedWeights(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    new = [(f"module.{name}", torch.full_like(p, 0.5)) for name, p in model.named_parameters()]

    def broken():
        yield from new[:3]
        raise ConnectionError("the producer died")

    with pytest.raises(ConnectionError):
        weights.apply(weights.stage(broken()))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    with pytest.raises(KeyError, match="Unknown weight 'nope'"):
        weights.stage([("nope", torch.zeros(1))])
    with pytest.raises(ValueError, match="has shape"):
        weights.stage([(new[0][0], torch.zeros(1))])
    weights.apply(weights.stage(new))  # wrapper prefixes removed, every tensor replaced
    assert all(torch.all(p == 0.5) for p in model.parameters())
    # Later loads stage into the same memory (no fresh copy per load), never into the model's own tensors.
    memory = {name: copy.data_ptr() for name, copy in weights._copies.items()}
    assert memory and not set(memory.values()) & {p.data_ptr() for p in model.parameters()}
    weights.apply(weights.stage([(name, torch.full_like(p, 0.25)) for name, p in model.named_parameters()]))
    assert all(torch.all(p == 0.25) for p in model.parameters())
    assert {name: copy.data_ptr() for name, copy in weights._copies.items()} == memory
    new = [(name, torch.full_like(p, 0.75)) for name, p in new]
    with pytest.raises(ConnectionError):  # a failed load over reused staging memory still changes nothing
        weights.apply(weights.stage(broken()))
    assert all(torch.all(p == 0.25) for p in model.parameters())
