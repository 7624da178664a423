"""Loss types, importance levels and importance corrections are registered functions (training/loss.py): the
registries hold exactly the names the config offers, and a loss type or correction registered here (one decorated
function each) is what the loss computes, over any split of the batch, through per_token_loss and
LossInputs.aggregate (the trainer's path for a custom loss)."""

from __future__ import annotations

import math

import pytest
import torch

from tests.helpers.micro_batches import gather_from_micro_batch, scatter_to_micro_batch
from verifiers_rl.config.grpo_fields import TRL_LOSS_TYPES
from verifiers_rl.config.rl_config import RLConfig, _choices
from verifiers_rl.core.choices import SEQUENCE_CORRECTIONS
from verifiers_rl.rollouts.synthetic import random_rollouts
from verifiers_rl.training.batching import BatchingConfig, compute_advantages, plan_batch, prepare_sequences
from verifiers_rl.training.loss import (
    IMPORTANCE_CORRECTIONS,
    IMPORTANCE_LEVELS,
    LOSS_TYPE_WEIGHTS,
    LossSettings,
    aggregation_weights,
    importance_correction,
    loss_type,
    per_token_loss,
)
from verifiers_rl.training.step_loss import LossInputs

REGISTRIES = {"loss_type": LOSS_TYPE_WEIGHTS, "importance_sampling_level": IMPORTANCE_LEVELS,
              "importance_correction": IMPORTANCE_CORRECTIONS}


@pytest.mark.parametrize("flag", sorted(REGISTRIES))
def test_each_registry_holds_exactly_the_configs_choices(flag):
    choices = set(_choices(RLConfig)[flag]) - set(TRL_LOSS_TYPES)  # TRL's names are mapped onto ours by the config
    assert set(REGISTRIES[flag].names) == choices
    help_text = next(f for f in RLConfig.__dataclass_fields__.values() if f.name == flag).metadata["help"]
    assert all(name in help_text for name in choices), f"--{flag}'s help lists each choice"


def test_the_configs_sequence_corrections_are_those_registered_at_the_sequence_level():
    # RLConfig refuses --importance_sequence_log_ratio beside any other correction (its list, not the registry).
    sequence = {name for name in IMPORTANCE_CORRECTIONS.names if IMPORTANCE_CORRECTIONS.get(name).options["level"]
                == "sequence"}
    assert sequence == set(SEQUENCE_CORRECTIONS)


def test_unknown_names_are_refused_by_flag():
    mask = torch.ones(1, 3)
    seq_index = torch.zeros(1, 3, dtype=torch.long)
    counts = plan_batch(random_rollouts(1, 2, vocab_size=20), BatchingConfig(max_seq_len=40))[0].micro_batches[0].counts
    with pytest.raises(ValueError, match="Unknown loss_type 'nope'"):
        aggregation_weights("nope", mask, mask, counts)
    with pytest.raises(ValueError, match="Unknown importance_correction 'nope'"):
        per_token_loss(-mask, mask, mask, seq_index, sampler_logps=-mask, settings=LossSettings(correction="nope"))
    with pytest.raises(ValueError, match="Unknown importance_sampling_level 'nope'"):
        per_token_loss(-mask, mask, mask, seq_index, settings=LossSettings(level="nope"))
    with pytest.raises(ValueError, match="Unknown importance_sampling_level 'nope'"):
        importance_correction("nope_truncate", level="nope")
    with pytest.raises(ValueError, match="loss_type 'grpo' is already registered"):
        loss_type("grpo")(lambda mask, tokens, counts: mask)


@pytest.fixture
def fp64():
    """The micro-batch helpers build tensors of torch's default dtype: fp64 for this test only."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)


@pytest.fixture
def registered():
    """The names a test registers, removed after it."""
    added = []
    yield added
    for registry, name in added:
        registry.unregister(name)


def test_a_loss_type_and_a_correction_registered_here_are_what_the_loss_computes(registered, fp64):
    @loss_type("sqrt_length")
    def sqrt_length_weights(mask, sequence_loss_tokens, counts):
        """Between grpo and seq_mean_token_sum: c = m / (B_v sqrt(N_i))."""
        return mask / max(counts.valid_sequences, 1) / sequence_loss_tokens.clamp(min=1).to(mask.dtype).sqrt()

    registered.append((LOSS_TYPE_WEIGHTS, "sqrt_length"))

    @importance_correction("sequence_sqrt", level="sequence")
    def sqrt_weight(rho, cap, cap_min):
        """w = min(sqrt(rho), cap)."""
        return rho.sqrt().clamp(max=cap)

    registered.append((IMPORTANCE_CORRECTIONS, "sequence_sqrt"))

    rollouts = random_rollouts(3, 4, vocab_size=50, seed=35)
    advantages = compute_advantages([r.reward for r in rollouts], [r.group_id for r in rollouts])
    sequences = prepare_sequences(rollouts, advantages, 40, overlong="truncate")
    gen = torch.Generator().manual_seed(35)
    leaves = [(-torch.rand(len(s), generator=gen, dtype=torch.float64) * 3).requires_grad_() for s in sequences]
    proximal = [-torch.rand(len(s), generator=gen, dtype=torch.float64) * 3 for s in sequences]
    sampler = [p + 0.5 * torch.randn(len(s), generator=gen, dtype=torch.float64) for p, s in zip(proximal, sequences)]
    cap = 1.1

    # The reference, one sequence at a time from the two functions' docstrings.
    terms, valid = [], 0
    for seq, l, p, q in zip(sequences, leaves, proximal, sampler):
        positions = [t for t, m in enumerate(seq.loss_mask) if m]
        if not positions:
            continue
        valid += 1
        l, p, q = l[positions], p[positions], q[positions]
        a = float(torch.tensor(seq.advantage, dtype=torch.float32))
        ratio = torch.exp(l - p)
        surrogate = -torch.minimum(ratio * a, torch.clamp(ratio, 0.8, 1.2) * a)
        w = min(math.sqrt(math.exp(float((p - q).mean()))), cap)
        terms.append((w * surrogate).sum() / math.sqrt(len(positions)))
    expected = sum(terms) / valid
    expected_grads = torch.autograd.grad(expected, leaves, allow_unused=True)
    ratios = [math.sqrt(math.exp(float((p - q)[[t for t, m in enumerate(s.loss_mask) if m]].mean())))
              for s, p, q in zip(sequences, proximal, sampler) if any(s.loss_mask)]
    assert min(ratios) < cap < max(ratios), "the cap bites on some sequences only"

    settings = LossSettings(level="token", epsilon_low=0.2, epsilon_high=0.2, correction="sequence_sqrt",
                            correction_cap=cap)
    for partition in (dict(world_size=1, mode="padded", rows_per_micro_batch=12),
                      dict(world_size=3, mode="padded", rows_per_micro_batch=2),
                      dict(world_size=2, mode="packed", max_tokens_per_microbatch=60)):
        total = torch.zeros((), dtype=torch.float64)
        for rank_batch in plan_batch(rollouts, BatchingConfig(max_seq_len=40, overlong="truncate", **partition)):
            for mb in rank_batch.micro_batches:
                logps = gather_from_micro_batch(mb, leaves)
                proximal_logps = scatter_to_micro_batch(mb, proximal)
                sampler_logps = scatter_to_micro_batch(mb, sampler)
                loss = per_token_loss(logps, mb.advantages.double(), mb.loss_mask.double(), mb.seq_index,
                                      proximal_logps=proximal_logps, sampler_logps=sampler_logps, settings=settings)
                inputs = LossInputs(logps, proximal_logps, sampler_logps, None, mb.advantages.double(),
                                    mb.loss_mask.double(), mb.seq_index, mb.sequence_loss_tokens.double(),
                                    {"loss_mask": mb.counts}, loss_type="grpo")
                total = total + inputs.aggregate(loss.per_token_loss, "sqrt_length")
        grads = torch.autograd.grad(total, leaves, allow_unused=True)
        assert math.isclose(total.item(), expected.item(), rel_tol=1e-10), partition
        for got, want in zip(grads, expected_grads):
            if want is not None:
                assert float((got - want).abs().max()) <= 1e-10 * max(float(want.abs().max()), 1e-12), partition
    assert abs(expected.item()) > 1e-6 and any(g is not None and float(g.abs().max()) > 1e-6 for g in expected_grads)
