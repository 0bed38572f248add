"""Every call into our C++ library (`torch.ops.contbatch_cpu`, built by `native.py`).

Callers import the ops from here, never from `torch.ops`: the contract of each op (shapes,
dtypes, what it refuses) is written once, beside its wrapper. The library is loaded on the
first call that needs it; importing this module builds nothing. Every op computes what the
PyTorch code it replaces computes: bit for bit where its docstring says so, else within the
rounding of float32 accumulation in another order.
"""

from __future__ import annotations

import torch

from . import native

SMALL_LINEAR_MAX_ROWS = 7  # rows `small_linear` takes; more go to another kernel
# Kernel codes of `routed_linear` (csrc/small_linear_cpu.cpp), which picks a route's kernel by
# the row count when it runs, so a compiled step needs one graph for every step size.
# `panel` needs its packed weight, which the op does not get: there it runs aten's linear.
ROUTED_CODES = {"aten": 0, "onednn": 1, "small_linear": 2, "panel": 4}
QUANT_CODE = 3  # decoder_stack's route code of a packed linear (cpu/quant/linear.py's QuantLinear)
PANEL_MAX_ROWS = 256  # rows `panel_linear` computes on its panels; more take aten's GEMM (csrc/panel_tile.h's kPanelMaxRows)
ROW_REGIMES = 4  # a route's kernels, one per row regime (`row_regime`): the codes a linear takes


def row_regime(rows: int) -> int:
    """A linear call's row regime, each with its own kernel per weight shape (routers/linear.py):
    0 one row (a lone request decoding), 1 two to SMALL_LINEAR_MAX_ROWS (a few requests, a
    verification run), 2 up to PANEL_MAX_ROWS (a batched decode step), 3 more (prompt chunks,
    compute-bound, where `panel` does not run). The C++ side's `regime_of` (csrc/decoder_layer.h)."""
    return 0 if rows <= 1 else 1 if rows <= SMALL_LINEAR_MAX_ROWS else 2 if rows <= PANEL_MAX_ROWS else 3

_argmax_kernel: bool | None = None  # resolved on the first CPU call
_fakes_registered: list[bool] = []
_quant_fakes_registered: list[bool] = []


# -- attention -------------------------------------------------------------------------------
def load_attention() -> tuple[bool, str]:
    """(available, how) for the attention kernels; never raises."""
    ok, how = native.load()
    return ok, how if ok else f"{how}; decode rows gather K/V instead"


def paged_decode(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, block_table: torch.Tensor,
                 kv_lens: torch.Tensor, sinks: torch.Tensor | None, block_size: int, scale: float,
                 window: int | None, softcap: float | None) -> torch.Tensor:
    """Decode rows' attention, reading K/V in place through the block tables. query [rows, H, D]
    contiguous; key/value `[H_kv, slots, D]` views of one layer's cache; block_table [rows, W]
    and kv_lens [rows] int32. Returns [rows, H, D]."""
    empty = query.new_empty(0, dtype=torch.float32)
    return torch.ops.contbatch_cpu.paged_decode(
        query, key, value, block_table, kv_lens, empty if sinks is None else sinks.float(), block_size, scale,
        window or 0, softcap or 0.0)


def paged_prefill(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, block_table: torch.Tensor,
                  q_start: torch.Tensor, q_lens: torch.Tensor, kv_lens: torch.Tensor, sinks: torch.Tensor | None,
                  block_size: int, scale: float, window: int | None, softcap: float | None, out: torch.Tensor) -> None:
    """Attention for prompt chunks, written into their rows of `out` ([T, H, D], contiguous).
    query [T, H, D] (rows contiguous); key/value `[H_kv, slots, D]` views of one layer's cache,
    this step's keys already written; block_table [chunks, W], q_start / q_lens / kv_lens
    [chunks] int32: each chunk's first row in `query`, its length, and the keys it sees."""
    empty = query.new_empty(0, dtype=torch.float32)
    torch.ops.contbatch_cpu.paged_prefill(
        query, key, value, block_table, q_start, q_lens, kv_lens, empty if sinks is None else sinks.float(),
        block_size, scale, window or 0, softcap or 0.0, out)


# -- the KV cache ----------------------------------------------------------------------------
def kv_write_available() -> bool:
    return native.load()[0] and hasattr(torch.ops.contbatch_cpu, "kv_write")


def kv_write(key_cache: torch.Tensor, value_cache: torch.Tensor, slots: torch.Tensor, key: torch.Tensor,
             value: torch.Tensor) -> None:
    """A step's new K/V (`[H_kv, T, D]`, last dim contiguous) into one layer's cache views
    (`[H_kv, slots, D]`) at `slots` (int64), without reading the lines they overwrite."""
    torch.ops.contbatch_cpu.kv_write(key_cache, value_cache, slots, key, value)


# -- linear layers ---------------------------------------------------------------------------
def small_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear` for 1 to SMALL_LINEAR_MAX_ROWS rows of float32 or bfloat16 ([..., in] -> [..., out]),
    float32 accumulation; other row counts and dtypes raise."""
    return torch.ops.contbatch_cpu.small_linear(x, weight, bias)


STREAM_KINDS = ("float", "packed", "kv")  # the streams whose prefetch is set apart (csrc/vec.h)


def stream_prefetch(kind: str, setting: tuple[int, int] | None = None) -> tuple[int, int]:
    """How the kernels ask for a stream of `kind` (`STREAM_KINDS`: `small_linear`'s float
    weight for one row, the tiled packed kernels' codes for one or two, the decode attention's
    K/V rows) ahead: (bytes ahead, 0 for not at all; the cache they fill, 1 for L1 or 2 for L2);
    with `setting` (bytes a multiple of 64) set for the whole process. Returns the one before."""
    bytes_, level = (-1, 1) if setting is None else setting
    before = torch.ops.contbatch_cpu.stream_prefetch(STREAM_KINDS.index(kind), bytes_, level)
    return before[0], before[1]


def panel_pack(weight: torch.Tensor) -> torch.Tensor:
    """A float32 [out, in] weight as `panel_linear` reads it: [ceil(out / 32), in, 32], panels of
    32 output features, each input feature's 32 weights one contiguous run (a copy)."""
    return torch.ops.contbatch_cpu.panel_pack(weight.detach())


def panel_linear(x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor,
                 bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear` for float32 rows on `packed` (`panel_pack(weight)`): up to PANEL_MAX_ROWS rows on
    the panels, float32 sums over the input features in order (a row's outputs the same whatever
    rows share the call), more rows by aten's linear on `weight`."""
    return torch.ops.contbatch_cpu.panel_linear(x, weight, packed, bias)


def routed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  codes: tuple[int, ...]) -> torch.Tensor:
    """`F.linear` on the kernel `codes` (ROUTED_CODES, one per `row_regime`) names for the call's
    row count, chosen when it runs; bit for bit that kernel's result, except `panel`, which runs
    aten's linear here (the op has no packed weight)."""
    return torch.ops.contbatch_cpu.routed_linear(x, weight, bias, *codes)


def register_linear_fakes() -> None:
    """Shapes of `small_linear` and `routed_linear` for Dynamo, so a compiled step calls them
    directly (extern kernels in Inductor's output). Needs the library loaded; once per process."""
    if not _fakes_registered:
        fake = torch.library.register_fake("contbatch_cpu::small_linear")
        fake(lambda x, w, b: x.new_empty(*x.shape[:-1], w.shape[0]))
        fake = torch.library.register_fake("contbatch_cpu::routed_linear")
        fake(lambda x, w, b, one, few, batch, many: x.new_empty(*x.shape[:-1], w.shape[0]))
        _fakes_registered.append(True)



# -- quantized linear layers (cpu/quant/) ----------------------------------------------------
def quant_tiles_available() -> bool:
    """Whether the library has the tiled layout's integer kernels (AVX-512 VNNI; csrc/quant_tiles.h)."""
    return native.load()[0] and bool(torch.ops.contbatch_cpu.quant_tiles())


def quant_linear(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
                 bias: torch.Tensor | None, bits: int, group: int) -> torch.Tensor:
    """`F.linear` on a packed weight (cpu/quant/format.py's layout), float32 accumulation, for
    float32 or bfloat16 x [..., in]: a few rows dequantize in registers (one or two rows of
    int8 apply each group's scale once, to the codes' dot product), more (from 16 rows of int8,
    12 of int4) a panel of 32 output features at a time into float32 tiles; a tiled weight
    (`bits` is the format's `op_bits`) takes integer dot products at every row count
    (csrc/quant_tiles.h). Equals `F.linear(x, quant_dequantize(...), bias)` up to float
    rounding (for tiled weights, within the bound csrc/quant_digits.h states)."""
    return torch.ops.contbatch_cpu.quant_linear(x, codes, scales, mins, bias, bits, group)


def quant_linears(x: torch.Tensor, linears: list[tuple]) -> list[torch.Tensor]:
    """`quant_linear` of several packed weights of one input size on x (1 to 512 rows) in one
    parallel region; `linears` holds (codes, scales, mins, bias, bits, group) each. Every
    output equals `quant_linear`'s bit for bit."""
    codes, scales, mins, biases, bits, groups = (list(t) for t in zip(*linears))
    return torch.ops.contbatch_cpu.quant_linears(x, codes, scales, mins, biases, bits, groups)


def quant_dequantize(codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, bits: int,
                     group: int) -> torch.Tensor:
    """The packed weight's float32 values [out, in], exactly `quant.format.dequantize`'s."""
    return torch.ops.contbatch_cpu.quant_dequantize(codes, scales, mins, bits, group)


def quant_rows(codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, ids: torch.Tensor, bits: int,
               group: int) -> torch.Tensor:
    """Rows `ids` (int64 [n]) of the packed weight's float32 values [n, in], dequantized in place
    in either layout (a tiled weight a tile of 16 rows at a time): exactly those rows of
    `quant_dequantize`'s output (an embedding's lookup)."""
    return torch.ops.contbatch_cpu.quant_rows(codes, scales, mins, ids, bits, group)


def register_quant_fakes() -> None:
    """The shapes of `quant_linear` and `quant_rows` for Dynamo (compiled steps call them as extern
    kernels)."""
    if not _quant_fakes_registered:
        fake = torch.library.register_fake("contbatch_cpu::quant_linear")
        fake(lambda x, codes, scales, mins, bias, bits, group: x.new_empty(*x.shape[:-1], codes.shape[0]))
        fake = torch.library.register_fake("contbatch_cpu::quant_rows")
        fake(lambda codes, scales, mins, ids, bits, group: scales.new_empty(
            ids.shape[0], codes.shape[1] * (2 if mins is not None else 1), dtype=torch.float32))
        _quant_fakes_registered.append(True)

# -- norms, rotary embeddings, decoder layers ------------------------------------------------
def fused_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """A Llama-family RMSNorm of the last dim (float32 or bfloat16), rounded as the module does:
    the normalised row to the input dtype, then times the weight."""
    return torch.ops.contbatch_cpu.rms_norm(x.contiguous(), weight, eps)


def fused_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' `apply_rotary_pos_emb` for q/k `[B, H, T, D]` and cos/sin `[B, T, D]` over
    the whole head, bit for bit (each product rounded, then the sum)."""
    return torch.ops.contbatch_cpu.rotary(q, k, cos, sin)


def decoder_stack(hidden: torch.Tensor, weights: list[torch.Tensor], biases: list[torch.Tensor | None],
                  packed: list[torch.Tensor | None], codes: list[int], eps: list[float], cos: torch.Tensor,
                  sin: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], slots: torch.Tensor,
                  decode: tuple, chunks: tuple, block_size: int, scales: list[float], windows: list[int],
                  head_dim: int, lora_a: list[torch.Tensor | None] | None = None,
                  lora_bt: list[torch.Tensor | None] | None = None, lora: tuple = (None,) * 3 + ((),),
                  quant: tuple[list, list, list[int]] | None = None) -> torch.Tensor:
    """Consecutive Llama-family decoder layers as one call: per layer, the kernels above and the
    attention kernels in the order the layer's own forward runs them, so the output is the
    per-module path's bit for bit. The lists hold one layer after the other: `weights` its
    input norm, q, k, v, o, post-attention norm, gate, up, down[, q norm, k norm]; `biases` and
    `packed` one per linear (q, k, v, o, gate, up, down; None where it has none); `codes` ROW_REGIMES
    ROUTED_CODES per linear; `eps` its norms', in the weights' order; `keys`, `values`, `scales`
    and `windows` one per layer. `decode` is (block_table, kv_lens) of the step's leading
    decode rows or two None, `chunks` (block_table, q_start, q_lens, kv_lens) of its prompt
    chunks or four None. `lora_a` and `lora_bt` hold a LoRA hook's stacked factors per linear
    (None where none applies; lora/hooks.py), `lora` the step's (rows, drop, inverse, bounds)
    groups (lora/segments.py's LoraStep; bounds () when padded): the call then adds each
    adapter's contribution after its linear, by the hook's own ops. `quant` is three lists,
    one entry per linear: a packed weight's scales, its mins (None for a symmetric format) and,
    two ints a linear, its (bits, group) (None, None and 0, 0 for a float linear); a packed
    linear has its codes in `weights`, QUANT_CODE as all its codes, and runs `quant_linear` as
    QuantLinear does. None: no linear is packed."""
    none = [None] * len(biases)
    return torch.ops.contbatch_cpu.decoder_stack(
        hidden, weights, biases, packed, codes, eps, cos, sin, keys, values, slots, *decode, *chunks, block_size,
        scales, windows, head_dim, none if lora_a is None else lora_a, none if lora_bt is None else lora_bt, *lora,
        *_quant_lists(quant, len(biases)))


def _quant_lists(quant: tuple[list, list, list[int]] | None, linears: int) -> tuple[list, list, list[int]]:
    """`quant` as the ops take it: None (no linear packed) as None scales and mins and (0, 0)
    formats for each of `linears`."""
    return ([None] * linears, [None] * linears, [0] * (2 * linears)) if quant is None else quant


def stack_args(weights: list[torch.Tensor], biases: list[torch.Tensor | None], codes: list[int], eps: list[float],
               keys: list[torch.Tensor], values: list[torch.Tensor], scales: list[float], windows: list[int],
               quant: tuple[list, list, list[int]] | None = None) -> torch.ScriptObject:
    """`decoder_stack`'s lists that a step does not change, as one object held in C++
    (csrc/decoder_stack_bound_cpu.cpp), for `decoder_stack_bound`: made once, they are not
    converted from Python at every call. It holds the tensors themselves: a replaced tensor
    (a new object in a module's dict) needs a new one, which the caller makes."""
    return torch.classes.contbatch_cpu.StackArgs(weights, biases, codes, eps, keys, values, scales, windows,
                                                 *_quant_lists(quant, len(biases)))


def decoder_stack_bound(hidden: torch.Tensor, args: torch.ScriptObject, packed: list[torch.Tensor | None],
                        cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor, decode: tuple, chunks: tuple,
                        block_size: int, head_dim: int, lora_a: list[torch.Tensor | None] | None = None,
                        lora_bt: list[torch.Tensor | None] | None = None,
                        lora: tuple = (None,) * 3 + ((),)) -> torch.Tensor:
    """`decoder_stack` with its step-independent lists in `args` (`stack_args`): the same layers,
    bit for bit. `packed`, `lora_a` and `lora_bt` are the step's, one entry per linear, or empty
    (None for every linear)."""
    return torch.ops.contbatch_cpu.decoder_stack_bound(
        hidden, args, packed, cos, sin, slots, *decode, *chunks, block_size, head_dim,
        [] if lora_a is None else lora_a, [] if lora_bt is None else lora_bt, *lora)


# -- sampling --------------------------------------------------------------------------------
def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """`logits.argmax(dim=-1)` for [rows, vocab] logits, int64 [rows]: the first index of the
    maximum, the first NaN's where a row holds one. CPU float32/bfloat16 rows with a contiguous
    vocabulary take our kernel; other devices, dtypes and layouts, or no library, take aten's."""
    global _argmax_kernel
    if (logits.device.type == "cpu" and logits.dim() == 2 and logits.dtype in (torch.float32, torch.bfloat16)
            and logits.shape[1] > 0 and logits.stride(1) == 1):
        if _argmax_kernel is None:
            _argmax_kernel = native.load()[0]
        if _argmax_kernel:
            return torch.ops.contbatch_cpu.argmax_rows(logits)
    return logits.argmax(dim=-1)
