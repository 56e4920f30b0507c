"""Tool use in chats (engine/chat_tools.py): a request's tools, an assistant's tool calls and
a tool's answer render as Hugging Face's apply_chat_template renders them (the calls'
arguments given as JSON text too, OpenAI's form, parsed as vLLM does); bad ones are refused
in LLM.chat's path, the SDK's request building and the router's reading. Through a real
router: tests/test_chat_serving.py."""
from __future__ import annotations

import copy
import json
import re

import grpc
import pytest

from client import Chat
from client.types import build_request, tokenize_request
from engine.chat_options import ChatOptions
from engine.chat_template import chat_prompt_ids
from engine.chat_tools import MAX_TOOL_CALLS
from engine.tokenizer import load_tokenizer
from router.errors import status_of
from router.prompts import INLINE_PROMPT_CHARS, ServedModel, _large_prompt
from tests.chat_models import model_with_template
from tests.chat_option_templates import TOOLS_TEMPLATE
from tests.hf_oracle import hf_tokenizer

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer", "minimum": 1}},
        "required": ["city"]}}},
    {"type": "function", "function": {"name": "now"}}]
# The arguments as the templates read them: an object.
CALLED = [{"role": "user", "content": "Weather in Oslo?"},
          {"role": "assistant", "content": "", "tool_calls": [
              {"id": "c1", "type": "function",
               "function": {"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}},
              {"id": "c2", "type": "function", "function": {"name": "now", "arguments": {}}}]},
          {"role": "tool", "content": "rain, 4 C", "tool_call_id": "c1"},
          {"role": "tool", "content": "10:00", "tool_call_id": "c2"}]


def _as_openai_sends_it(chat: list[dict]) -> list[dict]:
    """``chat`` with OpenAI's wire form: arguments as JSON text, no content beside calls."""
    out = copy.deepcopy(chat)
    for m in out:
        for call in m.get("tool_calls", []):
            call["function"]["arguments"] = json.dumps(call["function"]["arguments"])
        if m.get("tool_calls"):
            m["content"] = None
    return out


def answered_turn(user: dict, parsed) -> tuple[list[dict], list[dict]]:
    """``user``'s message, ``parsed``'s reply (two calls) and each call's answer: as the SDK
    sends them, and as HF's templates read them (the arguments as objects)."""
    ids = [c.id for c in parsed.tool_calls]
    turn = [user, parsed.as_message(),
            {"role": "tool", "content": "rain", "tool_call_id": ids[0]},
            {"role": "tool", "content": "10:00", "tool_call_id": ids[1]}]
    as_hf = copy.deepcopy(turn)
    for call in as_hf[1]["tool_calls"]:
        call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    return turn, as_hf


@pytest.fixture(scope="module")
def folder(preset_path, tmp_path_factory):
    return model_with_template(preset_path("tiny-llama"),
                               tmp_path_factory.mktemp("tools") / "m", TOOLS_TEMPLATE)


def _hf(folder, chat, **kw):
    return hf_tokenizer(folder).apply_chat_template(chat, tokenize=True, return_dict=False,
                                                    add_generation_prompt=True, **kw)


def test_tools_and_tool_calls_render_as_hugging_faces(folder):
    tok = load_tokenizer(folder)
    want = _hf(folder, CALLED, tools=TOOLS)
    text = tok.decode(want)
    assert '"get_weather"' in text and "city=Oslo days=2" in text and "[tool c1] rain" in text
    for chat in (CALLED, _as_openai_sends_it(CALLED)):
        assert chat_prompt_ids(tok, chat, options=ChatOptions(tools=TOOLS)) == want
    # No tools, or none offered ([]): the template's {% if tools %} renders none either way.
    assert chat_prompt_ids(tok, CALLED, options=ChatOptions(tools=[])) == _hf(folder, CALLED)


def test_llm_chat_prompt_takes_tools(reference, folder):
    ids = reference.chat_prompt(_as_openai_sends_it(CALLED), chat_template=TOOLS_TEMPLATE,
                                tools=TOOLS)
    assert ids == _hf(folder, CALLED, tools=TOOLS)


def test_sdk_sends_tools_and_calls_and_the_router_renders_them_as_hugging_faces(folder):
    tok = load_tokenizer(folder)
    served = ServedModel("m", tok, tok.vocab_size)
    for messages in (CALLED, _as_openai_sends_it(CALLED)):
        chat = Chat(messages, tools=TOOLS)
        req = build_request(chat, None, {})
        assert len(req.chat.tools) == 2 and len(req.chat.messages[1].tool_calls) == 2
        assert req.chat.messages[2].tool_call_id == "c1"
        assert not req.chat.messages[0].HasField("tool_call_id")
        assert served.prompt_ids(tokenize_request(chat)) == _hf(folder, CALLED, tools=TOOLS)


def _call(arguments, **function) -> dict:
    return {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function",
         "function": {"name": "f", "arguments": arguments, **function}}]}


USER = {"role": "user", "content": "hi"}
REFUSED = [
    (dict(tools=[{"type": "function", "function": {"description": "no name"}}]),
     [USER], "tools[0]'s function must have a non-empty string 'name'"),
    (dict(tools=[{"type": "retrieval", "function": {"name": "f"}}]), [USER],
     "tools[0]'s type must be 'function'"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": "x"}}]),
     [USER], "tools[0]'s parameters must be an object"),
    ({}, [USER, _call("{not json")], "chat message 1: tool_calls[0]'s arguments is not JSON"),
    ({}, [USER, _call("[1, 2]")], "arguments must be a JSON object (or its text), got list"),
    ({}, [USER, _call('{"x": NaN}')], "is nan: JSON has no such number"),
    ({}, [USER, {"role": "tool", "content": "x", "tool_call_id": ""}],
     "tool_call_id must be a non-empty string"),
    ({}, [USER, {"role": "assistant", "content": "", "tool_calls": [_call("{}")["tool_calls"][0]]
                 * (MAX_TOOL_CALLS + 1)}], f"tool_calls; at most {MAX_TOOL_CALLS}"),
]


@pytest.mark.parametrize("options, chat, match", REFUSED)
def test_bad_tools_and_calls_are_refused_in_llm_chat_and_by_the_router(folder, options, chat,
                                                                       match):
    tok = load_tokenizer(folder)
    with pytest.raises(ValueError, match=re.escape(match)):
        chat_prompt_ids(tok, chat, options=ChatOptions(**options))
    with pytest.raises(Exception) as err:
        ServedModel("m", tok, tok.vocab_size).prompt_ids(build_request(
            Chat(chat, **options), None, {}))
    code, message = status_of(err.value)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and match in message, message


@pytest.mark.parametrize("chat, match", [
    (Chat([USER], tools={"type": "function"}), "Chat.tools must be a list"),
    (Chat([USER], tools=["get_weather"]), "tools[0] must be a dict"),
    (Chat([{"role": "assistant", "content": None}]), "content must be a str (None beside "
                                                      "tool_calls)"),
    (Chat([{"role": "assistant", "content": "", "tool_calls": {"id": "c1"}}]),
     "tool_calls must be a list"),
    (Chat([{"role": "tool", "content": "x", "tool_call_id": 3}]), "tool_call_id must be a str"),
    (Chat([{"role": "user", "content": "x", "images": []}]), "may have only the keys"),
])
def test_the_sdk_refuses_what_it_cannot_send(chat, match):
    with pytest.raises(TypeError, match=re.escape(match)):
        build_request(chat, None, {})


def test_large_tools_are_read_off_the_event_loop():
    """Tools and calls are converted and checked like template kwargs (~0.1 s a MB): a chat
    whose tools or calls alone are large is read in a thread, as a long conversation is."""
    schema = {"type": "object", "properties": {f"p{i}": {"type": "string"}
                                               for i in range(INLINE_PROMPT_CHARS // 16)}}
    big = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
    assert _large_prompt(build_request(Chat([USER], tools=big), None, {}))
    call = _call({"x": "y" * INLINE_PROMPT_CHARS})
    assert _large_prompt(build_request(Chat([USER, call]), None, {}))
    assert not _large_prompt(build_request(Chat(CALLED, tools=TOOLS), None, {}))


@pytest.mark.parametrize("tools, calls, match", [
    (["{bad"], [], "tools[0] is not JSON"),
    (["[" * 100_000 + "]" * 100_000], [], "tools[0] nests deeper than"),
    (['{"type": "function", "function": {"name": "f", "parameters": '
      + '{"a": ' * 40 + "1" + "}" * 40 + "}}"], [], "tools nest deeper than 32 levels"),
    (['{"type": "function", "function": {"name": "f"}}'] * 513, [], "513 tools; at most 512"),
    ([], ['{"function": {"name": "f", "arguments": "{}"}, "id": 7}'],
     "chat message 1: tool_calls[0]'s id must be a string"),
    ([], ['"just text"'], "chat message 1: tool_calls[0] must be an object"),
])
def test_the_router_refuses_tools_and_calls_a_client_wrote_wrong(folder, tools, calls, match):
    """What another client than the SDK may send: JSON texts that are no JSON, nest too deep
    for the parser or past the bound, or are no tool."""
    from protos import router_pb2

    tok = load_tokenizer(folder)
    chat = router_pb2.ChatPrompt(tools=tools, messages=[
        router_pb2.ChatMessage(role="user", content="hi"),
        router_pb2.ChatMessage(role="assistant", tool_calls=calls)])
    with pytest.raises(Exception) as err:
        ServedModel("m", tok, tok.vocab_size).prompt_ids(router_pb2.TokenizeRequest(chat=chat))
    code, message = status_of(err.value)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and match in message, message


def test_hermes_tool_calls_parse_out_of_a_reply_and_go_back_as_the_next_turn(folder):
    """The SDK's parser of Hermes' call syntax (Qwen2.5's, Qwen3's): calls in order, each
    with its own id, the text before them as content; the parsed reply and the tools'
    answers render as HF renders the same turn with the arguments as objects."""
    from client import parse_hermes_tool_calls

    reply = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo",'
             ' "days": 2}}\n</tool_call>\n<tool_call>\n{"name": "now", "arguments": "{}"}\n'
             '</tool_call>')
    parsed = parse_hermes_tool_calls(reply)
    assert parsed.content == "Let me look."
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == \
        [("get_weather", {"city": "Oslo", "days": 2}), ("now", {})]
    ids = [c.id for c in parsed.tool_calls]
    assert len(set(ids)) == 2 and all(i.startswith("call_") for i in ids)
    turn, as_hf = answered_turn(USER, parsed)
    tok = load_tokenizer(folder)
    chat = Chat(turn, tools=TOOLS)
    assert ServedModel("m", tok, tok.vocab_size).prompt_ids(tokenize_request(chat)) == \
        _hf(folder, as_hf, tools=TOOLS)


@pytest.mark.parametrize("reply", [
    "No calls here.",
    '<tool_call>\n{"name": "now", "arguments": {}',  # cut short by max_tokens
    '<tool_call>{"name": "now", "arguments": {}}</tool_call><tool_call>{"nam</tool_call>',
    '<tool_call>{"arguments": {}}</tool_call>',  # no name
    '<tool_call>{"name": "now", "arguments": [1]}</tool_call>',
])
def test_a_reply_whose_calls_do_not_all_parse_is_all_content(reply):
    from client import parse_hermes_tool_calls

    parsed = parse_hermes_tool_calls(reply)
    assert parsed.content == reply and parsed.tool_calls == []
    assert parsed.as_message() == {"role": "assistant", "content": reply}
