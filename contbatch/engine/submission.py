"""Turning a caller's request into engine state, with every check done at submission.

Runs in the caller's thread and touches nothing shared: a bad request raises here, before it
can reach the engine thread or disturb another request.
"""

from __future__ import annotations

import dataclasses
import threading
import uuid
from collections.abc import Mapping, Sequence

import torch

from ..cache.block_manager import blocks_for
from ..config import ResolvedConfig
from ..detokenizer import IncrementalDetokenizer
from ..requests import RequestState
from ..sampling.grammar import GrammarCompiler
from ..sampling.params import SamplingParams, is_integer
from .stopping import StopDefaults


def as_token_ids(input_ids) -> list[int]:
    """One prompt's token ids from what a user has at hand: a list, a 1-D tensor (or a batch
    of one), or a tokenizer's output (`BatchEncoding` or any mapping with `input_ids`, as
    `apply_chat_template(..., return_dict=True)` and, in some versions, plain calls return).
    Floats and bools are refused, not truncated: they are a caller's bug, not token ids."""
    if isinstance(input_ids, Mapping):
        if "input_ids" not in input_ids:
            raise ValueError(f"a mapping prompt needs an 'input_ids' entry, got keys {list(input_ids)[:5]}")
        input_ids = input_ids["input_ids"]
    if isinstance(input_ids, (str, bytes)):
        raise ValueError("input_ids must be token ids, not text: tokenize the prompt first")
    if isinstance(input_ids, torch.Tensor):
        if input_ids.dim() > 1 and input_ids.shape[0] != 1 or input_ids.dim() > 2:
            raise ValueError(f"one prompt per request: got a tensor of shape {tuple(input_ids.shape)}")
        if input_ids.is_floating_point() or input_ids.dtype == torch.bool:
            raise ValueError(f"token ids must be integers, got a {input_ids.dtype} tensor")
        input_ids = input_ids.reshape(-1).tolist()
    elif not isinstance(input_ids, Sequence) and not hasattr(input_ids, "__array__"):
        raise ValueError(f"input_ids must be a sequence of token ids, got {type(input_ids).__name__}")
    ids = list(input_ids)
    if len(ids) == 1 and not is_integer(ids[0]) and not isinstance(ids[0], (str, bytes, float, bool)):
        return as_token_ids(ids[0])  # a batch of one, as tokenizers return with return_tensors
    bad = [t for t in ids if not is_integer(t)]
    if bad:
        raise ValueError(f"token ids must be integers, got {bad[0]!r} ({type(bad[0]).__name__})")
    if not ids:
        raise ValueError("empty prompt: a request needs at least one input token")
    return [int(t) for t in ids]


class RequestBuilder:
    def __init__(self, resolved: ResolvedConfig, defaults: StopDefaults, vocab_size: int, tokenizer=None) -> None:
        self.resolved = resolved
        self.defaults = defaults
        self.vocab_size = vocab_size
        self.tokenizer = tokenizer
        self._grammars: GrammarCompiler | None = None  # made on the first structured request
        self._grammars_lock = threading.Lock()

    def build(
        self,
        input_ids: Sequence[int] | torch.Tensor,
        request_id: str | None,
        max_new_tokens: int | None,
        streaming: bool,
        eos_token_id: int | Sequence[int] | None,
        sampling_params: SamplingParams | None,
    ) -> list[RequestState]:
        """One state per sample: n > 1 gives n siblings that share the prompt's blocks."""
        prompt = self._prompt(input_ids)
        params = self._params(sampling_params, max_new_tokens)
        self._check_fits(len(prompt), params.max_new_tokens)
        eos = self._stop_ids(params, eos_token_id)
        compiler = self.grammar_compiler() if params.structured_output is not None else None
        rid = request_id if request_id is not None else f"req_{uuid.uuid4().hex[:12]}"
        states: list[RequestState] = []
        for i in range(params.n):
            sample = params if params.seed is None or i == 0 else dataclasses.replace(params, seed=params.seed + i)
            states.append(
                RequestState(
                    request_id=rid if params.n == 1 else f"{rid}#{i}",
                    prompt_ids=prompt,
                    max_new_tokens=params.max_new_tokens,
                    eos_token_ids=eos,
                    max_context=self.resolved.max_context,
                    streaming=streaming,
                    params=sample,
                    min_new_tokens=params.min_new_tokens,
                    logprobs=[] if params.logprobs else None,
                    top_logprobs=[] if params.top_logprobs else None,
                    detokenizer=self._detokenizer(params),
                    index=i,
                    leader=states[0] if i else None,
                    parent_id=rid,
                    grammar=compiler.state(params.structured_output, eos) if compiler else None,
                )
            )
        return states

    def _prompt(self, input_ids) -> list[int]:
        prompt = as_token_ids(input_ids)
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"token ids outside the vocabulary [0, {self.vocab_size}): {bad[:5]}")
        return prompt

    def _params(self, params: SamplingParams | None, max_new_tokens: int | None) -> SamplingParams:
        params = params or SamplingParams()
        if max_new_tokens is not None:
            if max_new_tokens < 1:
                raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
            params = dataclasses.replace(params, max_new_tokens=int(max_new_tokens))
        params = params.resolve(self.defaults.generation_config, self.defaults.max_new_tokens)
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer: pass tokenizer= to the manager or generate_batch")
        if params.structured_output is not None and self.tokenizer is None:
            raise ValueError("structured output needs a tokenizer: pass tokenizer= to the manager or generate_batch")
        for name, ids in (("logit_bias", params.logit_bias or {}), ("stop_token_ids", params.stop_token_ids or ())):
            bad = [t for t in ids if t >= self.vocab_size]
            if bad:
                raise ValueError(f"{name} token ids outside the vocabulary [0, {self.vocab_size}): {bad[:5]}")
        if self.resolved.return_logprobs and not params.logprobs:
            params = dataclasses.replace(params, logprobs=True)
        return params

    def grammar_compiler(self) -> GrammarCompiler:
        """The compiler for this tokenizer and vocabulary, built once (by whichever thread
        submits the first structured request)."""
        if self.tokenizer is None:
            raise ValueError("structured output needs a tokenizer: pass tokenizer= to the manager or generate_batch")
        with self._grammars_lock:
            if self._grammars is None:
                self._grammars = GrammarCompiler(self.tokenizer, self.vocab_size, sorted(self.defaults.eos_token_ids))
            return self._grammars

    def close_grammars(self) -> None:
        """Stop the grammar compiler's worker processes (never waits on a compile); compiled
        grammars stay cached, and a later spec that needs a worker starts a new one."""
        with self._grammars_lock:
            grammars = self._grammars
        if grammars is not None:
            grammars.close()

    def _check_fits(self, prompt_len: int, max_new: int) -> None:
        r = self.resolved
        total = prompt_len + max_new
        if total > r.max_context:
            raise ValueError(
                f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new}) = {total} exceeds the model's "
                f"context of {r.max_context} tokens"
            )
        needed = blocks_for(total, r.block_size)
        if needed > r.max_blocks_per_request:
            raise ValueError(
                f"request needs {needed} blocks of {r.block_size} tokens but "
                f"max_blocks_per_request={r.max_blocks_per_request} addresses "
                f"{r.max_blocks_per_request * r.block_size} tokens; raise max_blocks_per_request or pass workload hints"
            )
        if needed > r.num_blocks:
            raise ValueError(
                f"request needs {total} tokens of KV but the whole cache holds {r.num_blocks * r.block_size}; "
                "raise num_blocks"
            )

    def _stop_ids(self, params: SamplingParams, eos_token_id) -> frozenset[int]:
        if params.ignore_eos:
            eos: frozenset[int] = frozenset()
        elif eos_token_id is None:
            eos = self.defaults.eos_token_ids
        else:
            eos = frozenset([eos_token_id] if isinstance(eos_token_id, int) else eos_token_id)
        return eos | frozenset(params.stop_token_ids or ())

    def _detokenizer(self, params: SamplingParams) -> IncrementalDetokenizer | None:
        if self.tokenizer is None:
            return None
        return IncrementalDetokenizer(
            self.tokenizer, params.skip_special_tokens, params.stop or (), params.include_stop_str_in_output
        )


def prefix_order(groups: list[list[RequestState]], block_size: int) -> list[list[RequestState]]:
    """With prefix sharing on, one request per distinct leading block goes first and the others
    follow grouped by prefix: the leaders compute the shared blocks, and the followers,
    admitted in later steps, find them cached."""
    if len(groups) < 2:
        return groups
    bs = block_size
    leaders: list[list[RequestState]] = []  # first of each prefix, and prompts too short to share
    seen: set[tuple[int, ...]] = set()
    followers: list[tuple[tuple[int, ...], int, list[RequestState]]] = []
    for i, group in enumerate(groups):
        prompt = group[0].prompt_ids
        key = tuple(prompt[:bs])
        if len(prompt) <= bs or key not in seen:
            seen.add(key)
            leaders.append(group)
        else:
            followers.append((key, i, group))
    followers.sort(key=lambda f: (f[0], f[1]))
    return leaders + [f[2] for f in followers]
