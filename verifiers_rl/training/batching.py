"""Rollouts -> per-rank micro-batches (docs/architecture.md, What one step computes).

Order of work, all on the whole batch before anything is split:
advantages per group -> truncation to ``max_seq_len`` -> global counts -> parts (one sequence each, or a group's
sequences sharing their prompt, ``prefix.py``) -> ranks balanced by forwarded tokens -> micro-batches (padded rows
or packed rows) -> equal micro-batch counts on every rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import torch

from verifiers_rl.core.choices import (  # noqa: F401  (batching's own names too)
    MicroBatchingMode,
    OverlongPolicy,
    ScaleRewards,
    SharePromptTraining,
    check_packed_row_fits,
    packed_row_fits,
)

from verifiers_rl.training.loss import GlobalCounts
from verifiers_rl.training.prefix import (
    first_fit_decreasing,
    Part,
    SharedPrefixRows,
    best_part_size,
    row_root,
    common_prefix_length,
    modelled_cost,
    shared_prefix_rows,
    split_for_ranks,
    split_group,
)
from verifiers_rl.training.prefix import unique_tokens as group_unique_tokens
from verifiers_rl.core.rollout import Rollout, episode_key, group_by_id
from verifiers_rl.training.segmented_attention import cheaper_cells

ADVANTAGE_EPS = 1e-4
# What one micro-batch costs beyond its rows, in token units: its forward, loss and backward calls and the smaller
# matrix products of fewer rows (profiled on a CPU, benchmarks/packing.py --workload uniform: 85-95 token-times on a
# tiny Llama; kernel launches weigh more on a GPU, so there it is a lower bound). Near a tie, fewer micro-batches win.
MICRO_BATCH_OVERHEAD_TOKENS = 64


class SequenceTooLongError(ValueError):
    pass


def compute_advantages(rewards: list[float], group_ids: list, scale_rewards: ScaleRewards = "group") -> list[float]:
    """A_i = r_i - mean_{g(i)} r, divided by (std + 1e-4) of the group (``group``) or of the batch (``batch``).

    Standard deviations are unbiased, as in TRL; a group of one rollout has advantage 0.
    """
    groups = group_by_id(range(len(group_ids)), group_ids.__getitem__)
    rewards_t = torch.tensor(rewards, dtype=torch.float64)
    advantages = torch.zeros_like(rewards_t)
    batch_std = rewards_t.std() if len(rewards) > 1 else torch.tensor(0.0, dtype=torch.float64)
    for members in groups:
        group_rewards = rewards_t[members]
        centred = group_rewards - group_rewards.mean()
        if scale_rewards == "group":
            std = group_rewards.std() if len(members) > 1 else torch.tensor(0.0, dtype=torch.float64)
            centred = centred / (std + ADVANTAGE_EPS)
        elif scale_rewards == "batch":
            centred = centred / (batch_std + ADVANTAGE_EPS)
        advantages[members] = centred
    return advantages.tolist()


def _nanstd(values: torch.Tensor, dim: int) -> torch.Tensor:
    """Unbiased standard deviation over the non-NaN entries (TRL's ``nanstd``: NaN where fewer than two)."""
    count = (~values.isnan()).sum(dim)
    centred = values - torch.nanmean(values, dim, keepdim=True)
    return (torch.nanmean(centred**2, dim) * count / (count - 1)).sqrt()


def normalize_then_sum_advantages(values: list[list[float]], weights: list[float], group_ids: list) -> list[float]:
    """TRL's ``multi_objective_aggregation="normalize_then_sum"`` (GDPO): each reward function standardised in its
    group, weighted and summed, then the sums standardised over the batch:

        s_i = sum_k w_k (v_ik - mean_g(i) v_k) / (std_g(i) v_k + 1e-4)   over the functions that apply to i,
        A_i = (s_i - mean s) / (std s + 1e-4).

    ``values[i][k]`` is function k's value for rollout i, NaN where it does not apply (TRL's None); a function with
    fewer than two values in a group adds nothing there, a group of one rollout has s = 0. Standard deviations are
    unbiased (TRL's ``nanstd``); ``scale_rewards`` does not apply (TRL ignores it in this mode).
    """
    sums = standardised_sums(values, weights, group_ids)
    return ((sums - sums.mean()) / (_batch_std(sums) + ADVANTAGE_EPS)).tolist()


def standardised_sums(values: list[list[float]], weights: list[float], group_ids: list) -> torch.Tensor:
    """The s_i of ``normalize_then_sum_advantages``: each function standardised in its group, weighted, summed."""
    table = torch.tensor(values, dtype=torch.float64).reshape(len(values), len(weights))
    sums = torch.zeros(len(values), dtype=torch.float64)
    for members in group_by_id(range(len(group_ids)), group_ids.__getitem__):
        grouped = table[members]
        if len(members) > 1:
            standardised = (grouped - torch.nanmean(grouped, 0)) / (_nanstd(grouped, 0) + ADVANTAGE_EPS)
            sums[members] = torch.nansum(standardised * torch.tensor(weights, dtype=torch.float64), 1)
    return sums


def _batch_std(values: torch.Tensor) -> torch.Tensor:
    return values.std() if len(values) > 1 else torch.tensor(0.0, dtype=torch.float64)


def zero_std_fraction(rollouts: list[Rollout], rewards: list[float], scale_rewards: ScaleRewards = "group",
                      reward_functions: tuple[tuple[str, float], ...] = ()) -> float:
    """TRL's ``frac_reward_zero_std``: the fraction of episodes (``episodes_of``: a rollout, or the branches of one
    multi-branch episode) whose advantage's standard deviation is 0 (``isclose``): their group's rewards'
    (scale_rewards group or none), the batch's rewards' (batch), or the batch's standardised sums'
    (normalize_then_sum); a group of one episode has std 0."""
    firsts, _ = episodes_of(rollouts, rewards)
    rollouts, rewards = [rollouts[i] for i in firsts], [rewards[i] for i in firsts]
    group_ids = [r.group_id for r in rollouts]
    if reward_functions:
        values = [[float(r.metrics.get(name, math.nan)) for name, _ in reward_functions] for r in rollouts]
        stds = _batch_std(standardised_sums(values, [w for _, w in reward_functions], group_ids)).expand(len(rollouts))
    elif scale_rewards == "batch":
        stds = _batch_std(torch.tensor(rewards, dtype=torch.float64)).expand(len(rollouts))
    else:
        stds = torch.zeros(len(rollouts), dtype=torch.float64)
        for members in group_by_id(range(len(group_ids)), group_ids.__getitem__):
            stds[members] = _batch_std(torch.tensor(rewards, dtype=torch.float64)[members])
    return torch.isclose(stds, torch.zeros_like(stds)).double().mean().item()


def episodes_of(rollouts: list[Rollout], rewards: list[float]) -> tuple[list[int], list[int]]:
    """(the index of each episode's first rollout, each rollout's episode number), episodes as
    ``core.rollout.episode_key`` tells them apart; an episode's branches must share its reward."""
    firsts: list[int] = []
    owner: list[int] = []
    seen: dict[tuple, int] = {}
    for index, rollout in enumerate(rollouts):
        key = episode_key(rollout, index)
        if key not in seen:
            seen[key] = len(firsts)
            firsts.append(index)
        elif rewards[index] != rewards[firsts[seen[key]]]:
            raise ValueError(
                f"Rollouts {firsts[seen[key]]} and {index} are branches of episode {rollout.episode_id!r} of group "
                f"{rollout.group_id!r} but have different rewards ({rewards[firsts[seen[key]]]} and {rewards[index]}): "
                "the branches of an episode carry the episode's reward.")
        owner.append(seen[key])
    return firsts, owner


def batch_advantages(rollouts: list[Rollout], rewards: list[float], scale_rewards: ScaleRewards = "group",
                     reward_functions: tuple[tuple[str, float], ...] = ()) -> list[float]:
    """The step batch's advantages, computed over EPISODES (``episodes_of``) and given to each of an episode's
    branches: ``compute_advantages`` of the episodes' rewards, or, when ``reward_functions`` (name, weight) are
    given, ``normalize_then_sum_advantages`` of those functions' values in each episode's (first branch's) metrics
    (a function missing from a rollout's metrics did not apply to it). An episode of three branches counts once in
    its group's mean and standard deviation (and the batch's), as an episode of one does."""
    firsts, owner = episodes_of(rollouts, rewards)
    episodes = [rollouts[i] for i in firsts]
    group_ids = [r.group_id for r in episodes]
    if not reward_functions:
        advantages = compute_advantages([rewards[i] for i in firsts], group_ids, scale_rewards)
    else:
        values = [[float(r.metrics.get(name, math.nan)) for name, _ in reward_functions] for r in episodes]
        advantages = normalize_then_sum_advantages(values, [w for _, w in reward_functions], group_ids)
    return [advantages[episode] for episode in owner]


@dataclass
class TrainSequence:
    """One rollout as the trainer sees it: prompt + completion, masks aligned to token positions.

    ``loss_mask[t]`` = 1 where token t was generated by the policy and is trained on; ``sampler_logprobs[t]``
    is the sampler's log-prob of token t (0 elsewhere).
    """

    input_ids: list[int]
    loss_mask: list[int]
    sampler_logprobs: list[float] | None
    advantage: float
    truncated: bool
    policy_version: int | None = None
    group_id: str | int | None = None

    @property
    def loss_tokens(self) -> int:
        return sum(self.loss_mask)

    def __len__(self) -> int:
        return len(self.input_ids)


def check_fits(rollout: Rollout, max_seq_len: int, overlong: OverlongPolicy, what: str) -> bool:
    """Whether ``rollout`` (``what`` names it in the error) fits ``max_seq_len`` tokens; False where
    ``overlong="truncate"`` may cut its completion. Raises SequenceTooLongError where nothing may be cut."""
    prompt_len = len(rollout.prompt_ids)
    total = prompt_len + len(rollout.completion_ids)
    if total <= max_seq_len:
        return True
    if prompt_len >= max_seq_len:
        fix = "Raise --max_seq_len: its prompt alone fills it, so no truncation can make it fit."
    elif overlong == "error":
        fix = "Raise --max_seq_len, or pass --overlong truncate to cut completions."
    else:
        return False
    raise SequenceTooLongError(f"{what} has {total} tokens (prompt {prompt_len}), more than max_seq_len={max_seq_len}. "
                               f"{fix}")


def check_all_fit(batches: list[list[Rollout]], max_seq_len: int, overlong: OverlongPolicy, source: str) -> None:
    """``check_fits`` for every rollout of ``batches`` (a replay's, known at start: refused before any training)."""
    for number, rollout in enumerate((rollout for batch in batches for rollout in batch), start=1):
        check_fits(rollout, max_seq_len, overlong, f"{source}: rollout {number} (group {rollout.group_id!r})")


def prepare_sequences(
    rollouts: list[Rollout],
    advantages: list[float],
    max_seq_len: int,
    overlong: OverlongPolicy = "error",
    mask_truncated_completions: bool = False,
) -> list[TrainSequence]:
    """Concatenate prompt and completion; cut (or refuse) sequences longer than ``max_seq_len``.

    ``overlong="truncate"`` keeps the first ``max_seq_len`` tokens (the completion's tail goes) and marks the
    rollout truncated; a prompt that alone fills ``max_seq_len`` is always an error.
    """
    sequences = []
    for index, (rollout, advantage) in enumerate(zip(rollouts, advantages, strict=True)):
        prompt_len = len(rollout.prompt_ids)
        truncated = rollout.truncated
        keep = len(rollout.completion_ids)
        if not check_fits(rollout, max_seq_len, overlong, f"Rollout {index} (group {rollout.group_id!r})"):
            keep = max_seq_len - prompt_len
            truncated = True
        completion_mask = list(rollout.completion_mask[:keep])
        if truncated and mask_truncated_completions:
            completion_mask = [0] * keep
        logprobs = None
        if rollout.completion_logprobs is not None:
            logprobs = [0.0] * prompt_len + [float(x) for x in rollout.completion_logprobs[:keep]]
        sequences.append(
            TrainSequence(
                input_ids=list(rollout.prompt_ids) + list(rollout.completion_ids[:keep]),
                loss_mask=[0] * prompt_len + completion_mask,
                sampler_logprobs=logprobs,
                advantage=float(advantage),
                truncated=truncated,
                policy_version=rollout.policy_version,
                group_id=rollout.group_id,
            )
        )
    return sequences


def global_counts(sequences: list[TrainSequence], horizon: int) -> GlobalCounts:
    """N, B_v and H over the whole batch (after truncation, before splitting)."""
    token_counts = [sequence.loss_tokens for sequence in sequences]
    return GlobalCounts(
        loss_tokens=sum(token_counts),
        valid_sequences=sum(1 for count in token_counts if count > 0),
        horizon=horizon,
    )


def assign_to_ranks(lengths: list[int], world_size: int) -> list[list[int]]:
    """Longest-first greedy: each sequence goes to the rank with the fewest tokens so far (ties: fewest sequences)."""
    ranks: list[list[int]] = [[] for _ in range(world_size)]
    loads = [0] * world_size
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        target = min(range(world_size), key=lambda r: (loads[r], len(ranks[r]), r))
        ranks[target].append(index)
        loads[target] += lengths[index]
    return ranks


def group_padded(indices: list[int], lengths: list[int], rows_per_micro_batch: int,
                 sizes: list[int] | None = None) -> list[list[int]]:
    """At most ``rows_per_micro_batch`` sequences per micro-batch; units (``sizes[i]`` sequences of ``lengths[i]``
    forwarded tokens; one sequence each by default) sorted by length, first fit, so each micro-batch pads little."""
    return first_fit_decreasing(indices, lengths, sizes or [1] * len(lengths), rows_per_micro_batch)


def group_packed(indices: list[int], lengths: list[int], token_budget: int) -> list[list[int]]:
    """First-fit decreasing: each micro-batch is one packed row of at most ``token_budget`` tokens."""
    for index in indices:
        if lengths[index] > token_budget:
            raise SequenceTooLongError(
                f"A sequence of {lengths[index]} tokens does not fit max_tokens_per_microbatch={token_budget}."
            )
    return first_fit_decreasing(indices, lengths, lengths, token_budget)


def groups_of(sequences: list[TrainSequence]) -> list[list[int]]:
    """Indices of each group's sequences, groups in order of first appearance."""
    return group_by_id(range(len(sequences)), lambda index: sequences[index].group_id)


def unique_tokens(sequences: list[TrainSequence]) -> int:
    """Tokens of the batch with each group's common prefix counted once (what one shared row per group forwards)."""
    return sum(group_unique_tokens([sequences[i].input_ids for i in members]) for members in groups_of(sequences))


def plan_parts(sequences: list[TrainSequence], config: "BatchingConfig", mode: str | None = None) -> list[Part]:
    """The units ranks and micro-batches are made of: one sequence each (``share_prompt_training`` off), or parts of groups
    that forward their common prefix once (``on``: as large as a micro-batch allows; ``auto``: the size with the
    lowest modelled cost, ``prefix.best_part_size``). ``mode``: the micro-batching, default ``config.mode``."""
    mode = mode or config.mode
    token_lists = [s.input_ids for s in sequences]
    if config.share_prompt_training == "off":
        return [Part([i], len(s), len(s)) for i, s in enumerate(sequences)]
    parts = []
    for members in groups_of(sequences):
        prefix = common_prefix_length([token_lists[i] for i in members])
        size = len(members) if mode == "packed" else min(len(members), config.rows_per_micro_batch)
        if config.share_prompt_training == "auto":
            branches = [len(token_lists[i]) - prefix for i in members]
            size = min(size, best_part_size(prefix, branches, config.attention_cost, config.run_attention))
        parts += split_group(members, token_lists, prefix, size, config.max_tokens_per_microbatch)
    return split_for_ranks(parts, config.world_size, token_lists)


@dataclass
class Layout:
    """Where a batch's parts go: ``micro_batches[rank]`` lists each micro-batch's part indices."""

    mode: MicroBatchingMode
    parts: list[Part]
    micro_batches: list[list[list[int]]]
    roots: list[list[int]]  # per rank, per micro-batch: its row root's tokens (``prefix.row_root``), held once

    def modelled_cost(self, attention_cost: float, run_attention: bool = False) -> float:
        """The busiest rank's modelled forward cost (``prefix.modelled_cost`` per row, plus
        ``MICRO_BATCH_OVERHEAD_TOKENS`` per micro-batch): a padded micro-batch is one row per part, each as wide as
        its widest; a packed one is one row of all its parts' tokens, their common root once. ``run_attention``:
        packed and shared rows attend run by run (``Part.cells``, the root's R^2 once; padding attends to nothing)
        where that is cheaper than densely (``cheaper_cells``, as the forward decides), plain padded rows densely."""
        def row_costs(group: list[int], root: int) -> float:
            parts = [self.parts[p] for p in group]
            tokens = [part.tokens for part in parts]
            if self.mode == "packed":
                width = sum(tokens) - (len(tokens) - 1) * root
                cells = (cheaper_cells(root * root + sum(part.cells(root) for part in parts),
                                       int(root > 0) + sum(part.runs(root) for part in parts), 1, width)
                         if run_attention else None)
                return modelled_cost(width, attention_cost, cells)
            if run_attention and any(len(part.members) > 1 for part in parts):  # shared rows (collate)
                cells = cheaper_cells(sum(part.cells() for part in parts), sum(part.runs() for part in parts),
                                      len(tokens), max(tokens))
                return modelled_cost(len(tokens) * max(tokens), attention_cost, cells)
            return len(tokens) * modelled_cost(max(tokens), attention_cost)

        return max(sum(row_costs(group, root) + MICRO_BATCH_OVERHEAD_TOKENS for group, root in zip(groups, roots)
                       if group) for groups, roots in zip(self.micro_batches, self.roots))


def layout(sequences: list[TrainSequence], config: "BatchingConfig", mode: MicroBatchingMode) -> Layout:
    """Parts (``plan_parts``), balanced over ranks by forwarded tokens, then grouped into ``mode`` micro-batches."""
    parts = plan_parts(sequences, config, mode)
    costs = [part.tokens for part in parts]
    sizes = [len(part.members) for part in parts]
    per_rank = assign_to_ranks(costs, config.world_size)
    micro_batches = [
        group_packed(indices, costs, config.max_tokens_per_microbatch)
        if mode == "packed"
        else group_padded(indices, costs, config.rows_per_micro_batch, sizes)
        for indices in per_rank
    ]
    roots = [[row_root([sequences[i].input_ids for p in group for i in parts[p].members], part_shapes(parts, group),
                       mode == "packed") for group in groups] for groups in micro_batches]
    return Layout(mode, parts, micro_batches, roots)


def part_shapes(parts: list[Part], group: list[int]) -> list[tuple[int, int]]:
    """(size, shared prefix length) of the parts ``group`` of a micro-batch, in its order (``collate``'s ``parts``)."""
    return [(len(parts[p].members), parts[p].prefix_len) for p in group]


def cheapest_layout(sequences: list[TrainSequence], config: "BatchingConfig") -> Layout:
    """``config.mode`` itself, or for ``auto`` the padded or packed layout of lower modelled cost (padded on a tie).
    Both are exact; the cost model (``BatchingConfig.attention_cost``) decides which forwards fewer token units."""
    if config.mode != "auto":
        return layout(sequences, config, config.mode)
    candidates = [layout(sequences, config, "padded")]
    if packed_row_fits(config.max_tokens_per_microbatch, config.max_seq_len):
        candidates.append(layout(sequences, config, "packed"))
    return min(candidates, key=lambda option: option.modelled_cost(config.attention_cost, config.run_attention))


@dataclass
class MicroBatch:
    """Tensors of one forward/backward pass, rows x positions.

    Padded: one sequence per row, right padding, ``attention_mask`` 1 on real tokens. Packed: one row holding
    several sequences, ``position_ids`` restarting at each, ``seq_index`` telling them apart (attention is
    confined to a sequence by the trainer). ``seq_index`` is -1 on padding.

    With ``shared`` set, these tensors are still one slot per (sequence, token), as the loss sees them, but the
    model forwards ``shared`` instead: rows in which sequences of a group hold their common prefix once
    (``prefix.SharedPrefixRows``).
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: torch.Tensor
    seq_index: torch.Tensor
    loss_mask: torch.Tensor
    sequence_loss_tokens: torch.Tensor
    advantages: torch.Tensor
    sampler_logps: torch.Tensor | None
    counts: GlobalCounts
    packed: bool
    batch_positions: list[int]  # index in the batch of each sequence of this micro-batch (by seq_index)
    proximal_logps: torch.Tensor | None = None
    ref_logps: torch.Tensor | None = None
    shared: SharedPrefixRows | None = None

    @property
    def num_sequences(self) -> int:
        return len(self.batch_positions)

    @property
    def real_tokens(self) -> int:
        """Tokens of this micro-batch's sequences (a shared prefix counted once per sequence)."""
        return int((self.seq_index >= 0).sum())

    @property
    def computed_tokens(self) -> int:
        """Tokens the forward runs over, padding included."""
        return self.shared.tokens if self.shared is not None else int(self.input_ids.numel())

    @property
    def padding_tokens(self) -> int:
        return self.shared.padding if self.shared is not None else int((self.seq_index < 0).sum())

    def to(self, device: torch.device) -> "MicroBatch":
        moved = {}
        for name, value in self.__dict__.items():
            moved[name] = value.to(device) if isinstance(value, (torch.Tensor, SharedPrefixRows)) else value
        return MicroBatch(**moved)


def collate(
    sequences: list[TrainSequence],
    counts: GlobalCounts,
    packed: bool,
    pad_token_id: int,
    batch_positions: list[int] | None = None,
    parts: list[tuple[int, int]] | None = None,
) -> MicroBatch:
    """Build one micro-batch. An empty list gives a zero-weight micro-batch of one 2-token padding row, so a
    rank with nothing left still runs the forward/backward every other rank runs.

    ``parts``: (size, shared prefix length) of consecutive runs of ``sequences``; when one holds several
    sequences, the micro-batch forwards shared-prefix rows (``prefix.shared_prefix_rows``)."""
    has_logprobs = any(s.sampler_logprobs is not None for s in sequences)
    if has_logprobs and not all(s.sampler_logprobs is not None for s in sequences):
        raise ValueError("Either every rollout of a batch carries completion_logprobs or none does.")
    rows: list[list[int]] = [[i] for i in range(len(sequences))] if not packed else [list(range(len(sequences)))]
    if not sequences:
        rows = []
    width = max([sum(len(sequences[i]) for i in row) for row in rows], default=2)
    num_rows = max(len(rows), 1)
    shape = (num_rows, width)
    input_ids = torch.full(shape, pad_token_id, dtype=torch.long)
    position_ids = torch.zeros(shape, dtype=torch.long)
    attention_mask = torch.zeros(shape, dtype=torch.long)
    seq_index = torch.full(shape, -1, dtype=torch.long)
    loss_mask = torch.zeros(shape, dtype=torch.float32)
    sequence_loss_tokens = torch.zeros(shape, dtype=torch.float32)
    advantages = torch.zeros(shape, dtype=torch.float32)
    sampler = torch.zeros(shape, dtype=torch.float32) if has_logprobs else None
    if not rows:
        attention_mask[0] = 1  # a real (if meaningless) row, so the forward is an ordinary one
    for r, row in enumerate(rows):
        offset = 0
        for i in row:
            s = sequences[i]
            n = len(s)
            span = slice(offset, offset + n)
            input_ids[r, span] = torch.tensor(s.input_ids)
            position_ids[r, span] = torch.arange(n)
            attention_mask[r, span] = 1
            seq_index[r, span] = i
            loss_mask[r, span] = torch.tensor(s.loss_mask, dtype=torch.float32)
            sequence_loss_tokens[r, span] = float(s.loss_tokens)
            advantages[r, span] = s.advantage
            if sampler is not None:
                sampler[r, span] = torch.tensor(s.sampler_logprobs, dtype=torch.float32)
            offset += n
    shared = None
    if parts and any(size > 1 for size, _ in parts):
        shared = shared_prefix_rows([s.input_ids for s in sequences], parts, packed, pad_token_id, seq_index)
    return MicroBatch(
        input_ids=input_ids,
        position_ids=position_ids,
        attention_mask=attention_mask,
        seq_index=seq_index,
        loss_mask=loss_mask,
        sequence_loss_tokens=sequence_loss_tokens,
        advantages=advantages,
        sampler_logps=sampler,
        counts=counts,
        packed=packed,
        batch_positions=list(batch_positions) if batch_positions is not None else list(range(len(sequences))),
        shared=shared,
    )


@dataclass
class BatchStats:
    """Global facts of one batch for logging (identical on every rank)."""

    num_sequences: int
    real_tokens: int  # tokens of the sequences
    computed_tokens: int  # tokens forwarded, padding included
    reward_mean: float
    reward_std: float
    truncated_fraction: float
    zero_std_fraction: float = 0.0  # TRL's frac_reward_zero_std (``zero_std_fraction``)
    input_tokens: int = 0  # prompt + sampled completion tokens of the rollouts: TRL's count for num_tokens
    unique_tokens: int = 0  # tokens with each group's common prefix counted once
    padding_tokens: int = 0  # forwarded padding
    extra: dict[str, float] = field(default_factory=dict)


@dataclass
class RankBatch:
    """What one rank trains on for one batch: its own micro-batches plus the global counts."""

    micro_batches: list[MicroBatch]
    counts: GlobalCounts
    stats: BatchStats
    batch_index: int = 0


@dataclass
class BatchingConfig:
    """How a batch is laid out over ranks and micro-batches. "from": the RLConfig field each is filled from
    (``step_batches.batching_config`` through ``core.settings.settings_from``); the others share its name or are
    the run's (world size, tokenizer, model)."""

    world_size: int = 1
    # auto: the cheaper of the two per batch (cheapest_layout)
    mode: MicroBatchingMode | Literal["auto"] = field(default="padded", metadata={"from": "micro_batching"})
    rows_per_micro_batch: int = field(default=1, metadata={"from": "per_device_train_batch_size"})
    max_tokens_per_microbatch: int = 4096
    max_seq_len: int = 1024
    horizon: int | None = field(default=None, metadata={"from": "dr_grpo_horizon"})
    overlong: OverlongPolicy = "error"
    mask_truncated_completions: bool = False
    scale_rewards: ScaleRewards = "group"
    # (name, weight) of TRL-style reward functions: advantages by normalize_then_sum; empty: of the summed reward.
    reward_functions: tuple[tuple[str, float], ...] = ()
    pad_token_id: int = 0
    share_prompt_training: str = "off"
    attention_cost: float = 0.0  # one attention cell's cost in token units (``prefix.modelled_cost``), for auto
    run_attention: bool = False  # packed and shared rows attend run by run (``policy.attends_run_by_run``)

    def __post_init__(self):
        # The knobs' choices and ranges (and that a packed row holds max_seq_len) are RLConfig's rules.
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}.")




def plan_batch(rollouts: list[Rollout], config: BatchingConfig, batch_index: int = 0) -> list[RankBatch]:
    """Turn one optimizer step's rollouts into one RankBatch per rank (docs/architecture.md's whole data path)."""
    if not rollouts:
        raise ValueError("A batch needs at least one rollout.")
    rewards = [float(r.reward) for r in rollouts]
    advantages = batch_advantages(rollouts, rewards, config.scale_rewards, config.reward_functions)
    sequences = prepare_sequences(
        rollouts, advantages, config.max_seq_len, config.overlong, config.mask_truncated_completions
    )
    counts = global_counts(sequences, config.horizon or config.max_seq_len)
    lengths = [len(s) for s in sequences]
    chosen = cheapest_layout(sequences, config)
    parts, grouped, packed = chosen.parts, chosen.micro_batches, chosen.mode == "packed"
    # Collectives need the same number of passes on every rank; the short ranks get zero-weight passes.
    num_micro_batches = max(len(groups) for groups in grouped)
    rank_batches = []
    micro_batches_all = []
    for groups in grouped:
        groups = groups + [[] for _ in range(num_micro_batches - len(groups))]
        micro_batches = []
        for group in groups:
            members = [i for p in group for i in parts[p].members]
            micro_batches.append(collate([sequences[i] for i in members], counts, packed, config.pad_token_id,
                                         members, part_shapes(parts, group)))
        micro_batches_all.extend(micro_batches)
        rank_batches.append(micro_batches)
    # An episode of several branches is one sample of its reward, as in its advantage and in evaluation.
    episode_rewards = [rewards[i] for i in episodes_of(rollouts, rewards)[0]]
    # One episode has no spread: NaN, as TRL's nanstd and evaluation's (TRL's log leaves it out of the backends).
    spread = torch.tensor(episode_rewards, dtype=torch.float64)
    reward_std = float(spread.std()) if len(episode_rewards) > 1 else math.nan
    stats = BatchStats(
        num_sequences=len(sequences),
        real_tokens=sum(lengths),
        computed_tokens=sum(mb.computed_tokens for mb in micro_batches_all),
        reward_mean=sum(episode_rewards) / len(episode_rewards),
        reward_std=reward_std,
        truncated_fraction=sum(s.truncated for s in sequences) / len(sequences),
        zero_std_fraction=zero_std_fraction(rollouts, rewards, config.scale_rewards, config.reward_functions),
        input_tokens=sum(len(r.prompt_ids) + sum(r.completion_mask) for r in rollouts),
        unique_tokens=unique_tokens(sequences),
        padding_tokens=sum(mb.padding_tokens for mb in micro_batches_all),
    )
    if config.mode == "auto":
        stats.extra["packed_micro_batches"] = float(packed)  # what auto chose for this batch
    return [RankBatch(mbs, counts, stats, batch_index) for mbs in rank_batches]
