"""Tensor parallelism: who is who, what is checked at start, and the engine's own process group.

Two groups carry a TP engine's traffic. The default group (torch.distributed's WORLD, NCCL on
CUDA, gloo on the CPU) carries the model's own collectives, the all-reduces and gathers of its
sharded layers. The engine's group (always gloo, so the host sends plain objects) carries what
rank 0 tells the workers: the shared config at start, then each step, and while no step is
sent a heartbeat (steps.py) whose round trip every worker must answer. Every rank gives up
after `CONTBATCH_TP_TIMEOUT` seconds: rank 0 on a worker that does not answer (it hangs), a
worker on a rank 0 that sends nothing (it hangs; an idle rank 0 still sends heartbeats). A
rank that dies is seen at once: its sockets close.

What happens then: the rank that sees it raises `RankFailure`; on rank 0 the engine fails
every request with the reason and stops (`is_running()` turns False), and the handlers
registered with `on_failure` run (the `contbatch` CLI ends its server with one: launch.py).

Who destroys what: the engine destroys its own group (`ContinuousBatchingManager.destroy()`,
idempotent); the default group belongs to whoever initialized it. `load_model(tp_plan=...)`
initializes it when nothing has, and the `contbatch` CLI destroys it on exit; a script launched
by `torchrun` calls `torch.distributed.destroy_process_group()` itself at the end.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from ..cache.paged_cache import KVLayout
from ..config import ContinuousBatchingConfig, ResolvedConfig
from ..cpu.knobs import without_routers
from ..runtime.step_runner import RunnerFailure

if TYPE_CHECKING:
    from ..cpu.plan import CpuPlan

logger = logging.getLogger("contbatch")

TIMEOUT_ENV = "CONTBATCH_TP_TIMEOUT"
DEFAULT_TIMEOUT_S = 120.0


class RankFailure(RunnerFailure):
    """A rank stopped answering (died, hung, or its collectives failed): the engine cannot go on."""


_failure_handlers: list[Callable[[RankFailure], None]] = []


def on_failure(handler: Callable[[RankFailure], None]) -> Callable[[], None]:
    """Call `handler(failure)` when rank 0's engine in this process finds its group broken (a
    step or the heartbeat failed); at most once per engine. Returns the function that removes
    the handler. Process-wide, as the default process group is."""
    _failure_handlers.append(handler)
    return lambda: _failure_handlers.remove(handler) if handler in _failure_handlers else None


def report_failure(failure: RankFailure) -> None:
    """Run the `on_failure` handlers (from whichever thread found the failure)."""
    for handler in list(_failure_handlers):
        try:
            handler(failure)
        except Exception:  # one handler's bug must not hide the failure from the others
            logger.exception("contbatch: a tensor-parallel failure handler raised")


def timeout_s() -> float:
    return float(os.environ.get(TIMEOUT_ENV) or DEFAULT_TIMEOUT_S)


def backend_for(device_type: str) -> str:
    return "nccl" if device_type == "cuda" else "gloo"


def env_world() -> tuple[int, int, int]:
    """(rank, world size, local rank) from torchrun's environment; (0, 1, 0) without one."""
    return (int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)),
            int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", 0))))


def init_from_env(device_type: str) -> None:
    """Initialize the default group from RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT, unless
    the caller already did: with our timeout, so a dead rank ends in an error, not a hang
    (transformers would wait two hours)."""
    if dist.is_initialized():
        return
    rank, world, local = env_world()
    if device_type == "cuda":
        torch.cuda.set_device(local)
    dist.init_process_group(backend_for(device_type), rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s()))


def check_tp_size(text_config, tp_size: int) -> None:
    """Each rank holds heads / tp query heads and kv_heads / tp KV heads: both must divide."""
    heads = int(text_config.num_attention_heads)
    kv_heads = int(getattr(text_config, "num_key_value_heads", None) or heads)
    if tp_size < 1:
        raise ValueError(f"tensor parallel size must be >= 1, got {tp_size}")
    if heads % tp_size or kv_heads % tp_size:
        working = [n for n in range(1, math.gcd(heads, kv_heads) + 1) if math.gcd(heads, kv_heads) % n == 0]
        raise ValueError(
            f"tensor parallel size {tp_size} does not divide the model's num_key_value_heads={kv_heads} "
            f"(num_attention_heads={heads}): each rank must hold whole KV heads; sizes that work: "
            f"{', '.join(map(str, working))}"
        )


def model_tp_size(model: torch.nn.Module) -> int:
    """The degree the model was sharded with (`from_pretrained(..., tp_plan=...)`), 1 if none."""
    return int(getattr(model, "tp_size", None) or 1) if dist.is_available() and dist.is_initialized() else 1


def shard_layout(layout: KVLayout, model: torch.nn.Module) -> KVLayout:
    """The KV layout one rank holds: its share of the KV heads (the attention function of a
    sharded model receives heads / tp of them)."""
    tp = model_tp_size(model)
    if tp == 1:
        return layout
    check_tp_size(model.config.get_text_config(), tp)
    return layout.shard(tp)  # every layer's own heads, split evenly


def _own_linear(base: CpuPlan | None, own: CpuPlan | None) -> CpuPlan | None:
    """Rank 0's CPU plan with this rank's own linear plan (each rank routes its own shards)."""
    if base is None or own is None:
        return own
    return dataclasses.replace(base, linear=own.linear)


@dataclasses.dataclass
class TensorParallel:
    """This process's place in a TP engine, and the engine's gloo group."""

    rank: int
    size: int
    backend: str  # of the default group: the model's collectives
    timeout_s: float
    group: object | None  # the engine's gloo group; None once destroyed
    notes: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()

    @classmethod
    def for_model(cls, model: torch.nn.Module) -> "TensorParallel | None":
        size = model_tp_size(model)
        if size == 1:
            return None
        if size != dist.get_world_size():
            raise ValueError(f"the model is sharded {size} ways but the process group has {dist.get_world_size()} "
                             "ranks; contbatch runs one TP group over the whole world")
        rank, limit = dist.get_rank(), timeout_s()
        group = dist.new_group(backend="gloo", timeout=timedelta(seconds=limit))  # every rank must call it
        return cls(rank, size, dist.get_backend(), limit, group)

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    # -- rank 0 to the workers -----------------------------------------------------------
    def send(self, obj) -> None:
        """Rank 0: hand `obj` to every worker; a worker gone raises RankFailure."""
        self._broadcast([obj])

    def recv(self):
        """A worker: the next object rank 0 sends; rank 0 gone raises RankFailure."""
        box = [None]
        self._broadcast(box)
        return box[0]

    def answer(self) -> None:
        """The heartbeat's round trip, on every rank: a one-element all-reduce over the engine's
        group. Rank 0 waits for every worker's part at most its timeout, so a worker that hangs
        (alive, its sockets open) raises RankFailure there, as one that died does at once."""
        self._collective(lambda: dist.all_reduce(torch.zeros(1), group=self.group))

    def _broadcast(self, box: list) -> None:
        self._collective(lambda: dist.broadcast_object_list(box, src=0, group=self.group))

    def _collective(self, run: Callable[[], object]) -> None:
        if self.group is None:
            raise RankFailure("the engine's tensor-parallel group was destroyed")
        try:
            run()
        except Exception as exc:
            who = "a tensor-parallel worker rank" if self.is_driver else "tensor-parallel rank 0 (the driver)"
            raise RankFailure(f"{who} stopped answering within {self.timeout_s:.0f} s or died "
                              f"({type(exc).__name__}: {str(exc)[:200]})") from exc

    # -- start-up ------------------------------------------------------------------------
    def share_config(self, config: ContinuousBatchingConfig | None) -> ContinuousBatchingConfig:
        """Every rank takes rank 0's config (workers are built without one), adjusted for TP:
        the step's inputs must be whole on the host when rank 0 sends them, so async batching
        (tokens carried over on the device), CUDA graphs and compiled steps are off, and so are
        the CPU kernel routers (`cpu.knobs.without_routers`: they time and check kernels per
        rank, and do not take sharded weights)."""
        spec = getattr(config, "speculative_config", None)
        refused = (self.is_driver and spec is not None and spec.method == "draft_model")
        # Refused on every rank alike (the workers wait in the broadcast): a draft model runs its
        # own steps on rank 0, which the workers' forwards would not follow.
        box = ["draft-model speculative decoding is not supported under tensor parallelism yet; use "
               "speculative_config={'method': 'ngram'} (prompt lookup works under TP)"] if refused else \
            [config or ContinuousBatchingConfig()]
        self._broadcast(box)
        if isinstance(box[0], str):
            raise ValueError(box[0])
        cfg = box[0]
        off = {"use_async_batching": False, "use_cuda_graph": False,
               "cpu_kernel_overrides": without_routers(cfg.cpu_kernel_overrides),
               "default_compile_level": 0, "decode_compile_config": None, "varlen_compile_config": None}
        asked = [k for k in ("use_async_batching", "use_cuda_graph", "decode_compile_config", "varlen_compile_config")
                 if getattr(cfg, k)] + (["default_compile_level"] if cfg.default_compile_level else [])
        self.warnings = tuple(f"{k}={getattr(cfg, k)!r} cannot run under tensor parallelism yet; off" for k in asked)
        self.notes = ("tensor parallelism: async batching, CUDA graphs, compiled steps and the CPU linear, norm, "
                      "rotary and layer routers are off (rank 0 sends each step's inputs whole, on the host)",)
        return dataclasses.replace(cfg, **off)

    def agree(self, resolved: ResolvedConfig, kv_heads_per_rank: int) -> ResolvedConfig:
        """Block tables address the same slots on every rank: all take the fewest blocks any
        rank can hold, and rank 0's resolution of everything else but this rank's own device
        (cuda:LOCAL_RANK) and linear plan."""
        blocks = torch.tensor([resolved.num_blocks], dtype=torch.long)
        dist.all_reduce(blocks, op=dist.ReduceOp.MIN, group=self.group)
        n = int(blocks.item())
        box = [resolved]
        self._broadcast(box)
        base = box[0]
        rule = base.num_blocks_rule
        if n < base.num_blocks:
            rule += f"; lowered to {n}, the fewest any of the {self.size} ranks can hold"
        per_block = base.kv_cache_bytes // (base.num_blocks + 2)
        return dataclasses.replace(
            base, device=resolved.device, num_blocks=n, num_blocks_rule=rule, max_requests_per_batch=min(base.max_requests_per_batch, n),
            kv_cache_bytes=(n + 2) * per_block, tp_size=self.size, tp_rank=self.rank, tp_backend=self.backend,
            kv_heads_per_rank=kv_heads_per_rank, cpu=_own_linear(base.cpu, resolved.cpu),
            notes=base.notes + self.notes, warnings=base.warnings + self.warnings,
        )

    def describe(self) -> str:
        role = "driver: takes requests, schedules, samples" if self.is_driver else "worker: runs rank 0's steps"
        return f"tensor-parallel rank {self.rank} of {self.size} ({role}; model collectives on {self.backend})"

    def destroy(self) -> None:
        """Release the engine's group (idempotent); the default group is left to its owner."""
        group, self.group = self.group, None
        if group is not None and dist.is_initialized():
            try:
                dist.destroy_process_group(group)
            except Exception:  # a broken group (a rank died) may refuse a clean teardown
                logger.debug("destroying the engine's tensor-parallel group failed", exc_info=True)
