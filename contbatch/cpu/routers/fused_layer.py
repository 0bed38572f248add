"""What a Llama-family decoder layer's one C++ call needs, and the whole stack as one call.

`FusedLayer` holds a layer's modules (their weights are read at every call, so replaced or
updated parameters are never stale), its linears' routes as `routed_linear` codes and its
constants; `one_call` passes a layer's arguments to `ops.decoder_stack`. `FusedStack` runs
every layer of the model as one call from a kind of step's second on, its step-independent
lists held in C++ (`ops.decoder_stack_bound`): both ops call the same C++ layer function,
layer after layer, so the stack is bit-identical by construction, and it is used only once a
step of that kind ran the layers one by one, every layer's check passed, and showed the
model's loop a plain chain (each layer called once, in order, on the previous layer's output).

The step's attention inputs come from the torch backend's plan of the step (`meta.prepared`,
attention/torch_backend.py's `TorchStep`), read by field name: this package does not import
the attention backends.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import repeat
from typing import Any

import torch

from .. import ops
from ..quant.linear import QuantLinear
from .linear import HOLDER_OF

HOLDERS = {ops.ROUTED_CODES[kernel]: attr for kernel, attr in HOLDER_OF.items()}  # per route code


@dataclass(eq=False)
class SharedState:
    """State of one manager's fused layers together: the engine's step context, the (layer
    variant, kind of step) pairs checked against a layer's own forward, whether every check
    passed, and the last position embeddings seen (every layer of a step gets the same)."""

    in_step: Callable[[], bool]
    active_step: Callable[[], Any]
    checked: set[tuple] = field(default_factory=set)
    enabled: bool = True
    last_emb: tuple = (None, False)  # (cos tensor, whether our rotary takes it)
    stack: FusedStack | None = None


@dataclass(frozen=True)
class StepInputs:
    """The step's attention inputs, as the torch backend planned them, and its kind: what
    decides the kernels it runs (the linears' row regime, the attention's parts)."""

    cache: Any
    slots: torch.Tensor
    decode: tuple  # (block_table, kv_lens) of the leading decode rows, or (None, None)
    chunks: tuple  # (block_table, q_start, q_lens, kv_lens) of the prompt chunks, or four None
    block_size: int
    kind: tuple  # (row regime: ops.row_regime; has decode rows; has prompt chunks;
    #              LoRA rows: 0 none, 1 in padded groups, 2 in segmented ones)
    lora: Any = None  # the step's LoRA groups (lora/segments.py's LoraStep), None: no adapter row


def step_inputs(meta: Any) -> StepInputs | None:
    """The step's attention inputs where every row takes our C++ attention (decode rows, then
    prompt chunks), else None; made once per step (kept on its metadata)."""
    cached = meta.__dict__.get("_contbatch_fused", False)
    if cached is not False:
        return cached
    inputs = None
    step = meta.prepared
    if (getattr(meta.backend, "name", None) == "torch" and not step.decode_groups and not step.prefill_rows
            and meta.write_slots.numel() == step.num_tokens and meta.cache.native_write
            and meta.cache.layout.calls_per_layer == 1 and meta.cache.layout.uniform):
        d, c, rows = step.decode_rows, step.prefill_chunks, step.num_tokens
        lora = getattr(meta, "lora", None)
        kind = (ops.row_regime(rows), d is not None, c is not None,
                0 if lora is None else 1 if lora.bounds is None else 2)
        inputs = StepInputs(meta.cache, meta.write_slots, (None, None) if d is None else (d.block_table, d.kv_lens),
                            (None,) * 4 if c is None else (c.block_table, c.q_start, c.q_lens, c.kv_lens),
                            meta.cache.block_size, kind, lora)
    meta.__dict__["_contbatch_fused"] = inputs
    return inputs


@dataclass(eq=False)
class FusedLayer:
    """What a layer's one call needs besides the step: its modules, routes and constants."""

    layer_idx: int
    norms: list[torch.nn.Module]  # input, post-attention[, q, k]
    linears: list[torch.nn.Module]  # q, k, v, o, gate, up, down
    codes: list[int]
    eps: list[float]
    scale: float
    window: int
    head_dim: int
    dtype: torch.dtype
    shared: SharedState
    previous: Callable | None = None  # the forward the layer had in its __dict__ (a compile region)
    position: int = -1  # its place in the model's stack of fused layers (-1: no stack)

    @functools.cached_property
    def variant(self) -> tuple:
        """What makes layers run different code: layers alike here are checked once for all."""
        return (self.window, self.head_dim, self.dtype, tuple(self.codes), len(self.norms),
                tuple(m.bias is None for m in self.linears), self.scale, tuple(self.eps),
                tuple((m.fmt.op_bits, m.fmt.group) if isinstance(m, QuantLinear) else None for m in self.linears))

    def own(self, layer: torch.nn.Module, *args, **kwargs) -> torch.Tensor:
        """The layer's forward without us: what compiled steps trace and other steps run."""
        if self.previous is not None:
            return self.previous(*args, **kwargs)
        return type(layer).forward(layer, *args, **kwargs)

    def __post_init__(self) -> None:
        # Parameters (a packed linear's buffers) are read from the modules' own dicts at every
        # call (cheaper than nn.Module.__getattr__), so a replaced tensor is never stale.
        def tensors(m: torch.nn.Module) -> dict:
            return m._buffers if isinstance(m, QuantLinear) else m._parameters

        self._weights = [(tensors(m), "codes" if isinstance(m, QuantLinear) else "weight")
                         for m in (self.norms[0], *self.linears[:4], self.norms[1], *self.linears[4:],
                                   *self.norms[2:])]
        self._biases = [tensors(m) for m in self.linears]
        self._formats = [(m._buffers, (m.fmt.op_bits, m.fmt.group) if isinstance(m, QuantLinear) else None)
                         for m in self.linears]
        self._packed = any(fmt for _, fmt in self._formats)
        self.known: set[tuple] = set()  # kinds of step this layer's variant passed the check in

    @functools.cached_property
    def arguments(self) -> Arguments:
        return Arguments([self])

    def packed(self, regime: int) -> list[torch.Tensor | None]:
        """The packed copies of the linears that run on one at this many rows (more than one:
        routers/linear.py): oneDNN's prepacked weight, or the panel kernel's."""
        packed = [None] * len(self.linears)
        if regime:
            for i, m in enumerate(self.linears):
                holder = m.__dict__.get(HOLDERS.get(self.codes[ops.ROW_REGIMES * i + regime], ""))
                if holder is not None:
                    packed[i] = holder.fresh(m.weight)
        return packed

    def lora_factors(self, lora: Any) -> list[tuple | None]:
        """Per linear, its LoRA hook's stacked factors for the step's groups (None where it has
        none or none applies); only LoRA hooks reach a fused layer (layer.py)."""
        out = []
        for m in self.linears:
            factors = None
            for hook in m._forward_hooks.values():
                factors = hook.lora_factors(lora)
            out.append(factors)
        return out

    def run(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, step: StepInputs) -> torch.Tensor:
        return one_call(self.arguments, self.codes, self.eps, [self.scale], [self.window], hidden, cos, sin, step)


@dataclass(eq=False)
class Arguments:
    """The tensors of consecutive layers' norms and linears laid end to end for one call, read
    from the modules' own dicts at every call (so a replaced tensor is never stale): one flat
    comprehension a list, not one a layer and list (a small model's lone decode step is short
    enough for those to show)."""

    layers: list[FusedLayer]

    def __post_init__(self) -> None:
        self._weights = [ref for f in self.layers for ref in f._weights]
        self._weight_dicts, self._weight_keys = [d for d, _ in self._weights], [k for _, k in self._weights]
        self._biases = [d for f in self.layers for d in f._biases]
        self._buffers = [d if fmt else {} for f in self.layers for d, fmt in f._formats]
        self._packed = any(f._packed for f in self.layers)
        # (bits, group) per linear, 0, 0 for a float one: fixed with the modules' formats
        self._bits_groups = [v for f in self.layers for _, fmt in f._formats for v in (fmt or (0, 0))]
        self._none = [None] * len(self._biases)

    def weights(self) -> list[torch.Tensor]:
        return [d[key] for d, key in self._weights]

    def biases(self) -> list[torch.Tensor | None]:
        return [d.get("bias") for d in self._biases]

    def quant(self) -> tuple[list, list, list[int]] | None:
        """ops.decoder_stack's `quant`: per linear, a packed one's scales, mins and (bits, group),
        read from its buffers (a float linear's buffers hold none of them); None when no linear
        is packed."""
        if not self._packed:
            return None
        buffers = self._buffers
        return [d.get("scales") for d in buffers], [d.get("mins") for d in buffers], self._bits_groups

    def holds(self, weights: list, biases: list, scales: list, mins: list) -> bool:
        """Whether the modules' dicts still hold these very objects (`weights()`, `biases()` and,
        where a linear is packed, `quant()`'s scales and mins, as made before): a check that
        makes none of the lists."""
        get = dict.get
        return (all(map(operator.is_, map(dict.__getitem__, self._weight_dicts, self._weight_keys), weights))
                and all(map(operator.is_, map(get, self._biases, repeat("bias")), biases))
                and (not self._packed or (all(map(operator.is_, map(get, self._buffers, repeat("scales")), scales))
                                          and all(map(operator.is_, map(get, self._buffers, repeat("mins")), mins)))))

    def packed(self, regime: int) -> list[torch.Tensor | None]:
        """oneDNN's prepacked copies per linear (none on one-row steps: FusedLayer.packed)."""
        return [p for f in self.layers for p in f.packed(regime)] if regime else self._none


def one_call(args: Arguments, codes: list[int], eps: list[float], scales: list[float],
             windows: list[int], hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
             step: StepInputs) -> torch.Tensor:
    """`args.layers` (consecutive ones: `FusedLayer.run` passes its own) as one `decoder_stack`
    call; `codes`, `eps`, `scales` and `windows` are theirs, laid end to end."""
    regime, layers = step.kind[0], args.layers
    caches = [step.cache.kv(f.layer_idx) for f in layers]
    return ops.decoder_stack(
        hidden, args.weights(), args.biases(), args.packed(regime), codes, eps, cos, sin, [k for k, _ in caches],
        [v for _, v in caches], step.slots, step.decode, step.chunks, step.block_size, scales, windows,
        layers[0].head_dim, *_lora(layers, step), args.quant())


def _lora(layers: list[FusedLayer], step: StepInputs) -> tuple:
    """(lora_a, lora_bt, groups) of decoder_stack for the step: None, None and no groups when
    no row of the step has an adapter."""
    if step.lora is None:
        return None, None, (None, None, None, ())
    factors = [f for layer in layers for f in layer.lora_factors(step.lora)]
    return ([None if f is None else f[0] for f in factors], [None if f is None else f[1] for f in factors],
            (step.lora.rows, step.lora.drop, step.lora.inverse, step.lora.bounds or ()))


def _same(lists: tuple, others: tuple) -> bool:
    """Whether each list holds the very objects (`is`) of its counterpart, in order."""
    return all(len(a) == len(b) and all(map(operator.is_, a, b)) for a, b in zip(lists, others))


class Held:
    """`FusedStack.bound`'s C++ object (`args`) and the tensors it was made from (`key`). A copy
    of the model taken while a manager is attached (`copy.deepcopy`, e.g. a frozen reference
    policy) or pickled gets an empty one: the C++ object is not copied, and is made again from
    the copy's own tensors if the copy ever runs a stack."""

    __slots__ = ("key", "args")

    def __init__(self, key: tuple | None = None, args: Any = None) -> None:
        self.key, self.args = key, args

    def __deepcopy__(self, memo: dict) -> Held:
        return Held()

    def __reduce__(self) -> tuple:
        return Held, ()


@dataclass(eq=False)
class FusedStack:
    """Every decoder layer of the model as one call, from the second step of each kind on: the
    model's own loop still calls each layer, the first runs them all and the others pass its
    output on. A model that scales, adds or reorders between layers never gets here."""

    layers: list[FusedLayer]
    modules: list[torch.nn.Module]
    kinds: set[tuple] = field(default_factory=set)  # kinds of step proven a plain chain
    chain: tuple = (None, None, -1)  # (step, last output, position) of the step running one by one
    done: tuple = (None, None)  # (step, output) of the stack's call in the step running now
    held: Held = field(default_factory=Held)  # `bound`'s C++ object and what it was made from

    def __post_init__(self) -> None:
        self.codes = [c for f in self.layers for c in f.codes]
        self.eps = [e for f in self.layers for e in f.eps]
        self.scales = [f.scale for f in self.layers]
        self.windows = [f.window for f in self.layers]
        self.arguments = Arguments(self.layers)

    def ready(self, step: StepInputs) -> bool:
        return step.kind in self.kinds and not any(m._forward_hooks or m._forward_pre_hooks for m in self.modules)

    def run(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, step: StepInputs) -> torch.Tensor:
        regime = step.kind[0]
        out = ops.decoder_stack_bound(
            hidden, self.bound(step.cache), self.arguments.packed(regime) if regime else [], cos, sin, step.slots,
            step.decode, step.chunks, step.block_size, self.layers[0].head_dim, *_lora(self.layers, step))
        self.done = (step, out)
        return out

    def bound(self, cache: Any) -> torch.ScriptObject:
        """The stack's lists that a step does not change, held in C++ (`ops.stack_args`): made
        again whenever a weight, bias, packed weight's scales or mins, or a cache tensor is not
        the object they were made from, so a replaced tensor is never stale (`decoder_stack`
        converting them at every call cost more than this check)."""
        args, key = self.arguments, self.held.key
        if key is None or not (args.holds(*key[:4]) and _same((cache.key_cache, cache.value_cache), key[4:])):
            weights, biases, quant = args.weights(), args.biases(), args.quant()
            caches = [cache.kv(f.layer_idx) for f in self.layers]
            made = ops.stack_args(weights, biases, self.codes, self.eps, [k for k, _ in caches],
                                  [v for _, v in caches], self.scales, self.windows, quant)
            self.held = Held((weights, biases, *(quant[:2] if quant else ((), ())), tuple(cache.key_cache),
                              tuple(cache.value_cache)), made)
        return self.held.args

    def pass_on(self, position: int) -> torch.Tensor:
        """A later layer's share of the stack's call in this step: the output, unchanged."""
        out = self.done[1]
        if position == len(self.layers) - 1:
            self.done = (None, None)
        return out

    def changed(self) -> None:
        """A later layer of a step whose stack ran was given another hidden state than the
        stack's output: the model's loop is not the chain it was, and this step's output is
        lost. The step fails; the following ones run the layers one by one until a step proves
        a chain again."""
        self.kinds.clear()
        self.done = (None, None)
        raise RuntimeError("contbatch: the decoder stack ran in one call, but a later layer was given another hidden "
                           "state (the model's loop changed): the step fails, the next ones run the layers one by one")

    def track(self, position: int, hidden: torch.Tensor, out: torch.Tensor, step: StepInputs) -> None:
        """Follows a step run one by one: a plain chain through every layer proves its kind."""
        chained = position == 0 or (self.chain[0] is step and self.chain[1] is hidden
                                     and self.chain[2] == position - 1)
        self.chain = (step, out, position) if chained else (None, None, -1)
        if chained and position == len(self.layers) - 1:
            self.chain = (None, None, -1)
            if all(step.kind in f.known for f in self.layers):
                self.kinds.add(step.kind)
