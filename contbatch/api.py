"""The two convenience entry points built on the manager."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from tqdm.auto import tqdm

from .config import ContinuousBatchingConfig
from .engine.manager import ContinuousBatchingManager
from .engine.stopping import stop_defaults
from .engine.submission import as_token_ids
from .requests import GenerationOutput
from .sampling.params import SamplingParams


@contextmanager
def continuous_batching(
    model: torch.nn.Module,
    generation_config=None,
    config: ContinuousBatchingConfig | None = None,
    tokenizer=None,
) -> Iterator[ContinuousBatchingManager]:
    """A started manager for the `with` block; drained on normal exit, hard-stopped on error."""
    manager = ContinuousBatchingManager(model, generation_config, config, tokenizer)
    manager.start()
    try:
        yield manager
    except BaseException:
        manager.stop(hard_stop=True)
        raise
    else:
        manager.stop()
    finally:
        manager.destroy()


def _with_hints(config: ContinuousBatchingConfig | None, inputs: Sequence[Sequence[int]], max_new: int):
    """Fill the workload hints the caller left open: generate_batch knows the workload."""
    config = config or ContinuousBatchingConfig()
    updates = {}
    if config.max_prompt_length is None and config.max_generated_length is None:
        updates["max_prompt_length"] = max(1, max((len(x) for x in inputs), default=1))
        updates["max_generated_length"] = max_new
    if config.max_requests_per_batch is None:
        updates["max_requests_per_batch"] = max(1, len(inputs))
    return dataclasses.replace(config, **updates) if updates else config


def generate_batch(
    model: torch.nn.Module,
    inputs: Sequence[Sequence[int]],
    generation_config=None,
    config: ContinuousBatchingConfig | None = None,
    progress_bar: bool = True,
    sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    tokenizer=None,
    lora_adapters: dict[str, str] | None = None,
    adapters: Sequence[str | None] | None = None,
) -> dict[str, GenerationOutput]:
    """Generate for every input and wait; results keyed `req_0`, `req_1`, ... in input order.

    `sampling_params` is one `SamplingParams` for all inputs or a list, one per input; a
    `tokenizer` adds decoded text (and enables stop strings). Requests that fail are returned
    with status FAILED and their error, never dropped. `lora_adapters` ({name: PEFT adapter
    directory}) are loaded first; `adapters` names one of them, or None, per input.
    """
    inputs = [as_token_ids(x) for x in inputs]  # BatchEncodings, tensors: lengths for the hints
    per_input = sampling_params if isinstance(sampling_params, Sequence) else [sampling_params]
    max_new = max(
        (p.max_new_tokens for p in per_input if p is not None and p.max_new_tokens),
        default=stop_defaults(model, generation_config).max_new_tokens,
    )
    config = _with_hints(config, inputs, max_new)
    ids = [f"req_{i}" for i in range(len(inputs))]
    results: dict[str, GenerationOutput] = {}
    with continuous_batching(model, generation_config, config, tokenizer) as manager:
        for name, path in (lora_adapters or {}).items():
            manager.load_adapter(name, path)
        manager.add_requests(inputs, request_ids=ids, sampling_params=sampling_params, adapters=adapters)
        with tqdm(total=len(ids), disable=not progress_bar, desc="generate_batch", unit="req") as bar:
            while len(results) < len(ids):
                out = manager.get_result(timeout=1.0)
                if out is None:
                    if not manager.is_running():
                        raise RuntimeError("the engine stopped before every request finished")
                    continue
                results[out.request_id] = out
                bar.update(1)
    return {rid: results[rid] for rid in ids}
