"""tool_choice and response_format by guided decoding (client/tool_choice.py,
client/response_format.py): the schemas for "required" and a named function, the engine's
replies under them read back as calls whose arguments are valid, the response formats'
schemas, and what is refused."""
from __future__ import annotations

import json

import pytest

from client import ParsedReply
from client.tool_choice import forced_tool_calls, tool_choice_schema
from engine import SamplingParams
from tests.serving_helpers import random_prompts

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city.",
        "parameters": {"type": "object", "required": ["city"], "properties": {
            "city": {"type": "string", "maxLength": 10},
            "unit": {"enum": ["celsius", "fahrenheit"]}}}}},
    {"type": "function", "function": {
        "name": "add", "parameters": {"type": "object", "required": ["a", "b"], "properties": {
            "a": {"type": "integer", "minimum": 0, "maximum": 99},
            "b": {"type": "integer", "minimum": 0, "maximum": 99}}}}},
]
NAMED = {"type": "function", "function": {"name": "add"}}
PROMPTS = random_prompts(3, seed=9)


def _valid_arguments(name: str, args: dict) -> bool:
    if name == "add":
        return set(args) == {"a", "b"} and all(type(v) is int and 0 <= v <= 99
                                               for v in args.values())
    return ({"city"} <= set(args) <= {"city", "unit"} and isinstance(args["city"], str)
            and len(args["city"]) <= 10 and args.get("unit", "celsius") in ("celsius",
                                                                             "fahrenheit"))


def test_the_schemas_force_a_call_or_the_named_ones_arguments():
    assert tool_choice_schema(TOOLS, "auto") is None and tool_choice_schema(TOOLS, "none") is None
    assert tool_choice_schema(TOOLS, NAMED) == TOOLS[1]["function"]["parameters"]
    required = tool_choice_schema(TOOLS, "required")
    assert required["type"] == "array" and required["minItems"] == 1
    assert [c["properties"]["name"] for c in required["items"]["anyOf"]] == [
        {"const": "get_weather"}, {"const": "add"}]
    # A tool without parameters takes any object.
    bare = [{"type": "function", "function": {"name": "now"}}]
    assert tool_choice_schema(bare, "required")["items"]["properties"]["parameters"] == {
        "type": "object"}


@pytest.mark.parametrize("tools, choice, match", [
    (TOOLS, {"type": "function", "function": {"name": "nope"}}, "not among the tools"),
    (TOOLS, "always", "tool_choice must be"),
    (TOOLS, {"function": {}}, "tool_choice must be"),
    ([], "required", "needs at least one tool"),
    ([{"type": "function", "function": {}}], "required", "not a function tool with a name"),
    (["get_weather"], "required", "not a function tool with a name"),
    ([{"type": "function", "function": {"name": "f", "parameters": []}}], "required",
     "not a JSON schema object"),
])
def test_choices_and_tools_that_cannot_be_forced_are_refused(tools, choice, match):
    with pytest.raises(ValueError, match=match):
        tool_choice_schema(tools, choice)


def test_replies_are_read_back_as_calls_and_others_as_content():
    reply = forced_tool_calls('[{"name": "add", "parameters": {"a": 1, "b": 2}}]', TOOLS,
                              "required")
    assert reply.content is None and [(c.name, json.loads(c.arguments))
                                      for c in reply.tool_calls] == [("add", {"a": 1, "b": 2})]
    named = forced_tool_calls('{"a": 3, "b": 4}', TOOLS, NAMED)
    assert [(c.name, json.loads(c.arguments)) for c in named.tool_calls] == [
        ("add", {"a": 3, "b": 4})]
    assert named.tool_calls[0].id.startswith("call_")
    for text, choice in [('[{"name": "add", "parameters": {"a": 1', "required"),  # cut short
                         ("[]", "required"), ('[{"name": "rm", "parameters": {}}]', "required"),
                         ('{"a": 3', NAMED), ("hello", "auto")]:
        assert forced_tool_calls(text, TOOLS, choice) == ParsedReply(text)


@pytest.mark.parametrize("choice", ["required", NAMED])
def test_guided_replies_are_calls_with_valid_arguments(reference, choice):
    schema = tool_choice_schema(TOOLS, choice)
    params = [SamplingParams(max_tokens=200, temperature=1.0, seed=i, guided_json=schema)
              for i in range(6)]
    outs = reference.generate([PROMPTS[i % 3] for i in range(6)], params)
    names = []
    for out in outs:
        reply = forced_tool_calls(out.text, TOOLS, choice)
        if out.finish_reason == "length":  # "required" lists any number of calls
            assert reply == ParsedReply(out.text)
            continue
        assert reply.content is None and reply.tool_calls, out.text
        for call in reply.tool_calls:
            assert _valid_arguments(call.name, json.loads(call.arguments)), out.text
            names.append(call.name)
    assert len(names) >= 4
    assert set(names) == ({"add"} if choice == NAMED else {"add", "get_weather"})


def test_response_formats_are_schemas_the_replies_parse_under(reference):
    from client.response_format import response_format_schema

    assert response_format_schema(None) is None
    assert response_format_schema({"type": "text"}) is None
    person = {"type": "object", "required": ["age"],
              "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 120}}}
    assert response_format_schema({"type": "json_schema",
                                   "json_schema": {"name": "p", "schema": person}}) == person
    for bad in ({"type": "json_schema"}, {"type": "xml"}, "json", {"type": "json_schema",
                                                                    "json_schema": {"schema": 1}}):
        with pytest.raises(ValueError, match="response_format must be"):
            response_format_schema(bad)
    # JSON mode: any object. A random model's open strings rarely close: a bounded schema is
    # what generates here; JSON mode's schema is checked to guide.
    from engine.guides import check_guide

    assert response_format_schema({"type": "json_object"}) == {"type": "object"}
    check_guide(SamplingParams(guided_json=response_format_schema({"type": "json_object"})))
    outs = reference.generate(PROMPTS, [SamplingParams(max_tokens=40, temperature=1.0, seed=i,
                                                       guided_json=person) for i in range(3)])
    assert all(0 <= json.loads(o.text)["age"] <= 120 for o in outs)
