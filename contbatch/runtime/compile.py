"""Compile levels: which steps run through `torch.compile`, with what settings, and at what cost.

The seed's levels: 0 none; 1 `default` mode with dynamic shapes; 2 `max-autotune-no-cudagraphs`
with dynamic shapes; 3 the same with `dynamic=False` (one compile per padded step shape).
`decode_compile_config` and `varlen_compile_config` (transformers' `CompileConfig`) override the
level for decode-only steps and for every other step. What is compiled is the whole forward,
embeddings to the sampled rows' logits, with paged attention as one opaque custom op per layer
(`attention/ops.py`): no graph break. Each decoder layer is a nested compile region, so
Dynamo traces one layer of each kind and Inductor compiles it once (`mark_layer_regions`).
Compiled steps are padded to the graph buckets (`buckets.py`), so the number of compiles stays
bounded; `stats()` counts them. With dynamic shapes one graph serves every step: the linear
layers choose their kernel by row count inside their op (`cpu/ops.py`'s `routed_linear`) and a
one-token step is not specialised, so a start traces the layers once.
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
import types
from collections.abc import Callable

import torch

from .. import context
from ..attention.paged import ENGINE_MASK
from ..config import CompileChoice
from ..cpu.routers.layer import LAYER_REGION

logger = logging.getLogger("contbatch")

LEVELS: dict[int, dict | None] = {
    0: None,
    1: {"mode": "default", "dynamic": True},
    2: {"mode": "max-autotune-no-cudagraphs", "dynamic": True},
    3: {"mode": "max-autotune-no-cudagraphs", "dynamic": False},
}
PATHS = ("decode", "varlen")
# A stack of decoder layers with more kinds than this (by `_structure`) is not marked as
# regions: each layer would be traced anyway, after a guard check against every earlier kind.
MAX_REGION_KINDS = 8
REGION_REUSE_ENTRIES = 1024
# The default level, by measurement: level 1 was no faster than the eager step on the CPUs
# measured, after a long compile at a first start (docs/cpu.md has the figures, machine by
# machine). So eager stays the default. On a GPU the step runs in CUDA graphs already.
DEFAULT_LEVEL = 0
DEFAULT_LEVEL_RULE = ("compile level 0 by default: level 1 measured 0.78-1.11x eager throughput on the CPU, "
                      "machine by machine, for 25-35 s of compiling at a first start and 10-15 s at later ones "
                      "(benchmarks/RESULTS.md); try --compile-level 1 where it measures faster")


def resolve_compile(level: int | None, decode_config, varlen_config, device_type: str
                    ) -> tuple[int, dict[str, CompileChoice | None], list[str], list[str]]:
    """The level in force and the compile choice of each path, with notes and warnings."""
    notes: list[str] = []
    warnings: list[str] = []
    if level is None:
        level = DEFAULT_LEVEL
        notes.append(DEFAULT_LEVEL_RULE)
    choices: dict[str, CompileChoice | None] = {}
    for path, config in zip(PATHS, (decode_config, varlen_config)):
        if config is None:
            base = LEVELS[level]
            choices[path] = CompileChoice(**base) if base else None
            continue
        mode = getattr(config, "mode", "default")
        if device_type != "cuda" and mode == "reduce-overhead":
            warnings.append(f"{path}_compile_config mode 'reduce-overhead' needs CUDA graphs; using 'default' here")
            mode = "default"
        choices[path] = CompileChoice(mode, getattr(config, "dynamic", None), getattr(config, "backend", "inductor"),
                                      bool(getattr(config, "fullgraph", True)), dict(getattr(config, "options", None) or {}))
    if device_type == "cpu" and any(c is not None and c.dynamic is False for c in choices.values()):
        notes.append("dynamic=False compiles once per padded step shape: many minutes of start-up on a CPU")
    return level, choices, notes, warnings


def compiled_forward(model: torch.nn.Module, choice: CompileChoice, variant: tuple = ()) -> Callable[..., torch.Tensor]:
    """The model's forward, from token ids to the logits of the sampled rows, compiled.

    One per model, choice and `variant` (what else changes the traced code: the float32 linear
    routing), kept on the model: a second manager on the same model (every `generate_batch`
    call makes one) reuses the compiled versions instead of tracing 30 layers again, which
    cost it ~30 s of Dynamo even with Inductor's artefacts on disk."""
    cache = model.__dict__.get("_contbatch_compiled")
    if cache is None:
        cache = model.__dict__["_contbatch_compiled"] = CompiledSteps()
    key = (repr(choice), variant)  # options is a dict: not hashable
    if key not in cache:
        def forward(input_ids: torch.Tensor, positions: torch.Tensor, logits_indices: torch.Tensor) -> torch.Tensor:
            out = model(input_ids=input_ids[None], position_ids=positions[None], attention_mask=ENGINE_MASK,
                        logits_to_keep=logits_indices, use_cache=False, step_metadata=context.COMPILED_STEP)
            return out.logits[0]

        if all(p.device.type == "cpu" for p in model.parameters()):  # see ops.paged_attention_region
            marked = mark_layer_regions(model)
            logger.info("contbatch: %d decoder layers compile as nested regions", marked)
        compiled = torch.compile(_own_code(forward), **choice.kwargs())
        # One graph for every step. Dynamo specialises a dynamic size seen as 1 (a lone request
        # decoding), which traced every layer a second time at each start (~40% of a warm
        # start), and ties sizes seen equal (the tokens and the sampled rows of a decode step),
        # which compiled again for the first prompt. A branch on a size still guards and
        # recompiles.
        compiled = torch.fx.experimental._config.patch(backed_size_oblivious=True, use_duck_shape=False)(compiled)
        # Floats (a norm's eps, the attention scaling) as constants: left symbolic, they become
        # operands of every layer region, which the region op does not take.
        cache[key] = torch._dynamo.config.patch(specialize_float=True)(compiled)
    return cache[key]


def mark_layer_regions(model: torch.nn.Module) -> int:
    """Mark each decoder layer as a nested compile region, so Dynamo traces one layer and
    stamps it out for the others of its kind, and Inductor compiles it once: tracing the
    default model's 30 layers one by one took ~30 s of every start (cold or warm). A layer
    that differs (a sliding window, another head count) fails the region's guards and is
    traced on its own, so nothing is reused wrongly. The layer index, the one constant that
    differs between identical layers, reaches paged attention as a tensor (`_contbatch_layer`,
    `ops.paged_attention_region`), not baked into the graph. Outside a compiled call the
    region is the layer's own forward. Returns the number of layers marked."""
    marked = 0
    for layers in _decoder_layer_lists(model):
        kinds = len({_structure(layer) for layer in layers})
        if kinds > MAX_REGION_KINDS:  # regions would not be reused: each lookup would only cost time
            logger.info("contbatch: %d decoder layers of %d kinds: traced one by one, not as regions",
                        len(layers), kinds)
            continue
        region = _region(type(layers[0]))
        for layer in layers:
            current = layer.__dict__.get("forward")  # a forward of its own: someone else's, left alone
            if current is None or getattr(current, "__func__", None) in (type(layer).forward, region):
                layer.forward = types.MethodType(region, layer)
            if getattr(layer.__dict__["forward"], "__func__", None) is not region:
                continue
            marked += 1
            for module in layer.modules():
                if isinstance(getattr(module, "layer_idx", None), int) and "_contbatch_layer" not in module.__dict__:
                    module._contbatch_layer = torch.tensor(module.layer_idx)  # a plain attribute: stays on the CPU
    return marked


def _decoder_layer_lists(model: torch.nn.Module) -> list[torch.nn.ModuleList]:
    """The model's stacks of decoder layers: module lists of two or more layers of one class,
    each holding an attention module (one with a `layer_idx`)."""
    found = []
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) > 1 and len({type(m) for m in module}) == 1:
            if all(any(isinstance(getattr(sub, "layer_idx", None), int) for sub in m.modules()) for m in module):
                found.append(module)
    return found


def _structure(layer: torch.nn.Module) -> tuple:
    """What tracing a layer depends on besides its inputs, its index aside: the classes, plain
    attributes and parameter shapes of its modules. Layers alike here are meant to share a
    region (Dynamo's guards still decide)."""
    scalar = (int, float, str, bool, type(None))
    parts = []
    for name, module in layer.named_modules():
        attrs = tuple(sorted((k, v) for k, v in vars(module).items() if k not in ("layer_idx", "_contbatch_layer")
                             and (isinstance(v, scalar) or isinstance(v, tuple) and all(isinstance(x, scalar)
                                                                                         for x in v))))
        tensors = tuple((n, tuple(t.shape), t.dtype) for n, t in (*module.named_parameters(recurse=False),
                                                                   *module.named_buffers(recurse=False)))
        parts.append((name, type(module), attrs, tensors))
    return tuple(parts)


@functools.cache
def _region(cls: type) -> Callable:
    # Reuse entries without Dynamo's default cap of 8 (it raises past it): a layer that differs
    # in a way `_structure` does not see (its forward reads its own index) must cost a trace of
    # its own, not the whole compile.
    region = torch.compiler.nested_compile_region(cls.forward, max_reuse_entries=REGION_REUSE_ENTRIES)
    # Named as the forward it wraps: a pickled layer then unpickles with its class's forward
    # (a bound method pickles as `getattr(layer, name)`).
    region.__name__, region.__qualname__ = cls.forward.__name__, cls.forward.__qualname__
    setattr(region, LAYER_REGION, cls)  # how the CPU layer router tells a region from a patched forward
    return region


class CompiledSteps(dict):
    """A model's compiled steps. They close over that model, so a copy of the model (a frozen
    reference policy made with `copy.deepcopy`, a pickled checkpoint) starts without them:
    sharing them would run the original's weights."""

    def __copy__(self) -> "CompiledSteps":
        return CompiledSteps()

    def __deepcopy__(self, memo) -> "CompiledSteps":
        return CompiledSteps()

    def __reduce__(self):
        return (CompiledSteps, ())


_engines = itertools.count()


def _own_code(fn: Callable) -> Callable:
    """`fn` with a code object of its own. Dynamo keeps compiled versions per code object:
    without this, every model of the process (tests, several models side by side) would pile
    its versions onto one code object and share one recompile limit."""
    code = fn.__code__.replace(co_name=f"{fn.__code__.co_name}_{next(_engines)}")
    return types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)


def allow_recompiles(count: int) -> None:
    """Dynamo gives up on a function after `recompile_limit` versions and runs it eagerly,
    with only a log line: raise the limit to the number of shapes the buckets allow."""
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    if getattr(config, name) < count:
        setattr(config, name, count)
        logger.info("contbatch: torch._dynamo.config.%s raised to %d (one compile per step bucket)", name, count)


def use_compile_cache(directory: str) -> None:
    """Keep Inductor's compiled artefacts under `directory` (in $CONTBATCH_CACHE), so that a
    second start reuses them; a directory the user chose already is left alone."""
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", directory)


def compile_counters() -> tuple[int, int]:
    """(graphs compiled, graph breaks) so far in this process, from Dynamo's counters."""
    counters = torch._dynamo.utils.counters
    return counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())
