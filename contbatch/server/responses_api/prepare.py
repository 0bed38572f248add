"""`POST /v1/responses` body -> what the engine takes: the synchronous half, run on the worker
pool like every other route's (parsing, the stored conversation, templating, tokenizing).

The conversation is the stored response's (`previous_response_id`, 404 if it is not in the
store), then the new input; it is rendered with the tools exactly as a chat completion would
be, through the same `Preparer`, and sampled with the same limits and parameters.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...sampling.params import SamplingParams
from ..params import max_new_tokens, sampling_params
from ..preparation import Preparer
from ..prompts import Prompt
from ..schemas import SamplingFields
from ..tools import ToolContext
from .convert import input_rows, refuse_unsupported, responses_tools, text_format, with_instructions
from .schemas import LOGPROBS, ResponsesRequest
from .store import ResponseStore

# Sampling fields a Responses request shares with chat completions (vLLM's extensions included).
SHARED = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
          "seed")


@dataclass(frozen=True)
class PreparedResponse:
    req: ResponsesRequest
    prompt: Prompt
    params: SamplingParams
    tools: ToolContext | None  # the output is read for these tools' calls
    history: list[dict]  # the conversation without the instructions: what a stored response continues
    logprobs: bool
    history_bytes: int  # the request bodies the conversation came in (the store's measure)

    @property
    def structured_param(self) -> str:
        """The field a grammar error names."""
        return "tools" if self.tools is not None else "text.format"


class ResponsesPreparer:
    def __init__(self, preparer: Preparer, store: ResponseStore) -> None:
        self.preparer = preparer
        self.store = store

    def prepare(self, body: bytes) -> PreparedResponse:
        p = self.preparer
        req = p.validate(body, ResponsesRequest, adapters=False)  # the base model only (docs/lora.md)
        history, size = [], len(body)
        if req.previous_response_id is not None:
            previous = self.store.get(req.previous_response_id, "previous_response_id")
            history, size = previous.history, previous.size + size
        rows = input_rows(req, history)
        tools = responses_tools(req)
        refuse_unsupported(req, tools)
        prompt = p.conversation(with_instructions(rows, req.instructions), tools)
        budget = max_new_tokens(req.max_output_tokens, None, len(prompt.token_ids), p.limits, "max_output_tokens",
                                "input")
        logprobs = req.top_logprobs is not None or LOGPROBS in (req.include or ())
        fields = SamplingFields.model_construct(**{name: getattr(req, name) for name in SHARED})
        params = sampling_params(fields, p.limits, budget, logprobs, req.top_logprobs or 0, p.settings.max_n,
                                 text_format(req))
        return PreparedResponse(req, prompt, p.with_tools(params, tools), p.toolbox.context(tools), rows, logprobs,
                                size)
