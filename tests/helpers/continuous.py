"""The continuous engine's tests' common parts (CPU and GPU): long-tailed seeded requests, a request decoded alone
through the batch-at-a-time path, callers on threads with event loops of their own, perturbed weights to load."""

from __future__ import annotations

import asyncio
import threading
import time

import torch

from verifiers_rl.envs import RolloutSampling, sampling_for_rollout

from tests.helpers.engines import sample_seeded

# Very different lengths (a long tail), a group of four samples of one prompt, more requests than rows; the last
# prompt is longer than any running row's context when it joins.
LENGTHS = [3, 32, 4, 20, 2, 12, 6, 26]
PROMPT_LENGTHS = [5, 30, 8, 8, 8, 8, 3, 90]


def requests_of(seed_base: int):
    gen = torch.Generator().manual_seed(seed_base)
    prompts = [torch.randint(3, 200, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]
    prompts[3] = prompts[4] = prompts[5] = prompts[2]  # one group: its prompt prefilled once
    temperatures = [0.7 if i % 3 == 1 else 1.0 for i in range(len(prompts))]
    return [(p, n, t, seed_base + i) for i, (p, n, t) in enumerate(zip(prompts, LENGTHS, temperatures))]


def alone(engine, prompt, max_new_tokens, temperature, seed):
    """The request decoded by itself through ``sample`` (the engine's batch-at-a-time path) under its rollout seed."""
    return sample_seeded(engine, [prompt], [seed], max_new_tokens, temperature)[0]


def in_thread(make_awaitable) -> tuple[threading.Thread, dict]:
    """Await ``make_awaitable()`` in an event loop of its own on a new thread; its result (or error) in the dict."""
    out: dict = {}

    async def main():
        return await make_awaitable()

    def run():
        try:
            out["result"] = asyncio.run(main())
        except BaseException as error:  # noqa: BLE001 - the test reads it
            out["error"] = error

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def joined(thread: threading.Thread, out: dict, timeout: float = 60.0):
    thread.join(timeout)
    assert not thread.is_alive(), "a caller still waits"
    if "error" in out:
        raise out["error"]
    return out["result"]


def wait_until(condition, timeout: float = 30.0, poll: float = 0.001) -> None:
    """Return once ``condition()`` holds, polling every ``poll`` s; fail the test after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(poll)


async def seeded(engine, prompt, max_new_tokens, temperature, seed, delay=0.0):
    """One rollout's call under its seed, after ``delay``; the sample and the versions its RolloutSampling recorded."""
    await asyncio.sleep(delay)
    sampling = RolloutSampling(seed, temperature)
    with sampling_for_rollout(sampling):
        sample = await engine.sample(prompt, max_new_tokens)
    return sample, sampling.versions


def perturbed_weights(engine):
    gen = torch.Generator().manual_seed(0)
    return [(name, param.cpu() + 0.2 * torch.randn(param.shape, generator=gen))
            for name, param in engine.model.named_parameters()]
