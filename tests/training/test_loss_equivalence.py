"""fp64, no processes: summed partial losses and their gradients equal the one-pass global loss and gradients,
for every loss type, IS level, correction mode, KL on/off, and random partitions into D ranks x A micro-batches
x padded/packed rows (ragged lengths, fully masked sequences, ranks with fewer tokens, empty micro-batches), with
and without shared prompts (groups kept in shared-prefix rows, split over micro-batches and ranks; multi-turn-like
prefixes shared past the prompt). The model forward of shared rows is checked in tests/training/test_logprobs.py.

The reference below is written per sequence straight from docs/architecture.md (What one step computes),
independent of the partitioned code path.
"""

import itertools
import math
import random
import zlib

import pytest
import torch

from verifiers_rl.training.batching import BatchingConfig, compute_advantages, plan_batch, prepare_sequences
from verifiers_rl.training.loss import LOSS_TYPES, LossSettings, aggregation_weights, per_token_loss
from verifiers_rl.rollouts.synthetic import random_rollouts

from tests.helpers.micro_batches import gather_from_micro_batch, scatter_to_micro_batch



@pytest.fixture(autouse=True)
def _fp64():
    """This module computes in fp64; other modules keep torch's default dtype."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)


def reference_loss(sequences, logps, proximal, sampler, ref, loss_type, level, correction, cap, cap_min, beta, horizon,
                   eps_low=0.2, eps_high=0.28, delta=None, kl_ratio=False, off_policy=None, log_ratio_sum=False):
    """Global loss of docs/architecture.md, one sequence at a time, with plain Python sums (TRL's knobs as TRL writes
    them)."""
    per_sequence_sums, token_counts = [], []
    for i, seq in enumerate(sequences):
        positions = [t for t, m in enumerate(seq.loss_mask) if m]
        token_counts.append(len(positions))
        if not positions:
            per_sequence_sums.append(torch.zeros(()))
            continue
        l = logps[i][positions]
        p = proximal[i][positions] if proximal is not None else l.detach()
        if level == "token":
            ratio = torch.exp(l - p)
        else:
            ratio = torch.exp((l - p).mean()).expand(len(positions))
        a = float(torch.tensor(seq.advantage, dtype=torch.float32))  # micro-batches carry fp32 advantages
        bounded = ratio if delta is None else torch.clamp(ratio, max=delta)
        surrogate = -torch.minimum(bounded * a, torch.clamp(ratio, 1 - eps_low, 1 + eps_high) * a)
        if sampler is not None and correction != "none":
            q = sampler[i][positions]
            if correction.startswith("token"):
                rho = torch.exp(p - q).detach()
            else:
                log_rho = (p - q).sum() if log_ratio_sum else (p - q).mean()
                rho = torch.exp(log_rho).detach().expand(len(positions))
            low = cap_min if cap_min is not None else 0.0
            if correction.endswith("truncate"):
                w = rho.clamp(min=low, max=cap)
            else:
                w = torch.where((rho <= cap) & (rho >= low), rho, torch.zeros_like(rho))
        else:
            w = torch.ones_like(surrogate)
        z = w * surrogate
        if off_policy is not None:
            behaviour = sampler[i][positions] if sampler is not None else p
            if a < 0 and float((behaviour - l.detach()).mean()) > off_policy:
                z = z * 0
        if beta:
            r = ref[i][positions]
            kl = torch.exp(r - l) - (r - l) - 1
            z = z + beta * (kl * ratio if kl_ratio else kl)
        per_sequence_sums.append(z.sum() / (len(positions) if loss_type == "grpo" else 1))
    valid = sum(1 for n in token_counts if n > 0)
    total = sum(per_sequence_sums)
    if loss_type == "token_mean":
        return total / max(sum(token_counts), 1)
    if loss_type == "dr_grpo":
        return total / max(valid * horizon, 1)
    return total / max(valid, 1)


CASES = list(
    itertools.product(
        LOSS_TYPES,
        ["token", "sequence"],
        ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask", "none"],
        [0.0, 0.05],
    )
)


# TRL's knobs (LossSettings' names), each on its own and all together, over every loss type.
KNOBS = [
    dict(delta=1.25),
    dict(kl_ratio=True),
    dict(off_policy_threshold=0.05),
    dict(sequence_log_ratio="sum"),
    dict(delta=1.1, kl_ratio=True, off_policy_threshold=0.0, sequence_log_ratio="sum"),
]
KNOB_CASES = [(loss_type, level, correction, 0.05, knobs) for loss_type in LOSS_TYPES for knobs in KNOBS
              for level, correction in (("token", "sequence_mask"), ("sequence", "sequence_truncate"))]


def _reference_knobs(knobs):
    knobs = knobs or {}
    return dict(delta=knobs.get("delta"), kl_ratio=knobs.get("kl_ratio", False),
                off_policy=knobs.get("off_policy_threshold"), log_ratio_sum=knobs.get("sequence_log_ratio") == "sum")


@pytest.mark.parametrize("loss_type,level,correction,beta,knobs",
                         [case + (None,) for case in CASES] + KNOB_CASES)
def test_partitions_sum_to_global_loss_and_gradient(loss_type, level, correction, beta, knobs):
    # crc32, not hash(): str hashes change per process (PYTHONHASHSEED), and a case's data must not.
    rng = random.Random(zlib.crc32(repr((loss_type, level, correction, beta, knobs)).encode()) % 10_000)
    rollouts = random_rollouts(5, 3, vocab_size=50, seed=rng.randrange(1000), fully_masked_fraction=0.2,
                               shared_turn_fraction=0.6)
    rollouts[0].completion_mask = [0] * len(rollouts[0].completion_mask)  # always one fully masked sequence
    advantages = compute_advantages([r.reward for r in rollouts], [r.group_id for r in rollouts])
    check_partitions(rollouts, advantages, loss_type, level, correction, beta, knobs, rng)


def episode_advantages_by_hand(rollouts):
    """docs/environments.md's rule for multi-branch episodes, written out: each group's mean and unbiased std over its
    EPISODES (one reward each, however many branches), every branch given its episode's (r - mean) / (std + 1e-4)."""
    out = []
    for rollout in rollouts:
        episodes = {}
        for other in rollouts:
            if other.group_id == rollout.group_id:
                episodes.setdefault(other.episode_id if other.episode_id is not None else id(other), other.reward)
        rewards = list(episodes.values())
        mean = sum(rewards) / len(rewards)
        std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / (len(rewards) - 1)) if len(rewards) > 1 else 0.0
        out.append((rollout.reward - mean) / (std + 1e-4))
    return out


@pytest.mark.parametrize("loss_type,level,correction,beta",
                         [(t, "token", "sequence_mask", 0.05) for t in LOSS_TYPES]
                         + [(t, "sequence", "token_truncate", 0.0) for t in LOSS_TYPES])
def test_multi_branch_episodes_partitions_sum_to_global_loss_and_gradient(loss_type, level, correction, beta):
    # Episodes of several branches (a v1 sub-agent): each branch is a sequence of its own in every denominator,
    # with its episode's advantage; split over ranks and micro-batches, the update is the fp64 reference's.
    rng = random.Random(zlib.crc32(repr(("branches", loss_type, level, correction, beta)).encode()) % 10_000)
    rollouts = random_rollouts(4, 5, vocab_size=50, seed=rng.randrange(1000), fully_masked_fraction=0.2,
                               shared_turn_fraction=0.6, branch_fraction=0.5)
    sizes = [sum(1 for r in rollouts if (r.group_id, r.episode_id) == key)
             for key in {(r.group_id, r.episode_id) for r in rollouts}]
    assert max(sizes) > 1 and min(sizes) == 1, "the batch mixes episodes of one branch and of several"
    check_partitions(rollouts, episode_advantages_by_hand(rollouts), loss_type, level, correction, beta, None, rng)


def check_partitions(rollouts, advantages, loss_type, level, correction, beta, knobs, rng):
    """The reference loss and gradients of ``rollouts`` (with ``advantages``) equal the sum of the partial losses of
    plan_batch's micro-batches (which compute their own advantages) over every partition."""
    max_seq_len = 40
    sequences = prepare_sequences(rollouts, advantages, max_seq_len, overlong="truncate")
    gen = torch.Generator().manual_seed(rng.randrange(1000))
    leaves = [(-torch.rand(len(s), generator=gen) * 3).requires_grad_() for s in sequences]
    # The knobs act through the ratio to a proximal policy: their cases always have one.
    proximal = [-torch.rand(len(s), generator=gen) * 3 for s in sequences] if knobs or rng.random() < 0.5 else None
    # Sampler log-probs near the proximal ones, so truncation and masking each hit some tokens and miss others.
    sampler = [(proximal[i] if proximal is not None else leaves[i].detach()) + 0.6 * torch.randn(len(s), generator=gen)
               for i, s in enumerate(sequences)]
    ref = [-torch.rand(len(s), generator=gen) * 3 for s in sequences]
    horizon = 37
    cap, cap_min = 1.5, (0.4 if correction.endswith("mask") else None)

    if knobs and "sequence_log_ratio" in knobs:
        # Summed log-ratios grow with length: sampler log-probs closer to the proximal ones, so the caps still bite
        # on some sequences and not on others.
        sampler = [(proximal[i] if proximal is not None else leaves[i].detach()) + 0.1 * torch.randn(len(s), generator=gen)
                   for i, s in enumerate(sequences)]
    expected = reference_loss(sequences, leaves, proximal, sampler, ref, loss_type, level, correction, cap, cap_min,
                              beta, horizon, **_reference_knobs(knobs))
    expected_grads = torch.autograd.grad(expected, leaves, allow_unused=True)
    if knobs:  # the knobs' cases have teeth: without the knobs, the loss or its gradient differs
        plain = reference_loss(sequences, leaves, proximal, sampler, ref, loss_type, level, correction, cap, cap_min,
                               beta, horizon)
        plain_grads = torch.autograd.grad(plain, leaves, allow_unused=True)
        assert abs(plain.item() - expected.item()) > 1e-9 or any(
            g is not None and h is not None and float((g - h).abs().max()) > 1e-9
            for g, h in zip(plain_grads, expected_grads))

    partitions = [
        dict(world_size=1, mode="padded", rows_per_micro_batch=15),  # one pass over everything
        dict(world_size=2, mode="padded", rows_per_micro_batch=1),
        dict(world_size=3, mode="padded", rows_per_micro_batch=2),
        dict(world_size=4, mode="packed", max_tokens_per_microbatch=40),
        dict(world_size=2, mode="packed", max_tokens_per_microbatch=97),
        dict(world_size=16, mode="padded", rows_per_micro_batch=1),  # a rank with nothing: only empty passes
        dict(world_size=rng.randint(1, 5), mode="packed", max_tokens_per_microbatch=rng.randint(40, 200)),
        dict(world_size=1, mode="padded", rows_per_micro_batch=15, share_prompt_training="on"),  # one row per group
        dict(world_size=2, mode="padded", rows_per_micro_batch=2, share_prompt_training="on"),  # groups of 3 split in 2 + 1
        dict(world_size=3, mode="packed", max_tokens_per_microbatch=40, share_prompt_training="on"),
        dict(world_size=8, mode="packed", max_tokens_per_microbatch=97, share_prompt_training="on"),  # groups split for ranks
        dict(world_size=2, mode="padded", rows_per_micro_batch=4, share_prompt_training="auto", attention_cost=0.01),
    ]
    for partition in partitions:
        config = BatchingConfig(max_seq_len=max_seq_len, horizon=horizon, overlong="truncate", **partition)
        rank_batches = plan_batch(rollouts, config)
        assert len({len(rb.micro_batches) for rb in rank_batches}) == 1, "every rank runs the same number of passes"
        if config.share_prompt_training == "on" and config.rows_per_micro_batch == 15:  # room for every group
            assert all(mb.shared is not None for rb in rank_batches for mb in rb.micro_batches), partition
        total = torch.zeros(())
        for rank_batch in rank_batches:
            for mb in rank_batch.micro_batches:
                logps = gather_from_micro_batch(mb, leaves)
                terms = per_token_loss(
                    logps,
                    mb.advantages.double(),
                    mb.loss_mask.double(),
                    mb.seq_index,
                    proximal_logps=scatter_to_micro_batch(mb, proximal) if proximal is not None else None,
                    sampler_logps=scatter_to_micro_batch(mb, sampler),
                    ref_logps=scatter_to_micro_batch(mb, ref) if beta else None,
                    settings=LossSettings(level=level, epsilon_low=0.2, epsilon_high=0.28, correction=correction,
                                          correction_cap=cap, correction_cap_min=cap_min, beta=beta,
                                          **(knobs or {})),
                )
                weights = aggregation_weights(loss_type, mb.loss_mask.double(), mb.sequence_loss_tokens.double(), mb.counts)
                total = total + (terms.per_token_loss * weights).sum()
        grads = torch.autograd.grad(total, leaves, allow_unused=True)
        assert math.isclose(total.item(), expected.item(), rel_tol=1e-10, abs_tol=1e-14), partition
        for got, want in zip(grads, expected_grads):
            got = torch.zeros(()) if got is None else got
            want = torch.zeros(()) if want is None else want
            scale = max(float(want.abs().max()), 1e-12)
            assert float((got - want).abs().max()) / scale < 1e-10, partition
    # The check has teeth: the gradient is not trivially zero.
    assert any(g is not None and float(g.abs().max()) > 1e-6 for g in expected_grads)


def test_micro_batch_mean_would_fail():
    """Averaging per-micro-batch token means (the verl #623 / TRL #3021 bug) differs from the global token mean
    on the same data, so the test above distinguishes right from wrong aggregation."""
    rollouts = random_rollouts(4, 2, vocab_size=50, seed=3, fully_masked_fraction=0.0)
    config = BatchingConfig(max_seq_len=40, mode="padded", rows_per_micro_batch=3)
    (rank_batch,) = plan_batch(rollouts, config)
    values = [torch.rand(mb.loss_mask.shape, generator=torch.Generator().manual_seed(k)) for k, mb in enumerate(rank_batch.micro_batches)]
    right = sum(
        (v * aggregation_weights("token_mean", mb.loss_mask.double(), mb.sequence_loss_tokens.double(), mb.counts)).sum()
        for v, mb in zip(values, rank_batch.micro_batches)
    )
    everything = torch.cat([v[mb.loss_mask > 0] for v, mb in zip(values, rank_batch.micro_batches)])
    wrong = sum((v * mb.loss_mask).sum() / mb.loss_mask.sum() for v, mb in zip(values, rank_batch.micro_batches)) / len(values)
    assert math.isclose(right.item(), everything.mean().item(), rel_tol=1e-12)
    assert abs(wrong.item() - right.item()) > 1e-4


def bigram_logps(table, ids):
    """log softmax(table[prev])[next] for each position of ``ids`` after the first (0 at position 0): a bigram
    policy, small enough to compute every token's log-prob under any version exactly."""
    ids = torch.tensor(ids)
    return torch.cat([torch.zeros(1), torch.log_softmax(table[ids[:-1]], dim=-1).gather(-1, ids[1:, None])[:, 0]])


def two_version_rollouts(policies, gen, vocab=12):
    """Three groups of two rollouts whose completions were sampled across a weight update: the first tokens by
    version 3, the rest by version 4 (each token's log-prob from its own version, rounded to fp32 as an engine
    records it), one of them multi-turn (environment tokens between its turns, version -1)."""
    from verifiers_rl.core.rollout import NOT_SAMPLED, Rollout

    rollouts = []
    for index in range(6):
        prompt = torch.randint(vocab, (3 + index % 3,), generator=gen).tolist()
        length, switch = 7 + index, 2 + index % 4
        completion, logprobs, versions, mask = [], [], [], []
        for t in range(length):
            context = prompt + completion
            if index == 5 and t in (4, 5):  # the environment's reply: not sampled, not trained
                completion.append(int(torch.randint(vocab, (1,), generator=gen)))
                logprobs.append(0.0), versions.append(NOT_SAMPLED), mask.append(0)
                continue
            version = 3 if t < switch else 4
            probs = torch.softmax(policies[version][context[-1]], dim=-1)
            token = int(torch.multinomial(probs, 1, generator=gen))
            completion.append(token)
            logprobs.append(float(torch.tensor(torch.log(probs[token]).item(), dtype=torch.float32)))
            versions.append(version), mask.append(1)
        rollouts.append(Rollout(prompt_ids=prompt, completion_ids=completion, completion_mask=mask,
                                reward=float(torch.rand((), generator=gen)), group_id=index // 2,
                                completion_logprobs=logprobs, policy_version=4, completion_versions=versions))
        rollouts[-1].validate()
    return rollouts


@pytest.mark.parametrize("loss_type,correction", [("grpo", "token_truncate"), ("token_mean", "token_mask"),
                                                  ("dr_grpo", "sequence_truncate")])
def test_a_completion_sampled_under_two_versions_is_corrected_token_by_token(loss_type, correction):
    # Issue 37: a sequence whose tokens came from two policy versions (an in-flight weight update). The trainer's
    # path (the rollouts' own log-probs through the batch plan and per-token loss) equals the fp64 reference whose
    # behaviour probabilities are recomputed here from each token's recorded version; using one version's log-probs
    # for every token gives another loss and gradient, so the test can tell.
    vocab = 12
    gen = torch.Generator().manual_seed(37)
    base = torch.randn(vocab, vocab, generator=gen)
    policies = {3: base + torch.randn(vocab, vocab, generator=gen), 4: base}
    theta = (base + 0.4 * torch.randn(vocab, vocab, generator=gen)).requires_grad_()
    rollouts = two_version_rollouts(policies, gen, vocab)
    assert {v for r in rollouts for v in r.completion_versions} == {-1, 3, 4}
    advantages = compute_advantages([r.reward for r in rollouts], [r.group_id for r in rollouts])
    sequences = prepare_sequences(rollouts, advantages, max_seq_len=40)
    current = lambda: [bigram_logps(theta, s.input_ids) for s in sequences]  # noqa: E731 - a fresh graph per use
    cap, cap_min, horizon = 1.5, (0.6 if correction.endswith("mask") else None), 37

    def behaviour(version_of):  # each token's fp32 log-prob under the version ``version_of(rollout, t)``
        out = []
        for rollout, sequence in zip(rollouts, sequences):
            prompt = len(rollout.prompt_ids)
            q = torch.zeros(len(sequence))
            for t, version in enumerate(rollout.completion_versions):
                if version >= 0:
                    v = version_of(version)
                    q[prompt + t] = float(torch.tensor(bigram_logps(policies[v], sequence.input_ids)[prompt + t].item(),
                                                       dtype=torch.float32))
            out.append(q)
        return out

    def reference(sampler):
        loss = reference_loss(sequences, current(), None, sampler, None, loss_type, "token", correction, cap, cap_min,
                              0.0, horizon)
        return loss, torch.autograd.grad(loss, theta)[0]

    expected, expected_grad = reference(behaviour(lambda v: v))
    for config in (BatchingConfig(max_seq_len=40, horizon=horizon, mode="padded", rows_per_micro_batch=6),
                   BatchingConfig(max_seq_len=40, horizon=horizon, world_size=2, mode="packed",
                                  max_tokens_per_microbatch=40)):
        total, logps = torch.zeros(()), current()
        for rank_batch in plan_batch(rollouts, config):
            for mb in rank_batch.micro_batches:
                if not mb.num_sequences:  # a rank's empty pass
                    continue
                terms = per_token_loss(gather_from_micro_batch(mb, logps), mb.advantages.double(),
                                       mb.loss_mask.double(), mb.seq_index, sampler_logps=mb.sampler_logps.double(),
                                       settings=LossSettings(level="token", epsilon_low=0.2, epsilon_high=0.28,
                                                             correction=correction, correction_cap=cap,
                                                             correction_cap_min=cap_min))
                weights = aggregation_weights(loss_type, mb.loss_mask.double(), mb.sequence_loss_tokens.double(),
                                              mb.counts)
                total = total + (terms.per_token_loss * weights).sum()
        grad = torch.autograd.grad(total, theta)[0]
        assert math.isclose(total.item(), expected.item(), rel_tol=1e-10, abs_tol=1e-14), config
        assert float((grad - expected_grad).abs().max()) / float(expected_grad.abs().max()) < 1e-10, config
    for one_version in (3, 4):
        loss, grad = reference(behaviour(lambda v: one_version))
        assert abs(loss.item() - expected.item()) > 1e-6 or float((grad - expected_grad).abs().max()) > 1e-6
