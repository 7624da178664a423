"""The embedded engine serving continuously (issue 37 items 1-2, 4, engine side): ``EmbeddedEngine(continuous_rows=N)``
decodes every ``sample`` in one running batch on a thread of its own. Requests from two event loops on two threads
join it and sample what they sample decoded alone; a weight load from another thread lands between two steps
(tokens carry both versions; the later ones are the new weights'); close() fails every waiting caller at once; a
failing step fails its own requests only; a cancelled caller frees its row; a multi-turn rollout carries each turn's
version in ``completion_versions``."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from verifiers_rl.core.engine import EngineClosedError
from verifiers_rl.core.rollout import NOT_SAMPLED
from verifiers_rl.envs import MultiTurnEnv, RolloutSampling, Rubric, derive_seed, sampling_for_rollout
from verifiers_rl.inference import EmbeddedEngine, SamplingConfig
from verifiers_rl.inference.embedded.running_batch import DecodeRequest, RunningBatch

from tests.helpers.continuous import alone, in_thread, joined, perturbed_weights, requests_of, seeded, wait_until

NO_TOKEN = -1  # an eos id no token has: a row decodes to its max_new_tokens


def test_requests_from_two_event_loops_join_one_running_batch_and_sample_what_they_sample_alone(tiny_model_dir):
    sampling = SamplingConfig(max_new_tokens=64)
    engine = EmbeddedEngine(tiny_model_dir, sampling=sampling, continuous_rows=3)
    reference = EmbeddedEngine(tiny_model_dir, sampling=sampling)  # batch by batch
    requests = requests_of(500)

    def staggered(part, delay):
        return lambda: asyncio.gather(*(seeded(engine, *request, delay=delay * i) for i, request in enumerate(part)))

    loops = [in_thread(staggered(requests[0::2], 0.01)), in_thread(staggered(requests[1::2], 0.013))]
    got = [None] * len(requests)
    got[0::2], got[1::2] = joined(*loops[0]), joined(*loops[1])
    for (prompt, max_new_tokens, temperature, seed), (sample, recorded) in zip(requests, got):
        want = alone(reference, prompt, max_new_tokens, temperature, seed)
        assert sample.token_ids == want.token_ids and sample.finish_reason == want.finish_reason
        assert max(abs(a - b) for a, b in zip(sample.logprobs, want.logprobs)) < 1e-5
        assert sample.versions == recorded == [0] * len(sample.token_ids)
    counters = engine.health()["continuous"]
    assert counters["admissions"] >= 1 and counters["served"] == len(requests)  # rows joined a running batch
    assert counters["row_steps"] > counters["steps"]  # steps decoded several rows at once
    assert engine.health()["pending"] == 0
    engine.close()


def test_a_weight_load_from_another_thread_lands_between_steps_without_draining_the_rows(tiny_model_dir):
    sampling = SamplingConfig(max_new_tokens=64)
    engine = EmbeddedEngine(tiny_model_dir, sampling=sampling, continuous_rows=3)
    reference = EmbeddedEngine(tiny_model_dir, sampling=sampling)
    for each in (engine, reference):
        each.eos_token_ids[:] = [NO_TOKEN]  # every row decodes to its length: rows are in flight at the load
    original = [(name, param.clone()) for name, param in reference.model.named_parameters()]
    perturbed = perturbed_weights(engine)
    first = [(prompt, 40, temperature, seed) for prompt, _, temperature, seed in requests_of(700)[:3]]
    later = [(prompt, 12, temperature, seed) for prompt, _, temperature, seed in requests_of(800)[:2]]

    wave = in_thread(lambda: asyncio.gather(*(seeded(engine, *request) for request in first)))
    wait_until(lambda: engine.health()["continuous"]["steps"] >= 10)
    engine.load_weights(perturbed, version=1)  # the trainer's thread, while the rows decode
    got = joined(*wave)
    for (prompt, max_new_tokens, temperature, seed), (sample, recorded) in zip(first, got):
        assert recorded == sample.versions and sample.versions == sorted(sample.versions)
        switch = sample.versions.index(1)  # rows in flight crossed the load: old tokens, then new ones
        assert 0 < switch < len(sample.versions) - 10
        # The reference: the row decoded alone, its weights swapped after the same number of tokens (its first
        # step draws two: the prefill's and the step's).
        steps = []

        def load_at_switch():
            steps.append(None)
            if len(steps) + 1 == switch:
                reference.load_weights(perturbed, version=1)

        reference.load_weights(original, version=0)
        request = DecodeRequest(prompt, max_new_tokens, temperature, derive_seed(seed, 0))
        (want,) = reference.generate_continuous([request], 1, between_steps=load_at_switch).samples
        assert sample.token_ids == want.token_ids and want.versions == sample.versions
        assert max(abs(a - b) for a, b in zip(sample.logprobs, want.logprobs)) < 1e-5
        old = alone(reference_at(reference, original), prompt, max_new_tokens, temperature, seed)
        assert old.token_ids[:switch] == sample.token_ids[:switch]  # the old weights' tokens are unchanged
        assert max(abs(a - b) for a, b in zip(old.logprobs[switch:], sample.logprobs[switch:])) > 1e-3
    # Requests after the load sample what the new weights sample alone, every token version 1.
    got = joined(*in_thread(lambda: asyncio.gather(*(seeded(engine, *request) for request in later))))
    reference.load_weights(perturbed, version=1)
    for (prompt, max_new_tokens, temperature, seed), (sample, _) in zip(later, got):
        want = alone(reference, prompt, max_new_tokens, temperature, seed)
        assert sample.token_ids == want.token_ids and sample.versions == [1] * max_new_tokens
    engine.close()


def reference_at(engine, weights):
    engine.load_weights(weights, version=0)
    return engine


def test_close_fails_every_waiting_and_decoding_caller_at_once(tiny_model_dir):
    engine = EmbeddedEngine(tiny_model_dir, sampling=SamplingConfig(max_new_tokens=2000), continuous_rows=1)
    engine.eos_token_ids[:] = [NO_TOKEN]
    requests = requests_of(900)[:4]
    callers = in_thread(lambda: asyncio.gather(*(engine.sample(prompt, 2000) for prompt, *_ in requests),
                                               return_exceptions=True))
    wait_until(lambda: engine.health()["continuous"]["steps"] >= 2)  # one decoding, three waiting
    start = time.monotonic()
    engine.close()
    results = joined(*callers, timeout=10)
    assert time.monotonic() - start < 5
    assert all(isinstance(result, EngineClosedError) for result in results)
    assert not engine._loop._thread.is_alive()
    with pytest.raises(EngineClosedError):
        asyncio.run(engine.sample([5, 6, 7], 4))


def test_a_failing_step_fails_its_requests_and_the_loop_serves_the_next(tiny_model_dir, monkeypatch):
    engine = EmbeddedEngine(tiny_model_dir, sampling=SamplingConfig(max_new_tokens=64), continuous_rows=2)
    engine.eos_token_ids[:] = [NO_TOKEN]
    reference = EmbeddedEngine(tiny_model_dir, sampling=SamplingConfig(max_new_tokens=64))
    reference.eos_token_ids[:] = [NO_TOKEN]
    step, failed = RunningBatch.step, []

    def failing_once_full(batch):
        if len(batch.requests) == 2 and not failed:  # the two rows it holds, the third request waiting
            failed.append(True)
            raise RuntimeError("the decode step failed")
        return step(batch)

    monkeypatch.setattr(RunningBatch, "step", failing_once_full)
    requests = [(prompt, 10, temperature, seed) for prompt, _, temperature, seed in requests_of(1000)[:4]]
    results = joined(*in_thread(lambda: asyncio.gather(*(seeded(engine, *request) for request in requests[:3]),
                                                       return_exceptions=True)))
    errors = [result for result in results if isinstance(result, RuntimeError)]
    assert len(errors) == 2 and all("the decode step failed" in str(error) for error in errors)
    (survivor,) = [(request, result) for request, result in zip(requests, results) if isinstance(result, tuple)]
    later = joined(*in_thread(lambda: seeded(engine, *requests[3])))  # a later request is not poisoned
    for (prompt, max_new_tokens, temperature, seed), (sample, _) in [survivor, (requests[3], later)]:
        assert sample.token_ids == alone(reference, prompt, max_new_tokens, temperature, seed).token_ids
    engine.close()


def test_a_cancelled_caller_frees_its_row(tiny_model_dir):
    engine = EmbeddedEngine(tiny_model_dir, sampling=SamplingConfig(max_new_tokens=4000), continuous_rows=1)
    engine.eos_token_ids[:] = [NO_TOKEN]
    (long_prompt, *_), (prompt, _, temperature, seed) = requests_of(1100)[:2]

    async def give_up_then_ask():
        long = asyncio.create_task(engine.sample(long_prompt, 4000))
        while engine.health()["continuous"]["steps"] < 3:  # decoding: it holds the only row
            await asyncio.sleep(0.001)
        long.cancel()
        return await asyncio.wait_for(seeded(engine, prompt, 8, temperature, seed), timeout=30)

    sample, _ = joined(*in_thread(give_up_then_ask))
    assert len(sample.token_ids) == 8
    wait_until(lambda: engine.health()["pending"] == 0, timeout=5)
    assert engine.health()["continuous"]["steps"] < 100  # the cancelled row left; it did not decode 4000 tokens
    engine.close()


class EchoEnv(MultiTurnEnv):
    """Answers "again <turn>" to every turn (the tiny model never stops by itself): max_turns turns."""

    async def env_response(self, messages, state):
        return [{"role": "user", "content": f"again {state['turn']}"}]


def test_a_multi_turn_rollout_carries_each_turns_version(tiny_model_dir):
    # An episode spanning a weight update: its first turn sampled by version 0, the others by version 1 (a load
    # between turns), environment tokens NOT_SAMPLED, through the environment's own rollout_group.
    engine = EmbeddedEngine(tiny_model_dir, sampling=SamplingConfig(max_new_tokens=12), continuous_rows=4)
    # A turn that hits max_new_tokens ends the episode; the random tiny model seldom draws eos, so half the
    # vocabulary stops a turn (a turn ending without the template's eos, which the environment's tokens then close).
    engine.eos_token_ids[:] = sorted(set(range(0, engine.vocab_size, 2)) | set(engine.eos_token_ids))
    perturbed = perturbed_weights(engine)

    class LoadAfterTheFirstTurn:
        calls = 0

        async def sample(self, prompt_ids, max_new_tokens):
            sample = await engine.sample(prompt_ids, max_new_tokens)
            self.calls += 1
            if self.calls == 1:
                await asyncio.to_thread(engine.load_weights, perturbed, 1)
            return sample

    env = EchoEnv([{"question": "go"}], Rubric(), engine.tokenizer, max_turns=3, max_new_tokens=12)
    (rollout,) = asyncio.run(env.rollout_group(LoadAfterTheFirstTurn(), env.dataset[0], 0, 1, seed=3))
    turns, current, previous = [], [], 0
    for mask, version in zip(rollout.completion_mask, rollout.completion_versions):
        assert (version == NOT_SAMPLED) == (mask == 0)
        if mask and not previous:
            turns.append(current := [])
        if mask:
            current.append(version)
        previous = mask
    assert len(turns) == 3 and turns[0] == [0] * len(turns[0]) and all(v == 1 for t in turns[1:] for v in t)
    rollout.validate()
    engine.close()


def test_continuous_batching_rows_reaches_the_engine_and_is_refused_beside_a_vllm_server(tiny_model_dir):
    from verifiers_rl.config.rl_config import RLConfig
    from verifiers_rl.inference.factory import build_engine, make_engine

    def config(**kwargs):
        return RLConfig(output_dir="/tmp/unused", report_to="none", max_completion_length=4, **kwargs)

    engine = build_engine(config(continuous_batching_rows=3), tiny_model_dir, None)
    try:
        asyncio.run(engine.sample([5, 6, 7], 4))
        assert engine.health()["continuous"]["rows"] == 3 and engine.health()["continuous"]["served"] == 1
    finally:
        engine.close()
    assert build_engine(config(), tiny_model_dir, None).health()["continuous"] is None  # 0: batch by batch
    with pytest.raises(ValueError, match=r"--continuous_batching_rows 2 .*a vLLM server \(--vllm_server_url\)"):
        config(continuous_batching_rows=2, vllm_server_url="http://127.0.0.1:8000")
    with pytest.raises(ValueError, match=r"continuous_rows=2 \(--continuous_batching_rows\)"):
        make_engine(tiny_model_dir, None, SamplingConfig(), vllm_server_url="http://127.0.0.1:9", continuous_rows=2)
    with pytest.raises(ValueError, match="continuous_batching_rows must be >= 0"):
        config(continuous_batching_rows=-1)
    with pytest.raises(ValueError, match=r"continuous_rows \(--continuous_batching_rows\) must be an int >= 0"):
        EmbeddedEngine(tiny_model_dir, continuous_rows=-1)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the advice is for the CPU; a GPU decodes off OpenMP")
def test_the_cpu_running_batch_names_the_openmp_wait_policy_unless_it_is_passive(tiny_model_dir, monkeypatch, caplog):
    from verifiers_rl.inference.factory import make_engine

    def warnings_when(policy: str | None, rows: int) -> list[str]:
        if policy is None:
            monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
        else:
            monkeypatch.setenv("OMP_WAIT_POLICY", policy)
        caplog.clear()
        with caplog.at_level("WARNING", logger="verifiers_rl.inference.factory"):
            make_engine(tiny_model_dir, None, SamplingConfig(), continuous_rows=rows).close()
        return [r.getMessage() for r in caplog.records if "OMP_WAIT_POLICY=PASSIVE" in r.getMessage()]

    assert len(warnings_when(None, 2)) == 1
    assert len(warnings_when("active", 2)) == 1
    assert warnings_when("passive", 2) == [] and warnings_when("PASSIVE", 2) == []
    assert warnings_when(None, 0) == []  # batch by batch: no decode thread beside training


def test_an_episodes_later_turns_continue_from_its_earlier_ones_and_sample_what_they_sample_prefilled_whole(
        tiny_model_dir):
    # Our multi-turn environment sends each turn as the last turn's prompt and tokens and its reply, token for token:
    # the loop prefills only the new tokens, even where its batch emptied while the environment answered (one
    # episode: every turn starts a fresh batch). The episode is the one decoded batch by batch, every turn whole.
    sampling = SamplingConfig(max_new_tokens=12)
    engine = EmbeddedEngine(tiny_model_dir, sampling=sampling, continuous_rows=4)
    reference = EmbeddedEngine(tiny_model_dir, sampling=sampling)
    for e in (engine, reference):  # as above: turns that end before max_new_tokens, so the episode goes on
        e.eos_token_ids[:] = sorted(set(range(0, e.vocab_size, 2)) | set(e.eos_token_ids))
    env = EchoEnv([{"question": "go"}], Rubric(), engine.tokenizer, max_turns=3, max_new_tokens=12)
    (rollout,) = asyncio.run(env.rollout_group(engine, env.dataset[0], 0, 1, seed=5))
    (want,) = asyncio.run(env.rollout_group(reference, env.dataset[0], 0, 1, seed=5))
    mask = rollout.completion_mask
    turns = sum(1 for i, m in enumerate(mask) if m and (i == 0 or not mask[i - 1]))
    assert turns == 3 and engine.health()["continuous"]["continued"] == turns - 1
    assert rollout.completion_ids == want.completion_ids
    assert max(abs(a - b) for a, b, m in zip(rollout.completion_logprobs, want.completion_logprobs,
                                             rollout.completion_mask) if m) < 1e-4
    engine.close()


def test_an_episodes_later_turn_is_decoded_before_first_turns_that_wait(tiny_model_dir):
    # Its last turn's keys/values are kept for it while few rows finish after it, and an episode begun ends sooner.
    engine = EmbeddedEngine(tiny_model_dir, sampling=SamplingConfig(max_new_tokens=400), continuous_rows=1)
    engine.eos_token_ids[:] = [NO_TOKEN]
    order = []

    async def call(name, prompt, max_new_tokens, earlier_tokens):
        sampling = RolloutSampling(1, 1.0)
        sampling.record_versions([0] * earlier_tokens)  # the rollout's earlier turns (none: a first turn)
        with sampling_for_rollout(sampling):
            await engine.sample(prompt, max_new_tokens)
        order.append(name)

    async def main():
        running = asyncio.ensure_future(call("running", [5] * 8, 400, 0))
        while not engine._loop._held:  # it holds the one row
            await asyncio.sleep(0.001)
        await asyncio.gather(running, call("first turn", [6] * 8, 2, 0), call("later turn", [7] * 30, 2, 3))

    asyncio.run(main())
    assert order == ["running", "later turn", "first turn"]
    engine.close()
