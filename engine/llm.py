"""The offline API: ``LLM(model, **config).generate(prompts, params)``, ``.chat(messages)``."""
from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from engine.config import EngineConfig
from engine.generation_defaults import check_generation_config, load_sampling_defaults
from engine.llm_engine import LLMEngine
from engine.outputs import PrefixCacheReset, RequestOutput
from engine.sampling_params import SamplingParams

Prompt = str | list[int]


class LLM:
    """``generation_config``: where requests without SamplingParams take their defaults from
    (engine/generation_defaults.py): "auto", the model's generation_config.json; "engine",
    the engine's SamplingParams() defaults; or another folder's file. ``tokenizer=FOLDER``
    (an EngineConfig field, as vLLM's argument) reads the tokenizer from that local folder
    instead of the model's (engine/tokenizer_choice.py)."""

    def __init__(self, model: str, generation_config: str = "auto", **config) -> None:
        check_generation_config(generation_config)
        self.engine = LLMEngine(EngineConfig(model=model, **config))
        self._ids = itertools.count()
        try:
            self._defaults = load_sampling_defaults(generation_config, self.engine.model_path,
                                                    self.engine.model_config.vocab_size)
        except ValueError:
            self.engine.shutdown()
            raise

    def default_sampling_params(self) -> SamplingParams:
        """The SamplingParams a call without any uses: the model's recommended defaults."""
        return SamplingParams(**self._defaults)

    @property
    def sampling_defaults(self) -> dict:
        """The SamplingParams fields the model recommends (empty: the engine's own)."""
        return dict(self._defaults)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def reset_prefix_cache(self) -> PrefixCacheReset:
        """Forgets every cached prefix block; refused (``reset`` False) while a request runs."""
        return self.engine.reset_prefix_cache()

    def shutdown(self) -> None:
        """Stops tensor-parallel worker processes (a no-op at TP=1)."""
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """Runs every prompt to completion; outputs come back in prompt order."""
        prompts = _as_prompt_list(prompts)
        if params is None or isinstance(params, SamplingParams):
            params = [params or self.default_sampling_params()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        # Validate everything before queueing anything, so a bad prompt queues nothing.
        token_lists = [self.engine.tokenize(p) for p in prompts]
        for ids, sp in zip(token_lists, params):
            self.engine.validate_prompt(ids, sp)
        order = {}
        for ids, sp in zip(token_lists, params):
            rid = f"offline-{next(self._ids)}"
            order[rid] = len(order)
            self.engine.add_request(rid, ids, sp)
        final: list[RequestOutput | None] = [None] * len(prompts)
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished and out.request_id in order:
                    final[order[out.request_id]] = out
        return final  # type: ignore[return-value]

    def chat(self, messages: Sequence[Mapping[str, str]], params: SamplingParams | None = None,
             *, continue_final_message: bool = False, chat_template: str | None = None,
             add_generation_prompt: bool | None = None,
             chat_template_kwargs: Mapping[str, Any] | None = None,
             chat_template_name: str | None = None,
             tools: Sequence[Mapping[str, Any]] | None = None) -> RequestOutput:
        """One assistant reply to a conversation (``[{"role": ..., "content": ...}, ...]``,
        a ``"name"``, an assistant's ``"tool_calls"`` and a tool's ``"tool_call_id"``
        optionally) rendered with the model's chat template, or ``chat_template`` (its
        text). The options are vLLM's (engine/chat_options.py; ``tools``: OpenAI's function
        specs, engine/chat_tools.py), but ``add_generation_prompt`` None is True unless
        ``continue_final_message``."""
        return self.generate([self.chat_prompt(
            messages, continue_final_message, chat_template,
            add_generation_prompt=add_generation_prompt,
            chat_template_kwargs=chat_template_kwargs,
            chat_template_name=chat_template_name, tools=tools)], params)[0]

    def chat_prompt(self, messages: Sequence[Mapping[str, str]],
                    continue_final_message: bool = False,
                    chat_template: str | None = None, *,
                    add_generation_prompt: bool | None = None,
                    chat_template_kwargs: Mapping[str, Any] | None = None,
                    chat_template_name: str | None = None,
                    tools: Sequence[Mapping[str, Any]] | None = None) -> list[int]:
        """The prompt token ids chat() sends (engine/chat_template.py)."""
        from engine.chat_options import ChatOptions
        from engine.chat_template import chat_prompt_ids

        if self.tokenizer is None:
            raise ValueError("the model has no tokenizer, so no chat template")
        options = ChatOptions(add_generation_prompt=add_generation_prompt,
                              continue_final_message=continue_final_message,
                              chat_template_kwargs=chat_template_kwargs,
                              chat_template_name=chat_template_name, tools=tools)
        return chat_prompt_ids(self.tokenizer, messages, chat_template=chat_template,
                               options=options)

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Yields one prompt's outputs as tokens arrive."""
        rid = f"offline-{next(self._ids)}"
        self.engine.add_request(rid, prompt, params or self.default_sampling_params())
        finished = False
        try:
            while not finished:
                for out in self.engine.step():
                    if out.request_id == rid:
                        finished = out.finished
                        yield out
        finally:
            if not finished:  # the caller stopped early: free the request's blocks now
                self.engine.abort(rid)
                self.engine.step()


def _as_prompt_list(prompts) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) and not isinstance(t, bool) for t in prompts):
        return [prompts]  # a single prompt given as token ids
    return prompts
