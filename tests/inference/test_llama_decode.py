"""The engine's lean Llama decode step (``llama_decode``) and the matmuls under it (``cpu_matmul``: padded
weight-major, oneDNN-packed, F.linear): equal to transformers' forward to float rounding, with left padding,
grouped-query attention and rows leaving the batch, and the engine samples the same tokens with it as without."""

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from verifiers_rl.cpu_matmul import PackedWeights, padded_rows, weight_major
from verifiers_rl.inference import EmbeddedEngine, SamplingConfig
from verifiers_rl.inference.llama_decode import LlamaDecoder, supports

from test_hf_engine import assert_parity, load, prompts_of, sample_seeded


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


@pytest.mark.parametrize("how", ["weight_major", "packed", "linear"])
@torch.no_grad()
def test_decode_steps_equal_transformers_forward_with_padding_and_rows_leaving(how):
    model = gqa_model()
    packs = PackedWeights(model)
    packs.refresh()
    linear = {"weight_major": weight_major, "packed": packs.linear, "linear": None}[how]
    assert supports(model)
    lengths = [9, 4, 7, 1, 6]  # left-padded to 9
    ids = torch.randint(3, 97, (len(lengths), 9))
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        mask[row, 9 - n :] = 1
    cache = DynamicCache(config=model.config)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache).logits[:, -1]
    reference_cache = DynamicCache(config=model.config)
    model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=reference_cache)
    decoder = LlamaDecoder(model, cache, capacity=9 + 12, linear=linear)
    tokens = logits.argmax(-1)
    for step in range(12):
        if step in (4, 8):  # rows leave: the second and the last, then the first
            keep = torch.tensor([0, 2, 3]) if step == 4 else torch.tensor([1, 2])
            decoder.keep(keep)
            reference_cache.batch_select_indices(keep)
            tokens, mask = tokens[keep], mask[keep]
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        positions = mask.sum(-1) - 1
        reference = model(input_ids=tokens[:, None], attention_mask=mask, position_ids=positions[:, None],
                          past_key_values=reference_cache).logits[:, -1]
        lean = decoder.step(tokens, positions, mask)
        torch.testing.assert_close(lean, reference, rtol=1e-5, atol=1e-5)
        tokens = reference.argmax(-1)
    assert decoder.length == 9 + 12


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
