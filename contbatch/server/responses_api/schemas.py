"""The body of `POST /v1/responses`, as strict pydantic models.

As on the other routes, a field that would change generation and that this server cannot honour
is refused with a 400 naming it (hosted tools, images, reasoning effort, `truncation: "auto"`,
`conversation`, background runs); fields that change nothing about what is generated
(`metadata`, `user`, `service_tier`, prompt-cache hints) are accepted. Input items carry every
field this server writes in its own output items, so a client can send a response's `output`
back as the next request's input (the openai-agents loop does).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag

from ..schemas import INT64_MAX, INT64_MIN, MAX_LOGPROBS, MAX_TOOLS, TOOL_NAME, Strict

ItemStatus = Literal["in_progress", "completed", "incomplete"]
LOGPROBS = "message.output_text.logprobs"
# Includables that name outputs this server never produces: accepted, nothing to include.
INCLUDABLE = (LOGPROBS, "reasoning.encrypted_content", "file_search_call.results", "web_search_call.results",
              "web_search_call.action.sources", "message.input_image.image_url",
              "computer_call_output.output.image_url", "code_interpreter_call.outputs")


class InputText(Strict):
    type: Literal["input_text"]
    text: str


class OutputText(Strict):
    type: Literal["output_text"]
    text: str
    annotations: list[dict[str, Any]] | None = None
    logprobs: list[dict[str, Any]] | None = None


class Refusal(Strict):
    type: Literal["refusal"]
    refusal: str


ContentPart = Annotated[InputText | OutputText | Refusal, Field(discriminator="type")]


class MessageItem(Strict):
    """A message: the client's, or an assistant message sent back."""

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ContentPart]
    id: str | None = None
    status: ItemStatus | None = None
    phase: str | None = None


class FunctionCallItem(Strict):
    """A call the model made earlier (an output item sent back)."""

    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str
    arguments: str
    id: str | None = None
    status: ItemStatus | None = None


class FunctionCallOutputItem(Strict):
    """The result of a call, for the model to read."""

    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str | list[InputText]
    id: str | None = None
    status: ItemStatus | None = None


def _item_type(value: Any) -> str | None:
    if isinstance(value, dict):
        kind = value.get("type", "message")
        return kind if isinstance(kind, str) else None
    return getattr(value, "type", None)


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")],
    Discriminator(_item_type, custom_error_type="input_item",
                  custom_error_message="input items are messages, function_call or function_call_output items "
                                       "(this server takes text only)"),
]


class FunctionToolParam(Strict):
    """A function the model may call (the Responses shape: name and parameters at the top)."""

    type: Literal["function"]
    name: str = Field(pattern=TOOL_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionChoice(Strict):
    type: Literal["function"]
    name: str


class FormatText(Strict):
    type: Literal["text"]


class FormatJSONObject(Strict):
    type: Literal["json_object"]


class FormatJSONSchema(Strict):
    type: Literal["json_schema"]
    name: str = Field(min_length=1, max_length=64)
    schema_: dict[str, Any] = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None  # constrained decoding enforces the schema either way


class TextConfig(Strict):
    format: Annotated[FormatText | FormatJSONObject | FormatJSONSchema, Field(discriminator="type")] | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # a hint for reasoning models; nothing here


class ReasoningConfig(Strict):
    """Only "no reasoning": this server's models answer directly."""

    effort: Literal["none"] | None = None
    summary: None = None


class ResponsesRequest(Strict):
    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    previous_response_id: str | None = None
    tools: list[FunctionToolParam] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    include: list[Literal[INCLUDABLE]] | None = None  # type: ignore[valid-type]
    stream: bool = False
    store: bool = True
    truncation: Literal["disabled"] | None = None
    reasoning: ReasoningConfig | None = None
    background: Literal[False] | None = None
    # vLLM's sampling extensions, as on the other routes.
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0, le=100)
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    # Accepted and ignored: they change nothing about what is generated.
    metadata: dict[str, str] | None = None
    user: str | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    safety_identifier: str | None = None
    stream_options: dict[str, bool] | None = None
