"""Per-token log-probs: chunked equals unchunked (values and gradients); packed rows equal padded rows on a real
tiny model; the attention mask comes from real-token positions, never from the loss mask or from pad ids."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from verifiers_rl.batching import BatchingConfig, collate, plan_batch, prepare_sequences
from verifiers_rl.loss import GlobalCounts
from verifiers_rl.policy import micro_batch_logprobs, target_logprobs
from verifiers_rl.rollouts import Rollout
from verifiers_rl.synthetic import random_rollouts


@pytest.mark.parametrize("chunk_size", [1, 7, 64, 1000])
@pytest.mark.parametrize("with_bias", [False, True])
def test_chunked_logprobs_match_unchunked_in_fp64(chunk_size, with_bias):
    gen = torch.Generator().manual_seed(chunk_size)
    hidden = torch.randn(50, 16, dtype=torch.float64, generator=gen, requires_grad=True)
    weight = torch.randn(300, 16, dtype=torch.float64, generator=gen, requires_grad=True)
    bias = torch.randn(300, dtype=torch.float64, generator=gen, requires_grad=True) if with_bias else None
    targets = torch.randint(0, 300, (50,), generator=gen)
    upstream = torch.randn(50, dtype=torch.float64, generator=gen)
    results = []
    for size in (None, chunk_size):
        logps, entropy = target_logprobs(hidden, weight, targets, bias=bias, temperature=0.7, chunk_size=size)
        inputs = [hidden, weight] + ([bias] if with_bias else [])
        grads = torch.autograd.grad((logps * upstream).sum(), inputs)
        results.append((logps.detach(), entropy, grads))
    (ref_logps, ref_entropy, ref_grads), (logps, entropy, grads) = results
    torch.testing.assert_close(logps, ref_logps, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(entropy, ref_entropy, rtol=1e-12, atol=1e-12)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    # Against a plain log_softmax over full logits at the temperature.
    logits = (hidden @ weight.T + (bias if with_bias else 0)) / 0.7
    direct = torch.log_softmax(logits, -1).gather(-1, targets[:, None]).squeeze(-1)
    torch.testing.assert_close(logps, direct.detach(), rtol=1e-12, atol=1e-12)


def test_temperature_must_be_positive():
    with pytest.raises(ValueError, match="temperature"):
        target_logprobs(torch.zeros(1, 2), torch.zeros(3, 2), torch.zeros(1, dtype=torch.long), temperature=0.0)


@pytest.fixture(scope="module")
def tiny_model(tiny_model_dir):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def single_sequence_logprobs(model, input_ids, temperature):
    """Reference: one sequence alone, no mask at all, full logits."""
    with torch.no_grad():
        logits = model(torch.tensor([input_ids])).logits[0].float() / temperature
    return torch.log_softmax(logits, -1)[:-1].gather(-1, torch.tensor(input_ids[1:])[:, None]).squeeze(-1)


def test_packed_and_padded_logprobs_agree_with_single_sequences(tiny_model):
    rollouts = random_rollouts(4, 3, vocab_size=390, seed=5, fully_masked_fraction=0.0, env_token_fraction=0.3)
    per_mode = {}
    for mode, extra in [("padded", dict(rows_per_micro_batch=4)), ("packed", dict(max_tokens_per_microbatch=80))]:
        (rank_batch,) = plan_batch(rollouts, BatchingConfig(mode=mode, max_seq_len=40, **extra))
        found = {}
        for mb in rank_batch.micro_batches:
            with torch.no_grad():
                out = micro_batch_logprobs(tiny_model, mb, temperature=0.8, chunk_size=16)
            for local, position in enumerate(mb.batch_positions):
                where = mb.seq_index == local
                found[position] = (out.logps[where], mb.loss_mask[where], mb.input_ids[where])
        per_mode[mode] = found
        if mode == "packed":
            assert any(mb.num_sequences > 1 for mb in rank_batch.micro_batches), "packing put several sequences in a row"
    for position, (logps, mask, ids) in per_mode["padded"].items():
        packed_logps, _, _ = per_mode["packed"][position]
        reference = single_sequence_logprobs(tiny_model, ids.tolist(), 0.8)
        trained = mask[1:] > 0
        torch.testing.assert_close(logps[1:][trained], reference[trained], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(packed_logps[1:][trained], reference[trained], rtol=1e-5, atol=1e-5)
        assert torch.all(logps[mask == 0] == 0)


def test_attention_mask_ignores_loss_mask_and_pad_equal_to_eos(tiny_model, tiny_model_dir):
    """Environment tokens (mask 0) in the middle of a completion, some of them equal to the pad id (pad == eos
    here), must still be attended to: the trained tokens after them see exactly the single-sequence context."""
    eos = tiny_model.config.eos_token_id
    prompt = [10, 11, 12, eos]
    completion = [20, 21, eos, eos, 30, 31, 32, eos]  # eos inside: end of a model turn, then env tokens
    mask = [1, 1, 1, 0, 0, 1, 1, 1]
    rollout = Rollout(prompt, completion, mask, reward=1.0, group_id=0)
    sequences = prepare_sequences([rollout, Rollout([5, 6], [7, 8, 9], [1, 1, 1], 0.0, 0)], [1.0, -1.0], 64)
    counts = GlobalCounts(loss_tokens=9, valid_sequences=2, horizon=64)
    reference = single_sequence_logprobs(tiny_model, prompt + completion, 1.0)
    trained = torch.tensor([0] * len(prompt) + mask)[1:] > 0
    for packed in (False, True):
        mb = collate(sequences, counts, packed=packed, pad_token_id=eos)  # pad id == eos id
        with torch.no_grad():
            out = micro_batch_logprobs(tiny_model, mb, temperature=1.0, chunk_size=4)
        got = out.logps[mb.seq_index == 0][1:]
        torch.testing.assert_close(got[trained], reference[trained], rtol=1e-5, atol=1e-5)
        # The environment tokens were attended to: masking them out of attention changes the later log-probs.
        broken = tiny_model(torch.tensor([prompt + completion]), attention_mask=torch.tensor([[1] * len(prompt) + mask])).logits[0]
        broken = torch.log_softmax(broken.float(), -1)[:-1].gather(-1, torch.tensor(prompt + completion)[1:, None]).squeeze(-1)
        assert (broken[trained] - reference[trained]).abs().max() > 1e-4
