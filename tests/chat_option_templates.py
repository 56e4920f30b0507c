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
