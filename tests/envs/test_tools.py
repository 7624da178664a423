"""ToolEnv: tools are shown through the chat template, run on the model's calls, and their results fed back."""

import asyncio

import pytest

from verifiers_rl.envs import Parser, Rubric, ToolEnv, extract_boxed_answer, parse_tool_calls

from .scripted import ScriptedSampler


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a + b


async def fail(reason: str) -> str:
    """Always fails.

    Args:
        reason: What to fail with.
    """
    raise RuntimeError(reason)


def boxed_five(completion, parser):
    return float(parser.parse_answer(completion) == "5")


def test_tool_env_runs_tools_and_feeds_results_back(tool_tokenizer):
    tok, eos = tool_tokenizer, tool_tokenizer.eos_token_id
    turns = [
        '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>',
        (
            '<tool_call>{"name": "fail", "arguments": {"reason": "boom"}}</tool_call>'
            '<tool_call>{"name": "nope", "arguments": {}}</tool_call>'
            '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'
            "<tool_call>{bad json</tool_call>"
        ),
        "It is \\boxed{5}.",
    ]
    sampler = ScriptedSampler([tok.encode(t, add_special_tokens=False) + [eos] for t in turns])
    env = ToolEnv(
        [{"question": "2 + 3?"}],
        Rubric([boxed_five], parser=Parser(extract=extract_boxed_answer)),
        tok,
        tools=[add, fail],
        system_prompt="Use tools.",
        max_new_tokens=1024,
        max_seq_len=4096,
    )
    rollout = asyncio.run(env.rollout(sampler, env.dataset[0], 0))

    assert '"name": "add"' in tok.decode(rollout.prompt_ids) and "Use tools." in tok.decode(rollout.prompt_ids)
    assert [m["content"] for m in rollout.completion[1:2] + rollout.completion[3:7]] == [
        "5",
        "Error: RuntimeError: boom",
        "Error: unknown tool 'nope'; available: ['add', 'fail'].",
        "Error: TypeError: add() missing 1 required positional argument: 'b'",
        "Error: the tool call is not valid JSON (Expecting property name enclosed in double quotes): '{bad json'",
    ]
    assert [m["role"] for m in rollout.completion] == [
        "assistant",
        "tool",
        "assistant",
        "tool",
        "tool",
        "tool",
        "tool",
        "assistant",
    ]
    assert rollout.reward == 1.0
    # The model read the first result in its next prompt, as environment tokens (mask 0).
    assert "<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n" in tok.decode(
        sampler.calls[1][0]
    )
    env_text = tok.decode([t for t, m in zip(rollout.completion_ids, rollout.completion_mask) if m == 0])
    assert env_text.count("<tool_response>") == 5 and "<tool_call>" not in env_text


def test_tool_env_needs_a_template_that_shows_tools(tokenizer, tool_tokenizer):
    with pytest.raises(ValueError, match=r"does not show the tools \['add'\] to the model"):
        ToolEnv([{"question": "q"}], Rubric(), tokenizer, tools=[add])

    def undocumented(x: int) -> int:
        return x

    with pytest.raises(ValueError, match="cannot describe a tool to the model: .*undocumented"):
        ToolEnv([{"question": "q"}], Rubric(), tool_tokenizer, tools=[undocumented])


def test_parse_tool_calls_formats():
    text = (
        '<tool_call>\n{"name": "a", "arguments": "{\\"x\\": 1}"}\n</tool_call> and '
        '<tool_call>{"name": "b"}</tool_call><tool_call>["not", "a", "call"]</tool_call>'
    )
    assert parse_tool_calls(text) == [
        {"name": "a", "arguments": {"x": 1}},
        {"name": "b", "arguments": {}},
        'a tool call must be {"name": <string>, "arguments": <object>}, got \'["not", "a", "call"]\'',
    ]
    assert parse_tool_calls("no calls, <tool_call>unclosed") == []
