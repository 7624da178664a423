"""Run-by-run attention over packed and shared-prefix rows (``segmented_attention``) equals dense masked attention,
and the trainer's forward takes it."""

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from verifiers_rl.training import segmented_attention
from verifiers_rl.training.batching import BatchingConfig, layout, plan_batch, prepare_sequences
from verifiers_rl.training.forward import attention_cells, micro_batch_logprobs, micro_batch_runs, tree_attention_mask
from verifiers_rl.training.prefix import PADDING, ROOT, best_part_size
from verifiers_rl.core.rollout import Rollout
from verifiers_rl.training.segmented_attention import row_runs, run_attention
from verifiers_rl.rollouts.synthetic import random_rollouts


def tree_rows():
    """Two rows: [root | block 0: prefix, branches 0, 1 | block 1: one unshared sequence | padding] and
    [block 0: prefix, branch 2 | block 1: prefix, branches 3, 4 (an empty one between) | padding]."""
    block = torch.tensor([[ROOT] * 3 + [0] * 9 + [1] * 4 + [PADDING] * 2,
                          [0] * 5 + [1] * 10 + [PADDING] * 3])
    branch = torch.tensor([[-1] * 3 + [-1] * 3 + [0] * 4 + [1] * 2 + [-1] * 4 + [-1] * 2,
                           [-1] * 2 + [2] * 3 + [-1] * 4 + [3] * 5 + [4] * 1 + [-1] * 3])
    return block, branch


def test_runs_are_the_masks_visible_spans():
    block, branch = tree_rows()
    runs = [(r.row, r.start, r.stop, r.before) for r in row_runs(block, branch)]
    assert runs == [
        (0, 0, 3, ()), (0, 3, 6, ((0, 3),)), (0, 6, 10, ((0, 6),)), (0, 10, 12, ((0, 6),)),
        (0, 12, 16, ((0, 3),)), (0, 16, 18, None),
        (1, 0, 2, ()), (1, 2, 5, ((0, 2),)), (1, 5, 9, ()), (1, 9, 14, ((5, 9),)), (1, 14, 15, ((5, 9),)),
        (1, 15, 18, None),
    ]


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2)])
def test_run_attention_equals_dense_masked_attention_in_fp64(heads, kv_heads):
    """Values and gradients (of q, k, v) at every real position equal SDPA over the whole row with
    ``tree_attention_mask``; padding positions come out 0 and receive no gradient."""
    block, branch = tree_rows()
    gen = torch.Generator().manual_seed(0)
    shape = (2, heads, block.shape[1], 8)
    q = torch.randn(shape, dtype=torch.float64, generator=gen, requires_grad=True)
    k = torch.randn(2, kv_heads, shape[2], 8, dtype=torch.float64, generator=gen, requires_grad=True)
    v = torch.randn(2, kv_heads, shape[2], 8, dtype=torch.float64, generator=gen, requires_grad=True)
    upstream = torch.randn(2, shape[2], heads, 8, dtype=torch.float64, generator=gen)
    real = (block != PADDING)[:, :, None, None]
    upstream = upstream * real  # nothing reads padding outputs

    mask = tree_attention_mask(block, branch, torch.float64)
    dense = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3, enable_gqa=True).transpose(1, 2)
    expected = torch.autograd.grad((dense * upstream).sum(), (q, k, v))
    runs = run_attention(q, k, v, row_runs(block, branch), 0.3)
    got = torch.autograd.grad((runs * upstream).sum(), (q, k, v))

    torch.testing.assert_close(runs * real, dense * real, rtol=1e-12, atol=1e-12)
    assert torch.all(runs[~real.expand_as(runs)] == 0)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    # The spans matter: a branch that also saw its sibling (block 0's branches as one) gives other values.
    merged = branch.clone()
    merged[0, 10:12] = 0
    wrong = run_attention(q, k, v, row_runs(block, merged), 0.3)
    assert (wrong[0, 10:12] - dense[0, 10:12]).abs().max() > 1e-3


def test_trainer_forward_attends_run_by_run_with_and_without_activation_checkpointing(tiny_model_dir, monkeypatch):
    """Packed shared-prefix rows of an sdpa model go through ``run_attention`` in every layer, never through a
    whole-row SDPA call; the values and gradients equal the forward that takes the dense mask instead (the calls
    without runs: transformers' own sdpa), also with activation checkpointing, whose recomputation takes the same
    path."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    assert segmented_attention.applies(model.config)
    rollouts = random_rollouts(3, 4, vocab_size=390, seed=3, completion_len=(60, 120), system_prompt_len=5)
    config = BatchingConfig(mode="packed", max_seq_len=160, max_tokens_per_microbatch=4096, share_prompt_training="on")
    (mb,) = plan_batch(rollouts, config)[0].micro_batches
    width = mb.shared.input_ids.shape[1]
    assert micro_batch_runs(mb) is not None  # long enough that runs beat one dense call at the default overhead

    widths = []
    sdpa = F.scaled_dot_product_attention

    def recording(query, key, *args, **kwargs):
        widths.append(key.shape[2])
        return sdpa(query, key, *args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recording)

    def update(runs: bool, checkpointing: bool):
        monkeypatch.setattr("verifiers_rl.training.forward.runs_apply", lambda config: runs)
        model.zero_grad(set_to_none=True)
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            model.train()
        widths.clear()
        out = micro_batch_logprobs(model, mb, temperature=1.0, chunk_size=64)
        (out.logps * mb.loss_mask).sum().backward()
        if checkpointing:
            model.gradient_checkpointing_disable()
            model.eval()
        return out.logps.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, list(widths)

    dense_logps, dense_grads, dense_widths = update(runs=False, checkpointing=False)
    assert set(dense_widths) == {width}
    for checkpointing in (False, True):
        logps, grads, widths_seen = update(runs=True, checkpointing=checkpointing)
        layers = model.config.num_hidden_layers
        assert len(widths_seen) >= (2 if checkpointing else 1) * layers * 3 and max(widths_seen) < width
        torch.testing.assert_close(logps, dense_logps, rtol=1e-5, atol=1e-5)
        for name, grad in dense_grads.items():
            torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-5)  # fp32 sums of ~1000 terms


def test_a_row_of_padding_only_gives_zero_output_and_zero_gradients():
    """An empty rank's zero-weight micro-batch: nothing to attend; its backward still reaches q, k and v (zeros),
    as every rank's backward must reach the same parameters."""
    block = torch.full((1, 4), PADDING)
    q, k, v = (torch.randn(1, 2, 4, 8, requires_grad=True) for _ in range(3))
    out = run_attention(q, k, v, row_runs(block, torch.full_like(block, -1)), 0.3)
    assert torch.all(out == 0)
    out.sum().backward()
    assert all(t.grad is not None and torch.all(t.grad == 0) for t in (q, k, v))


@pytest.mark.parametrize("overhead", [segmented_attention.RUN_OVERHEAD_CELLS, 0])
@pytest.mark.parametrize("mode,share,system,completion", [
    ("packed", "on", 5, (2, 30)),  # shared parts after a root
    ("packed", "on", 5, (100, 200)),  # long enough that runs win at the default overhead
    ("packed", "off", 5, (2, 30)),  # one block per sequence, no root
    ("packed", "auto", 0, (2, 30)),
    ("padded", "on", 5, (2, 30)),  # shared rows, one group each, padding attends to nothing
    ("padded", "on", 0, (100, 200)),
    ("padded", "off", 0, (2, 30)),  # plain rows: dense
])
def test_the_cost_model_counts_the_cells_the_forward_computes(mode, share, system, completion, overhead, monkeypatch):
    """``Layout.modelled_cost`` with ``run_attention`` charges each micro-batch the attention the forward takes on
    it: run by run (``Run.cells`` summed, plus ``RUN_OVERHEAD_CELLS`` per run) where that is cheaper than one dense
    call (rows x width^2), which is what ``policy.micro_batch_runs`` picks; so ``auto`` compares what runs."""
    monkeypatch.setattr(segmented_attention, "RUN_OVERHEAD_CELLS", overhead)
    rollouts = random_rollouts(5, 4, vocab_size=390, seed=11, completion_len=completion, system_prompt_len=system)
    config = BatchingConfig(mode=mode, max_seq_len=256, max_tokens_per_microbatch=1024, rows_per_micro_batch=4,
                            share_prompt_training=share, run_attention=True, attention_cost=1.0)
    sequences = prepare_sequences(rollouts, [0.0] * len(rollouts), config.max_seq_len)
    chosen = layout(sequences, config, mode)
    modelled_cells = chosen.modelled_cost(1.0, True) - chosen.modelled_cost(0.0, True)
    (rank_batch,) = plan_batch(rollouts, config)
    micro_batches = rank_batch.micro_batches
    assert modelled_cells == sum(attention_cells(mb, True, with_overhead=True) for mb in micro_batches)
    by_runs = [mb for mb in micro_batches if micro_batch_runs(mb) is not None]
    dense = sum(attention_cells(mb, run_attention=False) for mb in micro_batches)
    computed = sum(attention_cells(mb, run_attention=True) for mb in micro_batches)
    assert (computed < dense) == bool(by_runs)
    if overhead == 0 or completion[0] >= 100:  # runs compute fewer cells wherever a row holds several runs
        assert bool(by_runs) == (mode == "packed" or share == "on")


def test_a_quickstart_row_attends_densely_and_a_long_one_run_by_run():
    """The quickstart's shape (4 groups x 4 of 16-token completions after a 24-token system prompt, one packed row
    of ~300 tokens) is cheaper as one dense call than as 21 runs; 128-token completions are not."""
    runs = {}
    for longest in (16, 128):
        rollouts = random_rollouts(4, 4, vocab_size=390, seed=1, prompt_len=(8, 12), completion_len=(6, longest),
                                   system_prompt_len=24)
        config = BatchingConfig(mode="packed", max_seq_len=256, max_tokens_per_microbatch=1024,
                                share_prompt_training="on", run_attention=True)
        micro_batches = plan_batch(rollouts, config)[0].micro_batches
        widest = max(micro_batches, key=lambda mb: mb.shared.input_ids.shape[1])
        runs[longest] = (len(micro_batches), widest.shared.input_ids.shape[1], micro_batch_runs(widest) is not None)
    assert runs[16][:2] == (1, 250) and not runs[16][2]  # 21 runs would cost more than 250^2 cells
    assert runs[128][1] == 968 and runs[128][2]


def test_auto_keeps_a_group_of_long_completions_in_one_shared_row_when_rows_attend_run_by_run():
    """Dense attention makes long completions share less (one row per sequence); run by run a branch's cells do
    not depend on its row-mates, so ``auto`` keeps the group together and forwards its prompt once."""
    cost = 3.3e-4  # SmolLM2-135M's ratio (policy.attention_cost)
    assert best_part_size(100, [1000] * 8, cost) == 1
    assert best_part_size(100, [1000] * 8, cost, runs=True) == 8
    long = [Rollout([7] * 100, [10 + i] * 1000, [1] * 1000, float(i % 2), "long") for i in range(4)]
    config = dict(mode="padded", rows_per_micro_batch=4, max_seq_len=2048, max_tokens_per_microbatch=8192,
                  attention_cost=cost, share_prompt_training="auto")
    (dense,) = plan_batch(long, BatchingConfig(**config))
    (runs,) = plan_batch(long, BatchingConfig(**config, run_attention=True))
    assert dense.micro_batches[0].shared is None and dense.stats.computed_tokens == 4 * 1100
    assert runs.micro_batches[0].shared is not None and runs.stats.computed_tokens == 100 + 4 * 1000


def test_a_runs_batching_config_only_for_models_that_attend_through_sdpa(tiny_model_dir, tmp_path):
    """The trainer's cost model knows which attention its forward runs: run by run for an sdpa model, dense for an
    eager one (whose attention function is not the one ``install`` extends)."""
    from verifiers_rl.config.rl_config import RLConfig
    from verifiers_rl.training.step_batches import batching_config

    args = RLConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    for implementation, expected in (("sdpa", True), ("eager", False)):
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32,
                                                     attn_implementation=implementation)
        assert batching_config(args, model, 1, 0).run_attention is expected


def test_importing_the_package_leaves_transformers_attention_alone():
    """Run-by-run attention is installed when a forward first passes runs (and removed by the trainer when training
    ends), not as a side effect of an import: a fresh process that imports the trainer still has transformers'
    own ``sdpa``."""
    import subprocess
    import sys

    code = ("import verifiers_rl, verifiers_rl.training.trainer, verifiers_rl.training.forward\n"
            "from verifiers_rl.training import segmented_attention\n"
            "print(segmented_attention.installed())")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == "False"


def test_uninstall_restores_transformers_own_sdpa():
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    segmented_attention.install()
    own = ALL_ATTENTION_FUNCTIONS["sdpa"].transformers_sdpa
    segmented_attention.install()  # idempotent: not wrapped twice
    assert ALL_ATTENTION_FUNCTIONS["sdpa"].transformers_sdpa is own
    segmented_attention.uninstall()
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is own and not segmented_attention.installed()
    segmented_attention.install()  # as the rest of this process's tests had it
