"""Running a step on the model: static I/O slots, CUDA graphs, and three streams.

One runner for every device and backend. A step goes through three calls, so that the engine
can overlap them across steps:
`launch` copies the step's inputs to the device (host-to-device stream), fills in tokens
still being sampled by the previous step (carry-over), and enqueues the forward (compute
stream; a graph replay when its padded shape was seen before); `sample` enqueues token
choice once the previous step's tokens are known on the host (penalties need them), then
the copy back (device-to-host stream); `wait` blocks until that copy has landed.

Inputs live in per-slot buffers of fixed addresses, two slots when async batching is on:
step N+1 is written into one while step N's forward still reads the other. On a CPU the
streams are no-ops and everything runs in call order: the same code, exercised by the tests.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from ..attention.metadata import AttentionBackend, StepMetadata
from .. import context
from ..attention.paged import ENGINE_MASK
from ..cache.paged_cache import PagedAttentionCache
from ..faults import inject
from ..sampling.sampler import SampleResult, Sampler
from ..sampling.verify import verify
from .buckets import Bucketing, StepShape, pad_batch, round_up
from .compile import compile_counters
from .step_batch import StepBatch, apply_carry
from .graphs import GraphCache
from ..lora.segments import group_rows
from ..attention.recurrent import recurrent_step

_LONG = ("input_ids", "carry", "positions", "write_slots", "logits_indices")


class RunnerFailure(RuntimeError):
    """The runner can run no more steps (a tensor-parallel rank died or hung): the engine stops,
    failing every request with this message, which says all there is to say."""


class Streams:
    """Host-to-device, compute and device-to-host streams and their events. Every CUDA
    stream call of the runner goes through here: off CUDA they are no-ops and work runs in
    call order (tests substitute a recorder to check the ordering on the CPU)."""

    def __init__(self, device: torch.device) -> None:
        self.asynchronous = device.type == "cuda"
        if self.asynchronous:
            self.h2d, self.compute, self.d2h = (torch.cuda.Stream(device) for _ in range(3))

    def on(self, name: str):
        return torch.cuda.stream(getattr(self, name)) if self.asynchronous else nullcontext()

    def record(self, name: str, timing: bool = False):
        if not self.asynchronous:
            return None
        event = torch.cuda.Event(enable_timing=timing)
        event.record(getattr(self, name))
        return event

    def wait(self, name: str, event) -> None:
        """Stream `name` runs nothing more until `event` has passed."""
        if event is not None:
            getattr(self, name).wait_event(event)

    def synchronize(self, event) -> None:
        """The host blocks until `event` has passed."""
        if event is not None:
            event.synchronize()

    def elapsed(self, start, end) -> float:
        return start.elapsed_time(end) / 1000 if start is not None else 0.0

    def to_host(self, t: torch.Tensor | None) -> torch.Tensor | None:
        """Enqueue a copy to (pinned) host memory on the current (device-to-host) stream."""
        if t is None or not self.asynchronous:
            return t
        t.record_stream(self.d2h)  # made on the compute stream, read here: keep it alive
        return t.to("cpu", non_blocking=True)


@dataclass
class IOSlot:
    """Fixed-address input buffers (device) with their host staging (pinned on CUDA)."""

    index: int
    device: dict[str, torch.Tensor]
    host: dict[str, torch.Tensor]
    tokens: torch.Tensor  # sampled tokens of the slot's last step, read by the next step's carry
    h2d_done: object = None  # event: the staging may be rewritten once it has passed
    compute_done: object = None  # event: the device buffers are free once it has passed
    _views: dict = field(default_factory=dict)

    def views(self, shape: StepShape, which: str = "device") -> dict[str, torch.Tensor]:
        """The buffers cut to `shape` (cached: the same shapes come back step after step)."""
        cached = self._views.get((shape, which))
        if cached is not None:
            return cached
        bufs = getattr(self, which)
        t, b = shape.num_tokens, shape.num_requests
        sizes = dict.fromkeys(("input_ids", "carry", "positions", "write_slots"), t)
        sizes.update(cu_seqlens_q=b + 1, cu_seqlens_k=b + 1, kv_lens=b, logits_indices=shape.num_logits, block_table=b)
        sizes.update(tile_request=shape.num_tiles, tile_start=shape.num_tiles)
        views = {name: bufs[name][:n] for name, n in sizes.items()}
        if len(self._views) < 256:  # exact (unpadded) shapes are many; keep the cache bounded
            self._views[(shape, which)] = views
        return views


@dataclass
class InFlight:
    """A launched step: what the manager needs to finish it later."""

    batch: StepBatch
    shape: StepShape
    slot: IOSlot
    logits: torch.Tensor
    computed: list[int]  # each chunk's num_computed_tokens once this step has run
    token_index: list[int] = field(default_factory=list)  # each sampled request's reserved place
    events: list = field(default_factory=list)  # (start, end) timing pairs on the compute stream
    d2h_done: object = None
    result: SampleResult | None = None


class StepRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        cache: PagedAttentionCache,
        backend: AttentionBackend,
        bucketing: Bucketing,
        max_tokens: int,
        table_width: int,
        num_slots: int,
        graphs: GraphCache | None,
        sampler: Sampler | None = None,
        compiled: dict[str, Callable[..., torch.Tensor] | None] | None = None,
    ) -> None:
        self.model = model
        self.cache = cache
        self.backend = backend
        self.bucketing = bucketing
        self.graphs = graphs
        self.sampler = sampler or Sampler()
        self.streams = Streams(cache.device)
        self.table_width = table_width
        self.max_tokens = round_up(max_tokens, bucketing.q_interval)
        self.max_requests = bucketing.max_requests
        self.max_tiles = backend.max_varlen_tiles(self.max_tokens, self.max_requests) if backend.max_varlen_tiles else 0
        self.slots = [self._slot(i) for i in range(num_slots)]
        self._next_slot = 0
        self.busy_seconds = 0.0  # device time of forwards and sampling (CUDA events)
        self.decode_seconds = 0.0
        self.compiled = compiled or {}  # "decode" / "varlen" -> the compiled forward of that path
        self.compiles = 0  # graphs Dynamo compiled for our steps, and breaks it met in them
        self.graph_breaks = 0

    def _slot(self, index: int) -> IOSlot:
        t, b, w = self.max_tokens, self.max_requests, self.table_width
        sizes = {name: (t,) for name in ("input_ids", "carry", "positions", "write_slots")}
        # Logits rows: one per request, or up to one per token when speculation verifies runs.
        sizes.update(logits_indices=(max(b, t),), cu_seqlens_q=(b + 1,), cu_seqlens_k=(b + 1,), kv_lens=(b,))
        sizes.update(block_table=(b, w), tile_request=(self.max_tiles,), tile_start=(self.max_tiles,))
        dtype = {name: torch.long if name in _LONG else torch.int32 for name in sizes}
        dev = self.cache.device
        pin = dev.type == "cuda"
        device = {n: torch.zeros(s, dtype=dtype[n], device=dev) for n, s in sizes.items()}
        host = {n: torch.zeros(s, dtype=dtype[n], pin_memory=pin) for n, s in sizes.items()} if pin else device
        return IOSlot(index, device, host, torch.zeros(b, dtype=torch.long, device=dev))

    # -- launch --------------------------------------------------------------------------
    def shape_of(self, batch: StepBatch) -> tuple[StepShape, bool]:
        """The step's shape, and whether it runs as a graph. Graphs and compiled steps are
        padded to a bucket: each shape is a capture, or a compile."""
        if self.graphs is not None and self.bucketing.graphable(batch):
            return self.bucketing.padded(batch), True
        if self.compiled.get(_path(batch.decode_only)) is not None:
            return self.bucketing.padded(batch), False
        return self.bucketing.exact(batch), False

    @torch.inference_mode()
    def launch(self, batch: StepBatch, prev: InFlight | None) -> InFlight:
        slot = self.slots[self._next_slot]
        self._next_slot = (self._next_slot + 1) % len(self.slots)
        shape, graphed = self.shape_of(batch)
        host = pad_batch(batch, shape, self.table_width, self.cache.num_blocks, self.cache.write_trash_slot)
        none = torch.zeros(0, dtype=torch.int32)
        host["tile_request"], host["tile_start"] = (
            self.backend.varlen_tiles(host["cu_seqlens_q"], shape.num_tiles) if shape.num_tiles else (none, none)
        )
        self._upload(slot, shape, host)
        prepared = self.backend.prepare(host, self.cache)

        views = slot.views(shape)
        s = self.streams
        with s.on("compute"):
            s.wait("compute", slot.h2d_done)
            start = s.record("compute", timing=True)
            if prev is not None:
                apply_carry(views["input_ids"], views["carry"], prev.slot.tokens[: len(prev.batch.sampled)])
            lora = group_rows(batch.lora_slots, shape.num_tokens, self.cache.device)
            recurrent = recurrent_step(self.cache.recurrent, batch) if self.cache.recurrent is not None else None
            logits = self._forward(slot, shape, views, graphed, prepared, lora, recurrent)
            events = [(start, s.record("compute", timing=True))]
        # Proposals are not counted as computed: `EngineCore` adds the accepted ones.
        computed = [c.state.num_computed_tokens + c.num_tokens - len(c.draft) for c in batch.chunks]
        return InFlight(batch, shape, slot, logits, computed, events=events)

    def _upload(self, slot: IOSlot, shape: StepShape, host: dict[str, torch.Tensor]) -> None:
        s = self.streams
        if not s.asynchronous:
            for name, view in slot.views(shape).items():
                view.copy_(host[name])
            return
        s.synchronize(slot.h2d_done)  # the slot's staging is still being read otherwise
        staging, device = slot.views(shape, "host"), slot.views(shape)
        with s.on("h2d"):
            s.wait("h2d", slot.compute_done)  # the slot's last forward has read its inputs
            for name, view in staging.items():
                view.copy_(host[name])
                device[name].copy_(view, non_blocking=True)
            slot.h2d_done = s.record("h2d")

    def _forward(self, slot: IOSlot, shape: StepShape, views: dict[str, torch.Tensor], graphed: bool,
                 prepared: object, lora: object = None, recurrent: object = None) -> torch.Tensor:
        meta = StepMetadata(
            cache=self.cache,
            backend=self.backend,
            decode_only=shape.decode_only,
            write_slots=views["write_slots"],
            cu_seqlens_q=views["cu_seqlens_q"],
            cu_seqlens_k=views["cu_seqlens_k"],
            kv_lens=views["kv_lens"],
            block_table=views["block_table"],
            tile_request=views["tile_request"] if shape.num_tiles else None,
            tile_start=views["tile_start"] if shape.num_tiles else None,
            max_q_len=shape.num_tokens,
            max_kv_len=shape.max_kv_len,
            prepared=prepared,
            lora=lora,
            recurrent=recurrent,
            positions=views["positions"],
        )

        inject("forward")

        compiled = self.compiled.get(_path(shape.decode_only))

        def run() -> torch.Tensor:
            if compiled is not None:
                return self._run_compiled(compiled, meta, views)
            with context.running(meta):
                return self._run_eager(views, meta)

        if not graphed:
            return run()
        key = (slot.index, shape)
        logits = self.graphs.replay(key)
        if logits is None:
            logits = run()  # this step's result; it also warms up what the capture records
            self.graphs.add(key, run)
        return logits

    def _run_eager(self, views: dict[str, torch.Tensor], meta: StepMetadata) -> torch.Tensor:
        # A model attached while it trains (RL: the same object generates and learns) may be in
        # train mode; its steps must still be inference: no dropout, whatever the flag says.
        with _NoDropout() if self.model.training else nullcontext():
            out = self.model(
                input_ids=views["input_ids"][None],
                position_ids=views["positions"][None],
                attention_mask=ENGINE_MASK,
                logits_to_keep=views["logits_indices"],
                use_cache=False,
                step_metadata=meta,
            )
        return out.logits[0]

    def _run_compiled(self, fn: Callable[..., torch.Tensor], meta: StepMetadata,
                      views: dict[str, torch.Tensor]) -> torch.Tensor:
        graphs, breaks = compile_counters()
        with context.running(meta, compiled=True):
            logits = fn(views["input_ids"], views["positions"], views["logits_indices"])
        graphs_after, breaks_after = compile_counters()
        self.compiles += graphs_after - graphs
        self.graph_breaks += breaks_after - breaks
        return logits

    # -- sample and read back ------------------------------------------------------------
    @torch.inference_mode()
    def sample(self, step: InFlight) -> None:
        """Enqueue token choice for a launched step: call once the previous step's tokens
        are applied, since penalties and stop-token masks read each request's history."""
        s = self.streams
        states = step.batch.sampled
        with s.on("compute"):
            start = s.record("compute", timing=True)
            if step.batch.drafts is not None:
                result = verify(self.sampler, step.logits[: step.batch.num_logits], states, step.batch.drafts)
            else:
                result = self.sampler.sample_states(step.logits[: len(states)], states)
            step.slot.tokens[: len(states)].copy_(result.tokens)
            step.events.append((start, s.record("compute", timing=True)))
            step.slot.compute_done = s.record("compute")
        with s.on("d2h"):
            s.wait("d2h", step.slot.compute_done)
            step.result = SampleResult(*(s.to_host(t) for t in (result.tokens, *_extras(result))))
            step.d2h_done = s.record("d2h")

    def wait(self, step: InFlight) -> SampleResult:
        s = self.streams
        s.synchronize(step.d2h_done)
        busy = sum(s.elapsed(a, b) for a, b in step.events)
        self.busy_seconds += busy
        if step.shape.decode_only:
            self.decode_seconds += busy
        return step.result

    # -- what the manager asks of any runner (a tensor-parallel driver answers for its group) --
    def check(self) -> None:
        """Raise if the runner can no longer run steps (never, for a runner of this process)."""

    def close(self) -> None:
        """The engine stops for good (nothing to release here)."""

    def stats(self) -> dict:
        """Counters of the runner's own, beside the core's (none here)."""
        return {}


_DROPOUTS = {F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout, F.feature_alpha_dropout,
             torch.dropout, torch.alpha_dropout, torch.feature_alpha_dropout}


class _NoDropout(TorchFunctionMode):
    """Dropout as identity, on this thread only: the user's training forward elsewhere keeps it."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in _DROPOUTS:
            return args[0] if args else kwargs["input"]
        return func(*args, **(kwargs or {}))


def _path(decode_only: bool) -> str:
    return "decode" if decode_only else "varlen"


def _extras(result: SampleResult) -> tuple:
    return (result.logprobs, result.top_ids, result.top_logprobs, result.ok, result.run_tokens, result.run_lengths,
            result.run_logprobs)
