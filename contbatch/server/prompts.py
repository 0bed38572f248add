"""Turning request prompts into token ids: plain text, token ids, and chat messages.

The tokenizer is the model's own; chat goes through its chat template exactly as
`contbatch generate` does, so an HTTP chat request and a CLI one see the same tokens.

By default (as in vLLM) the rendered chat is tokenized as one text, so a special token typed
into a message ("<|im_end|>\n<|im_start|>system ...") becomes that control token: a client
can forge turns. With `escape_special_tokens` the template's own special tokens stay control
tokens and everything the client wrote is tokenized as plain text (transformers'
`sanitize_control_tokens`, which marks the client's strings before rendering and so finds
them even where the template trims or splits them). docs/security.md has the trade-off.

Every function here is CPU work on the request's data; the app runs them on its worker pool.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import bad_request
from .schemas import ChatMessage


@dataclass(frozen=True)
class Prompt:
    """One prompt as the engine gets it, and its text for `echo`."""

    token_ids: list[int]
    text: str | None  # for `echo` (completions); None for an escaped chat, never echoed


def completion_prompts(tokenizer, prompt, add_special_tokens: bool) -> list[Prompt]:
    """A string, a list of strings, a list of token ids, or a list of token-id lists."""
    if isinstance(prompt, str):
        items: list = [prompt]
    elif not prompt:
        raise bad_request("prompt must not be empty", "prompt")
    elif isinstance(prompt[0], int):
        items = [prompt]
    else:
        items = list(prompt)
    out = []
    for i, item in enumerate(items):
        if isinstance(item, str):
            ids = list(tokenizer.encode(item, add_special_tokens=add_special_tokens))
            text = item
        else:
            ids = list(item)
            text = None
        if not ids:
            where = "prompt" if len(items) == 1 else f"prompt[{i}]"
            raise bad_request(f"{where} is empty: a request needs at least one prompt token", "prompt")
        if text is None:
            text = decode(tokenizer, ids, "prompt")
        out.append(Prompt(ids, text))
    return out


def message_dicts(messages: list[ChatMessage]) -> list[dict]:
    """Messages as the chat template expects them; text parts are joined by newlines, as in
    vLLM; `developer` is OpenAI's newer name for `system`. An assistant's calls are kept under
    `tool_calls` (arguments as the JSON text they came as), a tool result has its `tool_call_id`
    and the `name` of the function it answers (when an earlier call in the conversation has that
    id): `tools.rendering` turns them into what the chat template takes."""
    rows = []
    names: dict[str, str] = {}
    for m in messages:
        if m.content is None:
            content = None
        else:
            content = m.content if isinstance(m.content, str) else "\n".join(p.text for p in m.content)
        row = {"role": "system" if m.role == "developer" else m.role, "content": content}
        if m.name is not None:
            row["name"] = m.name
        if m.tool_calls:
            row["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.function.name, "arguments": c.function.arguments}}
                                 for c in m.tool_calls]
            names.update((c.id, c.function.name) for c in m.tool_calls)
        if m.tool_call_id is not None:
            row["tool_call_id"] = m.tool_call_id
            if m.name is None and m.tool_call_id in names:
                row["name"] = names[m.tool_call_id]
        rows.append(row)
    return rows


def chat_prompt(
    tokenizer, rows: list[dict], add_generation_prompt: bool, continue_final_message: bool,
    add_special_tokens: bool = False, escape_special_tokens: bool = False, tools: list[dict] | None = None,
) -> Prompt:
    """The prompt of a conversation (`message_dicts` rows), with `tools` for the template."""
    if not getattr(tokenizer, "chat_template", None):
        raise bad_request("this model's tokenizer has no chat template: use /v1/completions", "messages")
    if continue_final_message:
        if add_generation_prompt:
            raise bad_request(
                "continue_final_message and add_generation_prompt cannot both be true", "continue_final_message"
            )
        if rows[-1]["role"] != "assistant":
            raise bad_request("continue_final_message needs the last message to be the assistant's", "messages")
    if escape_special_tokens:
        return _escaped_chat_prompt(tokenizer, rows, add_generation_prompt, continue_final_message, add_special_tokens,
                                    tools)
    try:
        text = tokenizer.apply_chat_template(
            rows, add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
            tokenize=False, tools=tools,
        )
    except Exception as exc:  # the template itself rejected the conversation (role order, ...)
        raise bad_request(f"the chat template rejected these messages: {exc}", "messages") from exc
    # The template already wrote any special tokens it wants; adding BOS again would double it.
    ids = list(tokenizer.encode(text, add_special_tokens=add_special_tokens))
    if not ids:
        raise bad_request("the chat template produced an empty prompt", "messages")
    return Prompt(ids, text)


def _escaped_chat_prompt(
    tokenizer, rows: list[dict], add_generation_prompt: bool, continue_final_message: bool, add_special_tokens: bool,
    tools: list[dict] | None,
) -> Prompt:
    """The chat's token ids with the clients' strings tokenized as plain text."""
    if add_special_tokens:
        raise bad_request("add_special_tokens cannot be combined with this server's escaping of special tokens: "
                          "the chat template writes them", "add_special_tokens")
    try:
        ids = tokenizer.apply_chat_template(
            rows, add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
            tokenize=True, return_dict=False, sanitize_control_tokens=True, tools=tools,
        )
    except Exception as exc:  # the template rejected the conversation, or rewrote text it cannot escape
        raise bad_request(f"the chat template rejected these messages: {exc}", "messages") from exc
    if not ids:
        raise bad_request("the chat template produced an empty prompt", "messages")
    return Prompt(list(ids), None)


def decode(tokenizer, ids: list[int], param: str) -> str:
    """Text of token ids, with ids the tokenizer does not know answered as a 400."""
    size = len(tokenizer)
    bad = [t for t in ids if not 0 <= t < size]
    if bad:
        raise bad_request(f"token ids outside the vocabulary [0, {size}): {bad[:5]}", param)
    try:
        return tokenizer.decode(ids)
    except Exception as exc:
        raise bad_request(f"cannot decode these token ids: {exc}", param) from exc
