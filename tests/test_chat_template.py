"""Chat prompts (engine/chat_template.py): rendering against Hugging Face's own
apply_chat_template, what is refused, the operator's template, the offline LLM.chat and
``pdserve chat`` against HF generate, and the SDK's request building."""
from __future__ import annotations

import copy
import io
import subprocess
import sys

import grpc
import pytest

from client import Chat, FailedPreconditionError
from client.errors import error_from_rpc
from client.types import build_request
from engine import SamplingParams
from engine.chat_template import (MAX_ROLE_CHARS, ChatMessage, ChatTemplateBroken,
                                  ChatTemplateMissing, chat_prompt_ids, check_messages,
                                  load_chat_template)
from engine.tokenizer import load_tokenizer
from engine.tokenizer_builder import CHAT_TEMPLATE
from router.config import RouterConfig
from tests.chat_models import model_with_template
from tests.hf_oracle import hf_greedy, hf_tokenizer

CHATS = [
    [{"role": "user", "content": "Hello there, who are you?"}],
    [{"role": "system", "content": "Be brief."},
     {"role": "user", "content": "Name three colours."},
     {"role": "assistant", "content": "Red, green and blue."},
     {"role": "user", "content": "Ünïcödé, 漢字 and emoji 🎉 too?"}],
    [{"role": "user", "content": ""}],
]
QA_TEMPLATE = ("{%- for m in messages -%}{{ 'Q: ' if m['role'] == 'user' else 'A: ' }}"
               "{{ m['content'] + '\\n' }}{%- endfor -%}"
               "{%- if add_generation_prompt -%}A:{%- endif -%}")


@pytest.fixture(scope="module")
def tok(preset_path):
    return load_tokenizer(preset_path("tiny-llama"))


@pytest.fixture(scope="module")
def hf_tok(preset_path):
    return hf_tokenizer(preset_path("tiny-llama"))


@pytest.mark.parametrize("chat", CHATS)
def test_prompt_ids_equal_hugging_faces(tok, hf_tok, chat):
    assert tok.chat_template == hf_tok.chat_template == CHAT_TEMPLATE
    want = hf_tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True,
                                      return_dict=False)
    got = chat_prompt_ids(tok, chat)
    assert got == want
    assert got[0] == tok.bos_token_id and got.count(tok.bos_token_id) == 1
    assert tok.decode(got, skip_special_tokens=False).endswith("### assistant\n")


def test_continue_final_message_leaves_the_reply_open(tok, hf_tok):
    chat = CHATS[1][:3]
    want = hf_tok.apply_chat_template(chat, continue_final_message=True, tokenize=True,
                                      return_dict=False)
    got = chat_prompt_ids(tok, chat, continue_final_message=True)
    assert got == want
    assert tok.decode(got, skip_special_tokens=False).endswith(
        "### assistant\nRed, green and blue.")
    # An empty reply to continue opens the assistant's turn, as HF renders it (it was refused).
    empty = [chat[0], {"role": "assistant", "content": ""}]
    got = chat_prompt_ids(tok, empty, continue_final_message=True)
    assert got == hf_tok.apply_chat_template(empty, continue_final_message=True, tokenize=True,
                                             return_dict=False)
    assert tok.decode(got, skip_special_tokens=False).endswith("### assistant\n")


@pytest.mark.parametrize("messages, match", [
    ([], "no messages"),
    ("hello", "list of"),
    ([{"role": "user"}], "must have the keys role and content"),
    ([{"role": "user", "content": "x", "images": []}], "must have the keys role and"),
    ([{"role": "user", "content": "x", "name": 3}], "name must be a string"),
    ([{"role": "", "content": "x"}], "role must be a non-empty"),
    ([{"role": "user", "content": 5}], "content must be a string"),
    ([{"role": "bot", "content": "x"}], "refused the conversation: roles must be"),
    ([{"role": "user", "content": "x"}, {"role": "system", "content": "y"}],
     "only the first message may be a system"),
    ([{"role": "user", "content": "x"}] * 4097, "more than 4096"),
])
def test_bad_conversations_are_refused(tok, messages, match):
    with pytest.raises(ValueError, match=match):
        chat_prompt_ids(tok, messages)


def test_a_model_without_a_template_needs_the_operators(preset_path, tmp_path):
    tok = load_tokenizer(preset_path("tiny-llama"))
    tok.chat_template = None
    # LLM.chat's caller has no router to start: the router names its flag itself (below).
    with pytest.raises(ChatTemplateMissing, match=r"give one \(chat_template\)") as e:
        chat_prompt_ids(tok, CHATS[0])
    assert "router" not in str(e.value)
    path = tmp_path / "qa.jinja"
    path.write_text(QA_TEMPLATE)
    for source in (QA_TEMPLATE, str(path)):
        ids = chat_prompt_ids(tok, CHATS[1][1:3], chat_template=load_chat_template(source))
        assert tok.decode(ids) == "Q: Name three colours.\nA: Red, green and blue.\nA:"


def test_load_chat_template_checks_the_operators_template(tmp_path):
    assert load_chat_template(None) is None
    with pytest.raises(ValueError, match="does not exist"):
        load_chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(ValueError, match="does not parse"):
        load_chat_template("{% for m in messages %}{{ m }")
    with pytest.raises(ValueError, match="file path or a Jinja template"):
        load_chat_template("  ")
    config = RouterConfig(model="tiny-llama", redis_url="redis://x", chat_template=QA_TEMPLATE)
    assert config.chat_template_text == QA_TEMPLATE
    with pytest.raises(ValueError, match="does not exist"):
        RouterConfig(model="tiny-llama", redis_url="redis://x", chat_template="nope.jinja")


def test_check_messages_takes_messages_and_mappings():
    msgs = check_messages([ChatMessage("user", "a"), {"role": "assistant", "content": "b"}])
    assert msgs == [ChatMessage("user", "a"), ChatMessage("assistant", "b")]


def test_llm_chat_equals_hf_generate_on_the_rendered_prompt(reference, hf_tok, preset_path):
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outs = [reference.chat(chat, params) for chat in CHATS[:2]]
    for chat, out in zip(CHATS, outs):
        ids = hf_tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True,
                                         return_dict=False)
        assert out.prompt_token_ids == ids
        assert out.token_ids == hf_greedy(preset_path("tiny-llama"), ids, 12)
    assert outs[0].token_ids != outs[1].token_ids


def test_pdserve_chat_offline_keeps_the_conversation(reference, monkeypatch, capsys):
    from engine.cli import main

    monkeypatch.setattr("sys.stdin", io.StringIO("Hello\nAnd then?\n/reset\nHello\n"))
    assert main(["chat", "--system", "Be brief.", "--max-tokens", "6", "--num-gpu-blocks",
                 "64"]) == 0
    out = capsys.readouterr()
    params = SamplingParams(max_tokens=6, temperature=0.0)
    history = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    first = reference.chat(history, params).text
    history += [{"role": "assistant", "content": first}, {"role": "user", "content": "And then?"}]
    second = reference.chat(history, params).text
    assert out.out == f"{first}\n{second}\n(conversation cleared)\n{first}\n"
    assert out.err.count("tokens, TTFT") == 3


def test_sdk_builds_chat_requests():
    chat = [{"role": "user", "content": "Hi"}]
    req = build_request(chat, None, {"max_tokens": 3})
    assert req.WhichOneof("prompt") == "chat"
    assert [(m.role, m.content) for m in req.chat.messages] == [("user", "Hi")]
    assert not req.chat.continue_final_message
    req = build_request(Chat(chat, continue_final_message=True), "r1", {})
    assert req.chat.continue_final_message and req.request_id == "r1"
    with pytest.raises(TypeError, match="chat message 0"):
        build_request([{"role": "user", "content": 3}], None, {})
    with pytest.raises(TypeError, match="Chat.messages"):
        build_request(Chat("hello"), None, {})


def test_router_answers_failed_precondition_without_a_template(preset_path):
    from router.errors import RouterRejectError
    from router.prompts import ServedModel

    tok = load_tokenizer(preset_path("tiny-llama"))
    tok.chat_template = None
    model = ServedModel("tiny-llama", tok, tok.vocab_size)
    req = build_request(CHATS[0], None, {})
    assert not model.has_chat_template
    with pytest.raises(RouterRejectError, match="model 'tiny-llama' has no chat template: "
                                                "start the router with --chat-template") as e:
        model.prompt_ids(req)
    assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
    model.chat_template = load_chat_template(QA_TEMPLATE)
    assert model.has_chat_template
    assert tok.decode(model.prompt_ids(req)) == "Q: Hello there, who are you?\nA:"
    assert build_request(Chat([]), None, {}).WhichOneof("prompt") == "chat"


class _RpcError(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.FAILED_PRECONDITION

    def details(self):
        return "no chat template"


def test_failed_precondition_has_its_own_sdk_error():
    err = error_from_rpc(_RpcError())
    assert isinstance(err, FailedPreconditionError) and err.details == "no chat template"


def test_clients_see_the_served_model_name():
    from router.prompts import load_served_model

    assert load_served_model("tiny-llama", "auto", None).info(64, 16).model == "tiny-llama"
    info = load_served_model("tiny-llama", "auto", None, "team/llama").info(64, 16)
    assert info.model == "team/llama"
    config = RouterConfig(model="tiny-llama", redis_url="redis://x",
                          served_model_name="team/llama")
    assert config.model_name == "team/llama"
    assert RouterConfig(model="tiny-llama", redis_url="redis://x").model_name == "tiny-llama"
    for bad in ("a b", "x\n", 7, "n" * 257):
        with pytest.raises(ValueError, match="served_model_name"):
            RouterConfig(model="tiny-llama", redis_url="redis://x", served_model_name=bad)


# Valid Hugging Face templates using the syntax transformers' environment adds: loop controls,
# and {% generation %} (the assistant-token mask's markers).
EXTENSION_TEMPLATES = [
    "{{ bos_token }}{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}"
    "{{ m.role }}: {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}assistant:"
    "{% endif %}",
    "{{ bos_token }}{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}"
    "{{ m.role }}: {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}assistant:"
    "{% endif %}",
    "{{ bos_token }}{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}"
    "{{ m.content }}{% endgeneration %}{% else %}{{ m.role }}: {{ m.content }}\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}",
]
SYNTAX_ERRORS = ["{% for m in messages %}{{ m.content }}",  # no endfor
                 "{% generation %}{{ messages[0].content }}",  # no endgeneration
                 "{% for m in messages %}{{ m }}{% endfor %}{% break %}",  # break outside a loop
                 "{{ messages[0].content }"]


@pytest.mark.parametrize("template", EXTENSION_TEMPLATES)
def test_templates_using_transformers_syntax_load_and_render_as_hf(tok, hf_tok, template):
    chat = [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "yo"}, {"role": "user", "content": "more"}]
    assert load_chat_template(template) == template
    want = hf_tok.apply_chat_template(chat, chat_template=template, add_generation_prompt=True,
                                      tokenize=True, return_dict=False)
    assert chat_prompt_ids(tok, chat, chat_template=template) == want


@pytest.mark.parametrize("template", SYNTAX_ERRORS)
def test_templates_with_syntax_errors_are_refused_as_hf_refuses_them(hf_tok, template):
    from jinja2 import TemplateSyntaxError

    # The oracle: transformers refuses it too (Python's SyntaxError for a break outside a loop,
    # which Jinja's parser lets through).
    with pytest.raises((TemplateSyntaxError, SyntaxError)):
        hf_tok.apply_chat_template([{"role": "user", "content": "hi"}], chat_template=template,
                                   tokenize=False)
    with pytest.raises(ChatTemplateBroken, match="does not parse"):
        load_chat_template(template)


def test_without_transformers_compiler_the_same_syntax_parses(monkeypatch):
    """transformers' compile function is private: where it is gone, a sandboxed environment
    with the same extensions parses what it did."""
    monkeypatch.setitem(sys.modules, "transformers.utils.chat_template_utils", None)
    for template in EXTENSION_TEMPLATES:
        assert load_chat_template(template) == template
    for template in SYNTAX_ERRORS:
        with pytest.raises(ChatTemplateBroken, match="does not parse"):
            load_chat_template(template)


def _served(tok, template: str):
    from router.prompts import ServedModel

    broken = copy.copy(tok)
    broken.chat_template = template
    return ServedModel("m", broken, tok.vocab_size)


def test_a_template_that_does_not_parse_is_the_servers_fault_a_refusal_the_clients(tok):
    """FAILED_PRECONDITION for a template no chat can render with; INVALID_ARGUMENT for one
    that refuses this conversation (its raise_exception)."""
    from router.errors import status_of

    req = build_request(CHATS[0], None, {})
    with pytest.raises(Exception) as err:
        _served(tok, SYNTAX_ERRORS[0]).prompt_ids(req)
    code, message = status_of(err.value)
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "does not parse" in message
    with pytest.raises(Exception) as err:
        _served(tok, CHAT_TEMPLATE).prompt_ids(build_request([{"role": "bot", "content": "x"}],
                                                             None, {}))
    code, message = status_of(err.value)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "roles must be" in message


def test_a_model_template_that_does_not_parse_fails_the_routers_start(preset_path, tmp_path):
    from router.prompts import load_served_model

    src = preset_path("tiny-llama")
    broken = model_with_template(src, tmp_path / "broken", SYNTAX_ERRORS[0])
    with pytest.raises(ChatTemplateBroken, match="chat template of model .* does not parse"):
        load_served_model(broken, "auto", None)
    # The operator's template replaces it: nothing renders with the model's then.
    assert load_served_model(broken, "auto", QA_TEMPLATE).has_chat_template
    fine = model_with_template(src, tmp_path / "fine", EXTENSION_TEMPLATES[2])
    assert load_served_model(fine, "auto", None).has_chat_template
    proc = subprocess.run([sys.executable, "-m", "engine.cli", "router", "--model", broken,
                           "--redis-url", "redis://127.0.0.1:1", "--port", "0"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "does not parse" in proc.stderr and "--chat-template" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_chat_role_is_bounded():
    assert ChatMessage("r" * MAX_ROLE_CHARS, "x").role
    with pytest.raises(ValueError, match=f"at most {MAX_ROLE_CHARS}"):
        ChatMessage("r" * (MAX_ROLE_CHARS + 1), "x")


def test_pdserve_chat_offline_refuses_a_model_without_a_template_before_loading_it(
        preset_path, tmp_path, monkeypatch, capsys):
    """Said at the start, with the flag that fixes it: it loaded the engine, then failed every
    turn typed with the router's hint ("start the router with --chat-template")."""
    from engine.cli import main

    folder = model_with_template(preset_path("tiny-llama"), tmp_path / "none", None)
    monkeypatch.setattr("sys.stdin", io.StringIO("Hello\nAgain\n"))
    assert main(["chat", "--model", folder, "--max-tokens", "2", "--num-gpu-blocks", "64"]) == 2
    err = capsys.readouterr().err
    assert "has no chat template: pass --chat-template FILE" in err and "router" not in err
    # The flag then does what the message says.
    monkeypatch.setattr("sys.stdin", io.StringIO("Hello\n"))
    assert main(["chat", "--model", folder, "--max-tokens", "2", "--num-gpu-blocks", "64",
                 "--chat-template", QA_TEMPLATE]) == 0
    assert capsys.readouterr().err.count("tokens, TTFT") == 1


def test_a_reply_ends_at_the_tokenizers_eos_that_config_json_does_not_list(preset_path, tmp_path,
                                                                          hf_tok):
    """A chat model whose turns end with its tokenizer's eos, in neither config.json nor
    generation_config.json (Llama 3 Instruct's first release and its <|eot_id|>): vLLM stops
    there. The reply ran on past it to max_tokens, every token of it hidden from the text."""
    from engine import LLM
    from router.prompts import load_served_model

    folder = model_with_template(preset_path("tiny-llama"), tmp_path / "eot", CHAT_TEMPLATE,
                                 eos_token="<|pad|>")
    eot = hf_tok.convert_tokens_to_ids("<|pad|>")
    chat = [{"role": "user", "content": "Hello"}]
    with LLM(folder, num_gpu_blocks=64) as llm:
        assert llm.tokenizer.eos_token_id == eot
        assert llm.tokenizer.decode(llm.chat_prompt(chat), skip_special_tokens=False) \
            .endswith("Hello<|pad|>\n### assistant\n")  # how its template ends a turn
        # The model made to say it at once (random weights would never): the reply ends there.
        out = llm.chat(chat, SamplingParams(max_tokens=8, temperature=0.0,
                                            logit_bias={eot: 100}))
        assert (out.token_ids, out.text, out.finish_reason) == ([eot], "", "stop")
        # ignore_eos goes past it, as past any eos.
        out = llm.chat(chat, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True,
                                            logit_bias={eot: 100}))
        assert out.token_ids == [eot] * 3 and out.finish_reason == "length"
    # The router reports the ids its workers stop on.
    eos = hf_tok.convert_tokens_to_ids("<|end_of_text|>")
    assert load_served_model(folder, "auto", None).eos_token_ids == [eos, eot]
