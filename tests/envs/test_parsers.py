"""Parsers on edge cases: last occurrence wins, missing or unclosed parts give None, nested braces."""

import pytest

from verifiers_rl.envs import Parser, ThinkParser, XMLParser, extract_boxed_answer


@pytest.mark.parametrize(
    "text, expected",
    [
        ("so \\boxed{42}.", "42"),
        ("\\boxed{1} then \\boxed{2}", "2"),
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("\\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),
        ("\\boxed{}", ""),
        ("no box", None),
        ("\\boxed{\\frac{1}{2}", None),
    ],
)
def test_extract_boxed_answer(text, expected):
    assert extract_boxed_answer(text) == expected


def test_xml_parser_takes_the_last_occurrence_and_reports_missing_fields():
    parser = XMLParser(fields=["think", "answer"])
    text = "<think>\nfirst\n</think><answer>1</answer> wait <answer>\n 2 \n</answer>"
    assert parser.parse_fields(text) == {"think": "first", "answer": "2"}
    assert parser.parse("<think>no answer</think>") is None
    assert parser.parse("<answer>unclosed") is None
    assert (
        parser.parse_answer([{"role": "assistant", "content": "<answer>a</answer>"}, {"role": "user", "content": "x"}])
        == "a"
    )


def test_xml_format_reward_is_the_fraction_of_fields_present_per_assistant_turn():
    parser = XMLParser(fields=["think", "answer"])
    completion = [
        {"role": "assistant", "content": "<think>t</think><answer>a</answer>"},
        {"role": "user", "content": "<think>ignored</think>"},
        {"role": "assistant", "content": "<answer>a</answer>"},
    ]
    assert parser.format_reward(completion) == (1.0 + 0.5) / 2
    assert parser.format_reward([]) == 0.0


def test_xml_parser_rejects_an_answer_field_outside_its_fields():
    with pytest.raises(ValueError, match="answer_field 'answer' must be one of"):
        XMLParser(fields=["think"])


def test_think_parser_reads_after_the_last_think_close():
    assert ThinkParser().parse("<think>a</think>b</think>  final ") == "final"
    assert ThinkParser().parse("<think>still thinking") is None
    assert ThinkParser(extract=extract_boxed_answer).parse("<think>\\boxed{1}</think>so \\boxed{2}") == "2"


def test_plain_parser_uses_the_last_assistant_message():
    completion = [
        {"role": "assistant", "content": " a "},
        {"role": "tool", "content": "t"},
        {"role": "assistant", "content": " b "},
    ]
    assert Parser().parse_answer(completion) == "b"
    assert Parser().parse_answer([]) == ""
