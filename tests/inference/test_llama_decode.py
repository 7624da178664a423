"""The engine's lean Llama decode step (``llama_decode``) and the matmuls under it (``cpu_matmul``: padded
weight-major, oneDNN-packed, F.linear): equal to transformers' forward to float rounding, with left padding,
grouped-query attention and rows leaving the batch, and the engine samples the same tokens with it as without; the
same for ``graph_decode``'s fixed-shape step (Llama and Qwen2), run eagerly here (tests/gpu captures it)."""

import asyncio

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from verifiers_rl.inference.kernels.cpu_matmul import PackedWeights, padded_rows, weight_major
from verifiers_rl.inference import EmbeddedEngine, SamplingConfig
from verifiers_rl.inference.kernels.graph_decode import GraphDecoder
from verifiers_rl.inference.kernels.graph_decode import supports as graph_decode_supports
from verifiers_rl.inference.kernels.llama_decode import LlamaDecoder, supports

from tests.helpers.engines import assert_parity, load, prompts_of, sample_seeded


@pytest.mark.parametrize("rows", range(1, 26))
def test_weight_major_equals_f_linear_for_every_row_count(rows):
    torch.manual_seed(rows)
    layer = torch.nn.Linear(48, 40)
    x = torch.randn(rows, 48)
    assert padded_rows(rows) >= rows
    torch.testing.assert_close(weight_major(x, layer), torch.nn.functional.linear(x, layer.weight, layer.bias),
                               rtol=0, atol=1e-5)
    assert weight_major(x, layer).is_contiguous()


def gqa_model(seed=0):
    """A random Llama with grouped-query attention (4 query heads on 2 key/value heads) and rope scaling."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0})
    return LlamaForCausalLM(config).eval()


def qwen2_model(seed=0):
    """A random Qwen2 (q/k/v biases) with grouped-query attention."""
    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    return Qwen2ForCausalLM(config).eval()


@torch.no_grad()
def assert_steps_equal_forward(model, make_decoder, tolerance=1e-5):
    """12 decode steps of a left-padded batch whose rows leave twice: ``make_decoder(cache, capacity)``'s logits
    equal transformers' forward with a cache (on the model's device) to ``tolerance``."""
    device = model.device
    lengths = [9, 4, 7, 1, 6]  # left-padded to 9
    ids = torch.randint(3, 97, (len(lengths), 9), device=device)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        mask[row, 9 - n :] = 1
    cache = DynamicCache(config=model.config)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache).logits[:, -1]
    reference_cache = DynamicCache(config=model.config)
    model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=reference_cache)
    decoder = make_decoder(cache, 9 + 12)
    tokens = logits.argmax(-1)
    for step in range(12):
        if step in (4, 8):  # rows leave: the second and the last, then the first
            keep = torch.tensor([0, 2, 3] if step == 4 else [1, 2], device=device)
            decoder.keep(keep)
            reference_cache.batch_select_indices(keep)
            tokens, mask = tokens[keep], mask[keep]
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        positions = mask.sum(-1) - 1
        reference = model(input_ids=tokens[:, None], attention_mask=mask, position_ids=positions[:, None],
                          past_key_values=reference_cache).logits[:, -1]
        lean = decoder.step(tokens, positions, mask)
        torch.testing.assert_close(lean, reference, rtol=tolerance, atol=tolerance)
        tokens = reference.argmax(-1)
    assert decoder.length == 9 + 12


@pytest.mark.parametrize("how", ["weight_major", "packed", "linear"])
def test_decode_steps_equal_transformers_forward_with_padding_and_rows_leaving(how):
    model = gqa_model()
    packs = PackedWeights(model)
    packs.refresh()
    linear = {"weight_major": weight_major, "packed": packs.linear, "linear": None}[how]
    assert supports(model)
    assert_steps_equal_forward(model, lambda cache, capacity: LlamaDecoder(model, cache, capacity, linear=linear))


@pytest.mark.parametrize("build", [gqa_model, qwen2_model])
def test_the_graph_steps_static_shapes_equal_transformers_forward(build):
    """graph_decode's step (every row kept, attention over the whole zeroed buffer under the mask, the write position
    a tensor), run eagerly on CPU; tests/gpu captures and replays it on a GPU."""
    model = build()
    assert not graph_decode_supports(model)  # a CPU model: the engine does not capture it
    assert_steps_equal_forward(model, lambda cache, capacity: GraphDecoder(model, cache, capacity, capture=False))


@pytest.mark.parametrize("in_loop_thread", [True, False])
def test_the_engine_takes_the_graph_step_only_when_it_decodes_on_the_callers_thread(tiny_model_dir, monkeypatch,
                                                                                      in_loop_thread):
    """Rows of different lengths leave the batch while the graph step keeps them all: the engine samples the same
    seeded tokens as with transformers' forward. No GPU here: graph_decode's support check (a GPU model) is stubbed
    to admit the CPU model and its step runs eagerly (capture=False); tests/gpu captures it on a GPU."""
    from verifiers_rl.envs import RolloutSampling, sampling_for_rollout
    from verifiers_rl.inference.embedded import batch_decode

    made = []

    def decoder(model, cache, capacity):
        made.append(capacity)
        return GraphDecoder(model, cache, capacity, capture=False)

    monkeypatch.setattr(batch_decode, "graph_decode_supports", lambda model: True)
    monkeypatch.setattr(batch_decode, "GraphDecoder", decoder)
    prompts = prompts_of(load(tiny_model_dir)[1])
    limits = [4 + 5 * i for i in range(len(prompts))]

    def sample(engine):
        async def one(prompt, seed, limit):
            with sampling_for_rollout(RolloutSampling(seed, None)):
                return await engine.sample(prompt, limit)

        async def run():
            return await asyncio.gather(*(one(p, s, n) for s, (p, n) in enumerate(zip(prompts, limits))))

        try:
            return asyncio.run(run())
        finally:
            engine.close()

    samples = [sample(EmbeddedEngine(tiny_model_dir, cuda_graphs=graphs, llama_decode=False,
                                     generate_in_loop_thread=in_loop_thread)) for graphs in (True, False)]
    assert bool(made) == in_loop_thread
    assert len({len(s.token_ids) for s in samples[1]}) > 1  # rows left the batch at different steps
    for graph, plain in zip(*samples, strict=True):
        assert graph.token_ids == plain.token_ids
        torch.testing.assert_close(torch.tensor(graph.logprobs), torch.tensor(plain.logprobs), rtol=0, atol=1e-5)


def test_only_fp32_cpu_llama_models_are_supported(tiny_model_dir):
    model, _ = load(tiny_model_dir)
    assert supports(model)
    assert not supports(gqa_model().to(torch.bfloat16))
    model.lm_head.forward = lambda hidden: torch.nn.functional.linear(hidden, model.lm_head.weight)  # replaced head
    assert not supports(model)


def test_engine_samples_the_same_tokens_with_the_lean_step(tiny_model_dir, monkeypatch):
    model, tokenizer = load(tiny_model_dir)
    lean = EmbeddedEngine(model, tokenizer, SamplingConfig(temperature=1.0))
    plain = EmbeddedEngine(model, tokenizer, SamplingConfig(temperature=1.0), llama_decode=False)
    assert lean.llama_decode and not plain.llama_decode
    steps = []
    original = LlamaDecoder.step

    def counted(self, *args):
        steps.append(args[0].shape[0])
        return original(self, *args)

    monkeypatch.setattr(LlamaDecoder, "step", counted)
    prompts = [p for p in prompts_of(tokenizer) for _ in range(4)]
    seeds = list(range(300, 300 + len(prompts)))
    a = sample_seeded(lean, prompts, seeds, 24)
    used = len(steps)
    b = sample_seeded(plain, prompts, seeds, 24)
    assert used > 0 and len(steps) == used  # the lean engine stepped with it, the plain one never
    assert [s.token_ids for s in a] == [s.token_ids for s in b]
    assert max(abs(x - y) for s, t in zip(a, b) for x, y in zip(s.logprobs, t.logprobs)) < 1e-5
    assert_parity(model, prompts, a, 1.0)
