"""Prompts for `contbatch generate` (here and on Ray): built-in ones, a file of them, and
their token ids."""

from __future__ import annotations

import json
from pathlib import Path

BUILTIN_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue.",
    "Give three tips for writing clear code.",
    "What is continuous batching in LLM inference?",
    "Translate 'good morning' into Spanish and German.",
    "Name the planets of the solar system in order.",
    "Write a Python function that reverses a string.",
]

def read_prompts(path: Path) -> list[str | list[dict]]:
    """One prompt a line, or JSONL with `prompt` (text) or `messages` (chat) fields."""
    prompts: list[str | list[dict]] = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        if path.suffix == ".jsonl":
            row = json.loads(line)
            prompts.append(row["messages"] if "messages" in row else row["prompt"])
        else:
            prompts.append(line)
    return prompts


def encode(tokenizer, prompt, chat: bool) -> list[int]:
    """A prompt as token ids: chat messages through the chat template; plain text too, when
    `chat` and the tokenizer has a template; else the text tokenized as it is."""
    if isinstance(prompt, list):
        messages = prompt
    elif chat and tokenizer.chat_template:
        messages = [{"role": "user", "content": prompt}]
    else:
        return tokenizer.encode(prompt)
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    return list(ids)
