"""The launcher's server caches prefixes: the samples of one group share their prompt, so every request after the
first reuses its keys/values (read from the server's own counters), while an unrelated prompt reuses nothing."""

from __future__ import annotations

import asyncio
import os
import random

import httpx2 as httpx

from verifiers_rl.inference import VLLMEngine


def prefix_cache_hits(url: str) -> float:
    """The server's ``vllm:prefix_cache_hits`` counter (prompt tokens served from cached blocks, summed over engines)."""
    headers = {"Authorization": f"Bearer {os.environ['VLLM_API_KEY']}"}  # set by the session's fixture
    text = httpx.get(f"{url}/metrics", headers=headers, timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:prefix_cache_hits_total"))


def test_a_groups_requests_reuse_the_cached_prompt(untied):
    engine = VLLMEngine(untied.url, model=untied.model_dir)
    try:
        rng = random.Random(0)
        prompt = [rng.randrange(3, engine.vocab_size) for _ in range(300)]  # longer than a cache block (<= 256)
        other = [rng.randrange(3, engine.vocab_size) for _ in range(300)]
        before = prefix_cache_hits(untied.url)
        for _ in range(4):  # one after the other, as a group's samples reach the server over time
            asyncio.run(engine.sample(prompt, max_new_tokens=2))
        shared = prefix_cache_hits(untied.url) - before
        asyncio.run(engine.sample(other, max_new_tokens=2))
        unrelated = prefix_cache_hits(untied.url) - before - shared
    finally:
        engine.close()
    assert shared >= 3 * 128, f"{shared} prompt tokens came from the cache over 3 repeats of a 300-token prompt"
    assert unrelated == 0
