"""The SDK's parsers of the call syntaxes other than Hermes' (client/tool_parsers.py): Llama
3.1's JSON, Mistral's [TOOL_CALLS] (both tokenizer generations), Llama 3.2's and 4's pythonic
lists. Calls in order with fresh ids, the content before them; a reply whose calls do not all
parse is all content; a Mistral reply goes back as the next turn through a template that
takes only Mistral's ids, as HF renders the same turn."""
from __future__ import annotations

import json
import re

import grpc
import pytest

from client import (TOOL_CALL_SYNTAXES, Chat, parse_hermes_tool_calls,
                    parse_llama3_json_tool_calls, parse_mistral_tool_calls,
                    parse_pythonic_tool_calls, parse_tool_calls)
from client.types import tokenize_request
from engine.tokenizer import load_tokenizer
from router.errors import status_of
from router.prompts import ServedModel
from tests.chat_models import model_with_template
from tests.test_chat_tools import answered_turn
from tests.hf_oracle import hf_tokenizer

WEATHER = ("get_weather", {"city": "Oslo", "days": 2})
NOW = ("now", {})

VALID = [
    (parse_llama3_json_tool_calls,
     '{"name": "get_weather", "parameters": {"city": "Oslo", "days": 2}}', None, [WEATHER]),
    (parse_llama3_json_tool_calls,
     '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo", "days": 2}}; '
     '{"name": "now", "parameters": {}}', None, [WEATHER, NOW]),
    (parse_llama3_json_tool_calls,  # "arguments" too, as text, and no arguments at all
     ' {"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\", \\"days\\": 2}"};'
     '{"name": "now"}\n', None, [WEATHER, NOW]),
    (parse_mistral_tool_calls,
     'Let me look.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo", '
     '"days": 2}}, {"name": "now", "arguments": {}}]', "Let me look.", [WEATHER, NOW]),
    (parse_mistral_tool_calls,
     '[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo", "days": 2}[TOOL_CALLS]now[ARGS]{}',
     None, [WEATHER, NOW]),
    (parse_mistral_tool_calls, 'Sure. [TOOL_CALLS]get_weather{"city": "Oslo", "days": 2}',
     "Sure.", [WEATHER]),
    (parse_pythonic_tool_calls, '[get_weather(city="Oslo", days=2), now()]', None,
     [WEATHER, NOW]),
    (parse_pythonic_tool_calls,
     '<|python_start|>[get_weather(city=\'Oslo\', days=2)]<|python_end|>', None, [WEATHER]),
    (parse_pythonic_tool_calls, '[search(q="a", tags=("x", "y"), deep=None, n=-1.5)]', None,
     [("search", {"q": "a", "tags": ["x", "y"], "deep": None, "n": -1.5})]),
]


@pytest.mark.parametrize("parse, reply, content, calls", VALID)
def test_calls_parse_out_of_a_reply_in_order(parse, reply, content, calls):
    parsed = parse(reply)
    assert parsed.content == content
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == calls
    ids = [c.id for c in parsed.tool_calls]
    assert len(set(ids)) == len(ids)
    if parse is parse_mistral_tool_calls:  # the only ids Mistral's templates take back
        assert all(re.fullmatch(r"[A-Za-z0-9]{9}", i) for i in ids)
    else:
        assert all(re.fullmatch(r"call_[0-9a-f]{24}", i) for i in ids)
    assert parsed.as_message()["tool_calls"] == [c.as_dict() for c in parsed.tool_calls]


@pytest.mark.parametrize("parse, reply", [
    (parse_llama3_json_tool_calls, "Oslo has rain."),
    (parse_llama3_json_tool_calls, '{"name": "now", "parameters": {}'),  # cut by max_tokens
    (parse_llama3_json_tool_calls, '{"name": "now"} and then'),
    (parse_llama3_json_tool_calls, '{"name": "now"}; {"nam'),
    (parse_llama3_json_tool_calls, '{"parameters": {}}'),  # no name
    (parse_llama3_json_tool_calls, '{"name": "f", "parameters": [1]}'),
    (parse_llama3_json_tool_calls, '{"name": "f", "parameters": {"x": NaN}}'),  # no JSON
    (parse_mistral_tool_calls, "No calls."),
    (parse_mistral_tool_calls, '[TOOL_CALLS][{"name": "now", "arguments": {}'),
    (parse_mistral_tool_calls, "[TOOL_CALLS][]"),
    (parse_mistral_tool_calls, '[TOOL_CALLS]{"name": "now"}'),
    (parse_mistral_tool_calls, '[TOOL_CALLS]now[ARGS]{}[TOOL_CALLS]bad name[ARGS]{}'),
    (parse_mistral_tool_calls, "[TOOL_CALLS]now[ARGS]{"),
    (parse_pythonic_tool_calls, "[1, 2]"),
    (parse_pythonic_tool_calls, "[]"),
    (parse_pythonic_tool_calls, '[get_weather("Oslo")]'),  # a positional argument
    (parse_pythonic_tool_calls, "[f(**kw)]"),
    (parse_pythonic_tool_calls, "[f(x=y)]"),  # no literal
    (parse_pythonic_tool_calls, "[f(x={1, 2})]"),  # no JSON value
    (parse_pythonic_tool_calls, "[f()(x=1)]"),
    (parse_pythonic_tool_calls, "[f(x=1)"),
    (parse_pythonic_tool_calls, "[" * 300 + "]" * 300),  # too deep for the parser
])
def test_a_reply_whose_calls_do_not_all_parse_is_all_content(parse, reply):
    parsed = parse(reply)
    assert parsed.content == reply and parsed.tool_calls == []
    assert parsed.as_message() == {"role": "assistant", "content": reply}


def test_parse_tool_calls_takes_vllms_parser_names():
    assert sorted(TOOL_CALL_SYNTAXES) == ["hermes", "llama3_json", "mistral", "pythonic"]
    assert TOOL_CALL_SYNTAXES["hermes"] is parse_hermes_tool_calls
    reply = "[now()]"
    assert [c.name for c in parse_tool_calls(reply, "pythonic").tool_calls] == ["now"]
    assert parse_tool_calls(reply, "hermes").tool_calls == []
    with pytest.raises(ValueError, match="one of hermes, llama3_json, mistral, pythonic"):
        parse_tool_calls(reply, "llama3")
    with pytest.raises(TypeError, match="text must be a str"):
        parse_tool_calls(b"[now()]", "pythonic")


# Mistral's way with calls, cut down: its templates refuse any id but 9 letters and digits.
MISTRAL_LIKE = (
    "{{- bos_token -}}{%- for m in messages -%}"
    "{%- if m.role == 'user' -%}{{- '[INST]' + m.content + '[/INST]' -}}"
    "{%- elif m.role == 'assistant' and m.tool_calls -%}{{- '[TOOL_CALLS][' -}}"
    "{%- for c in m.tool_calls -%}"
    "{%- if c.id is not string or c.id | length != 9 -%}"
    "{{- raise_exception('Tool call IDs should be alphanumeric strings with length 9!') -}}"
    "{%- endif -%}"
    "{{- {'name': c.function.name, 'arguments': c.function.arguments, 'id': c.id} | tojson -}}"
    "{%- if not loop.last -%}{{- ', ' -}}{%- endif -%}{%- endfor -%}{{- ']' + eos_token -}}"
    "{%- elif m.role == 'tool' -%}"
    "{{- '[TOOL_RESULTS]' + {'content': m.content, 'call_id': m.tool_call_id} | tojson -}}"
    "{{- '[/TOOL_RESULTS]' -}}"
    "{%- else -%}{{- m.content + eos_token -}}{%- endif -%}{%- endfor -%}")


def test_a_mistral_reply_goes_back_as_the_next_turn(preset_path, tmp_path):
    """The parsed calls and their answers render through the router as HF renders the same
    turn with the arguments as objects; an OpenAI id in their place is refused by the
    template, which is why the parser makes Mistral's."""
    folder = model_with_template(preset_path("tiny-llama"), tmp_path / "m", MISTRAL_LIKE)
    parsed = parse_mistral_tool_calls(
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo", "days": 2}[TOOL_CALLS]now[ARGS]{}')
    ids = [c.id for c in parsed.tool_calls]
    turn, as_hf = answered_turn({"role": "user", "content": "Weather in Oslo?"}, parsed)
    tok = load_tokenizer(folder)
    served = ServedModel("m", tok, tok.vocab_size)
    want = hf_tokenizer(folder).apply_chat_template(as_hf, tokenize=True, return_dict=False)
    assert served.prompt_ids(tokenize_request(Chat(turn, add_generation_prompt=False))) == want
    assert f'"id": "{ids[0]}"' in tok.decode(want)
    turn[1]["tool_calls"][0]["id"] = "call_" + "0" * 24
    with pytest.raises(Exception) as err:
        served.prompt_ids(tokenize_request(Chat(turn, add_generation_prompt=False)))
    code, message = status_of(err.value)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "length 9" in message, message
