"""The embedded engine's sampling processors (repetition penalty, min-p, top-k, top-p): it samples from the processed
distribution and reports log-probs of that distribution (the importance correction divides by them), recomputed
here independently (``tests/helpers/sampling_reference.py``); the defaults add no processor and change nothing."""

import asyncio

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from verifiers_rl.envs import RolloutSampling, sampling_for_rollout
from verifiers_rl.inference import EmbeddedEngine, SamplingConfig
from verifiers_rl.inference.embedded.engine import RowSampler

from tests.helpers.sampling_reference import penalised, reference_logprobs, spy_on_sampler, step_logits

TEXTS = [
    "What is 2 + 2?",
    "Reverse the text: hello world",
    "Guess",
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
]
# The tiny random model's logits are nearly flat (max/min probability ~4 at T = 1): T = 0.3 spreads them enough for
# min-p to remove tokens and for the penalty to move probabilities.
SETTINGS = {
    "min_p": dict(temperature=0.3, min_p=0.2),
    "penalty": dict(temperature=0.3, repetition_penalty=1.5),
    "penalty_below_1": dict(temperature=0.3, repetition_penalty=0.7),
    "all_together": dict(temperature=0.3, min_p=0.05, repetition_penalty=1.3, top_k=40, top_p=0.9),
    "min_p_then_top_p": dict(temperature=0.3, min_p=0.3, top_p=0.5),  # top-p on what min-p left (vLLM's order)
    "top_k_top_p": dict(temperature=0.7, top_k=5, top_p=0.8),
}


def load(folder):
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(folder)


def batch(tokenizer, copies=2):
    """Prompts of four lengths (left padding), each twice (a group: its prompt prefilled once), with their seeds."""
    prompts = [tokenizer(text)["input_ids"] for text in TEXTS for _ in range(copies)]
    return prompts, list(range(100, 100 + len(prompts)))


def sample_seeded(engine, prompts, seeds, max_new_tokens=16, temperatures=None):
    """All requests in one batch, each in its own task under ``RolloutSampling(seed, temperature)``."""
    temperatures = temperatures or [None] * len(prompts)

    async def one(prompt, seed, temperature):
        with sampling_for_rollout(RolloutSampling(seed, temperature)):
            return await engine.sample(prompt, max_new_tokens)

    async def run():
        return await asyncio.gather(*(one(*args) for args in zip(prompts, seeds, temperatures)))

    return asyncio.run(run())


@pytest.mark.parametrize("name", SETTINGS)
def test_reported_logprobs_are_those_of_the_distribution_sampled(tiny_model_dir, name):
    model, tokenizer = load(tiny_model_dir)
    sampling = SETTINGS[name]
    engine = EmbeddedEngine(model, tokenizer, SamplingConfig(max_new_tokens=16, **sampling), max_batch_size=16)
    prompts, seeds = batch(tokenizer)
    samples = sample_seeded(engine, prompts, seeds)
    assert engine.generate_calls == 1 and engine.health()["prefills_shared"] == 4
    gap_from_plain = 0.0
    for prompt, sample in zip(prompts, samples):
        expected = reference_logprobs(model, prompt, sample.token_ids, **sampling)
        assert torch.isfinite(expected).all(), "a sampled token lies outside the filtered distribution"
        assert (torch.tensor(sample.logprobs) - expected).abs().max().item() < 1e-5, (name, sample.token_ids)
        plain = reference_logprobs(model, prompt, sample.token_ids, sampling["temperature"])
        gap_from_plain = max(gap_from_plain, (plain - expected).abs().max().item())
    assert gap_from_plain > 1e-2, "the setting must change the distribution for the check above to mean anything"


def _below_min_p(model, prompts, samples, temperature, min_p):
    """How many sampled tokens have p < min_p * max p under the tempered softmax (what min-p removes)."""
    below = 0
    for prompt, sample in zip(prompts, samples):
        probs = torch.softmax(step_logits(model, prompt, sample.token_ids) / temperature, -1)
        chosen = probs.gather(-1, torch.tensor(sample.token_ids)[:, None])[:, 0]
        below += int((chosen < min_p * probs.max(-1).values).sum())
    return below


def test_min_p_never_samples_a_token_below_min_p_times_the_top_probability(tiny_model_dir):
    model, tokenizer = load(tiny_model_dir)
    prompts, seeds = batch(tokenizer, copies=4)
    drawn = {}
    for min_p in (0.0, 0.2):
        engine = EmbeddedEngine(model, tokenizer, SamplingConfig(temperature=0.3, min_p=min_p, max_new_tokens=24))
        drawn[min_p] = sample_seeded(engine, prompts, seeds, 24)
    assert _below_min_p(model, prompts, drawn[0.2], 0.3, 0.2) == 0
    # Without min-p the same seeds do draw such tokens: the check above could fail.
    assert _below_min_p(model, prompts, drawn[0.0], 0.3, 0.2) > 10


def test_repetition_penalty_follows_its_formula_over_prompt_and_generated_tokens(tiny_model_dir):
    """The penalty by its formula (not transformers' processor), over the row's own prompt and completion so far:
    never its left padding (prompts of four lengths share the batch, padded with a likely token absent from them)."""
    model, tokenizer = load(tiny_model_dir)
    prompts, seeds = batch(tokenizer)
    with torch.no_grad():
        first = model(torch.tensor([prompts[0]])).logits[0, -1]
    first[sorted({t for p in prompts for t in p})] = -float("inf")
    tokenizer.pad_token = tokenizer.convert_ids_to_tokens(int(first.argmax()))  # penalised, were padding counted
    plain = sample_seeded(EmbeddedEngine(model, tokenizer, SamplingConfig(temperature=0.3)), prompts, seeds)
    for penalty in (1.5, 0.7):
        engine = EmbeddedEngine(model, tokenizer, SamplingConfig(temperature=0.3, repetition_penalty=penalty))
        samples = sample_seeded(engine, prompts, seeds)
        assert [s.token_ids for s in samples] != [s.token_ids for s in plain], "the same seeds draw other tokens"
        for prompt, sample in zip(prompts, samples):
            raw, ids = step_logits(model, prompt, sample.token_ids), sample.token_ids
            expected = torch.stack([torch.log_softmax(penalised(raw[t], prompt + ids[:t], penalty) / 0.3, -1)[token]
                                    for t, token in enumerate(ids)])
            assert (torch.tensor(sample.logprobs) - expected).abs().max().item() < 1e-5, (penalty, prompt, ids)


def test_greedy_rows_take_the_argmax_of_the_penalised_logits_beside_sampled_rows(tiny_model_dir):
    """Temperature 0 (a rollout's override, batched with sampled rows): the penalty applies, the filters do not
    (as in vLLM), and the log-probs are the penalised softmax at temperature 1."""
    model, tokenizer = load(tiny_model_dir)
    sampling = dict(temperature=0.3, repetition_penalty=1.5, min_p=0.3, top_k=3)
    engine = EmbeddedEngine(model, tokenizer, SamplingConfig(**sampling))
    prompts, seeds = batch(tokenizer)
    temperatures = [0.0, None] * (len(prompts) // 2)  # a greedy row beside a sampled one, in every group
    samples = sample_seeded(engine, prompts, seeds, 16, temperatures)
    assert engine.generate_calls == 1
    unpenalised_differs = False
    for prompt, sample, temperature in zip(prompts, samples, temperatures):
        if temperature is None:
            expected = reference_logprobs(model, prompt, sample.token_ids, **sampling)
        else:
            raw, ids = step_logits(model, prompt, sample.token_ids), sample.token_ids
            logits = torch.stack([penalised(raw[t], prompt + ids[:t], 1.5) for t in range(len(ids))])
            assert ids == logits.argmax(-1).tolist()
            unpenalised_differs |= ids != raw.argmax(-1).tolist()
            expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids)[:, None])[:, 0]
        assert (torch.tensor(sample.logprobs) - expected).abs().max().item() < 1e-5, (temperature, sample.token_ids)
    assert unpenalised_differs, "greedy decoding without the penalty must pick other tokens somewhere"


@pytest.mark.parametrize("temperatures", [[1.0] * 8, [0.7] * 8, [0.0, 1.0] * 4])
def test_default_settings_add_no_processor_and_report_the_tempered_softmax_bit_for_bit(tiny_model_dir, temperatures,
                                                                                     monkeypatch):
    """What the engine reported before these settings existed: log_softmax(raw logits / T) of the model's own
    logits at each step (T = 1 for greedy rows). The defaults give exactly those (torch.equal), with no filter or
    penalty added."""
    model, tokenizer = load(tiny_model_dir)
    engine = EmbeddedEngine(model, tokenizer, SamplingConfig(temperature=1.0))
    steps = spy_on_sampler(monkeypatch)
    prompts, seeds = batch(tokenizer)
    samples = sample_seeded(engine, prompts, seeds, 16, temperatures)
    sampler = steps[0][0]
    assert all(step[0] is sampler for step in steps) and sampler.filters == [] and sampler.repetition_penalty == 1
    scale = torch.tensor([t or 1.0 for t in temperatures])
    for row, sample in enumerate(samples):
        before = torch.stack([torch.log_softmax(raw.float() / scale[rows][:, None], -1)[rows.index(row), token]
                              for (_, raw, rows, _), token in zip(steps, sample.token_ids)])
        assert torch.equal(torch.tensor(sample.logprobs), before), row


def test_row_sampler_draws_from_the_penalised_min_p_softmax_and_logs_it():
    """Gumbel-max per row over 40k rows: frequencies match the penalised, tempered, min-p filtered and renormalised
    softmax (5 standard errors), removed tokens never appear, and ``draw``'s log-probs are that distribution's. The rows'
    context is [3, 0, 4] with the 3 a left pad: tokens 0 and 4 are penalised, 3 is not."""
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    rows, temperature, min_p, penalty = 40_000, 0.8, 0.15, 1.5
    sampler = RowSampler([temperature] * rows, list(range(rows)), 0, 1.0, min_p, penalty, pad_lengths=[1] * rows)
    context = torch.tensor([[3, 0, 4]]).expand(rows, -1)
    drawn, logprobs = sampler.draw(context, logits.expand(rows, -1).clone(), list(range(rows)))
    by_hand = torch.tensor([2.0 / penalty, 1.0, 0.5, 0.0, -1.0 * penalty, -3.0]) / temperature
    probs = torch.softmax(by_hand, -1)
    keep = probs >= min_p * probs.max()
    assert 0 < int((~keep).sum()) < 5  # min-p removes some tokens, not all
    probs = torch.where(keep, probs, 0.0) / probs[keep].sum()
    counts = torch.bincount(drawn, minlength=len(logits)).double() / rows
    stderr = (probs * (1 - probs) / rows).sqrt()
    assert ((counts - probs).abs() <= 5 * stderr + 1e-12).all(), (counts, probs)
    assert (counts[~keep] == 0).all()
    torch.testing.assert_close(logprobs, probs.log()[drawn].float(), rtol=0, atol=1e-6)


@pytest.fixture
def two_threads():
    """torch at two threads for one test (RowSampler draws seeded rows' noise on two threads only then), restored."""
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(previous)


@pytest.mark.parametrize("temperatures, top_k, seeded", [
    ([1.0] * 6, 0, True), ([0.7, 1.0, 0.0, 1.3, 1.0, 0.5], 0, True), ([1.0] * 6, 3, True), ([1.0] * 6, 0, False),
])
def test_row_sampler_draws_the_plain_gumbel_max_formula_bit_for_bit(temperatures, top_k, seeded, two_threads):
    """``draw`` in place and on two threads (seeded rows) is token = argmax(l - log(-log u)), u drawn row after row
    by ``torch.rand(vocab, generator=<the row's>)`` (the global generator, in row order, where unseeded), and the
    log-prob is log_softmax(l) there: the same tokens and log-probs to the bit, also once rows have left."""
    vocab, seeds = 5000, ([11, 12, 13, 14, 15, 16] if seeded else [None] * 6)
    sampler = RowSampler(temperatures, seeds, top_k, 1.0)
    mine = [torch.Generator().manual_seed(seed) if seeded else None for seed in seeds]
    for step in range(6):
        rows = [0, 1, 2, 3, 4, 5] if step < 3 else [1, 3, 4, 5]
        scores = torch.randn(len(rows), vocab, generator=torch.Generator().manual_seed(step)) * 3
        context = torch.zeros(len(rows), 2, dtype=torch.long)
        torch.manual_seed(step)
        tokens, logprobs = sampler.draw(context, scores, rows)
        torch.manual_seed(step)
        uniform = torch.stack([torch.rand(vocab, generator=mine[row]) for row in rows])
        tempered = torch.tensor([temperatures[row] or 1.0 for row in rows])[:, None]
        l = scores / tempered
        if top_k:
            l = l.masked_fill(l < l.topk(top_k, -1).values[:, -1:], float("-inf"))
        greedy = torch.tensor([temperatures[row] == 0 for row in rows])[:, None]
        l = torch.where(greedy, scores, l)
        gumbel = -torch.log(-torch.log(uniform.clamp_min(torch.finfo(torch.float32).tiny)))
        noisy = torch.where(greedy, scores, l + gumbel)
        expected = noisy.argmax(-1)
        assert torch.equal(tokens, expected), step
        assert torch.equal(logprobs, torch.log_softmax(l, -1).gather(-1, expected[:, None])[:, 0]), step


@pytest.mark.parametrize("bad, flag", [
    (dict(min_p=1.0), "min_p"), (dict(min_p=-0.1), "min_p"), (dict(min_p=float("nan")), "min_p"),
    (dict(repetition_penalty=0.0), "repetition_penalty"), (dict(repetition_penalty=float("inf")), "repetition_penalty"),
])
def test_sampling_config_refuses_values_outside_range_naming_the_flag(bad, flag):
    with pytest.raises(ValueError, match=rf"^{flag} must be"):
        SamplingConfig(**bad)
    assert SamplingConfig(min_p=0.0, repetition_penalty=1.0) == SamplingConfig()  # the defaults: off
