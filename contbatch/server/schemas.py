"""Request bodies of the OpenAI-compatible routes, as strict pydantic models.

Every model forbids unknown fields: a parameter this server would not honour (best_of above n,
`functions`, ...) is rejected with a 400 naming it, never silently ignored. Fields that
change nothing about generation (`user`, `metadata`, `store`, ...) are accepted, as OpenAI's
own clients send them. Values are strict (no "1.0" strings for numbers) and finite.

The vLLM extensions that a sampling engine can honour are accepted too: top_k, min_p,
repetition_penalty, min_tokens, ignore_eos, stop_token_ids, include_stop_str_in_output,
skip_special_tokens, add_special_tokens, add_generation_prompt, continue_final_message, and
`structured_outputs` (json, regex, choice, grammar), beside OpenAI's `response_format`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

MAX_LOGPROBS = 20  # the engine's top_logprobs limit
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

TokenId = Annotated[int, Field(ge=0, le=INT64_MAX)]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class UpdateWeightsRequest(Strict):
    """`POST /update_weights_from_disk`: a file under `--weights-dir` and what becomes of
    requests in flight."""

    path: str = Field(min_length=1)
    inflight: Literal["recompute", "keep", "abort"] = "recompute"


class StreamOptions(Strict):
    include_usage: bool = False


class JSONSchemaFormat(Strict):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")  # None: any JSON object
    strict: bool | None = None  # constrained decoding enforces the schema either way


class ResponseFormat(Strict):
    """OpenAI's: free text, any JSON object, or a JSON schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class StructuredOutputs(Strict):
    """vLLM's `structured_outputs`: exactly one of these."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class SamplingFields(Strict):
    """What completions and chat completions share: the model and how to sample."""

    model: str | None = None  # optional, as in vLLM: the served model when left out
    n: int = Field(1, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0, le=100)
    logit_bias: dict[str, float] | None = None
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    speculative: bool = True  # false: this request never takes speculative proposals (same tokens)
    # Accepted and ignored: they change nothing about what is generated.
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    suffix: str | None = None  # rejected when set: the engine has no insertion mode
    max_tokens: int | None = Field(None, ge=1)  # None: OpenAI's 16, clipped to the context left
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    best_of: int | None = Field(None, ge=1)  # only None or == n: no server-side ranking
    add_special_tokens: bool = True


class TextPart(Strict):
    type: Literal["text"]
    text: str


MAX_TOOLS = 128  # OpenAI's limit on the functions of one request
TOOL_NAME = r"^[A-Za-z0-9_-]{1,64}$"  # OpenAI's rule for a function's name


class FunctionDefinition(Strict):
    """A function the model may call; `parameters` is a JSON schema of its arguments (an object).
    `strict: false` constrains the arguments to any JSON object instead of the schema."""

    name: str = Field(pattern=TOOL_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(Strict):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(Strict):
    name: str


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: FunctionName


class CalledFunction(Strict):
    name: str
    arguments: str  # JSON text, as the model wrote it


class ToolCall(Strict):
    """A call the assistant made earlier in the conversation."""

    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(Strict):
    """One message of a conversation. An assistant message may carry `tool_calls` (its content
    may then be null); a `tool` message answers the call named by `tool_call_id`. `refusal`,
    `annotations`, `audio` and `function_call` are what the `openai` client sends back when an
    assistant message it received is appended to the next request's messages: accepted, unused."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    refusal: str | None = None
    annotations: list[dict[str, Any]] | None = None
    audio: None = None
    function_call: None = None

    @model_validator(mode="after")
    def _shape(self) -> ChatMessage:
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a message with role 'tool' needs the tool_call_id of the call it answers")
        if self.role != "tool" and self.tool_call_id is not None:
            raise ValueError(f"tool_call_id belongs on a message with role 'tool', not {self.role!r}")
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError(f"tool_calls belong on an assistant message, not one with role {self.role!r}")
        if self.content is None and not (self.role == "assistant" and (self.tool_calls or self.refusal is not None)):
            raise ValueError(f"a message with role {self.role!r} needs content (only an assistant message with "
                             "tool_calls may leave it null)")
        return self


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)  # deprecated by OpenAI, still sent by many clients
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[ChatTool] | None = Field(None, min_length=1, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False


class TokenizeCompletionRequest(Strict):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(Strict):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ChatTool] | None = Field(None, min_length=1, max_length=MAX_TOOLS)  # rendered as a chat request's
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: bool = False


class DetokenizeRequest(Strict):
    model: str | None = None
    tokens: list[TokenId]
