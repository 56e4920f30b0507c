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
from hypothesis import given, settings
from hypothesis import strategies as st

from client import (TOOL_CALL_SYNTAXES, Chat, ToolCallStream, parse_hermes_tool_calls,
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


# --- streaming: ToolCallStream -----------------------------------------------------------------

_NAMES = {parse_hermes_tool_calls: "hermes", parse_llama3_json_tool_calls: "llama3_json",
          parse_mistral_tool_calls: "mistral", parse_pythonic_tool_calls: "pythonic"}
HERMES = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
          '</tool_call>')
STREAMED = ([(_NAMES[parse], reply) for parse, reply, _, _ in VALID]
            + [("hermes", HERMES), ("hermes", "No calls, but <tool and <tool_call"),
               ("hermes", "<tool_call>{\"name\": \"now\"}</tool_call>"),
               ("mistral", "Sure [TOOL_CALL"), ("llama3_json", "  Oslo: rain"),
               ("llama3_json", "{not a call}"), ("llama3_json", "<|python"),
               ("pythonic", "[1] is a footnote"), ("pythonic", " "), ("hermes", "")])


def _stream(syntax: str, reply: str, cuts: list[int]):
    stream, shown = ToolCallStream(syntax), []
    for a, b in zip([0, *cuts], [*cuts, len(reply)]):
        shown.append(stream.feed(reply[a:b]))
    return shown, stream.finish()


@pytest.mark.parametrize("syntax, reply", STREAMED)
@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_a_streamed_reply_shows_its_content_and_none_of_its_calls(syntax, reply, data):
    """However the chunks cut the reply: what was shown, then the rest, is the text before
    the calls' markup, all shown while streaming, when the calls parse; else the whole reply,
    held back only from where it may have begun calls. The calls are the whole reply's."""
    cuts = sorted(data.draw(st.sets(st.integers(1, max(len(reply) - 1, 1)), max_size=8)))
    shown, end = _stream(syntax, reply, [c for c in cuts if c < len(reply)])
    want = parse_tool_calls(reply, syntax)  # the same but for the calls' fresh ids
    assert end.reply.content == want.content
    assert [(c.name, c.arguments) for c in end.reply.tool_calls] == \
        [(c.name, c.arguments) for c in want.tool_calls]
    if end.reply.tool_calls:
        marker = {"hermes": "<tool_call>", "mistral": "[TOOL_CALLS]"}.get(syntax)
        assert "".join(shown) == (reply[:reply.index(marker)] if marker else "")
        assert end.rest == ""
    else:
        assert "".join(shown) + end.rest == reply


def test_a_streamed_marker_is_held_back_from_its_first_characters():
    stream = ToolCallStream("hermes")
    assert stream.feed("Let me look. <to") == "Let me look. "
    assert stream.feed("ol_call>{\"name\": \"now\"") == ""
    assert stream.feed("}</tool_call>") == ""
    end = stream.finish()
    assert end.rest == "" and [c.name for c in end.reply.tool_calls] == ["now"]
    stream = ToolCallStream("hermes")
    assert stream.feed("a <to") == "a "
    assert stream.feed("day") == "<today"  # not the marker after all
    stream = ToolCallStream("pythonic")
    assert stream.feed("  ") == "" and stream.feed("It") == "  It" and stream.feed("!") == "!"
    with pytest.raises(ValueError, match="one of hermes, llama3_json, mistral, pythonic"):
        ToolCallStream("json")
    with pytest.raises(TypeError, match="delta must be a str"):
        ToolCallStream().feed(None)
