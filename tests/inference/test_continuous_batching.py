"""Continuous batching in the embedded engine (issue 37 item 1): ``EmbeddedEngine.generate_continuous`` admits new
rows into its running decode batch between steps. A row admitted mid-way samples the tokens it samples decoded
alone under the same seed (log-probs within 1e-5), on the lean Llama step and on transformers' forward, and the
batch stays full (max_rows rows a step) while requests wait."""

from __future__ import annotations

import pytest
import torch

from verifiers_rl.envs import derive_seed
from verifiers_rl.inference import EmbeddedEngine, SamplingConfig
from verifiers_rl.inference.embedded.prefill import KeptTurns, padded_runs
from verifiers_rl.inference.embedded.running_batch import DecodeRequest

from tests.helpers.continuous import alone, requests_of

MAX_ROWS = 3


@pytest.mark.parametrize("llama_decode,sampling", [
    (True, SamplingConfig(max_new_tokens=64)),
    (False, SamplingConfig(max_new_tokens=64)),
    (True, SamplingConfig(max_new_tokens=64, repetition_penalty=1.3, top_k=20)),  # the penalty's context moves
])
def test_an_admitted_row_samples_what_it_samples_decoded_alone(tiny_model_dir, llama_decode, sampling):
    engine = EmbeddedEngine(tiny_model_dir, sampling=sampling, llama_decode=llama_decode)
    # (test_hf_engine checks that ``sample`` itself draws a row's tokens independently of its batch)
    assert engine.llama_decode == llama_decode  # the tiny model is a plain fp32 Llama: the lean step applies
    requests = requests_of(100)
    run = engine.generate_continuous([DecodeRequest(p, n, t, derive_seed(s, 0)) for p, n, t, s in requests], MAX_ROWS)
    assert run.stats.admissions >= len(requests) - MAX_ROWS  # rows really joined a running batch
    if llama_decode:  # most joined free rows of the lean step's buffers; the last, long prompt did not fit
        assert 2 <= run.stats.rebuilds < run.stats.admissions
    for (prompt, max_new_tokens, temperature, seed), got in zip(requests, run.samples):
        want = alone(engine, prompt, max_new_tokens, temperature, seed)
        assert got.token_ids == want.token_ids and got.finish_reason == want.finish_reason
        assert max(abs(a - b) for a, b in zip(got.logprobs, want.logprobs)) < 1e-5
    assert run.versions == [[0] * len(sample.token_ids) for sample in run.samples]  # the engine's version per token
    lengths = [len(sample.token_ids) for sample in run.samples]
    assert max(lengths) >= 8 * min(lengths)  # a long tail beside short rows
    # The point of it: the batch stays full while requests wait.
    rows, waiting = run.stats.rows_per_step, run.stats.waiting_per_step
    assert sum(waiting) > 0 and all(r == MAX_ROWS for r, w in zip(rows, waiting) if w)
    # Each decode step ran only rows with tokens left to draw (a row's first token comes from its prefill).
    assert sum(rows) == sum(length - 1 for length in lengths)


def test_the_lean_steps_buffers_hold_the_rows_running_not_max_rows(tiny_model_dir):
    # --continuous_batching_rows is a cap: a cap far above the rows a run holds (a GPU's 256 for 16 rows, or a
    # nonsense 10**12) must not allocate its whole size at every rebuild (10**12 rows: an allocation error).
    engine = EmbeddedEngine(tiny_model_dir, sampling=SamplingConfig(max_new_tokens=64))
    batch = engine._running_batch(10**12)
    requests = requests_of(900)
    ids = [batch.add(DecodeRequest(p, n, t, derive_seed(s, 0))) for p, n, t, s in requests]
    samples, held = {}, []
    while not batch.done:
        samples.update(engine._continuous_step(batch))
        if batch.rows:
            held.append((batch.kv.keys[0].shape[0], len(batch.rows)))
    assert held and all(buffer <= 2 * len(requests) for buffer, _ in held)
    assert max(rows for _, rows in held) == len(requests) - 1  # all joined together (the shortest ended at once)
    for (prompt, max_new_tokens, temperature, seed), rid in zip(requests, ids):
        assert samples[rid].token_ids == alone(engine, prompt, max_new_tokens, temperature, seed).token_ids
    engine.close()


def test_finished_rows_kept_for_a_next_turn_are_as_many_as_rows_run_at_once_not_max_rows(tiny_model_dir):
    # Each finished row's keys/values wait for its episode's next turn; under a cap far above the rows a run holds
    # they were kept up to the cap (every finished row of the run, single-turn ones too).
    engine = EmbeddedEngine(tiny_model_dir, sampling=SamplingConfig(max_new_tokens=64))
    batch = engine._running_batch(10**12)
    finished, peak = 0, 0
    for wave in range(4):  # three requests at a time: at most three rows run together
        for prompt, max_new_tokens, temperature, seed in requests_of(900)[:3]:
            batch.add(DecodeRequest(prompt, max_new_tokens + wave, temperature, derive_seed(seed, wave)))
        while not batch.done:
            finished += len(engine._continuous_step(batch))
            peak = max(peak, len(batch.rows))
    assert finished == 12 and 1 <= peak <= 3
    assert len(batch.prefill.kept.turns) == peak  # the newest, as many as rows ran at once
    engine.close()


def test_requests_and_max_rows_are_checked(tiny_model_dir):
    engine = EmbeddedEngine(tiny_model_dir)
    with pytest.raises(ValueError, match="max_rows must be >= 1"):
        engine.generate_continuous([DecodeRequest([1, 2], 4)], 0)
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        engine.generate_continuous([DecodeRequest([1, 2], 4, temperature=-1.0)], 2)
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
        engine.generate_continuous([DecodeRequest([1, 2], 0)], 2)


def test_a_weight_load_between_steps_keeps_the_rows_in_flight_and_versions_every_token(tiny_model_dir):
    # Issue 37 item 2's engine part: new weights enter between two decode steps without draining the batch; a row
    # in flight samples its earlier tokens under version 0 and its later ones under version 1, as recorded.
    engine = EmbeddedEngine(tiny_model_dir, sampling=SamplingConfig(max_new_tokens=64))
    requests = [DecodeRequest(p, n, t, derive_seed(s, 0)) for p, n, t, s in requests_of(300)[:5]]
    before = engine.generate_continuous(requests, MAX_ROWS)
    gen = torch.Generator().manual_seed(0)
    perturbed = [(name, param + 0.2 * torch.randn(param.shape, generator=gen))
                 for name, param in engine.model.named_parameters()]
    steps = []

    def load_at_step_six():
        steps.append(None)
        if len(steps) == 6:
            engine.load_weights(perturbed, version=1)

    run = engine.generate_continuous(requests, MAX_ROWS, between_steps=load_at_step_six)
    spanning = [v for v in run.versions if 0 in v and 1 in v]
    assert spanning and all(v == sorted(v) for v in run.versions)  # rows in flight crossed the update, in order
    for old, new, versions in zip(before.samples, run.samples, run.versions):
        first_new = versions.index(1) if 1 in versions else len(versions)
        assert new.token_ids[:first_new] == old.token_ids[:first_new]  # the old weights' tokens are unchanged
        if first_new < min(len(old.token_ids), len(new.token_ids)):  # the new weights sampled the rest
            assert max(abs(a - b) for a, b in zip(new.logprobs[first_new:], old.logprobs[first_new:])) > 1e-3


def test_a_sliding_window_model_is_refused_by_name(tiny_model_dir):
    # Its cache layers keep only the window's keys/values: left-padded rows cannot be joined to them.
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, use_sliding_window=True, sliding_window=4,
                         max_window_layers=0, eos_token_id=tokenizer.eos_token_id)
    engine = EmbeddedEngine(Qwen2ForCausalLM(config), tokenizer)
    with pytest.raises(ValueError, match=r"Qwen2ForCausalLM has cache layers other than full attention.*"
                                         r"EmbeddedEngine\.sample"):
        engine.generate_continuous([DecodeRequest([5, 6, 7], 4, 1.0, 1)], 2)


def admit_at_once(engine, seed_base: int):
    """Distinct prompts of different (close) lengths and a group of two, all admitted in the first step (as many
    rows as requests): the model's forward calls meanwhile, and the run."""
    import functools

    gen = torch.Generator().manual_seed(seed_base)
    prompts = [torch.randint(4, 200, (n,), generator=gen).tolist() for n in (20, 23, 18, 21)]
    requests = [(p, 6 + i, 1.0, seed_base + i) for i, p in enumerate(prompts + [prompts[1]])]
    forward, calls = engine.model.forward, []

    @functools.wraps(forward)  # keeps its signature: the batch still asks for the last position's logits only
    def counted(*args, **kwargs):
        calls.append(kwargs["input_ids"].shape)
        return forward(*args, **kwargs)

    engine.model.forward = counted
    try:
        run = engine.generate_continuous([DecodeRequest(p, n, t, derive_seed(s, 0)) for p, n, t, s in requests],
                                         len(requests))
    finally:
        del engine.model.forward
    return requests, calls, run


def test_distinct_prompts_admitted_together_are_prefilled_in_one_padded_forward(tiny_model_dir):
    # Multi-turn episodes queue a new distinct prompt per turn: a forward each made an admission cost as many.
    engine = EmbeddedEngine(tiny_model_dir, sampling=SamplingConfig(max_new_tokens=64), llama_decode=True)
    requests, calls, run = admit_at_once(engine, 500)
    assert calls == [(4, 23)]  # the lean step decodes: the one forward is the prefill, each distinct prompt once
    for (prompt, max_new_tokens, temperature, seed), got in zip(requests, run.samples):
        want = alone(engine, prompt, max_new_tokens, temperature, seed)
        assert got.token_ids == want.token_ids
        assert max(abs(a - b) for a, b in zip(got.logprobs, want.logprobs)) < 1e-5


def test_a_nan_in_the_padding_never_reaches_a_real_row(tiny_model_dir):
    # A NaN at a padding position (here the pad token's embedded input; on a GPU a kernel's fully masked row) is 0 x NaN
    # in every real row's attention: the prompts are then forwarded one by one, and rows draw what they draw alone.
    engine = EmbeddedEngine(tiny_model_dir, sampling=SamplingConfig(max_new_tokens=64), llama_decode=True)
    pad = engine.pad_token_id
    engine.model.get_input_embeddings().register_forward_hook(
        lambda module, args, out: out.masked_fill((args[0] == pad)[..., None], float("nan")))
    requests, calls, run = admit_at_once(engine, 600)
    for (prompt, max_new_tokens, temperature, seed), got in zip(requests, run.samples):
        want = alone(engine, prompt, max_new_tokens, temperature, seed)
        assert got.token_ids == want.token_ids
        assert max(abs(a - b) for a, b in zip(got.logprobs, want.logprobs)) < 1e-5
    assert calls == [(4, 23), (1, 18), (1, 20), (1, 21), (1, 23)]  # the padded forward, then each alone


def test_prompts_of_very_different_lengths_are_prefilled_in_separate_forwards():
    # Padded tokens cost as much as real ones where the forward is compute-bound: a run keeps its padding bounded.
    prompts = [(1,) * n for n in (2, 3, 20, 21, 23, 80)]
    assert [[len(p) for p in run] for run in padded_runs(prompts)] == [[2, 3], [20, 21, 23], [80]]


@pytest.mark.parametrize("llama_decode", [True, False])
def test_every_model_forward_of_a_running_batch_computes_through_the_engine_linears(tiny_model_dir, llama_decode):
    """A step swaps the layers' forward for the engine's linear product (``cpu_linears``) only where it runs the
    model's own forward: every prefill, and every step without the lean Llama step; the lean steps compute through
    the product they hold and skip the swap (a walk over every module each step)."""
    engine = EmbeddedEngine(tiny_model_dir, sampling=SamplingConfig(max_new_tokens=64), llama_decode=llama_decode)
    assert engine.cpu_matmuls != "linear"  # otherwise there is nothing to swap
    swapped = []
    engine.model.register_forward_pre_hook(lambda module, args: swapped.append("forward" in module.lm_head.__dict__))
    requests = [DecodeRequest(p, n, t, s) for p, n, t, s in requests_of(700)]
    run = engine.generate_continuous(requests, MAX_ROWS)
    steps = len(run.stats.rows_per_step)
    assert swapped and all(swapped), swapped
    if llama_decode:  # the prefills alone (a few admissions), far fewer than the steps
        assert len(swapped) < steps / 4, (len(swapped), steps)
    else:  # one forward a step, and the prefills
        assert len(swapped) > steps
    engine.close()


def run_turns(engine, batch, turns: list[tuple[list[int], int, int]]) -> list:
    """``(prompt, max_new_tokens, seed)`` requests added to the long-lived ``batch`` together and stepped until done
    (as the decode loop steps its batch); their samples in order."""
    ids = [batch.add(DecodeRequest(p, n, 1.0, derive_seed(seed, 0))) for p, n, seed in turns]
    samples = {}
    while not batch.done:
        samples.update(engine._continuous_step(batch))
    return [samples[rid] for rid in ids]


def second_turns(first_turns, samples, reply_length: int):
    """Each episode's next turn: its prompt, its tokens and an environment reply of ``reply_length`` tokens."""
    gen = torch.Generator().manual_seed(17)
    return [(prompt + sample.token_ids + torch.randint(4, 200, (reply_length,), generator=gen).tolist(), n + 2,
             seed + 50) for (prompt, n, seed), sample in zip(first_turns, samples)]


@pytest.mark.parametrize("llama_decode", [True, False])
def test_an_episodes_next_turn_forwards_only_its_new_tokens_and_samples_what_it_samples_prefilled_whole(
        tiny_model_dir, llama_decode):
    # A multi-turn episode sends each turn as a prompt that extends its last one: the finished row's keys/values
    # are kept, and the next turn's admission forwards only what is new (its last token and the reply).
    engine = EmbeddedEngine(tiny_model_dir, sampling=SamplingConfig(max_new_tokens=64), llama_decode=llama_decode)
    gen = torch.Generator().manual_seed(700)
    firsts = [(torch.randint(4, 200, (n,), generator=gen).tolist(), tokens, 700 + i)
              for i, (n, tokens) in enumerate([(12, 9), (30, 4), (7, 20)])]
    batch = engine._running_batch(3)
    samples = run_turns(engine, batch, firsts)
    assert batch.stats.continued == 0
    seconds = second_turns(firsts, samples, reply_length=5)
    got = run_turns(engine, batch, seconds)
    assert batch.stats.continued == 3  # all three from their first turns' keys/values, in one admission
    # Each fed its first turn's last token and the reply (6 tokens); the rest came from the kept keys/values.
    assert batch.stats.reused_positions == sum(len(prompt) - 6 for prompt, _, _ in seconds)
    for (prompt, max_new_tokens, seed), sample in zip(seconds, got):
        want = alone(engine, prompt, max_new_tokens, 1.0, seed)
        assert sample.token_ids == want.token_ids
        assert max(abs(a - b) for a, b in zip(sample.logprobs, want.logprobs)) < 1e-4


@torch.no_grad()
def first_token_logprob(prefix_model, model, prompt, kept: int, token: int) -> float:
    """log p(token | prompt) by ``model`` over the keys/values ``prefix_model`` computed for ``prompt[:kept]``."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    prefix_model(input_ids=torch.tensor([prompt[:kept]]), past_key_values=cache, use_cache=True)
    logits = model(input_ids=torch.tensor([prompt[kept:]]), past_key_values=cache, use_cache=True).logits[0, -1]
    return float(torch.log_softmax(logits, -1)[token])


def test_a_turn_after_a_weight_load_continues_from_the_earlier_weights_keys_and_values(tiny_model_dir):
    # As a row in flight across a load: the kept keys/values are the old weights', the new weights draw the turn's
    # tokens (versioned so), and each log-prob recorded is the one its token was drawn with.
    import copy

    engine = EmbeddedEngine(tiny_model_dir, sampling=SamplingConfig(max_new_tokens=64))
    gen = torch.Generator().manual_seed(800)
    firsts = [(torch.randint(4, 200, (10,), generator=gen).tolist(), 6, 800 + i) for i in range(2)]
    batch = engine._running_batch(2)
    samples = run_turns(engine, batch, firsts)
    old = copy.deepcopy(engine.model)
    engine.load_weights([(name, param + 0.2 * torch.randn(param.shape, generator=gen))
                         for name, param in engine.model.named_parameters()], version=1)
    seconds = second_turns(firsts, samples, reply_length=3)
    got = run_turns(engine, batch, seconds)
    assert batch.stats.continued == 2
    for (first, _, _), sample, (prompt, _, _), new in zip(firsts, samples, seconds, got):
        kept, token = len(first) + len(sample.token_ids) - 1, new.token_ids[0]
        assert abs(new.logprobs[0] - first_token_logprob(old, engine.model, prompt, kept, token)) < 1e-4
        # not what a prefill by the new weights alone gives
        assert abs(new.logprobs[0] - first_token_logprob(engine.model, engine.model, prompt, kept, token)) > 1e-3
        assert set(new.versions) == {1}


def test_kept_turns_give_the_longest_turn_a_prompt_extends_and_keep_the_newest():
    turns = KeptTurns(max_turns=2)
    kv = [(torch.zeros(1, 1, 3, 2), torch.zeros(1, 1, 3, 2))]
    turns.keep((1, 2, 3), kv)
    turns.keep((1, 2), kv)
    assert turns.take((1, 2, 3))[0] == 2  # strictly extended: (1, 2, 3) itself has no new token
    turns.keep((1, 2), kv)
    assert turns.take((1, 2, 3, 4))[0] == 3  # the longest
    assert turns.take((1, 2, 3, 4))[0] == 2  # taken once each
    assert turns.take((1, 2, 3, 4)) is None
    for tokens in ((5,), (6,), (7,)):
        turns.keep(tokens, kv)
    assert list(turns.turns) == [(6,), (7,)]  # the oldest dropped
