"""The one turn-bridge algorithm (envs/turns.py) that MultiTurnEnv and the verifiers adapter's client share: the
environment's tokens between two model turns, the sampled tokens never re-rendered."""

from __future__ import annotations

import copy

import pytest

from verifiers_rl.envs.turns import TemplateError, bridge_ids

from .templates import ALTERNATING_TEMPLATE


def render_with(tokenizer):
    return lambda messages, gen: tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)


def encode_with(tokenizer):
    return lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]


def test_the_bridge_is_what_the_template_renders_after_the_models_turn(tokenizer):
    render, encode = render_with(tokenizer), encode_with(tokenizer)
    eos = tokenizer.eos_token_id
    new = [{"role": "user", "content": "again"}]
    sampled = encode("cat") + [eos]  # the model ended its turn with the template's end-of-turn token
    bridge = bridge_ids(render, encode, sampled[-1:], new, "t")
    assert tokenizer.decode(bridge) == "\n<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n"
    # Without the model's eos, the bridge starts with the end-of-turn the model did not emit.
    assert bridge_ids(render, encode, encode("cat")[-1:], new, "t") == [eos] + bridge
    # Appended to a whole conversation, the ids read exactly as the template renders it.
    prompt = [{"role": "user", "content": "say cat"}]
    ids = encode(render(prompt, True)) + sampled + bridge
    full = render(prompt + [{"role": "assistant", "content": "cat"}] + new, True)
    assert tokenizer.decode(ids) == full


def test_tool_results_follow_a_stand_in_turn_with_tool_calls(tool_tokenizer):
    render, encode = render_with(tool_tokenizer), encode_with(tool_tokenizer)
    new = [{"role": "tool", "tool_call_id": "c1", "content": "42"}]
    bridge = bridge_ids(render, encode, [tool_tokenizer.eos_token_id], new, "t")
    assert "42" in tool_tokenizer.decode(bridge) and tool_tokenizer.decode(bridge).endswith("assistant\n")


def test_a_template_that_rewrites_earlier_assistant_turns_still_bridges(tokenizer):
    # Like Qwen3's, which drops the reasoning of assistant turns before the last user message: the sampled tokens
    # stay as sampled, since the model's own turn is never rendered again.
    dropping = copy.deepcopy(tokenizer)
    dropping.chat_template = tokenizer.chat_template.replace("message['content']", "message['content'].split('</think>')[-1]")
    assert "message['content'].split" in dropping.chat_template
    bridge = bridge_ids(render_with(dropping), encode_with(dropping), [dropping.eos_token_id],
                        [{"role": "user", "content": "more"}], "t")
    assert dropping.decode(bridge).startswith("\n<|im_start|>user\nmore")


def test_a_template_whose_roles_must_alternate_from_a_user_turn_bridges(tokenizer):
    # Like Gemma's: a conversation opening with an assistant turn is refused ("roles must alternate"), so the stand-in
    # turn alone failed every multi-turn rollout of such a model.
    alternating = copy.deepcopy(tokenizer)
    alternating.chat_template = ALTERNATING_TEMPLATE
    render, encode = render_with(alternating), encode_with(alternating)
    new = [{"role": "user", "content": "again"}]
    sampled = encode("cat") + [alternating.eos_token_id]  # the model's eos is not the template's end of turn
    bridge = bridge_ids(render, encode, sampled[-1:], new, "t")
    expected = "<end_of_turn>\n<start_of_turn>user\nagain<end_of_turn>\n<start_of_turn>model\n"
    assert alternating.decode(bridge) == expected
    prompt = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "say cat"}]
    ids = encode(render(prompt, True)) + encode("cat") + bridge
    assert alternating.decode(ids) == render(prompt + [{"role": "assistant", "content": "cat"}] + new, True)


def test_a_template_that_is_not_prefix_consistent_is_a_clear_error(tokenizer):
    counting = copy.deepcopy(tokenizer)
    counting.chat_template = "{{ messages | length }} messages\n" + tokenizer.chat_template
    with pytest.raises(TemplateError, match="t: the chat template is not prefix-consistent"):
        bridge_ids(render_with(counting), encode_with(counting), [5], [{"role": "user", "content": "x"}], "t")
