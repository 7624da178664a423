"""``Environment.use_chat_template_kwargs``: the variables reach every chat template an environment applies: a tool
environment's prompt and the tokens between its turns (template and text tool modes), a classic verifiers
environment's client; the rows are filtered again; what cannot take them is refused by name."""

import asyncio
import copy

import pytest

from verifiers_rl.envs import Rubric, SingleTurnEnv, ToolEnv, load_environment
from verifiers_rl.core.models import CHAT_TEMPLATE

from .scripted import ScriptedSampler
from .templates import TOOL_TEMPLATE

NO_THINKING = {"enable_thinking": False}
THINK = "<think>\n\n</think>\n\n"
GENERATION_PROMPT = "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
assert GENERATION_PROMPT in TOOL_TEMPLATE
# TOOL_TEMPLATE with Qwen3's switch after the generation prompt (as the tiny tokenizer's own CHAT_TEMPLATE has it).
THINKING_TOOL_TEMPLATE = TOOL_TEMPLATE.replace(GENERATION_PROMPT, CHAT_TEMPLATE[CHAT_TEMPLATE.index("{% if add_gen"):])


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a + b


@pytest.fixture(scope="module")
def thinking_tool_tokenizer(tokenizer):
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = THINKING_TOOL_TEMPLATE
    return tok


def environment_text(tok, rollout) -> str:
    """The environment's tokens between the model's turns (mask 0), decoded."""
    return tok.decode([t for t, m in zip(rollout.completion_ids, rollout.completion_mask) if m == 0])


def tool_rollout(tok, env):
    turns = ['<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>', "It is 5."]
    sampler = ScriptedSampler([tok.encode(t, add_special_tokens=False) + [tok.eos_token_id] for t in turns])
    return asyncio.run(env.rollout(sampler, env.dataset[0], 0)), sampler


@pytest.mark.parametrize("mode", ["template", "text"])
@pytest.mark.parametrize("kwargs", [None, NO_THINKING])
def test_tool_turns_render_with_the_kwargs(tokenizer, thinking_tool_tokenizer, mode, kwargs):
    # text mode: the tiny tokenizer's own template (no tool support), the tools described in the system prompt.
    tok = thinking_tool_tokenizer if mode == "template" else tokenizer
    env = ToolEnv([{"question": "2 + 3?"}], Rubric([lambda completion: 0.0]), tok, tools=[add], tool_mode=mode,
                  max_new_tokens=64, max_seq_len=1024)
    env.use_chat_template_kwargs(kwargs)
    assert env.tool_mode == mode
    rollout, sampler = tool_rollout(tok, env)
    prompt = tok.decode(rollout.prompt_ids)
    assert '"name": "add"' in prompt and prompt.endswith("<|im_start|>assistant\n" + (THINK if kwargs else ""))
    # The tokens after the tool's result end with the next generation prompt, rendered with the kwargs too.
    between = environment_text(tok, rollout)
    assert "5" in between and between.endswith("<|im_start|>assistant\n" + (THINK if kwargs else ""))
    assert between.count("<think>") == (1 if kwargs else 0)
    assert tok.decode(sampler.calls[1][0]).count("<think>") == (2 if kwargs else 0)  # what the model read


def test_a_tool_env_built_with_the_kwargs_renders_as_one_given_them_later(thinking_tool_tokenizer):
    tok = thinking_tool_tokenizer
    built = ToolEnv([{"question": "2 + 3?"}], Rubric([]), tok, tools=[add], chat_template_kwargs=NO_THINKING)
    later = ToolEnv([{"question": "2 + 3?"}], Rubric([]), tok, tools=[add])
    later.use_chat_template_kwargs(NO_THINKING)
    assert built.prompt_ids(built.dataset[0].prompt) == later.prompt_ids(later.dataset[0].prompt)
    assert tok.decode(built.prompt_ids(built.dataset[0].prompt)).endswith(THINK)
    later.use_chat_template_kwargs(dict(NO_THINKING))  # the same again: nothing to change
    with pytest.raises(ValueError, match=r"ToolEnv already renders with chat_template_kwargs=\{'enable_thinking': "
                                         r"False\}, but the run's chat_template_kwargs are \{\}"):
        later.use_chat_template_kwargs(None)


@pytest.mark.parametrize("kind", ["single", "tool"])
def test_a_verifiers_environment_renders_with_the_kwargs(tokenizer, thinking_tool_tokenizer, kind):
    tok = thinking_tool_tokenizer if kind == "tool" else tokenizer
    env = load_environment("vf:tests.envs.vf_envs", tokenizer=tok, kind=kind)
    env.use_chat_template_kwargs(NO_THINKING)
    turns = ['<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>', "It is 5."]
    sampler = ScriptedSampler([tok.encode(t, add_special_tokens=False) + [tok.eos_token_id] for t in turns])
    (rollout,) = asyncio.run(env.rollout_group(sampler, env.dataset[0], 0, 1, seed=0))
    assert tok.decode(rollout.prompt_ids).endswith("<|im_start|>assistant\n" + THINK)
    assert env.prompt_ids(env.dataset[0].prompt) == rollout.prompt_ids  # the length filter's rendering is the same
    if kind == "tool":
        assert '"name": "add"' in tok.decode(rollout.prompt_ids)
        assert environment_text(tok, rollout).endswith("<|im_start|>assistant\n" + THINK)


def test_rows_are_filtered_again_under_the_kwargs(tokenizer):
    env = SingleTurnEnv([{"question": "hi"}, {"question": "a much longer question " * 3}], Rubric([]), tokenizer,
                        max_new_tokens=1)
    env.adopt_limits(max_seq_len=len(env.prompt_ids(env.dataset[-1].prompt)) + 1)  # both rows fit, just
    assert len(env.dataset) == 2
    env.use_chat_template_kwargs(NO_THINKING)  # the think block makes the long one too long
    assert [row.prompt[0]["content"] for row in env.dataset] == ["hi"]


class OwnRender(SingleTurnEnv):
    def render(self, messages, add_generation_prompt):
        return "".join(m["content"] for m in messages)


def test_an_environment_with_its_own_render_and_reserved_keys_are_refused_by_name(tokenizer):
    env = OwnRender([{"question": "hi"}], Rubric([]), tokenizer)
    env.use_chat_template_kwargs(None)  # nothing asked: nothing to refuse
    with pytest.raises(ValueError, match=r"OwnRender: chat_template_kwargs=\{'enable_thinking': False\} cannot reach "
                                         r"its prompts: OwnRender renders them with its own render\(\)"):
        env.use_chat_template_kwargs(NO_THINKING)
    with pytest.raises(ValueError, match=r"chat_template_kwargs: \['add_generation_prompt', 'tools'\] are set by"):
        SingleTurnEnv([{"question": "hi"}], Rubric([]), tokenizer,
                      chat_template_kwargs={"tools": [], "add_generation_prompt": False})
    with pytest.raises(ValueError, match="chat_template_kwargs must be a dict of template variables"):
        SingleTurnEnv([{"question": "hi"}], Rubric([]), tokenizer, chat_template_kwargs="enable_thinking=false")
