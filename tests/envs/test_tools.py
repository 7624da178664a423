"""ToolEnv: tools are shown through the chat template, run on the model's calls, and their results fed back."""

import asyncio
import copy
import datetime
import json
import logging
import threading

import pytest

from verifiers_rl.envs import Parser, Rubric, Sample, ToolEnv, extract_boxed_answer, parse_tool_calls
from verifiers_rl.envs.loading import load_with_args
from verifiers_rl.envs.tools import default_tool_mode, tool_call_id, tool_result_text

from .scripted import ScriptedSampler
from .templates import (ALTERNATING_TEMPLATE, CALL_ID_TOOL_TEMPLATE, NINE_CHARACTER_ID_TEMPLATE,
                        OTHER_CALL_FORMAT_TEMPLATE)


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


def lookup(city: str) -> dict:
    """Look a city up.

    Args:
        city: The city's name.
    """
    return {"city": city, "found": True, "population": None, "tags": ("a", "b"), "since": datetime.date(1048, 1, 1)}


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


def test_tool_modes_template_text_and_auto(tokenizer, tool_tokenizer, caplog):
    """A template without tool support gets the tools described in the system prompt (auto, with a notice, or
    tool_mode="text"); tool_mode="template" refuses it; a template with tool support shows them itself."""
    with pytest.raises(ValueError, match=r"does not show the tools \['add'\] to the model; .*tool_mode='text' \(the "
                                         r"environment's tool_mode argument"):
        ToolEnv([{"question": "q"}], Rubric(), tokenizer, tools=[add], tool_mode="template")
    with caplog.at_level(logging.WARNING):
        auto = ToolEnv([{"question": "q"}], Rubric(), tokenizer, tools=[add], system_prompt="Use tools.")
    assert auto.tool_mode == "text" and "no tool support" in caplog.text and "tool_mode='text'" in caplog.text
    prompt = auto.render(auto.dataset[0].prompt, True)
    assert prompt.startswith("<|im_start|>system\nUse tools.\n\n# Tools\n") and '"name": "add"' in prompt
    assert '<tool_call>{"name": <function name>, "arguments": <JSON object>}</tool_call>' in prompt
    with default_tool_mode("text"):
        assert ToolEnv([{"question": "q"}], Rubric(), tool_tokenizer, tools=[add]).tool_mode == "text"
    shown = ToolEnv([{"question": "q"}], Rubric(), tool_tokenizer, tools=[add])
    assert shown.tool_mode == "template" and "# Tools\n<tools>" in shown.render(shown.dataset[0].prompt, True)

    def undocumented(x: int) -> int:
        return x

    with pytest.raises(ValueError, match="cannot describe a tool to the model: .*undocumented"):
        ToolEnv([{"question": "q"}], Rubric(), tool_tokenizer, tools=[undocumented])


def test_a_template_asking_for_another_call_format_gets_the_tools_as_text(tokenizer, caplog):
    """A template that shows the tools but asks for calls in its own format (Llama 3.1's bare JSON) would have the
    model write calls that are never read: no tool ever ran. auto describes the tools in the system prompt instead,
    with a notice; tool_mode="template" is refused by name."""
    other = copy.deepcopy(tokenizer)
    other.chat_template = OTHER_CALL_FORMAT_TEMPLATE
    with caplog.at_level(logging.WARNING):
        env = ToolEnv([{"question": "q"}], Rubric(), other, tools=[add])
    assert env.tool_mode == "text" and "asks for tool calls in a format of its own" in caplog.text
    assert "<tool_call>" in env.render(env.dataset[0].prompt, True)
    with pytest.raises(ValueError, match=r"asks for tool calls in a format of its own.*tool_mode='text' \(the "
                                         r"environment's tool_mode argument"):
        ToolEnv([{"question": "q"}], Rubric(), other, tools=[add], tool_mode="template")


def test_two_tools_of_one_name_are_refused_by_name(tool_tokenizer):
    """Calls are looked up by name: of two tools named alike the model would see both schemas and reach only the
    last one, whatever it meant to call."""
    def negate():
        def add(a: int) -> int:
            """Negate an integer.

            Args:
                a: The integer.
            """
            return -a

        return add

    with pytest.raises(ValueError, match=r"ToolEnv: two tools are named 'add'.*give each tool a distinct name"):
        ToolEnv([{"question": "q"}], Rubric(), tool_tokenizer, tools=[add, negate()])


@pytest.mark.parametrize("tools,refused", [
    (add, r"tools must be a list of functions, got function <function add .*\(for one tool: tools=\[f\]\)"),
    ("add", r"tools must be a list of functions, got str 'add'"),
    ([add, "fail"], r"each tool must be a function .*got str 'fail'"),
])
def test_tools_that_are_not_a_list_of_functions_are_refused_by_name(tool_tokenizer, tools, refused):
    # tools=add said "'function' object is not iterable"; tools=["add"] "'str' object has no attribute '__name__'".
    with pytest.raises(TypeError, match=rf"ToolEnv: {refused}"):
        ToolEnv([{"question": "q"}], Rubric(), tool_tokenizer, tools=tools)


def test_default_tool_mode_records_what_read_it(tokenizer):
    """--tool_mode is refused where nothing reads it: the block names the tool environments built inside it (a
    nested load's too), none for an environment without tools, none for a ToolEnv given its own mode."""
    from verifiers_rl.envs import load_environment
    from verifiers_rl.envs.mixture import load_mixture, parse_entries

    with default_tool_mode("text") as readers:
        load_environment("reverse_text", tokenizer=tokenizer, tool_mode="text")
    assert readers == []
    with default_tool_mode("text") as readers:
        ToolEnv([{"question": "q"}], Rubric(), tokenizer, tools=[add], tool_mode="text")
    assert readers == []
    with default_tool_mode("text") as readers:
        calculator = load_environment("calculator", tokenizer=tokenizer, tool_mode="text")
    assert calculator.tool_mode == "text" and len(readers) == 1
    entries = parse_entries('[{"env": "reverse_text"}, {"env": "calculator"}]', "--env")
    with default_tool_mode("text") as readers:
        load_mixture(entries, lambda entry: load_environment(entry.env, tokenizer=tokenizer, tool_mode="text"),
                     lambda env, entry: None, "--env")
    assert len(readers) == 1


def test_text_mode_tool_env_runs_tools_from_the_text(tokenizer):
    """The tiny tokenizer's template has no tool support: calls are still read from the sampled text, results come
    back as tool messages (environment tokens), and the trained ids are the sampled ids."""
    tok, eos = tokenizer, tokenizer.eos_token_id
    turns = ['<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>', "It is \\boxed{5}."]
    sampled = [tok.encode(t, add_special_tokens=False) + [eos] for t in turns]
    sampler = ScriptedSampler(sampled)
    env = ToolEnv([{"question": "2 + 3?"}], Rubric([boxed_five], parser=Parser(extract=extract_boxed_answer)), tok,
                  tools=[add], max_new_tokens=512, max_seq_len=4096)
    rollout = asyncio.run(env.rollout(sampler, env.dataset[0], 0))
    assert rollout.reward == 1.0 and [m["role"] for m in rollout.completion] == ["assistant", "tool", "assistant"]
    model_ids = [t for t, m in zip(rollout.completion_ids, rollout.completion_mask) if m == 1]
    assert model_ids == sampled[0] + sampled[1]
    assert "<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n" in tok.decode(sampler.calls[1][0])


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


def test_arguments_written_as_a_string_that_is_not_json_are_named_as_such():
    """A call whose arguments are a string that is not JSON was reported as "the tool call is not valid JSON", though
    the call was: the model read that its whole call was malformed."""
    (problem,) = parse_tool_calls('<tool_call>{"name": "add", "arguments": "a=1, b=2"}</tool_call>')
    assert problem.startswith("the tool call's arguments are a string that is not valid JSON (Expecting value): ")
    (problem,) = parse_tool_calls('<tool_call>{"name": "add", "arguments": {"a": 1}</tool_call>')
    assert problem.startswith("the tool call is not valid JSON (")


def test_the_eval_cli_shows_the_tools_as_its_tool_mode_flag_says(tiny_model_dir, tool_tokenizer, tmp_path, capsys):
    """A run trained with --tool_mode text evaluates as it trained only if `verifiers-rl eval` takes the flag too: the
    template would otherwise show the tools its own way, to prompts the model never trained on."""
    from verifiers_rl.cli.eval import main

    tool_tokenizer.save_pretrained(tmp_path / "tokenizer")  # a chat template with tool support
    base = ["--model", tiny_model_dir, "--tokenizer", str(tmp_path / "tokenizer"), "-n", "1"]

    def prompt(flags: list[str]) -> str:
        out = tmp_path / f"eval{len(flags)}.jsonl"
        assert main([*base, "--env", "calculator", "--env_args", '{"max_new_tokens": 4}', "--output", str(out),
                     *flags]) == 0
        return tool_tokenizer.decode(json.loads(out.read_text().splitlines()[0])["prompt_ids"])

    assert "You may call the functions below" in prompt(["--tool_mode", "text"])
    assert "# Tools\n<tools>" in prompt([]) and "You may call the functions below" not in prompt([])
    with pytest.raises(ValueError, match="--tool_mode text is not used by this evaluation: no environment it loads"):
        main([*base, "--env", "reverse_text", "--tool_mode", "text"])


def test_a_tool_result_reaches_the_model_as_json(tool_tokenizer):
    """A dict or list result reached the model as Python's str() ({'found': True, 'population': None}), which no
    model reads as tool output: it is JSON; a string stays as it is; what JSON cannot hold is written with str()."""
    env = ToolEnv([{"question": "q"}], Rubric(), tool_tokenizer, tools=[lookup, add])

    def result(name, **arguments):
        return asyncio.run(env.call_tool({"name": name, "arguments": arguments}))["content"]

    assert json.loads(result("lookup", city="Oslo")) == {"city": "Oslo", "found": True, "population": None,
                                                          "tags": ["a", "b"], "since": "1048-01-01"}
    assert result("lookup", city="Zürich").startswith('{"city": "Zürich", "found": true, "population": null')
    assert result("add", a=2, b=3) == "5"
    # A result that has no text is the model's error to read, not the rollout's crash.
    assert result("add", a=10**4300, b=0).startswith("Error: ValueError: Exceeds the limit (4300 digits)")
    assert [tool_result_text(v) for v in ("it's 'as is'", [1, None], {(1, 2): 3}, datetime.date(2026, 1, 2))] == [
        "it's 'as is'", "[1, null]", "{(1, 2): 3}", "2026-01-02"]


def test_tool_messages_carry_the_id_of_their_call(tool_tokenizer):
    """Tool messages had no tool_call_id: a template that needs one (Mistral's) failed every tool rollout, and none
    could show the model which result answers which call. The model's own id is kept; a call without one gets one."""
    tok = copy.deepcopy(tool_tokenizer)
    tok.chat_template = CALL_ID_TOOL_TEMPLATE
    turns = ['<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}, "id": "abc123xyz"}</tool_call>'
             '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 1}}</tool_call><tool_call>oops</tool_call>',
             '<tool_call>{"name": "add", "arguments": {"a": 0, "b": 5}}</tool_call>', "\\boxed{5}"]
    sampler = ScriptedSampler([tok.encode(t, add_special_tokens=False) + [tok.eos_token_id] for t in turns])
    env = ToolEnv([{"question": "2 + 3?"}], Rubric(), tok, tools=[add], max_new_tokens=512, max_seq_len=4096)
    rollout = asyncio.run(env.rollout(sampler, env.dataset[0], 0))
    tool_messages = [m for m in rollout.completion if m["role"] == "tool"]
    assert [(m["tool_call_id"], m["content"]) for m in tool_messages] == [
        ("abc123xyz", "5"), ("call01001", "2"), ("call01002", tool_messages[2]["content"]), ("call02000", "5")]
    assert all(len(m["tool_call_id"]) == 9 and m["tool_call_id"].isalnum() for m in tool_messages)  # as Mistral asks
    env_text = tok.decode([t for t, m in zip(rollout.completion_ids, rollout.completion_mask) if m == 0])
    assert "<tool_response id=abc123xyz>\n5\n</tool_response>" in env_text
    assert "<tool_response id=call02000>" in env_text


def test_generated_tool_call_ids_stay_9_letters_and_digits_past_turn_99_and_call_999():
    """call<turn:02d><index:03d> grew to 10 characters at model turn 100 or call 1000 of a turn (a ToolEnv of
    max_turns > 99), which Mistral's template refuses. Past those the id is T + base-36 turn + base-36 index."""
    ids = {(turn, index): tool_call_id("not valid", turn, index) for turn in (*range(0, 130), 1295, 1296, 36**4 - 1)
           for index in (*range(0, 40), *range(990, 1040), 36**4 - 1)}
    assert all(len(i) == 9 and i.isalnum() for i in ids.values())
    assert len(set(ids.values())) == len(ids)  # unique within a rollout
    assert (ids[1, 0], ids[99, 999], ids[100, 0], ids[1, 1000]) == ("call01000", "call99999", "T002s0000", "T000100rs")
    assert tool_call_id({"name": "add", "arguments": {}, "id": "own123456"}, 500, 0) == "own123456"
    with pytest.raises(ValueError, match="no 9-character tool_call_id is left"):
        tool_call_id("not valid", 36**4, 0)


def test_an_id_the_model_writes_in_another_form_does_not_fail_the_rollout(tool_tokenizer):
    """The model's own id was kept whatever it was: one of another length than 9 (sampled text) failed the rollout in
    Mistral's template, which refuses it, and the group was retried with the same seeds to the same failure. An id of
    9 letters and digits is kept; any other is replaced by the generated one."""
    tok = copy.deepcopy(tool_tokenizer)
    tok.chat_template = NINE_CHARACTER_ID_TEMPLATE
    turns = ['<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}, "id": "abc"}</tool_call>'
             '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 1}, "id": "abc123xyz"}</tool_call>'
             '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}, "id": "call_1-ab"}</tool_call>', "\\boxed{5}"]
    sampler = ScriptedSampler([tok.encode(t, add_special_tokens=False) + [tok.eos_token_id] for t in turns])
    env = ToolEnv([{"question": "2 + 3?"}], Rubric(), tok, tools=[add], max_new_tokens=512, max_seq_len=4096)
    rollout = asyncio.run(env.rollout(sampler, env.dataset[0], 0))
    assert [(m["tool_call_id"], m["content"]) for m in rollout.completion if m["role"] == "tool"] == [
        ("call01000", "5"), ("abc123xyz", "2"), ("call01002", "3")]


def test_tool_call_ids_are_unique_within_an_episode_whatever_ids_the_model_writes(tool_tokenizer):
    """A model's 9-character id was kept as written: one equal to a generated id (call02000, written in turn 1, is
    the id turn 2's first call gets) or one used twice (in a turn, or in two turns) made two tool messages answer the
    same id. Such an id is replaced as an id of another form is."""
    tok = copy.deepcopy(tool_tokenizer)
    tok.chat_template = CALL_ID_TOOL_TEMPLATE
    call = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": %d}%s}</tool_call>'
    turns = [call % (1, ', "id": "call02000"') + call % (2, ', "id": "abc123xyz"') + call % (3, ', "id": "abc123xyz"'),
             call % (4, "") + call % (5, ', "id": "abc123xyz"') + call % (6, ', "id": "TAB012345"'), "\\boxed{5}"]
    sampler = ScriptedSampler([tok.encode(t, add_special_tokens=False) + [tok.eos_token_id] for t in turns])
    env = ToolEnv([{"question": "2 + 3?"}], Rubric(), tok, tools=[add], max_new_tokens=512, max_seq_len=4096)
    rollout = asyncio.run(env.rollout(sampler, env.dataset[0], 0))
    assert [(m["tool_call_id"], m["content"]) for m in rollout.completion if m["role"] == "tool"] == [
        ("call01000", "2"), ("abc123xyz", "3"), ("call01002", "4"), ("call02000", "5"), ("call02001", "6"),
        ("TAB012345", "7")]


def test_tool_calls_are_read_where_the_tokenizer_counts_their_markers_as_special_tokens(tokenizer):
    """A reply was decoded with skip_special_tokens=True: with <tool_call> and </tool_call> special tokens (as some
    Hermes-style tokenizers have them) the markers vanished and no call ever ran. The eos still leaves the text."""
    tok = copy.deepcopy(tokenizer)
    tok.add_special_tokens({"additional_special_tokens": ["<tool_call>", "</tool_call>"]})
    turns = ['<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>', "\\boxed{5}"]
    sampled = [tok.encode(t, add_special_tokens=False) + [tok.eos_token_id] for t in turns]
    assert tok.convert_tokens_to_ids("<tool_call>") in sampled[0]  # one special token, as the model samples it
    env = ToolEnv([{"question": "2 + 3?"}], Rubric(), tok, tools=[add], tool_mode="text", max_new_tokens=512,
                  max_seq_len=4096)
    rollout = asyncio.run(env.rollout(ScriptedSampler(sampled), env.dataset[0], 0))
    assert [(m["role"], m["content"]) for m in rollout.completion] == [
        ("assistant", turns[0]), ("tool", "5"), ("assistant", "\\boxed{5}")]


def test_a_bad_tool_mode_in_env_args_is_named_as_the_environments_argument(tool_tokenizer):
    """A tool_mode given in --env_args was refused as if it came from --tool_mode, a flag the user never gave."""
    with pytest.raises(ValueError) as refused:
        load_with_args("calculator", tool_tokenizer, env_args={"tool_mode": "bogus"})
    message = str(refused.value)
    assert "calculator: unknown tool_mode 'bogus' given to the environment" in message and "--env_args" in message
    assert "--tool_mode" not in message


def test_a_template_mode_the_template_cannot_show_names_what_set_it(tokenizer):
    """tool_mode 'template' given in --env_args, with a template without tool support, was refused with "or
    tool_mode='text' (--tool_mode text)": a flag that does not override the environment's own argument, so the
    advice failed again. The error names --env_args there, and --tool_mode where the flag set the mode."""
    with pytest.raises(ValueError) as given:
        load_with_args("calculator", tokenizer, "text", env_args={"tool_mode": "template"})  # --tool_mode text
    assert "e.g. in --env_args; --tool_mode does not override it" in str(given.value)
    with pytest.raises(ValueError) as flag:
        load_with_args("calculator", tokenizer, "template", env_args={})
    assert "tool_mode='text' (--tool_mode text)" in str(flag.value) and "--env_args" not in str(flag.value)


def test_tool_calls_of_the_last_turn_max_turns_allows_mark_the_rollout_truncated(tool_tokenizer):
    """The calls of the last turn max_turns allows never run, and the rollout was not marked truncated: it was
    trained (and scored) as a finished episode, and --mask_truncated_completions left it in. It is truncated now; an
    episode that ends by answering on that turn is not."""
    tok, ran = tool_tokenizer, []

    def count(n: int) -> int:
        """Count a call.

        Args:
            n: Any number.
        """
        ran.append(n)
        return n

    call = '<tool_call>{"name": "count", "arguments": {"n": %d}}</tool_call>'
    env = ToolEnv([{"question": "go"}], Rubric(), tok, tools=[count], max_turns=2, max_new_tokens=512, max_seq_len=4096)

    def roll(*turns):
        sampler = ScriptedSampler([tok.encode(t, add_special_tokens=False) + [tok.eos_token_id] for t in turns])
        return asyncio.run(env.rollout(sampler, env.dataset[0], 0))

    cut = roll(call % 1, call % 2)
    assert cut.truncated and ran == [1]  # the second turn's call never ran
    assert [m["role"] for m in cut.completion] == ["assistant", "tool", "assistant"]
    answered = roll(call % 3, "\\boxed{3}")
    assert not answered.truncated and ran == [1, 3]


def test_a_slow_plain_tool_does_not_hold_up_the_other_rollouts(tool_tokenizer):
    """A plain (def) tool ran on the event loop: one slow call (a blocking request) stopped every rollout in flight
    until it returned. It runs in a worker thread: while it waits, another rollout's turns go on."""
    tok, events, other_went_on = tool_tokenizer, [], threading.Event()

    def wait_for_other(seconds: int) -> str:
        """Wait until another rollout has gone on, or ``seconds`` have passed.

        Args:
            seconds: The longest wait.
        """
        other_went_on.wait(seconds)  # set by the other rollout's second model turn, if it runs meanwhile
        events.append("slow tool returned")
        return "done"

    replies = {"slow": ['<tool_call>{"name": "wait_for_other", "arguments": {"seconds": 5}}</tool_call>', "ok"],
               "fast": ['<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>', "ok"]}

    class TwoTasks:  # the model: each task's replies in turn; the fast task's second turn is the progress observed
        async def sample(self, prompt_ids, max_new_tokens):
            task = "slow" if "slow task" in tok.decode(prompt_ids) else "fast"
            if task == "fast" and len(replies["fast"]) == 1:
                events.append("other rollout's second turn")
                other_went_on.set()
            ids = tok.encode(replies[task].pop(0), add_special_tokens=False) + [tok.eos_token_id]
            return Sample(ids, [-1.0] * len(ids), "stop")

    env = ToolEnv([{"question": "slow task"}, {"question": "fast task"}], Rubric(), tok, tools=[wait_for_other, add],
                  max_new_tokens=512, max_seq_len=4096)

    async def both():
        return await asyncio.gather(*(env.rollout(TwoTasks(), row, i) for i, row in enumerate(env.dataset)))

    rollouts = asyncio.run(both())
    assert events == ["other rollout's second turn", "slow tool returned"]
    assert [m["content"] for r in rollouts for m in r.completion if m["role"] == "tool"] == ["done", "3"]


def test_tool_results_reach_a_template_without_a_tool_role_as_user_turns(tokenizer, caplog):
    """Gemma's template refuses a "tool" message (roles must alternate): every rollout that called a tool failed with
    the template's error. Its results go in one user turn of <tool_response> blocks, said once; the completion keeps
    the tool messages (for the rubric) and the trained ids are the sampled ids."""
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = ALTERNATING_TEMPLATE
    turns = ['<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
             '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 1}}</tool_call>', "It is \\boxed{5}."]
    sampled = [tok.encode(t, add_special_tokens=False) + [tok.eos_token_id] for t in turns]
    sampler = ScriptedSampler(list(sampled))
    with caplog.at_level(logging.WARNING):
        env = ToolEnv([{"question": "2 + 3?"}], Rubric([boxed_five], parser=Parser(extract=extract_boxed_answer)),
                      tok, tools=[add], max_new_tokens=512, max_seq_len=4096)
    rollout = asyncio.run(env.rollout(sampler, env.dataset[0], 0))
    assert "does not show tool messages, so tool results are sent as user messages" in caplog.text
    assert [m["role"] for m in rollout.completion] == ["assistant", "tool", "tool", "assistant"]
    assert rollout.reward == 1.0
    assert [t for t, m in zip(rollout.completion_ids, rollout.completion_mask) if m] == sampled[0] + sampled[1]
    assert tok.decode(sampler.calls[1][0]).endswith(
        "<start_of_turn>user\n<tool_response>\n5\n</tool_response>\n<tool_response>\n2\n</tool_response>"
        "<end_of_turn>\n<start_of_turn>model\n")
