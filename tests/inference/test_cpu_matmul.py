"""The engine's CPU matmuls (``cpu_matmul``): weight-major and oneDNN-packed products equal F.linear to float
rounding, row by row independent of the batch, in force only while the engine generates; packs follow every change
of their weights; and sampling with either draws the same tokens as with F.linear."""

import pytest
import torch

from verifiers_rl.inference.kernels.cpu_matmul import PackedWeights, applies, cpu_linears, packs_available, plain_linear, weight_major
from verifiers_rl.inference import EmbeddedEngine, SamplingConfig

from tests.helpers.engines import assert_parity, load, prompts_of, sample_seeded

pytestmark = pytest.mark.skipif(not packs_available(), reason="this torch has no oneDNN")


def packed_linear(model):
    packs = PackedWeights(model)
    packs.refresh()
    return packs.linear


@pytest.mark.parametrize("how", ["weight_major", "packed"])
def test_cpu_linears_equal_f_linear_and_restore_each_layers_forward(tiny_model_dir, how):
    model, tokenizer = load(tiny_model_dir)
    ids = torch.tensor([prompts_of(tokenizer)[2]])
    head = model.get_output_embeddings()
    own = lambda hidden: torch.nn.functional.linear(hidden, head.weight) * 2  # noqa: E731  (an instance forward)
    head.forward = own
    layers = [layer for layer in model.modules() if applies(layer)]
    assert head not in layers and len(layers) > 0  # a layer whose forward was already replaced keeps it
    product = weight_major if how == "weight_major" else packed_linear(model)
    calls = []

    def linear(x, layer):
        calls.append(layer)
        return product(x, layer)

    with torch.no_grad():
        reference = model(input_ids=ids).logits
        with cpu_linears(model, linear) as replaced:
            inside = model(input_ids=ids).logits
            assert all("forward" in layer.__dict__ for layer in layers) and head.forward is own
        after = model(input_ids=ids).logits
    assert replaced == len(layers)
    torch.testing.assert_close(inside, reference, rtol=0, atol=1e-5)
    assert set(calls) == set(layers)  # every admitted layer ran the replacement, and only those
    assert torch.equal(after, reference)  # every forward put back
    assert head.forward is own and all("forward" not in layer.__dict__ for layer in layers)


@torch.no_grad()
def test_packed_equals_f_linear_for_every_row_count_and_each_row_alone():
    torch.manual_seed(0)
    layer = torch.nn.Linear(96, 80)
    packs = PackedWeights(layer)
    assert packs.refresh() == 1
    x = torch.randn(40, 96)
    full = packs.linear(x, layer)
    torch.testing.assert_close(full, torch.nn.functional.linear(x, layer.weight, layer.bias), rtol=0, atol=1e-5)
    for rows in range(1, 26):  # a row's product does not depend on the rows beside it (sampling is per row)
        assert torch.equal(packs.linear(x[:rows], layer), full[:rows])
    assert torch.equal(packs.linear(x[7:8], layer), full[7:8])


@torch.no_grad()
def test_packs_follow_every_change_of_their_weights():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 48, bias=False), torch.nn.Linear(48, 32))
    packs = PackedWeights(model)
    assert packs.refresh() == 2 and packs.refresh() == 0  # nothing changed: nothing re-packed
    x = torch.randn(5, 32)
    model[0].weight.mul_(2)  # changed in place, as a weight load's copy_
    with pytest.raises(RuntimeError, match="refresh"):
        packs.linear(x, model[0])  # a stale pack is never used
    assert packs.refresh() == 1
    torch.testing.assert_close(packs.linear(x, model[0]), x @ model[0].weight.T, rtol=0, atol=1e-5)
    model[0].weight = torch.nn.Parameter(torch.randn(48, 32))  # another tensor (a re-tied head)
    assert packs.refresh() == 1
    torch.testing.assert_close(packs.linear(x, model[0]), x @ model[0].weight.T, rtol=0, atol=1e-5)
    model[1].bias.add_(1)  # the bias is read at each call, never packed
    h = torch.randn(5, 48)
    torch.testing.assert_close(packs.linear(h, model[1]), model[1](h), rtol=0, atol=1e-5)


@pytest.mark.parametrize("how", ["packed", "weight_major"])
def test_engine_samples_the_same_tokens_as_with_f_linear(tiny_model_dir, how):
    model, tokenizer = load(tiny_model_dir)
    fast = EmbeddedEngine(model, tokenizer, SamplingConfig(temperature=1.0), cpu_matmuls=how)
    plain = EmbeddedEngine(model, tokenizer, SamplingConfig(temperature=1.0), cpu_matmuls="linear")
    assert EmbeddedEngine(model, tokenizer).cpu_matmuls == "packed"  # auto, where torch has oneDNN
    seen = {}

    def record(name):
        def hook(layer, args):  # whether the layer's forward is replaced (returns None: the input stays as it is)
            seen.setdefault(name, "forward" in layer.__dict__)
        return hook

    watched = {name: next(layer for layer in engine.model.modules() if applies(layer))
               for name, engine in (("fast", fast), ("plain", plain))}
    for name, layer in watched.items():
        layer.register_forward_pre_hook(record(name))
    prompts = [p for p in prompts_of(tokenizer) for _ in range(4)]
    seeds = list(range(200, 200 + len(prompts)))
    a, b = sample_seeded(fast, prompts, seeds, 24), sample_seeded(plain, prompts, seeds, 24)
    assert seen == {"fast": True, "plain": False}
    assert [s.token_ids for s in a] == [s.token_ids for s in b]
    assert max(abs(x - y) for s, t in zip(a, b) for x, y in zip(s.logprobs, t.logprobs)) < 1e-5
    assert_parity(model, prompts, a, 1.0)
    # After generating, the fast engine's layers have their own forward back; the post-sync probe keeps F.linear
    # (it compares with the trainer's own forward).
    assert "forward" not in watched["fast"].__dict__
    assert fast.prompt_logprobs(prompts[0]) == plain.prompt_logprobs(prompts[0])


def test_unknown_cpu_matmuls_is_refused_by_name(tiny_model_dir):
    model, tokenizer = load(tiny_model_dir)
    with pytest.raises(ValueError, match="cpu_matmuls must be"):
        EmbeddedEngine(model, tokenizer, cpu_matmuls="fast")


def test_plain_linear_equals_f_linear_and_leaves_autograd_to_it():
    torch.manual_seed(0)
    x, weight, bias = torch.randn(3, 7, 48), torch.randn(40, 48), torch.randn(40)
    reference = torch.nn.functional.linear(x, weight, bias)
    with torch.no_grad():
        fast = plain_linear(x, weight, bias)
    torch.testing.assert_close(fast, reference, rtol=0, atol=1e-5)
    assert fast.shape == (3, 7, 40) and fast.grad_fn is None
    weight.requires_grad_()
    tracked = plain_linear(x, weight, bias)  # a graph to record: F.linear, whose backward exists
    assert tracked.grad_fn is not None and torch.equal(tracked, torch.nn.functional.linear(x, weight, bias))
    tracked.sum().backward()
    torch.testing.assert_close(weight.grad, x.reshape(-1, 48).T.sum(-1).expand(40, 48), rtol=1e-5, atol=1e-5)
    low = plain_linear(x.bfloat16(), weight.detach().bfloat16())  # other dtypes: F.linear
    assert low.dtype == torch.bfloat16 and torch.equal(low, torch.nn.functional.linear(x.bfloat16(),
                                                                                      weight.detach().bfloat16()))
