"""Ray Data: batch generation with one engine per actor, `Dataset.map_batches`-style.

`ContbatchPredictor` is a stateful callable class: Ray Data constructs it once per actor (the
model is loaded and the engine started there), then calls it with batch after batch. Each
batch goes to the engine in one `add_requests`, so the engine's own continuous batching fills
its steps from the whole batch (Ray Data's batch is the unit of work an actor is handed, not
the engine's step). Rows come back in input order, with the generated token ids, text, finish
reason, error and, if asked, logprobs; a request that fails (or that the engine refuses, e.g.
a prompt longer than the context) is a row with its error, never a lost row or a failed job.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Sequence

import numpy as np

from ..engine.manager import ContinuousBatchingManager
from ..requests import GenerationOutput, RequestStatus
from ..sampling.params import SamplingParams
from .spec import EngineSpec

logger = logging.getLogger("contbatch.ray")

RESULT_COLUMNS = ("generated_token_ids", "generated_text", "status", "finish_reason", "error")


def _objects(values: list) -> np.ndarray:
    """A 1-D object array (np.array would make equal-length lists a 2-D array)."""
    out = np.empty(len(values), dtype=object)
    out[:] = values
    return out


class ContbatchPredictor:
    """For `ds.map_batches(ContbatchPredictor, fn_constructor_kwargs=..., concurrency=N)`.

    Input rows carry `token_ids` (a list of ints) or `prompt` (text, encoded by the model's
    tokenizer; with `chat_template` wrapped as one user turn). Every input column is kept."""

    def __init__(self, spec: EngineSpec, sampling_params: SamplingParams | None = None, *,
                 chat_template: bool = False, result_timeout_s: float = 600.0) -> None:
        model, self.tokenizer = spec.load()
        self.sampling_params = sampling_params
        self.chat_template = chat_template
        self.result_timeout_s = result_timeout_s
        self.manager = ContinuousBatchingManager(model, None, spec.config, tokenizer=self.tokenizer)
        self.manager.start()
        self._prefix = uuid.uuid4().hex[:8]
        self._batches = 0

    def _encode(self, prompt) -> list[int]:
        if not isinstance(prompt, str):
            return [int(t) for t in prompt]
        if self.chat_template and self.tokenizer.chat_template:
            return list(self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                           add_generation_prompt=True, tokenize=True,
                                                           return_dict=False))
        return self.tokenizer.encode(prompt)

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        column = "token_ids" if "token_ids" in batch else "prompt"
        if column not in batch:
            raise ValueError(f"a batch needs a `token_ids` or `prompt` column; got {sorted(batch)}")
        inputs = [self._encode(p) for p in batch[column]]
        self._batches += 1
        ids = [f"{self._prefix}-{self._batches}-{i}" for i in range(len(inputs))]
        refused = self._submit(inputs, ids)
        outs = [refused[rid] if rid in refused else self._wait(rid) for rid in ids]
        result = {
            "generated_token_ids": _objects([list(o.generated_tokens) for o in outs]),
            "generated_text": _objects([o.text for o in outs]),
            "status": _objects([o.status.value for o in outs]),
            "finish_reason": _objects([o.finish_reason for o in outs]),
            "error": _objects([o.error for o in outs]),
        }
        if self.sampling_params is not None and self.sampling_params.wants_logprobs:
            result["logprobs"] = _objects([list(o.logprobs or []) for o in outs])
        return {**batch, **result}

    def _submit(self, inputs: list[list[int]], ids: list[str]) -> dict[str, GenerationOutput]:
        """Submit the batch in one call; if the engine refuses it (`add_requests` is all or
        nothing), submit row by row so that only the bad rows fail. Returns the refused rows
        as failed outputs carrying the engine's message."""
        try:
            self.manager.add_requests(inputs, request_ids=ids, sampling_params=self.sampling_params)
            return {}
        except ValueError:
            pass
        refused = {}
        for x, rid in zip(inputs, ids):
            try:
                self.manager.add_request(x, request_id=rid, sampling_params=self.sampling_params)
            except ValueError as exc:
                refused[rid] = GenerationOutput(rid, list(x), [], RequestStatus.FAILED, "error", str(exc))
        return refused

    def _wait(self, request_id: str):
        out = self.manager.get_result(request_id, timeout=self.result_timeout_s)
        if out is None:
            raise RuntimeError(f"request {request_id} had no result within {self.result_timeout_s} s "
                               f"(engine running: {self.manager.is_running()})")
        return out

    def __del__(self) -> None:
        manager = getattr(self, "manager", None)
        if manager is not None and manager.is_running():
            manager.stop(hard_stop=True)


def generate(ds, *, model: str | None = None, spec: EngineSpec | None = None,
             sampling_params: SamplingParams | None = None, concurrency: int = 1, batch_size: int = 16,
             num_cpus: float = 1.0, num_gpus: float = 0.0, chat_template: bool = False, **sampling):
    """Generate for every row of the Ray Dataset `ds` on `concurrency` engine actors.

    Rows need `token_ids` or `prompt`; the result is a lazy Dataset with the input columns and
    `RESULT_COLUMNS` (plus `logprobs` when asked), in input order. `sampling` keywords build the
    `SamplingParams` (e.g. `max_new_tokens=32, temperature=0`) when `sampling_params` is None."""
    import ray.data

    if spec is None:
        spec = EngineSpec(model=model)
    elif model is not None:
        raise ValueError("give either model= or spec=, not both")
    if sampling_params is None:
        sampling_params = SamplingParams(**sampling) if sampling else None
    elif sampling:
        raise ValueError(f"give either sampling_params= or sampling keywords, not both ({sorted(sampling)})")
    # Ray Data may finish blocks out of order; the caller gets results in input order. A Dataset
    # runs with the context it was made with (a copy), so set it there, not only globally.
    ray.data.DataContext.get_current().execution_options.preserve_order = True
    ds.context.execution_options.preserve_order = True
    out = ds.map_batches(
        ContbatchPredictor, fn_constructor_kwargs={"spec": spec, "sampling_params": sampling_params,
                                                   "chat_template": chat_template},
        concurrency=concurrency, batch_size=batch_size, num_cpus=num_cpus, num_gpus=num_gpus,
        batch_format="numpy")
    out.context.execution_options.preserve_order = True
    return out


def generate_rows(prompts: Sequence, **kwargs) -> list[dict]:
    """`generate` over a list of prompts (text or token-id lists) in a new Dataset; rows in order."""
    import ray.data

    key = "prompt" if prompts and isinstance(prompts[0], str) else "token_ids"
    ds = ray.data.from_items([{key: p} for p in prompts])
    return generate(ds, **kwargs).take_all()
