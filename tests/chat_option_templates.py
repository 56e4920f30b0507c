"""Chat templates reading what vLLM's chat options set (add_generation_prompt, a message's
name, chat_template_kwargs), for tests comparing pdserve's rendering with Hugging Face's."""
from __future__ import annotations

# Reads a message's name, a boolean and an integer kwarg, and a nested one; written for these
# tests (a thinking switch as Qwen3's templates have one).
OPTIONS_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for m in messages -%}"
    "{{- '[' + m.role + ('/' + m.name if m.name is defined else '') + '] ' + m.content -}}"
    "{%- if not loop.last or add_generation_prompt -%}{{- '\\n' -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '[assistant] ' -}}"
    "{%- if enable_thinking is defined and not enable_thinking -%}{{- '(no thinking) ' -}}"
    "{%- endif -%}{%- endif -%}"
    "{%- if budget is defined -%}{{- ' budget=' ~ budget -}}{%- endif -%}"
    "{%- if persona is defined -%}{{- ' ' ~ persona.style ~ persona.tags | join(',') -}}"
    "{%- endif -%}")
QA_TEMPLATE = ("{%- for m in messages -%}{{ 'Q: ' if m['role'] == 'user' else 'A: ' }}"
               "{{ m['content'] + '\\n' }}{%- endfor -%}"
               "{%- if add_generation_prompt -%}A:{%- endif -%}")
# As tokenizer_config.json lists named templates (transformers makes them a dict).
NAMED_WITH_DEFAULT = [{"name": "default", "template": OPTIONS_TEMPLATE},
                      {"name": "qa", "template": QA_TEMPLATE}]
NAMED_WITHOUT_DEFAULT = [{"name": "thinking", "template": OPTIONS_TEMPLATE},
                         {"name": "qa", "template": QA_TEMPLATE}]
# Renders OpenAI's tools and tool-use messages as Hermes-style templates (Qwen2.5's) do: each
# tool's JSON, an assistant's calls with their arguments as JSON and walked as an object, and
# a tool's answer under the id of its call.
TOOLS_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- if tools -%}{{- '<tools>' -}}{%- for t in tools -%}{{- t | tojson -}}{%- endfor -%}"
    "{{- '</tools>\\n' -}}{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'tool' -%}{{- '[tool ' + m.tool_call_id + '] ' + m.content -}}"
    "{%- else -%}{{- '[' + m.role + '] ' + m.content -}}{%- endif -%}"
    "{%- if m.tool_calls is defined -%}{%- for c in m.tool_calls -%}"
    "{{- '<call ' + c.id + '>' + c.function.name + (c.function.arguments | tojson) -}}"
    "{%- for k, v in c.function.arguments | dictsort -%}{{- ' ' + k + '=' ~ v -}}{%- endfor -%}"
    "{{- '</call>' -}}{%- endfor -%}{%- endif -%}"
    "{{- '\\n' -}}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '[assistant] ' -}}{%- endif -%}")


# Other turn markers than the tests' models' own templates, so a prompt shows which ran: the
# operator's --chat-template in tests/test_chat_serving.py, a request's own elsewhere.
TURNS_TEMPLATE = ("{{- bos_token -}}{%- for m in messages -%}"
                  "{{- '<' + m['role'] + '> ' + m['content'] + '\\n' -}}{%- endfor -%}"
                  "{%- if add_generation_prompt -%}{{- '<assistant> ' -}}{%- endif -%}")
