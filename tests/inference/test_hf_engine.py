"""The embedded HF engine: sampler log-probs equal the trainer's, batching, weight loads, errors, SmolLM2."""

import asyncio
import threading
import time

import pytest
import torch

from verifiers_rl.envs import derive_seed
from verifiers_rl.inference import EmbeddedEngine, EngineClosedError, InferenceEngine, Sample, SamplingConfig
from verifiers_rl.inference.embedded import batch_decode
from verifiers_rl.inference.embedded.engine import RowSampler
from verifiers_rl.inference.kernels.llama_decode import LlamaDecoder
from verifiers_rl.core.models import build_tiny_model

from tests.helpers.engines import TEXTS, assert_parity, load, prompts_of, sample_seeded
from tests.helpers.sampling_reference import spy_on_sampler

@pytest.fixture(scope="module")
def untied_model_dir(tmp_path_factory):
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny-untied"), tie_word_embeddings=False, seed=1))


def sample_all(engine, prompts, max_new_tokens=16):
    async def run():
        limits = max_new_tokens if isinstance(max_new_tokens, list) else [max_new_tokens] * len(prompts)
        return await asyncio.gather(*(engine.sample(p, n) for p, n in zip(prompts, limits)))

    return asyncio.run(run())


def gumbel_noise(seed, steps, vocab):
    """The noise RowSampler draws for a request whose rollout seed is ``seed`` (first model call)."""
    generator = torch.Generator().manual_seed(derive_seed(seed, 0))
    uniform = torch.stack([torch.rand(vocab, generator=generator) for _ in range(steps)])
    return -torch.log(-torch.log(uniform.clamp_min(torch.finfo(torch.float32).tiny)))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampler_logprobs_equal_trainer_logprobs(tiny_model_dir, temperature, monkeypatch):
    trainer_model, tokenizer = load(tiny_model_dir)
    # A checkpoint's own sampling defaults must not leak into the engine's sampling (transformers' generate would
    # fill unset options from model.generation_config; the engine's decode loop reads none).
    trainer_model.generation_config.top_k = 5
    trainer_model.generation_config.repetition_penalty = 1.5
    trainer_model.generation_config.min_new_tokens = 4
    engine = EmbeddedEngine(trainer_model, tokenizer, SamplingConfig(temperature=temperature), max_batch_size=8)
    assert isinstance(engine, InferenceEngine)
    assert engine.model is not trainer_model  # its own copy
    steps = spy_on_sampler(monkeypatch)
    prompts = prompts_of(tokenizer)
    seeds = [11, 12, 13, 14, 15]
    samples = sample_seeded(engine, prompts, seeds, max_new_tokens=24)
    assert len(steps) == max(len(s.token_ids) for s in samples)  # one batch, decoded until its longest row ends
    for row, (seed, sample) in enumerate(zip(seeds, samples)):
        # Only the temperature and the row's own Gumbel noise touched the logits: no top-k/top-p/penalty/min-length
        # processors, so the argmax is a draw from softmax(logits / T).
        noise = gumbel_noise(seed, len(sample.token_ids), steps[0][1].shape[-1])
        for t, token in enumerate(sample.token_ids):
            _, raw, rows, noisy = steps[t]
            i = rows.index(row)
            torch.testing.assert_close(noisy[i], raw[i] / temperature + noise[t], rtol=0, atol=1e-5)
            assert int(noisy[i].argmax()) == token
        assert all(row not in rows for _, _, rows, _ in steps[len(sample.token_ids):])  # a finished row left the batch
    for s in samples:
        assert len(s.token_ids) == len(s.logprobs) > 0 and all(lp <= 0 for lp in s.logprobs)
    assert_parity(trainer_model, prompts, samples, temperature)


def test_row_sampler_draws_from_the_filtered_softmax():
    """Gumbel-max per row samples exactly softmax(logits / T) restricted by top-k / top-p: frequencies over 40k
    rows match the distribution (5 standard errors), and filtered-out tokens never appear."""
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    rows = 40_000
    for temperature, top_k, top_p in ((1.0, 0, 1.0), (0.7, 3, 1.0), (1.3, 0, 0.8)):
        sampler = RowSampler([temperature] * rows, list(range(rows)), top_k, top_p)
        drawn, _ = sampler.draw(torch.zeros(rows, 1, dtype=torch.long), logits.expand(rows, -1).clone(),
                                list(range(rows)))
        probs = torch.softmax(logits / temperature, -1)
        keep = torch.ones_like(probs, dtype=torch.bool)
        if top_k:
            keep[probs.argsort(descending=True)[top_k:]] = False
        if top_p < 1:
            order = probs.argsort(descending=True)
            outside = (probs[order].cumsum(0) - probs[order]) >= top_p  # tokens after the nucleus is full
            keep[order[outside]] = False
        probs = torch.where(keep, probs, 0.0)
        probs = probs / probs.sum()
        counts = torch.bincount(drawn, minlength=len(logits)).double() / rows
        stderr = (probs * (1 - probs) / rows).sqrt()
        assert ((counts - probs).abs() <= 5 * stderr + 1e-12).all(), (temperature, top_k, top_p, counts, probs)
        assert (counts[~keep] == 0).all()


def test_seeded_sampling_is_reproducible_independent_of_batching_and_leaves_global_rng_alone(tiny_model_dir):
    model, tokenizer = load(tiny_model_dir)
    engine = EmbeddedEngine(model, tokenizer, SamplingConfig(temperature=1.0), max_batch_size=64)
    prompts = prompts_of(tokenizer)
    state = torch.random.get_rng_state()
    together = sample_seeded(engine, prompts, [1, 2, 3, 4, 5])
    assert torch.equal(torch.random.get_rng_state(), state)  # a seeded sample draws nothing from torch's RNG
    again = sample_seeded(engine, prompts[::-1], [5, 4, 3, 2, 1])  # other order, other rows beside each
    alone = [sample_seeded(engine, [p], [seed])[0] for p, seed in zip(prompts, [1, 2, 3, 4, 5])]
    assert [s.token_ids for s in together] == [s.token_ids for s in again[::-1]] == [s.token_ids for s in alone]
    for a, b in zip(together, alone):
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4
    other = sample_seeded(engine, prompts, [6, 7, 8, 9, 10])
    assert [s.token_ids for s in other] != [s.token_ids for s in together]


def test_a_groups_prompt_is_prefilled_once_and_sampling_is_unchanged(tiny_model_dir):
    """Requests sharing a prompt (a group) reuse one prefill's keys/values: the same tokens and log-probs (to float
    rounding) as when every request prefills its own copy, prompts of other lengths (left padding) beside them."""
    model, tokenizer = load(tiny_model_dir)
    prompts = [p for p in prompts_of(tokenizer) for _ in range(4)]  # 5 groups of 4 samples
    seeds = list(range(100, 100 + len(prompts)))
    shared = EmbeddedEngine(model, tokenizer, SamplingConfig(temperature=1.0), max_batch_size=64)
    alone = EmbeddedEngine(model, tokenizer, SamplingConfig(temperature=1.0), max_batch_size=64, share_prompt_prefill=False)
    # The input shape of every forward of the decoder and of the whole model (with the output layer: the decode
    # loop's forwards only).
    prefilled, with_head = [], []
    shared.model.get_decoder().register_forward_pre_hook(
        lambda module, args, kwargs: prefilled.append(kwargs["input_ids"].shape), with_kwargs=True)
    shared.model.register_forward_pre_hook(
        lambda module, args, kwargs: with_head.append(kwargs["input_ids"].shape), with_kwargs=True)
    with_sharing = sample_seeded(shared, prompts, seeds, 12)
    without = sample_seeded(alone, prompts, seeds, 12)
    assert shared.health()["prefills_shared"] == 15 and alone.health()["prefills_shared"] == 0
    width = max(len(p) for p in prompts)
    # The first forward is the shared prefill: 5 distinct prompts, all but the last position.
    assert prefilled[0] == (5, width - 1)
    # ... which skips the output layer: the whole model first runs on the prompts' last positions.
    assert len(with_head) == len(prefilled) - 1 and with_head[0] == (20, 1)
    assert [s.token_ids for s in with_sharing] == [s.token_ids for s in without]
    for a, b in zip(with_sharing, without):
        assert a.finish_reason == b.finish_reason
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-5
    assert_parity(model, prompts, with_sharing, 1.0)


@pytest.mark.parametrize("llama_decode", [True, False])
def test_a_batchs_common_system_prompt_is_prefilled_once_and_sampling_is_unchanged(tiny_model_dir, llama_decode):
    """Prompts that all start with one system prompt (groups of several sizes and lengths, and a lone prompt):
    the system prompt (the batch's root) is prefilled once, each distinct prompt continues from a copy of its
    keys/values, rows are laid out [root | padding | the rest]; the same tokens and log-probs (to float rounding)
    as without sharing, and the trainer's log-probs. A repetition penalty (its context skips left padding only)
    turns the root off."""
    model, tokenizer = load(tiny_model_dir)
    system = tokenizer("You are a careful assistant. Answer briefly and exactly, and check every step twice.")["input_ids"]
    root = len(system)
    assert root >= batch_decode.MIN_ROOT_TOKENS
    prompts = [system + p for p in prompts_of(tokenizer)]
    prompts = [p for i, p in enumerate(prompts) for _ in range(i % 3 + 1)]  # groups of 1, 2 and 3 samples
    seeds = list(range(300, 300 + len(prompts)))
    shared = EmbeddedEngine(model, tokenizer, SamplingConfig(temperature=1.0), llama_decode=llama_decode)
    alone = EmbeddedEngine(model, tokenizer, SamplingConfig(temperature=1.0), share_prompt_prefill=False,
                           llama_decode=llama_decode)
    prefilled = []
    shared.model.get_decoder().register_forward_pre_hook(
        lambda module, args, kwargs: prefilled.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True)
    with_root = sample_seeded(shared, prompts, seeds, 12)
    without = sample_seeded(alone, prompts, seeds, 12)
    distinct, width = len(TEXTS), max(len(p) for p in prompts)
    assert prefilled[:2] == [(1, root), (distinct, width - 1 - root)]  # the root once, then the distinct prompts
    assert shared.health()["root_tokens_shared"] == root * (distinct - 1)
    assert shared.health()["prefills_shared"] == len(prompts) - distinct
    assert [s.token_ids for s in with_root] == [s.token_ids for s in without]
    for a, b in zip(with_root, without):
        assert a.finish_reason == b.finish_reason
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-5
    assert_parity(model, prompts, with_root, 1.0)
    penalised = EmbeddedEngine(model, tokenizer, SamplingConfig(temperature=1.0, repetition_penalty=1.3))
    sample_seeded(penalised, prompts, seeds, 4)
    assert penalised.health()["root_tokens_shared"] == 0 and penalised.health()["prefills_shared"] > 0


def test_rollout_temperature_overrides_the_engines(tiny_model_dir):
    """Evaluation samples greedily (temperature 0) through an engine that trains at temperature 1."""
    model, tokenizer = load(tiny_model_dir)
    greedy_engine = EmbeddedEngine(model, tokenizer, SamplingConfig(temperature=0.0))
    engine = EmbeddedEngine(model, tokenizer, SamplingConfig(temperature=1.0))
    prompts = prompts_of(tokenizer)
    greedy = sample_all(greedy_engine, prompts, 12)
    overridden = sample_seeded(engine, prompts, [None] * len(prompts), 12, temperature=0.0)
    assert [s.token_ids for s in overridden] == [s.token_ids for s in greedy]
    mixed = sample_seeded(engine, prompts, [3] * len(prompts), 12, temperature=0.0)  # a seed changes nothing greedy
    assert [s.token_ids for s in mixed] == [s.token_ids for s in greedy]
    assert_parity(model, prompts, overridden, 1.0)  # greedy rows report log-probs at temperature 1


def test_finish_reasons_eos_and_per_request_lengths(tiny_model_dir, monkeypatch):
    model, tokenizer = load(tiny_model_dir)
    eos = tokenizer.eos_token_id
    with torch.no_grad():
        model.get_output_embeddings().weight[eos] *= 100  # eos likely at about half the positions
    engine = EmbeddedEngine(model, tokenizer, SamplingConfig(temperature=1.0))
    forwarded = []  # rows of each decode step: the first through the model's forward, the rest the lean step's
    engine.model.register_forward_pre_hook(
        lambda module, args, kwargs: forwarded.append(kwargs["input_ids"].shape[0]), with_kwargs=True)
    lean_step = LlamaDecoder.step
    monkeypatch.setattr(LlamaDecoder, "step",
                        lambda self, ids, *rest: forwarded.append(len(ids)) or lean_step(self, ids, *rest))
    torch.manual_seed(1)
    prompts = prompts_of(tokenizer) * 2
    limits = [1, 3, 8, 16, 32] * 2
    samples = sample_all(engine, prompts, limits)
    assert engine.generate_calls == 1
    # A row that drew eos or reached its own limit left the batch: after the first forward (every row), each row
    # was forwarded once per token it drew after its first.
    assert forwarded[0] == len(prompts) and sum(forwarded[1:]) == sum(len(s.token_ids) - 1 for s in samples)
    assert forwarded == sorted(forwarded, reverse=True) and forwarded[-1] < len(prompts)
    reasons = {s.finish_reason for s in samples}
    assert reasons == {"stop", "length"}
    for s, limit in zip(samples, limits):
        s.validate(limit)  # the environments' sampler contract
        assert len(s.token_ids) <= limit
        assert eos not in s.token_ids[:-1] and tokenizer.pad_token_id not in s.token_ids
        if s.finish_reason == "stop":
            assert s.token_ids[-1] == eos
        else:
            assert len(s.token_ids) == limit and s.token_ids[-1] != eos
    assert_parity(model, prompts, samples, 1.0)


def test_concurrent_calls_are_batched_and_each_gets_its_own_result(tiny_model_dir):
    model, tokenizer = load(tiny_model_dir)
    engine = EmbeddedEngine(model, tokenizer, SamplingConfig(temperature=0.0), max_batch_size=64)
    prompts = prompts_of(tokenizer)
    alone = [sample_all(engine, [p], 12)[0] for p in prompts]
    assert engine.generate_calls == len(prompts)

    async def late(prompt, delay_rounds):
        for _ in range(delay_rounds):  # an environment doing some async work first
            await asyncio.sleep(0)
        return await engine.sample(prompt, 12)

    async def run():
        return await asyncio.gather(*(late(p, i) for i, p in enumerate(prompts)))

    before = engine.generate_calls
    together = asyncio.run(run())
    assert engine.generate_calls == before + 1, "concurrent requests should share one generate call"
    assert [s.token_ids for s in together] == [s.token_ids for s in alone]
    for a, b in zip(together, alone):
        assert a.finish_reason == b.finish_reason
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4

    small = EmbeddedEngine(model, tokenizer, SamplingConfig(temperature=0.0), max_batch_size=2)
    samples = sample_all(small, prompts, 12)  # a second event loop on the same engine works too
    assert small.generate_calls == 3 and small.health()["requests_served"] == 5
    assert [s.token_ids for s in samples] == [s.token_ids for s in alone]


def test_event_loop_stays_responsive_during_generation(tiny_model_dir):
    model, tokenizer = load(tiny_model_dir)
    engine = EmbeddedEngine(model, tokenizer, SamplingConfig(max_new_tokens=4))
    original = engine._decode

    def slow_decode(*args):
        time.sleep(0.3)
        return original(*args)

    engine._decode = slow_decode

    async def run():
        ticks = 0
        task = asyncio.ensure_future(engine.sample(prompts_of(tokenizer)[0]))
        while not task.done():
            ticks += 1
            await asyncio.sleep(0.01)
        return ticks, await task

    ticks, sample = asyncio.run(run())
    assert ticks >= 10 and isinstance(sample, Sample)


def perturbed_copy(folder, seed):
    model, _ = load(folder)
    torch.manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.5)
    return model


@pytest.mark.parametrize("tied", [True, False])
def test_load_weights_then_parity_with_new_trainer_weights(tiny_model_dir, untied_model_dir, tied):
    folder = tiny_model_dir if tied else untied_model_dir
    engine = EmbeddedEngine(folder, sampling=SamplingConfig(temperature=1.0))  # a fresh load from the folder
    tokenizer = engine.tokenizer
    head, embed = engine.model.get_output_embeddings().weight, engine.model.get_input_embeddings().weight
    assert (head is embed) == tied
    prompts = prompts_of(tokenizer)
    torch.manual_seed(2)
    before = sample_all(engine, prompts, 16)
    trainer = perturbed_copy(folder, seed=3)
    names = [name for name, _ in trainer.named_parameters()]  # deduplicated: a tied head is not listed
    assert ("lm_head.weight" in names) == (not tied)
    # As the trainer sends them from a DDP wrapper.
    engine.load_weights(((f"module.{n}", p.detach().clone()) for n, p in trainer.named_parameters()), version=1)
    assert engine.policy_version == 1 and engine.health()["policy_version"] == 1
    torch.manual_seed(2)
    after = sample_all(engine, prompts, 16)
    assert [s.token_ids for s in after] != [s.token_ids for s in before]
    assert_parity(trainer, prompts, after, 1.0)  # the output layer uses the new weights too
    with pytest.raises(AssertionError):
        assert_parity(trainer, prompts, before, 1.0)  # and the check does catch stale weights


def test_bad_weight_names_and_shapes_are_errors_and_change_nothing(tiny_model_dir):
    engine = EmbeddedEngine(tiny_model_dir, sampling=SamplingConfig(temperature=0.0))
    prompt = prompts_of(engine.tokenizer)[:1]
    reference = sample_all(engine, prompt, 8)[0].logprobs
    embed = engine.model.get_input_embeddings().weight
    with pytest.raises(KeyError, match="model.no_such.weight"):
        zeros = torch.zeros_like(embed)
        engine.load_weights([("model.embed_tokens.weight", zeros), ("model.no_such.weight", embed)], 5)
    with pytest.raises(ValueError, match="shape"):
        engine.load_weights([("model.embed_tokens.weight", torch.zeros(3, 3))], 5)
    assert engine.policy_version == 0
    assert sample_all(engine, prompt, 8)[0].logprobs == reference


def test_generate_error_reaches_every_concurrent_caller(tiny_model_dir):
    model, tokenizer = load(tiny_model_dir)
    engine = EmbeddedEngine(model, tokenizer, SamplingConfig(), max_batch_size=2)
    original = engine._decode

    def broken(*args):
        raise RuntimeError("boom in generate")

    engine._decode = broken

    async def run():
        calls = (engine.sample(p, 4) for p in prompts_of(tokenizer))
        return await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), timeout=20)

    results = asyncio.run(run())
    assert len(results) == 5 and engine.generate_calls == 3  # three batches, each failing on its own
    assert all(isinstance(r, RuntimeError) and "boom in generate" in str(r) for r in results)
    engine._decode = original  # the engine recovers for later requests
    assert isinstance(sample_all(engine, prompts_of(tokenizer)[:2], 4)[0], Sample)

    with pytest.raises(ValueError, match="outside the vocabulary"):
        sample_all(engine, [[engine.vocab_size + 7]], 4)
    engine.close()
    assert engine.health()["ok"] is False
    with pytest.raises(EngineClosedError):
        sample_all(engine, prompts_of(tokenizer)[:1], 4)


def test_load_weights_waits_for_running_generate(tiny_model_dir):
    model, tokenizer = load(tiny_model_dir)
    engine = EmbeddedEngine(model, tokenizer, SamplingConfig(temperature=0.0))
    original, started = engine._decode, threading.Event()

    def slow_decode(*args):
        started.set()
        time.sleep(0.3)
        return original(*args)

    engine._decode = slow_decode
    trainer = perturbed_copy(tiny_model_dir, seed=4)
    prompts = prompts_of(tokenizer)
    result = {}
    worker = threading.Thread(target=lambda: result.update(samples=sample_all(engine, prompts, 8)))
    worker.start()
    assert started.wait(10)
    engine.load_weights(trainer.named_parameters(), version=7)  # blocks until the generate is done
    worker.join(10)
    assert engine.policy_version == 7
    # The batch in flight was generated entirely with the old weights: parity against the original model.
    assert_parity(model, prompts, result["samples"], 1.0)


def test_weight_loads_never_interleave(tiny_model_dir):
    """Loads stage into reused memory (``StagedWeights``): a second load waits for the first to be applied, so the
    weights end as one load's, never a mix of the two."""
    engine = EmbeddedEngine(tiny_model_dir, sampling=SamplingConfig(temperature=0.0))
    names = [name for name, _ in engine.model.named_parameters()]
    shapes = {name: p.shape for name, p in engine.model.named_parameters()}
    second = threading.Thread(target=lambda: engine.load_weights(
        [(name, torch.full(shapes[name], 0.25)) for name in names], version=2))

    def first():
        for i, name in enumerate(names):
            if i == len(names) // 2:  # half staged: the second load starts, and must wait
                second.start()
                time.sleep(0.3)
                assert second.is_alive()
            yield name, torch.full(shapes[name], 0.5)

    engine.load_weights(first(), version=1)
    second.join(10)
    assert not second.is_alive() and engine.policy_version == 2
    assert all(torch.all(p == 0.25) for p in engine.model.parameters())


def test_smollm2_converts_loads_and_answers(smollm2_model_dir):
    model, tokenizer = load(smollm2_model_dir)
    assert len(tokenizer) == 49152 and tokenizer.eos_token == "<|im_end|>"
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
    prompt_ids = list(prompt["input_ids"])
    assert tokenizer.decode(prompt_ids).endswith("<|im_start|>assistant\n")
    greedy = EmbeddedEngine(model, tokenizer, SamplingConfig(temperature=0.0))
    answer = sample_all(greedy, [prompt_ids], 12)[0]
    assert "Paris" in tokenizer.decode(answer.token_ids), tokenizer.decode(answer.token_ids)
    greedy.close()
    engine = EmbeddedEngine(model, tokenizer, SamplingConfig(temperature=0.7))
    torch.manual_seed(0)
    samples = sample_all(engine, [prompt_ids, prompt_ids[:-3]], 8)
    assert_parity(model, [prompt_ids, prompt_ids[:-3]], samples, 0.7)
