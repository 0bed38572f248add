"""The packed weight format of quantized linear layers, and round-to-nearest quantization into it.

One format for every source (a float model quantized at load, a GGUF file's Q8_0/Q4_0/Q4_1
blocks), so one kernel serves them all (csrc/quant_linear_cpu.cpp):

- int8: `codes` int8 [out, in]; w = code * scale. Per output channel (group = in, symmetric)
  when quantized here; GGUF Q8_0 is the same with groups of 32.
- int4: `codes` uint8 [out, in / 2]; within each block of 32 inputs byte j (0..15) holds input j
  in its low nibble and input j + 16 in its high one: ggml's Q4_0/Q4_1 block order, so GGUF
  blocks are copied as they are. w = code * scale + min, code 0..15 (asymmetric, as Q4_1; Q4_0's
  w = (code - 8) * d is min = -8 d, the same value exactly).
- `scales` (and int4's `mins`): float16 [out, in / group], group a multiple of 32 dividing `in`.
  fp16 because ggml's blocks carry fp16 fields (a GGUF file's scales are kept as they are, and
  the resident weights stay the file's size: Q4_1 is 20 bytes a block of 32 here as there);
  quantizing here rounds each scale and min to fp16 first and computes the codes from the
  rounded values, so a weight's error grows by at most fp16's precision (2^-11 of the group's
  largest magnitude) over round-to-nearest's half a step.
- tiled (`QuantFormat.tiled`, where the C++ library has AVX-512 VNNI: `tile`): the same
  tensors and shapes, each run of 16 output features stored as one tile: int8 codes as
  [in / 4][16][4] (input 4v + k of output j at byte 64 v + 4 j + k), int4 codes as
  [in / 8][16][4] (byte 64 v + 4 j + k: input 8v + k of output j in the low nibble, 8v + 4 + k
  in the high one), scales and mins as [groups][16]: the integer dot products of
  csrc/quant_tiles.h take 16 outputs at once. `untile` and `PackedWeight.rows` give the row
  layout back. An int4 weight whose every min is -8 x its scale (Q4_0) is marked `symmetric`
  when tiled (SYMMETRIC_FLAG in its format word): the kernels then take the -8 into their
  integer sums instead of a min product. The flag describes the buffers as tiled; packed
  buffers are not rewritten in place (`update_weights` refuses quantized models).

The dequantized value of a weight is defined as float32 `code * scale` (then `+ min`), the
fp16 fields widened to float32 exactly and each step rounded: the row layout's kernels rebuild
exactly these values, and the exactness tests compare against `F.linear` on them (the tiled
layout's integer kernels multiply the codes instead, within the bound csrc/quant_digits.h states).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK = 32  # inputs per int4 nibble block (ggml's QK4_0 / QK8_0)
TILE = 16  # output features a tile of the tiled layout
TILED_FLAG = 256  # csrc/quant_tiles.h's kTiledFlag
SYMMETRIC_FLAG = 512  # csrc/quant_tiles.h's kSymmetricFlag
INT4_GROUPS = (32, 128)
FORMATS = ("int8", "int4")


@dataclass(frozen=True)
class QuantFormat:
    """How a layer's weight is stored: bits, inputs per scale, and where it came from."""

    bits: int  # 8 or 4
    group: int  # inputs sharing one scale (and min); `in_features` for per-channel int8
    source: str  # "int8", "int4-g32", "int4-g128" (quantized here) or a GGUF type ("Q4_1", ...)
    tiled: bool = False  # codes, scales and mins in 16-output tiles (module docstring)
    # int4 whose every min is -8 x its scale (Q4_0: w = (code - 8) * scale): the tiled kernels
    # then take the -8 into the integer sums and skip the min's product (set by `tile`)
    symmetric: bool = False

    def __post_init__(self) -> None:
        if self.bits not in (4, 8):
            raise ValueError(f"quantized weights have 8 or 4 bits, got {self.bits}")
        if self.group <= 0 or self.group % BLOCK:
            raise ValueError(f"the quantization group must be a positive multiple of {BLOCK}, got {self.group}")

    @property
    def op_bits(self) -> int:
        """The format word the C++ ops take as `bits`: the bits, plus TILED_FLAG for a tiled weight
        and SYMMETRIC_FLAG for a tiled symmetric one."""
        return self.bits | (TILED_FLAG if self.tiled else 0) | (SYMMETRIC_FLAG if self.tiled and self.symmetric else 0)


@dataclass
class PackedWeight:
    """A quantized weight in the packed format: codes, fp16 scales and (int4) mins, CPU tensors."""

    fmt: QuantFormat
    codes: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None
    out_features: int
    in_features: int

    def __post_init__(self) -> None:
        o, i, f = self.out_features, self.in_features, self.fmt
        if i % f.group:
            raise ValueError(f"{i} inputs are not a whole number of groups of {f.group}")
        want = (o, i) if f.bits == 8 else (o, i // 2)
        dtype = torch.int8 if f.bits == 8 else torch.uint8
        if tuple(self.codes.shape) != want or self.codes.dtype != dtype:
            raise ValueError(f"{f.bits}-bit codes must be {dtype} {want}, got {self.codes.dtype} {tuple(self.codes.shape)}")
        if tuple(self.scales.shape) != (o, i // f.group) or self.scales.dtype != torch.float16:
            raise ValueError(f"scales must be float16 {(o, i // f.group)}, got {self.scales.dtype} {tuple(self.scales.shape)}")
        if (self.mins is not None) != (f.bits == 4):
            raise ValueError("int4 weights have mins, int8 ones none")
        if self.mins is not None and (self.mins.shape != self.scales.shape or self.mins.dtype != torch.float16):
            raise ValueError("mins must be float16, shaped as the scales")
        if f.tiled and o % TILE:
            raise ValueError(f"a tiled weight has a multiple of {TILE} output features, got {o}")

    def rows(self, ids: torch.Tensor) -> "PackedWeight":
        """Output features `ids` (int64 [n]) as an untiled weight [n, in] (an embedding's lookup)."""
        if not self.fmt.tiled:
            mins = None if self.mins is None else self.mins.index_select(0, ids)
            return PackedWeight(self.fmt, self.codes.index_select(0, ids), self.scales.index_select(0, ids), mins,
                                ids.numel(), self.in_features)
        o, i, g = self.out_features, self.in_features, self.scales.shape[1]
        t, j = ids // TILE, ids % TILE
        width = self.codes.shape[1]  # bytes a row
        codes = self.codes.view(o // TILE, width // 4, TILE, 4)[t, :, j, :].reshape(-1, width)
        fields = [f.view(o // TILE, g, TILE)[t, :, j] for f in (self.scales, self.mins) if f is not None]
        if self.fmt.bits == 4:
            codes = pack_int4(_tiled_nibbles(codes))
        return PackedWeight(untiled_format(self.fmt), codes, fields[0], fields[1] if self.mins is not None else None,
                            ids.numel(), i)

    @property
    def nbytes(self) -> int:
        """Resident bytes of the packed weight (codes, scales, mins)."""
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scales, self.mins) if t is not None)


def untiled_format(fmt: QuantFormat) -> QuantFormat:
    return QuantFormat(fmt.bits, fmt.group, fmt.source)


def _tiled_nibbles(rows: torch.Tensor) -> torch.Tensor:
    """int4 rows [n, in / 2] of tiled bytes (byte 4v + k: input 8v + k low, 8v + 4 + k high) as
    int codes [n, in] in input order."""
    n = rows.shape[0]
    b = rows.view(n, -1, 4).to(torch.int32)
    return torch.stack([b & 15, b >> 4], dim=2).reshape(n, -1)


def _tile_fields(f: torch.Tensor | None, o: int) -> torch.Tensor | None:
    return None if f is None else f.view(o // TILE, TILE, -1).permute(0, 2, 1).contiguous().view(o, -1)


def symmetric_mins(scales: torch.Tensor) -> torch.Tensor:
    """The fp16 mins of a symmetric int4 weight (Q4_0: w = (code - 8) x scale), -8 x each
    scale: exact in fp16 (a power of two) unless |scale| > 8188 overflows it."""
    return (scales.float() * -8).half()


def _untile_fields(f: torch.Tensor | None, o: int) -> torch.Tensor | None:
    return None if f is None else f.view(o // TILE, -1, TILE).permute(0, 2, 1).contiguous().view(o, -1)


def tile(w: PackedWeight) -> PackedWeight:
    """A weight with a multiple of 16 output features in the tiled layout (the same bytes
    reordered, int4 nibbles regrouped); other weights as they are."""
    o, i = w.out_features, w.in_features
    if w.fmt.tiled or o % TILE:
        return w
    if w.fmt.bits == 8:
        rows = w.codes
    else:  # input 8v + k in byte 4v + k's low nibble, 8v + 4 + k in its high one
        q = unpack_codes(w.codes, 4).view(o, i // 8, 2, 4)
        rows = (q[:, :, 0] | (q[:, :, 1] << 4)).to(torch.uint8).view(o, i // 2)
    width = rows.shape[1]
    codes = rows.view(o // TILE, TILE, width // 4, 4).permute(0, 2, 1, 3).contiguous().view(o, width)
    symmetric = w.mins is not None and torch.equal(w.mins, symmetric_mins(w.scales))
    fmt = QuantFormat(w.fmt.bits, w.fmt.group, w.fmt.source, tiled=True, symmetric=symmetric)
    return PackedWeight(fmt, codes, _tile_fields(w.scales, o), _tile_fields(w.mins, o), o, i)


def untile(w: PackedWeight) -> PackedWeight:
    """The row layout of a tiled weight (a copy); an untiled weight as it is."""
    if not w.fmt.tiled:
        return w
    o, i = w.out_features, w.in_features
    width = w.codes.shape[1]
    codes = w.codes.view(o // TILE, width // 4, TILE, 4).permute(0, 2, 1, 3).contiguous().view(o, width)
    if w.fmt.bits == 4:
        codes = pack_int4(_tiled_nibbles(codes))
    return PackedWeight(untiled_format(w.fmt), codes, _untile_fields(w.scales, o), _untile_fields(w.mins, o), o, i)


def unpack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """The integer codes as int32 [out, in] in input order (int4 nibbles unpacked block by block)."""
    if bits == 8:
        return codes.to(torch.int32)
    out = codes.shape[0]
    blocks = codes.reshape(out, -1, BLOCK // 2)
    low, high = (blocks & 0x0F).to(torch.int32), (blocks >> 4).to(torch.int32)
    return torch.cat([low, high], dim=-1).reshape(out, -1)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """int codes 0..15 [out, in] (in a multiple of 32) into the nibble layout above."""
    out = q.shape[0]
    blocks = q.to(torch.uint8).reshape(out, -1, BLOCK)
    return (blocks[..., : BLOCK // 2] | (blocks[..., BLOCK // 2:] << 4)).reshape(out, -1).contiguous()


def dequantize(w: PackedWeight) -> torch.Tensor:
    """float32 [out, in]: the weight's defined values (see the module docstring), in PyTorch;
    the C++ library's `quant_dequantize` computes the same values faster."""
    w = untile(w)
    q = unpack_codes(w.codes, w.fmt.bits).to(torch.float32).reshape(w.out_features, -1, w.fmt.group)
    values = q * w.scales.float().unsqueeze(-1)
    if w.mins is not None:
        values = values + w.mins.float().unsqueeze(-1)
    return values.reshape(w.out_features, w.in_features)


def quantize(weight: torch.Tensor, fmt: QuantFormat) -> PackedWeight:
    """Round-to-nearest quantization of a float weight [out, in] into `fmt`.

    int8: symmetric, scale = max|w| / 127 per group, codes in -127..127. int4: asymmetric per
    group, min = the group's minimum, scale = (max - min) / 15, codes round((w - min) / scale)
    clamped to 0..15 (an all-equal group gets scale 0 and is represented by its min). Scales and
    mins are rounded to fp16 before the codes are computed from them; a weight beyond fp16's
    range is refused."""
    if weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(f"quantize takes a floating-point weight [out, in], got {weight.dtype} {tuple(weight.shape)}")
    out, inp = weight.shape
    if inp % fmt.group:
        raise ValueError(f"{inp} inputs are not a whole number of groups of {fmt.group}")
    w = weight.detach().to("cpu", torch.float32).reshape(out, inp // fmt.group, fmt.group)
    if not torch.isfinite(w).all():
        raise ValueError("cannot quantize a weight holding NaN or infinity")
    if w.abs().max() > torch.finfo(torch.float16).max:
        raise ValueError("cannot quantize a weight beyond float16's range (its scales are fp16)")
    if fmt.bits == 8:
        scales = _fp16(w.abs().amax(dim=-1) / 127)
        safe = torch.where(scales > 0, scales.float(), torch.ones_like(scales, dtype=torch.float32))
        codes = torch.round(w / safe.unsqueeze(-1)).clamp(-127, 127).to(torch.int8).reshape(out, inp)
        return PackedWeight(fmt, codes.contiguous(), scales, None, out, inp)
    lo = _fp16(w.amin(dim=-1))
    scales = _fp16((w.amax(dim=-1) - lo.float()) / 15)
    safe = torch.where(scales > 0, scales.float(), torch.ones_like(scales, dtype=torch.float32))
    q = torch.round((w - lo.float().unsqueeze(-1)) / safe.unsqueeze(-1)).clamp(0, 15).reshape(out, inp)
    return PackedWeight(fmt, pack_int4(q), scales, lo, out, inp)


def _fp16(values: torch.Tensor) -> torch.Tensor:
    """float32 values rounded to the nearest fp16, contiguous."""
    return values.to(torch.float16).contiguous()


def format_for(name: str, in_features: int) -> QuantFormat:
    """The format `load_model(quantization=name)` gives a layer of `in_features` inputs:
    "int8" (per output channel), "int4" (groups of 32), "int4-g32" or "int4-g128"."""
    if name == "int8":
        return QuantFormat(8, in_features, "int8")
    if name in ("int4", "int4-g32", "int4-g128"):
        group = 128 if name == "int4-g128" else 32
        return QuantFormat(4, group, f"int4-g{group}")
    raise ValueError(f"quantization must be one of int8, int4, int4-g32, int4-g128, got {name!r}")
