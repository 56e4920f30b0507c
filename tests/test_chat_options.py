"""vLLM's chat options (engine/chat_options.py): add_generation_prompt, continue_final_message,
chat_template_kwargs, a message's name and a model's named templates, rendered as Hugging
Face's apply_chat_template renders them with the same arguments; what is refused, in
LLM.chat's path, the SDK's request building and the router's reading of it. Through a real
router: tests/test_chat_serving.py."""
from __future__ import annotations

import io

import grpc
import pytest

from client import Chat
from client.types import build_request, tokenize_request
from engine.chat_options import MAX_TEMPLATE_KWARGS_BYTES, ChatOptions
from engine.chat_template import chat_prompt_ids
from engine.tokenizer import load_tokenizer
from router.errors import status_of
from router.prompts import ServedModel, _large_prompt, load_served_model
from tests.chat_models import model_with_template
from tests.chat_option_templates import (NAMED_WITH_DEFAULT, NAMED_WITHOUT_DEFAULT,
                                         OPTIONS_TEMPLATE, QA_TEMPLATE, TURNS_TEMPLATE)
from tests.hf_oracle import hf_tokenizer

CHAT = [{"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi", "name": "ann"},
        {"role": "assistant", "content": "Hello", "name": "bot"},
        {"role": "user", "content": "Think?"}]
BEGUN = CHAT + [{"role": "assistant", "content": "Let me"}]
# (options as ChatOptions takes them, the same as apply_chat_template's arguments)
CASES = [
    ({}, {"add_generation_prompt": True}),
    ({"add_generation_prompt": False}, {"add_generation_prompt": False}),
    ({"chat_template_kwargs": {"enable_thinking": False}},
     {"add_generation_prompt": True, "enable_thinking": False}),
    ({"chat_template_kwargs": {"enable_thinking": True, "budget": 3,
                               "persona": {"style": "terse ", "tags": ["a", "b"]}}},
     {"add_generation_prompt": True, "enable_thinking": True, "budget": 3,
      "persona": {"style": "terse ", "tags": ["a", "b"]}}),
]


@pytest.fixture(scope="module")
def folders(preset_path, tmp_path_factory):
    src = preset_path("tiny-llama")
    root = tmp_path_factory.mktemp("templates")
    return {name: model_with_template(src, root / name, template) for name, template in
            [("options", OPTIONS_TEMPLATE), ("named", NAMED_WITH_DEFAULT),
             ("nodefault", NAMED_WITHOUT_DEFAULT)]}


def _hf(folder, chat, **kw):
    return hf_tokenizer(folder).apply_chat_template(chat, tokenize=True, return_dict=False, **kw)


@pytest.mark.parametrize("options, hf_args", CASES)
def test_options_render_as_hugging_faces(folders, options, hf_args):
    tok = load_tokenizer(folders["options"])
    assert chat_prompt_ids(tok, CHAT, options=ChatOptions(**options)) == \
        _hf(folders["options"], CHAT, **hf_args)


def test_continuing_the_final_message_renders_as_hugging_faces(folders):
    tok = load_tokenizer(folders["options"])
    want = _hf(folders["options"], BEGUN, continue_final_message=True)
    got = chat_prompt_ids(tok, BEGUN, options=ChatOptions(add_generation_prompt=False,
                                                          continue_final_message=True))
    assert got == want
    assert tok.decode(got, skip_special_tokens=False).endswith("[assistant/bot] Hello\n"
                                                               "[user] Think?\n[assistant] Let me")
    # continue_final_message alone, as before add_generation_prompt was an option.
    assert chat_prompt_ids(tok, BEGUN, continue_final_message=True) == want


def test_named_templates_render_their_default_or_the_one_named(folders):
    tok = load_tokenizer(folders["named"])
    assert sorted(tok.chat_templates) == ["default", "qa"]
    assert chat_prompt_ids(tok, CHAT) == _hf(folders["named"], CHAT, add_generation_prompt=True)
    qa = chat_prompt_ids(tok, CHAT, options=ChatOptions(chat_template_name="qa"))
    assert qa == _hf(folders["named"], CHAT, chat_template="qa", add_generation_prompt=True)
    assert tok.decode(qa).endswith("Q: Think?\nA:")


def test_named_templates_without_a_default_need_a_name(folders):
    """Such a model counted as having no template at all (FAILED_PRECONDITION)."""
    tok = load_tokenizer(folders["nodefault"])
    with pytest.raises(ValueError, match=r"none named 'default': choose one with "
                                         r"chat_template_name \('qa', 'thinking'\)"):
        chat_prompt_ids(tok, CHAT)
    with pytest.raises(ValueError, match="no default specified"):  # the oracle refuses too
        _hf(folders["nodefault"], CHAT)
    got = chat_prompt_ids(tok, CHAT, options=ChatOptions(chat_template_name="thinking"))
    assert got == _hf(folders["nodefault"], CHAT, chat_template="thinking",
                      add_generation_prompt=True)
    with pytest.raises(ValueError, match=r"no chat template named 'rag': it has 'qa', "
                                         r"'thinking'"):
        chat_prompt_ids(tok, CHAT, options=ChatOptions(chat_template_name="rag"))
    with pytest.raises(ValueError, match="a template given in its place"):
        chat_prompt_ids(tok, CHAT, chat_template=QA_TEMPLATE,
                        options=ChatOptions(chat_template_name="qa"))
    served = load_served_model(folders["nodefault"], "auto", None)
    assert served.has_chat_template
    assert list(served.info(64, 16).chat_template_names) == ["qa", "thinking"]


@pytest.mark.parametrize("options, match", [
    ({"add_generation_prompt": True, "continue_final_message": True}, "cannot both be true"),
    ({"add_generation_prompt": "yes"}, "add_generation_prompt must be true or false"),
    ({"chat_template_kwargs": {"messages": []}}, "may not set 'messages'"),
    ({"chat_template_kwargs": {"add_generation_prompt": False, "bos_token": "x"}},
     "may not set 'add_generation_prompt', 'bos_token'"),
    ({"chat_template_kwargs": {"s": {1, 2}}}, r"\['s'\] is a set: only JSON values"),
    ({"chat_template_kwargs": {"x": float("nan")}}, "JSON has no such number"),
    ({"chat_template_kwargs": {"x": {3: 1}}}, "keys must be non-empty strings"),
    ({"chat_template_kwargs": {"x": "y" * MAX_TEMPLATE_KWARGS_BYTES}}, "bytes of JSON"),
    ({"chat_template_kwargs": {"x": [[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]}}, "nest deeper"),
    ({"chat_template_kwargs": ["enable_thinking"]}, "must be a mapping"),
    ({"chat_template_name": ""}, "non-empty string"),
])
def test_bad_options_are_refused(options, match):
    with pytest.raises(ValueError, match=match):
        ChatOptions(**options)


def test_continuing_a_user_message_renders_as_transformers(folders):
    # HF's apply_chat_template and vLLM continue whatever message comes last (a user's
    # sentence to complete, too): refusing it would break callers that relied on it.
    tok = load_tokenizer(folders["options"])
    assert CHAT[-1]["role"] == "user"
    assert chat_prompt_ids(tok, CHAT, continue_final_message=True) == _hf(
        folders["options"], CHAT, add_generation_prompt=False, continue_final_message=True)


def test_sdk_sends_the_options_and_the_router_reads_them_back(folders):
    tok = load_tokenizer(folders["options"])
    served = ServedModel("m", tok, tok.vocab_size)
    kwargs = {"enable_thinking": False, "budget": 3, "ratio": 0.5, "none": None,
              "persona": {"style": "terse ", "tags": ["a", "b"]}}
    chat = Chat(CHAT, add_generation_prompt=True, chat_template_kwargs=kwargs)
    req = build_request(chat, None, {})
    assert req.chat.HasField("add_generation_prompt") and req.chat.add_generation_prompt
    assert [m.name for m in req.chat.messages if m.HasField("name")] == ["ann", "bot"]
    from router.prompts import template_kwargs

    # A Struct's numbers are doubles: the whole one comes back the int the client wrote.
    back = template_kwargs(req.chat.chat_template_kwargs)
    assert back == kwargs and type(back["budget"]) is int
    assert served.prompt_ids(tokenize_request(chat)) == \
        _hf(folders["options"], CHAT, add_generation_prompt=True, **kwargs)
    assert not build_request(Chat(CHAT), None, {}).chat.HasField("add_generation_prompt")
    for bad, match in [({"s": {1}}, "is a set"), ({"n": 2 ** 60}, "beyond 2\\*\\*53"),
                       ({"x": float("inf")}, "no such number"), ({1: True}, "keys must be str")]:
        with pytest.raises(TypeError, match=match):
            build_request(Chat(CHAT, chat_template_kwargs=bad), None, {})
    with pytest.raises(TypeError, match="name must be a str"):
        build_request([{"role": "user", "content": "x", "name": 1}], None, {})
    with pytest.raises(TypeError, match="may have only the keys 'role', 'content', 'name'"):
        build_request([{"role": "user", "content": "x", "images": []}], None, {})


@pytest.mark.parametrize("chat, match", [
    (Chat(BEGUN, add_generation_prompt=True, continue_final_message=True), "cannot both"),
    (Chat(CHAT, chat_template_kwargs={"messages": "x"}), "may not set 'messages'"),
    (Chat(CHAT, chat_template_kwargs={"self": 1}), "may not set 'self'"),
    (Chat(CHAT, chat_template_name="qa"), "no named templates"),
])
def test_the_router_refuses_bad_options_as_invalid_argument(folders, chat, match):
    tok = load_tokenizer(folders["options"])
    with pytest.raises(Exception) as err:
        ServedModel("m", tok, tok.vocab_size).prompt_ids(build_request(chat, None, {}))
    code, message = status_of(err.value)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and match in message, message


def test_a_chats_own_template_renders_as_hugging_faces_only_where_trusted(folders):
    tok = load_tokenizer(folders["named"])
    trusting = ServedModel("m", tok, tok.vocab_size, trust_request_chat_template=True)
    chat = Chat(CHAT, chat_template=TURNS_TEMPLATE)
    want = _hf(folders["named"], CHAT, chat_template=TURNS_TEMPLATE, add_generation_prompt=True)
    assert trusting.prompt_ids(tokenize_request(chat)) == want
    assert _large_prompt(tokenize_request(chat))  # rendered off the router's event loop
    assert not _large_prompt(tokenize_request(Chat(CHAT)))
    assert want != _hf(folders["named"], CHAT, add_generation_prompt=True)  # not the model's
    assert trusting.info(64, 16).accepts_request_chat_template
    # Refused by a router that does not trust its clients' templates: the operator's choice,
    # not a bad request.
    plain = ServedModel("m", tok, tok.vocab_size)
    assert not plain.info(64, 16).accepts_request_chat_template
    with pytest.raises(Exception) as err:
        plain.prompt_ids(tokenize_request(chat))
    code, message = status_of(err.value)
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert "--trust-request-chat-template" in message
    with pytest.raises(TypeError, match="chat_template must be a non-empty str"):
        build_request(Chat(CHAT, chat_template=""), None, {})


@pytest.mark.parametrize("chat, match", [
    (Chat(CHAT, chat_template=TURNS_TEMPLATE, chat_template_name="qa"), "not both"),
    (Chat(CHAT, chat_template="{% for m in messages %}"), "does not parse"),
    (Chat(CHAT, chat_template="{{ raise_exception('no system turns') }}"), "no system turns"),
    (Chat(CHAT, chat_template="{{ messages[0]['content'] + 1 }}"), "failed on the conversation"),
    (Chat(CHAT, chat_template="x" * (128 * 1024 + 1)), "characters, over 131072"),
])
def test_a_chats_own_bad_template_is_the_clients_invalid_argument(folders, chat, match):
    """Where the router's own template failing is FAILED_PRECONDITION (the operator's to
    mend), the request's is INVALID_ARGUMENT."""
    tok = load_tokenizer(folders["named"])
    served = ServedModel("m", tok, tok.vocab_size, trust_request_chat_template=True)
    with pytest.raises(Exception) as err:
        served.prompt_ids(build_request(chat, None, {}))
    code, message = status_of(err.value)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and match in message, message


def test_large_template_kwargs_are_read_off_the_event_loop():
    """Their conversion and checks take ~0.1 s a MB: a chat whose kwargs alone are large
    (no message, or one short one) is read in a thread, as a long conversation is."""
    from router.prompts import INLINE_PROMPT_CHARS, _large_prompt

    big = {f"k{i}": i for i in range(INLINE_PROMPT_CHARS)}
    for messages in ([], [{"role": "user", "content": "hi"}]):
        req = build_request(Chat(messages, chat_template_kwargs=big), None, {})
        assert _large_prompt(req)
    assert not _large_prompt(build_request(Chat(CHAT, chat_template_kwargs={"b": 1}), None,
                                           {}))


def test_llm_chat_prompt_takes_the_options(reference, folders):
    ids = reference.chat_prompt(CHAT, chat_template=OPTIONS_TEMPLATE, add_generation_prompt=False,
                                chat_template_kwargs={"budget": 7})
    assert ids == _hf(folders["options"], CHAT, add_generation_prompt=False, budget=7)
    with pytest.raises(ValueError, match="cannot both be true"):
        reference.chat(BEGUN, continue_final_message=True, add_generation_prompt=True)


def test_pdserve_chat_offline_picks_a_named_template_and_passes_kwargs(folders, monkeypatch,
                                                                       capsys):
    from engine.cli import main

    folder = folders["nodefault"]
    monkeypatch.setattr("sys.stdin", io.StringIO("Hi\n"))
    # Refused before the engine loads, with the names to pick from.
    assert main(["chat", "--model", folder, "--max-tokens", "2"]) == 2
    assert "no chat template named 'default': pass --chat-template-name (its named " \
           "templates: qa, thinking)" in capsys.readouterr().err
    assert main(["chat", "--model", folder, "--chat-template", QA_TEMPLATE,
                 "--chat-template-name", "qa"]) == 2
    assert "--chat-template replaces them" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["chat", "--model", folder, "--chat-template-kwargs", "[1]"])
    assert "must be a JSON object" in capsys.readouterr().err
    for bad, match in [('{"b": NaN}', "JSON has no such number"),
                       ('{"bos_token": "x"}', "may not set 'bos_token'")]:
        with pytest.raises(SystemExit):
            main(["chat", "--model", folder, "--chat-template-kwargs", bad])
        assert match in capsys.readouterr().err
    # The engine takes any int; a router's Struct cannot carry one past 2**53 exactly, so
    # through a router it is refused before the first turn (no router needed to see it).
    assert main(["chat", "--router", "127.0.0.1:1", "--chat-template-kwargs",
                 '{"seed": 9007199254740993}']) == 2
    assert "--chat-template-kwargs: chat_template_kwargs['seed'] is 9007199254740993: " \
           "integers beyond 2**53" in capsys.readouterr().err
    assert main(["chat", "--model", folder, "--max-tokens", "2", "--num-gpu-blocks", "64",
                 "--chat-template-name", "thinking", "--chat-template-kwargs",
                 '{"enable_thinking": false, "budget": 2}']) == 0
    want = _hf(folder, [{"role": "user", "content": "Hi"}], chat_template="thinking",
               add_generation_prompt=True, enable_thinking=False, budget=2)
    assert f"{len(want)} prompt tokens" in capsys.readouterr().err
