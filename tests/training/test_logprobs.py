"""Per-token log-probs: chunked equals unchunked (values and gradients); packed rows equal padded rows on a real
tiny model; the attention mask comes from real-token positions, never from the loss mask or from pad ids."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from verifiers_rl.training.batching import BatchingConfig, collate, plan_batch, prepare_sequences
from verifiers_rl.training.loss import GlobalCounts
from verifiers_rl.training.forward import micro_batch_logprobs, micro_batch_runs, target_logprobs
from verifiers_rl.training.prefix import ROOT, common_prefix_length
from verifiers_rl.core.rollout import Rollout
from verifiers_rl.rollouts.synthetic import random_rollouts

from tests.helpers.logprobs import shared_prefix_rollouts, single_sequence_logprobs


@pytest.mark.parametrize("chunk_size", [1, 7, 64, 1000])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("through", ["logps", "entropy", "both"])
def test_chunked_logprobs_match_unchunked_in_fp64(chunk_size, with_bias, through):
    """Values, and gradients through the log-probs, the entropy (an entropy bonus) or both; a second backward through
    the same graph (the forward's kept last chunk is used once, then recomputed) gives the same gradients."""
    gen = torch.Generator().manual_seed(chunk_size)
    hidden = torch.randn(50, 16, dtype=torch.float64, generator=gen, requires_grad=True)
    weight = torch.randn(300, 16, dtype=torch.float64, generator=gen, requires_grad=True)
    bias = torch.randn(300, dtype=torch.float64, generator=gen, requires_grad=True) if with_bias else None
    targets = torch.randint(0, 300, (50,), generator=gen)
    upstream = torch.randn(50, dtype=torch.float64, generator=gen)
    upstream_h = torch.randn(50, dtype=torch.float64, generator=gen)
    results = []
    for size in (None, chunk_size):
        logps, entropy = target_logprobs(hidden, weight, targets, bias=bias, temperature=0.7, chunk_size=size)
        inputs = [hidden, weight] + ([bias] if with_bias else [])
        objective = {"logps": (logps * upstream).sum(), "entropy": (entropy * upstream_h).sum(),
                     "both": (logps * upstream).sum() + (entropy * upstream_h).sum()}[through]
        grads = torch.autograd.grad(objective, inputs, retain_graph=True)
        for again, first in zip(torch.autograd.grad(objective, inputs), grads):
            torch.testing.assert_close(again, first, rtol=1e-12, atol=1e-12)
        results.append((logps.detach(), entropy.detach(), grads))
    (ref_logps, ref_entropy, ref_grads), (logps, entropy, grads) = results
    torch.testing.assert_close(logps, ref_logps, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(entropy, ref_entropy, rtol=1e-12, atol=1e-12)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    # Against a plain log_softmax over full logits at the temperature.
    logits = (hidden @ weight.T + (bias if with_bias else 0)) / 0.7
    direct = torch.log_softmax(logits, -1).gather(-1, targets[:, None]).squeeze(-1)
    torch.testing.assert_close(logps, direct.detach(), rtol=1e-12, atol=1e-12)
    if through != "logps":  # the entropy's gradient is the entropy's: H = -sum p log p over full logits
        probs = torch.softmax(logits, -1)
        direct_h = -(probs * torch.log_softmax(logits, -1)).sum(-1)
        want = torch.autograd.grad((direct_h * upstream_h).sum() + (0 if through == "entropy" else (direct * upstream).sum()),
                                   [hidden, weight])
        for got, expected in zip(grads, want):
            torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)


def test_temperature_must_be_positive():
    with pytest.raises(ValueError, match="temperature"):
        target_logprobs(torch.zeros(1, 2), torch.zeros(3, 2), torch.zeros(1, dtype=torch.long), temperature=0.0)


@pytest.fixture(scope="module")
def tiny_model(tiny_model_dir):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


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


@pytest.fixture
def fp64_model(tiny_model, monkeypatch):
    """The tiny model in float64 throughout: Llama's RMSNorm computes in float32 whatever the input (its backward
    would round the shared prefix's summed gradient to float32), so it is made to keep float64 here."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    def rms_norm(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))

    monkeypatch.setattr(LlamaRMSNorm, "forward", rms_norm)
    yield tiny_model.double()
    tiny_model.float()


@pytest.mark.parametrize("mode,extra,system", [
    ("padded", dict(rows_per_micro_batch=4), 0),  # one group per row
    ("padded", dict(rows_per_micro_batch=3), 0),  # groups of 4 split over micro-batches, prompt repeated per part
    ("packed", dict(max_tokens_per_microbatch=90), 0),  # several groups per row, some split by the budget
    ("packed", dict(max_tokens_per_microbatch=110), 6),  # the same, with a system prompt every row holds once
    ("padded", dict(rows_per_micro_batch=4), 6),  # a system prompt, but one group per row: no root
])
@pytest.mark.parametrize("run_overhead", [None, 0])  # these rows are short: dense at the default; run by run at 0
def test_shared_prefix_rows_equal_single_sequences_in_fp64(fp64_model, mode, extra, system, run_overhead, monkeypatch):
    """Values and gradients: a forward in which each group's common prefix appears once (and a packed row's common
    system prompt once) equals, to fp64 rounding, the unshared micro-batches and the single-sequence reference;
    every sequence is covered once; with dense attention over the rows and attending run by run."""
    if run_overhead is not None:
        monkeypatch.setattr("verifiers_rl.training.segmented_attention.RUN_OVERHEAD_CELLS", run_overhead)
    model = fp64_model
    rollouts = shared_prefix_rollouts(system)
    results = {}
    for share in ("off", "on"):
        config = BatchingConfig(mode=mode, max_seq_len=40, share_prompt_training=share, **extra)
        (rank_batch,) = plan_batch(rollouts, config)
        model.zero_grad(set_to_none=True)
        found = {}
        for mb in rank_batch.micro_batches:
            out = micro_batch_logprobs(model, mb, temperature=0.8, chunk_size=16)
            weights = mb.loss_mask.double() * (1.0 + mb.advantages.double())
            (out.logps * weights).sum().backward()
            for local, position in enumerate(mb.batch_positions):
                where = mb.seq_index == local
                found[position] = (out.logps[where].detach(), mb.loss_mask[where], mb.input_ids[where])
        grads = {name: p.grad.clone() for name, p in model.named_parameters()}
        results[share] = (found, grads, rank_batch)
    (plain, plain_grads, plain_batch), (shared, shared_grads, shared_batch) = results["off"], results["on"]
    assert any(mb.shared is not None for mb in shared_batch.micro_batches), "no micro-batch shared a prefix"
    by_runs = [micro_batch_runs(mb) is not None for mb in shared_batch.micro_batches if mb.shared is not None]
    assert all(by_runs) if run_overhead == 0 else not any(by_runs)
    rooted = [mb for mb in shared_batch.micro_batches
              if mb.shared is not None and bool((mb.shared.block == ROOT).any())]
    assert bool(rooted) == (mode == "packed" and system > 0)  # a root only where a packed row holds several groups
    assert shared_batch.stats.computed_tokens < plain_batch.stats.computed_tokens
    assert sorted(shared) == list(range(len(rollouts)))
    for position, (logps, mask, ids) in plain.items():
        reference = single_sequence_logprobs(model, ids.tolist(), 0.8)
        trained = mask[1:] > 0
        torch.testing.assert_close(shared[position][0], logps, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(shared[position][0][1:][trained], reference[trained], rtol=1e-10, atol=1e-12)
        assert torch.all(shared[position][0][mask == 0] == 0)
    for name, grad in plain_grads.items():
        torch.testing.assert_close(shared_grads[name], grad, rtol=1e-9, atol=1e-12)
    assert max(float(g.abs().max()) for g in plain_grads.values()) > 1e-3  # the gradients are not trivially 0


def test_shared_rows_forward_each_group_prefix_once(tiny_model):
    """Packed with room for everything: the forwarded tokens are exactly the unique tokens (each group's common
    prefix once); the shared prefix is the common prefix of token ids (past the prompt where every sequence of the
    group starts with the same turn); a branch never sees another branch (letting it changes the log-probs)."""
    rollouts = shared_prefix_rollouts()
    (rank_batch,) = plan_batch(rollouts, BatchingConfig(mode="packed", max_seq_len=40, max_tokens_per_microbatch=4096,
                                                        share_prompt_training="on"))
    (mb,) = rank_batch.micro_batches
    assert mb.computed_tokens == rank_batch.stats.unique_tokens < rank_batch.stats.real_tokens
    block, branch = mb.shared.block[0], mb.shared.branch[0]
    block_of = [int(block[mb.shared.source[mb.seq_index == j][-1]]) for j in range(mb.num_sequences)]
    for k in range(int(block.max()) + 1):
        members = [mb.batch_positions[j] for j in range(mb.num_sequences) if block_of[j] == k]
        ids = [rollouts[i].prompt_ids + rollouts[i].completion_ids for i in members]
        expected = next(t for t in range(min(map(len, ids)) + 1)
                        if t == min(map(len, ids)) or len({tuple(x[: t + 1]) for x in ids}) > 1)
        assert int(((block == k) & (branch < 0)).sum()) == expected
        if rollouts[members[0]].group_id == "edge":
            assert expected == 5 > len(rollouts[members[0]].prompt_ids)  # the prompt and the common first turn
    with torch.no_grad():
        good = micro_batch_logprobs(tiny_model, mb, temperature=1.0, chunk_size=64).logps
        mb.shared.branch[mb.shared.branch >= 0] = 0  # every branch sees every earlier branch of its group
        broken = micro_batch_logprobs(tiny_model, mb, temperature=1.0, chunk_size=64).logps
    assert (good - broken).abs().max() > 1e-4


def test_packed_row_holds_the_groups_common_system_prompt_once(tiny_model):
    """Groups that start with the same system prompt, packed into one row: the row holds it once (its root), each
    group's prefix after it once, so the forwarded tokens are the unique tokens less the root's repeats; every
    position sees the root (making it invisible to the later groups changes their log-probs), and the log-probs
    equal the single-sequence forwards."""
    rollouts = shared_prefix_rollouts(system_prompt_len=6)
    groups = len({r.group_id for r in rollouts})
    (rank_batch,) = plan_batch(rollouts, BatchingConfig(mode="packed", max_seq_len=40, max_tokens_per_microbatch=4096,
                                                        share_prompt_training="on"))
    (mb,) = rank_batch.micro_batches
    root = int((mb.shared.block == ROOT).sum())
    assert root == common_prefix_length([r.prompt_ids for r in rollouts]) >= 6
    assert mb.computed_tokens == rank_batch.stats.unique_tokens - (groups - 1) * root
    assert torch.equal(mb.shared.position_ids[0, :root], torch.arange(root))
    with torch.no_grad():
        good = micro_batch_logprobs(tiny_model, mb, temperature=1.0, chunk_size=64).logps
        for local, position in enumerate(mb.batch_positions):
            ids = mb.input_ids[mb.seq_index == local].tolist()
            mask = mb.loss_mask[mb.seq_index == local][1:] > 0
            reference = single_sequence_logprobs(tiny_model, ids, 1.0)
            torch.testing.assert_close(good[mb.seq_index == local][1:][mask], reference[mask], rtol=1e-5, atol=1e-5)
        mb.shared.block[mb.shared.block == ROOT] = 0  # the root as part of the first group only
        broken = micro_batch_logprobs(tiny_model, mb, temperature=1.0, chunk_size=64).logps
    first = mb.shared.block[0, root]  # the group right after the root still sees it
    later = [local for local in range(mb.num_sequences) if mb.loss_mask[mb.seq_index == local].any()
             and int(mb.shared.block.flatten()[mb.shared.source[mb.seq_index == local][-1]]) != int(first)]
    assert later and all((good[mb.seq_index == j] - broken[mb.seq_index == j]).abs().max() > 1e-4 for j in later)
