"""Request bodies -> what the engine takes: parse, validate, template, tokenize, check limits.

Everything here is synchronous CPU work on one request's data, proportional to its size, so
the app runs it on its worker pool (`workers.py`), never on the event loop: there, one large
body would stall every other client. Failures are `APIError`s, raised into the route.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass, replace
from typing import TypeVar

import pydantic_core
from pydantic import BaseModel, ValidationError

from ..sampling.params import SamplingParams
from .errors import APIError, bad_request, describe_validation_error
from .params import Limits, max_new_tokens, sampling_params, structured_output
from .prompts import Prompt, chat_prompt, completion_prompts, decode, message_dicts
from .schemas import (
    ChatCompletionRequest,
    ChatTool,
    CompletionRequest,
    DetokenizeRequest,
    NamedToolChoice,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from .settings import ServerSettings
from .tools import FunctionTool, ToolContext, Toolbox, ToolRequest, tool_request

M = TypeVar("M", bound=BaseModel)


@dataclass(frozen=True)
class Prepared:
    """A generation request ready to submit: one prompt and its params per engine request."""

    req: CompletionRequest | ChatCompletionRequest
    prompts: list[Prompt]
    params: list[SamplingParams]
    tools: ToolContext | None = None  # the output is read for these tools' calls

    @property
    def structured_param(self) -> str:
        """The field a structured-output error names."""
        if self.tools is not None:
            return "tools"
        fmt = self.req.response_format
        return "response_format" if fmt is not None and fmt.type != "text" else "structured_outputs"


def chat_tools(tools: list[ChatTool] | None, choice, parallel: bool | None) -> ToolRequest | None:
    """Chat completions' `tools`, `tool_choice` and `parallel_tool_calls`, checked."""
    functions = [FunctionTool(t.function.name, t.function.description, t.function.parameters, t.function.strict)
                 for t in tools or ()]
    if isinstance(choice, NamedToolChoice):
        return tool_request(functions, "named", choice.function.name, parallel)
    return tool_request(functions, choice, None, parallel)


def parse_body(body: bytes, model: type[M]) -> M:
    """The body as `model`, or a 400 saying what is wrong. pydantic's JSON parser refuses
    nesting deeper than 200 levels (json's recursed), on every route that parses through here."""
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        message, param = describe_validation_error(exc)
        raise APIError(400, message, param) from None


class Preparer:
    """The synchronous half of every POST route, for one app."""

    def __init__(self, tokenizer, limits: Limits, settings: ServerSettings) -> None:
        self.tokenizer = tokenizer
        self.limits = limits
        self.settings = settings
        self.toolbox = Toolbox(tokenizer, settings.tool_call_parser)
        self.adapter_names: Callable[[], Collection[str]] = tuple  # LoRA adapters served as models (app.py sets it)

    def conversation(self, rows: list[dict], tools: ToolRequest | None, add_generation_prompt: bool = True,
                     continue_final_message: bool = False, add_special_tokens: bool = False) -> Prompt:
        """The prompt of a conversation (`prompts.message_dicts` rows) with its tools."""
        escape = self.settings.escape_special_tokens
        rows, template_tools = self.toolbox.prompt(rows, tools, escape)
        return chat_prompt(self.tokenizer, rows, add_generation_prompt, continue_final_message, add_special_tokens,
                           escape, template_tools)

    def with_tools(self, params: SamplingParams, tools: ToolRequest | None) -> SamplingParams:
        """`params` with the tools' grammar in place of (or around) the structured output, and
        special tokens kept in the text when the call format is written with one."""
        if tools is None:
            return params
        constraint = self.toolbox.constraint(tools, params.structured_output)
        context = self.toolbox.context(tools)
        keep = context is not None and not context.fmt.skip_special_tokens
        return replace(params, structured_output=constraint,
                       skip_special_tokens=params.skip_special_tokens and not keep)

    def validate(self, body: bytes, model: type[M], adapters: bool = True) -> M:
        """The body as `model`, or a 400 saying what is wrong (pydantic's JSON parser also
        refuses nesting deeper than 200 levels), or 404 for another model's name (the base
        model's names and, where `adapters`, the loaded LoRA adapters' are served)."""
        parsed = parse_body(body, model)
        name = getattr(parsed, "model", None)
        if not adapters and name is not None and name not in self.settings.served_model_names:
            if name in self.adapter_names():
                raise APIError(404, f"`{name}` is a LoRA adapter, and this route serves the base model "
                               f"`{self.settings.model_name}` only", "model", "model_not_found")
        if name is not None and name not in self.settings.served_model_names and name not in self.adapter_names():
            served = "".join(f", `{a}`" for a in sorted(self.adapter_names()))
            raise APIError(404, f"The model `{name}` does not exist. This server serves `{self.settings.model_name}`"
                           f"{served}.", "model", "model_not_found")
        return parsed

    def completion(self, body: bytes) -> Prepared:
        req = self.validate(body, CompletionRequest)
        if req.suffix is not None:
            raise bad_request("suffix is not supported: this engine generates left to right only", "suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise bad_request(f"best_of ({req.best_of}) must equal n ({req.n}): this server does not rank "
                              "hidden samples", "best_of")
        if req.echo and req.logprobs is not None:
            raise bad_request("echo with logprobs needs prompt logprobs, which this engine does not compute; "
                              "drop one of them", "echo")
        prompts = completion_prompts(self.tokenizer, req.prompt, req.add_special_tokens)
        structured = structured_output(req)
        params = [
            sampling_params(
                req, self.limits,
                max_new_tokens(req.max_tokens, 16, len(p.token_ids), self.limits, "max_tokens", "prompt"),
                req.logprobs is not None, req.logprobs or 0, self.settings.max_n, structured,
            )
            for p in prompts
        ]
        return Prepared(req, prompts, params)

    def chat(self, body: bytes) -> Prepared:
        req = self.validate(body, ChatCompletionRequest)
        if req.top_logprobs and not req.logprobs:
            raise bad_request("top_logprobs needs logprobs to be true", "top_logprobs")
        tools = chat_tools(req.tools, req.tool_choice, req.parallel_tool_calls)
        prompt = self.conversation(message_dicts(req.messages), tools, req.add_generation_prompt,
                                   req.continue_final_message)
        requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        budget = max_new_tokens(requested, None, len(prompt.token_ids), self.limits, param, "messages")
        params = sampling_params(req, self.limits, budget, req.logprobs, req.top_logprobs or 0, self.settings.max_n,
                                 structured_output(req))
        return Prepared(req, [prompt], [self.with_tools(params, tools)], self.toolbox.context(tools))

    def tokenize(self, body: bytes) -> dict:
        """vLLM's two forms: {"prompt": ...} or {"messages": [...]}."""
        try:  # a first look, to pick the schema; pydantic's parser has a depth limit (json's recursed)
            chat = "messages" in pydantic_core.from_json(body)  # a list or a string: "in" works, schema refuses
        except (ValueError, TypeError):
            chat = False  # not JSON: the schema below says what is wrong
        req = self.validate(body, TokenizeChatRequest if chat else TokenizeCompletionRequest)
        if isinstance(req, TokenizeChatRequest):
            ids = self.conversation(message_dicts(req.messages), chat_tools(req.tools, None, None),
                                    req.add_generation_prompt, req.continue_final_message,
                                    req.add_special_tokens).token_ids
        else:
            ids = list(self.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens))
        out = {"count": len(ids), "max_model_len": self.limits.max_model_len, "tokens": ids}
        if req.return_token_strs:
            out["token_strs"] = self.tokenizer.convert_ids_to_tokens(ids)
        return out

    def detokenize(self, body: bytes) -> dict:
        req = self.validate(body, DetokenizeRequest)
        return {"prompt": decode(self.tokenizer, req.tokens, "tokens")}
