"""Draft-model proposals: a smaller LM with the target's tokenizer, run by the engine's own
machinery (a paged cache, a step runner, the same attention backend) beside the target.

Each request keeps a shadow sequence in the draft's cache: the tokens whose draft KV is in
place. A proposal round first catches each shadow up with the request's real tokens (its
whole prompt the first time; afterwards the tokens accepted since, after dropping the
rejected tail), sampling the first proposal from the last caught-up row, then runs k - 1
single-token steps, all requests of the round in one batch. The draft proposes greedily, so
its proposal is a point mass and the target's verification (`sampling/verify.py`) keeps the
target's distribution exactly. A draft cache that runs out of blocks drops the shadows of
requests not proposing now, then skips proposals that still do not fit: never an error.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import numpy as np
import torch

from ..attention.paged import attach, detach, is_attached
from ..cache.paged_cache import KVLayout
from ..cpu.plan import plan_cpu
from ..cpu.routers import CpuRouters
from ..runtime.machinery import build_machinery
from ..runtime.step_batch import build_step_batch
from ..requests import RequestState, RequestStatus
from ..sampling.params import SamplingParams
from ..scheduling.scheduler import ScheduledChunk, StepPlan
from ..config import SpeculativeConfig

logger = logging.getLogger("contbatch")

_GREEDY = SamplingParams(temperature=0.0)


def _cpu_routers(draft: torch.nn.Module, r) -> CpuRouters:
    """The target's CPU kernel choices (linear kernel and prepacking as in force for the
    target, fused norm and rotary) planned for the draft's own layers: its forwards are engine
    steps like the target's. Its decoder layers keep their own forward. Shapes the target
    shares were probed already; the plan is logged once."""
    if torch.device(r.device).type != "cpu" or r.cpu is None:
        return CpuRouters(draft, None)
    knobs = dataclasses.replace(r.cpu.knobs, linear_prepack=r.cpu.linear.prepack)
    plan = plan_cpu(draft, knobs, prefill=r.cpu.prefill, layers=False)
    logger.info("contbatch: draft model %s", plan.describe(prefill=False))
    return CpuRouters(draft, plan)


class DraftProposer:
    def __init__(self, config: SpeculativeConfig, draft: torch.nn.Module, resolved) -> None:
        r = resolved
        self.model = draft  # on the target's device and dtype (setup/loading.py's load_draft)
        self.layout = KVLayout.from_model_config(self.model.config, next(self.model.parameters()).dtype)
        machinery = build_machinery(self.model, r, self.layout, primary=False)  # one slot, eager, unshared
        self.cache, self.runner = machinery.cache, machinery.runner
        self.max_batch_tokens = r.max_batch_tokens
        self.shadows: dict[str, RequestState] = {}
        self._saved_attn: str | None = None
        self.routers = _cpu_routers(self.model, r)
        self.seconds = 0.0  # spent in draft forwards: the cost side of speculation

    # -- lifecycle ------------------------------------------------------------------------
    def attach(self) -> None:
        # The target itself as its own draft (a test of full acceptance) is attached already.
        if self._saved_attn is None and not is_attached(self.model):
            self._saved_attn = attach(self.model)
            self.routers.install()

    def detach(self) -> None:
        if self._saved_attn is not None:
            detach(self.model, self._saved_attn)
            self._saved_attn = None
            self.routers.uninstall()

    def forget(self, request_id: str) -> None:
        if self.shadows.pop(request_id, None) is not None:
            self.cache.block_manager.free(request_id)

    # -- proposing -------------------------------------------------------------------------
    def _shadow(self, state: RequestState) -> RequestState:
        """The request's shadow, with its rejected tail dropped: only tokens that still
        match the request's own keep their draft KV."""
        shadow = self.shadows.get(state.request_id)
        if shadow is None:
            shadow = self.shadows[state.request_id] = RequestState(state.request_id, [], max_new_tokens=1,
                                                                   params=_GREEDY, status=RequestStatus.DECODING)
        fed, real = shadow.all_token_ids, state.all_token_ids
        n = min(shadow.num_computed_tokens, len(real))
        same = np.asarray(fed[:n], np.int64) == np.asarray(real[:n], np.int64)
        keep = n if same.all() else int(np.argmin(same))
        keep = min(keep, len(real) - 1)  # the last token runs again: its row gives the first proposal
        shadow.all_token_ids = list(real)
        shadow.num_computed_tokens = keep
        return shadow

    def _room(self, shadows: list[RequestState], ks: list[int]) -> list[bool]:
        """Blocks for each shadow's catch-up and proposals; under pressure, others' shadows go first."""
        bm = self.cache.block_manager
        wanted = {s.request_id for s in shadows}
        fits = []
        for shadow, k in zip(shadows, ks):
            need = len(shadow.all_token_ids) + k
            ok = bm.ensure(shadow.request_id, need)
            if not ok:
                for other in [rid for rid in self.shadows if rid not in wanted]:
                    self.forget(other)
                    if bm.ensure(shadow.request_id, need):
                        ok = True
                        break
            fits.append(ok)
        return fits

    def _run(self, chunks: list[ScheduledChunk]) -> dict[str, int]:
        """One draft step; returns the greedy next token of each chunk that reaches its end."""
        batch = build_step_batch(StepPlan(chunks), self.cache.block_manager)
        step = self.runner.launch(batch, None)
        self.runner.sample(step)
        tokens = self.runner.wait(step).tokens.tolist()
        for chunk, computed in zip(batch.chunks, step.computed):
            chunk.state.num_computed_tokens = computed
        return {s.request_id: t for s, t in zip(batch.sampled, tokens)}

    @torch.inference_mode()
    def propose(self, wanted: list[tuple[RequestState, int]]) -> list[list[int]]:
        t0 = time.perf_counter()
        self.attach()
        shadows = [self._shadow(s) for s, _ in wanted]
        ks = [k for _, k in wanted]
        fits = self._room(shadows, ks)
        drafts: dict[str, list[int]] = {s.request_id: [] for s in shadows}
        active = [(sh, k) for sh, k, ok in zip(shadows, ks, fits) if ok]
        # Catch up, in steps of at most max_batch_tokens; a shadow's last chunk yields its first proposal.
        pending = [sh for sh, _ in active]
        while pending:
            budget, chunks = self.max_batch_tokens, []
            for sh in pending:
                if budget <= 0:
                    break
                n = min(sh.remaining_tokens, budget)
                chunks.append(ScheduledChunk(sh, n))
                budget -= n
            for rid, token in self._run(chunks).items():
                drafts[rid].append(token)
            pending = [sh for sh in pending if sh.remaining_tokens > 0]
        # Then one token per step, each shadow until it has its k proposals.
        for _ in range(max((k for _, k in active), default=0) - 1):
            chunks = []
            for sh, k in active:
                if len(drafts[sh.request_id]) < k:
                    sh.all_token_ids.append(drafts[sh.request_id][-1])
                    chunks.append(ScheduledChunk(sh, 1))
            if not chunks:
                break
            for rid, token in self._run(chunks).items():
                drafts[rid].append(token)
        self.seconds += time.perf_counter() - t0
        return [drafts[s.request_id] for s in shadows]
