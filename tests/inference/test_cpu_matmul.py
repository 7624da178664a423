"""The engine's weight-major CPU matmuls: equal to F.linear to float rounding, in force only while it generates,
and sampling with them draws the same tokens as without (``cpu_matmul``)."""

import torch

from verifiers_rl.inference import EmbeddedEngine, SamplingConfig
from verifiers_rl.cpu_matmul import applies, weight_major_linears

from test_hf_engine import assert_parity, load, prompts_of, sample_seeded


def test_weight_major_linears_equal_f_linear_and_restore_each_layers_forward(tiny_model_dir):
    model, tokenizer = load(tiny_model_dir)
    ids = torch.tensor([prompts_of(tokenizer)[2]])
    head = model.get_output_embeddings()
    own = lambda hidden: torch.nn.functional.linear(hidden, head.weight) * 2  # noqa: E731  (an instance forward)
    head.forward = own
    layers = [layer for layer in model.modules() if applies(layer)]
    assert head not in layers and len(layers) > 0  # a layer whose forward was already replaced keeps it
    with torch.no_grad():
        reference = model(input_ids=ids).logits
        with weight_major_linears(model) as replaced:
            inside = model(input_ids=ids).logits
            assert all("forward" in layer.__dict__ for layer in layers) and head.forward is own
        after = model(input_ids=ids).logits
    assert replaced == len(layers)
    torch.testing.assert_close(inside, reference, rtol=0, atol=1e-5)
    assert torch.equal(after, reference)  # every forward put back
    assert head.forward is own and all("forward" not in layer.__dict__ for layer in layers)


def test_engine_generates_weight_major_and_samples_the_same_tokens(tiny_model_dir):
    model, tokenizer = load(tiny_model_dir)
    fast = EmbeddedEngine(model, tokenizer, SamplingConfig(temperature=1.0))
    plain = EmbeddedEngine(model, tokenizer, SamplingConfig(temperature=1.0), weight_major_matmuls=False)
    seen = {}

    def record(name):
        def hook(layer, args):  # whether the layer runs weight-major (returns None: the input stays as it is)
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
