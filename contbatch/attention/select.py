"""Which attention kernels a manager uses, chosen once at start-up, reported back, and loaded.

The reference engine drops its decode fast path silently when the kernel it needs is
missing. Here every request that cannot be honoured becomes a warning (logged when the
manager starts) and the resolved value says what actually runs.

Every backend takes the same step layout (`StepMetadata`):
- `torch`: the CPU path. Decode rows read K/V in place through the block tables in our C++
  kernel (`cpu/ops.py`, its decode fast path; without it, or with the fast path off, they
  gather their keys and run batched matmuls); prefill chunks read K/V in place in our C++
  prefill kernel, every chunk of the step in one call (the `prefill` CPU kernel "off", or no
  compiler: SDPA per request). Planned on the host each step, so no CUDA graphs.
- `triton`: our kernels (`triton_kernels.py`) over flat tensor metadata: a varlen kernel for
  mixed steps and a decode fast path that reads K/V in place through the block tables.
- `flash`: `flash_attn_varlen_func` / `flash_attn_with_kvcache` over the same metadata; the
  cache is token-major and blocks a multiple of 256 tokens, as flash-attn's paged path needs.
- `reference`: the kernels' PyTorch reference (`varlen_reference.py`): the decode fast path,
  padding to graph buckets and async carry-over, testable on any device.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .kernel_backend import KernelBackend
from .metadata import AttentionBackend, Kernel

KERNEL_BACKENDS = ("triton", "flash", "reference")  # kernels that walk the block tables
GRAPH_BACKENDS = ("triton", "flash")  # no host syncs inside the forward
FLASH_BLOCK_MULTIPLE = 256


def _importable(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def triton_runs_here(device_type: str) -> bool:
    """Triton compiles for CUDA; on the CPU only its interpreter can run our kernels."""
    if not _importable("triton"):
        return False
    return device_type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


@dataclass
class BackendChoice:
    name: str
    block_size: int
    decode_fast_path: bool
    use_cuda_graph: bool
    use_async_batching: bool
    kv_layout: str
    prefill_kernel: bool = False  # torch backend: prefill chunks in our C++ kernel, not SDPA
    notes: list[str] = field(default_factory=list)  # why something is off or changed
    warnings: list[str] = field(default_factory=list)  # the user asked for it and did not get it


def choose_backend(
    requested: str,
    device_type: str,
    block_size: int,
    decode_fast_path: bool | None,
    use_cuda_graph: bool | None,
    use_async_batching: bool | None,
    cpu_prefill_kernel: str = "auto",  # the `prefill` CPU kernel asked (cpu/knobs.py)
) -> BackendChoice:
    c = BackendChoice(requested, block_size, False, False, False, "heads-first")
    cuda = device_type == "cuda"
    has_flash = cuda and _importable("flash_attn")
    has_triton = triton_runs_here(device_type)

    if requested == "auto":
        if has_flash and block_size % FLASH_BLOCK_MULTIPLE == 0:
            c.name = "flash"
        elif cuda and has_triton:
            c.name = "triton"
            if has_flash:
                c.notes.append(f"flash-attn needs block_size % {FLASH_BLOCK_MULTIPLE} == 0 (got {block_size}); using triton")
        else:
            c.name = "torch"
            if cuda:
                c.warnings.append("no flash-attn and no Triton on this CUDA machine: the slow torch backend runs "
                                  "(keys gathered per step, no decode fast path, no CUDA graphs)")
    elif requested == "flash" and not has_flash:
        c.name = "triton" if cuda and has_triton else "torch"
        c.warnings.append(f"attention_backend='flash' needs flash-attn on CUDA; using {c.name}")
    elif requested == "triton" and not has_triton:
        c.name = "torch"
        why = "triton is not installed" if not _importable("triton") else "no GPU (set TRITON_INTERPRET=1 to test)"
        c.warnings.append(f"attention_backend='triton' cannot run: {why}; using torch")
    if c.name == "triton" and not cuda:
        c.notes.append("Triton runs in its CPU interpreter: correct, and very slow (for tests)")
    if c.name == "flash":
        c.kv_layout = "token-major"
        if block_size % FLASH_BLOCK_MULTIPLE:
            c.block_size = -(-block_size // FLASH_BLOCK_MULTIPLE) * FLASH_BLOCK_MULTIPLE
            c.warnings.append(f"block_size rounded up from {block_size} to {c.block_size}: flash-attn's paged "
                              f"KV needs a multiple of {FLASH_BLOCK_MULTIPLE}")

    fast_ok, why_not = c.name in KERNEL_BACKENDS, "needs triton, flash or reference, or torch on the CPU"
    if c.name == "torch" and not cuda and decode_fast_path is not False:
        from ..cpu import ops as cpu_ops

        fast_ok, how = cpu_ops.load_attention()
        why_not = f"the C++ CPU decode kernel is {how}"
    c.decode_fast_path = fast_ok if decode_fast_path is None else (decode_fast_path and fast_ok)
    if decode_fast_path and not fast_ok:
        c.warnings.append(f"decode_fast_path=True cannot run on the {c.name} backend ({why_not}); decode rows "
                          "gather keys instead")
    elif decode_fast_path is None and not fast_ok and c.name == "torch" and not cuda:
        c.warnings.append(f"decode fast path off: {why_not}")
    elif not c.decode_fast_path:
        c.notes.append("decode fast path off: decode-only steps take the varlen/gather path")

    if c.name == "torch" and not cuda:
        if cpu_prefill_kernel == "off":
            c.notes.append("the prefill CPU kernel is off: prefill chunks run SDPA one request at a time")
        else:
            from ..cpu import ops as cpu_ops

            c.prefill_kernel, how = cpu_ops.load_attention()
            if not c.prefill_kernel:
                c.warnings.append(f"the C++ CPU prefill kernel is {how}: prefill chunks run SDPA one request at a "
                                  "time")

    graphs_ok = cuda and c.name in GRAPH_BACKENDS
    c.use_cuda_graph = graphs_ok if use_cuda_graph is None else (use_cuda_graph and graphs_ok)
    if use_cuda_graph and not graphs_ok:
        why = "no GPU" if not cuda else f"the {c.name} backend syncs with the host inside the forward"
        c.warnings.append(f"use_cuda_graph=True cannot run: {why}; steps run eagerly")

    # The torch backend plans each step on the host from the step's own inputs: with nothing
    # to overlap it with, async batching would only add the carry-over's work.
    async_ok = c.name in KERNEL_BACKENDS
    c.use_async_batching = c.use_cuda_graph if use_async_batching is None else (use_async_batching and async_ok)
    if use_async_batching and not async_ok:
        c.warnings.append(f"use_async_batching=True needs a kernel backend {KERNEL_BACKENDS}, not {c.name}; "
                          "steps run one after another")
    elif c.use_async_batching and not cuda:
        c.notes.append("async batching on the CPU keeps its carry-over pipeline but overlaps nothing")
    return c


def _paged_adapters(decode_fn: Callable, varlen_fn: Callable, block_size: int) -> tuple[Kernel, Kernel]:
    """Our Triton kernels and their PyTorch reference share one signature: one adapter."""

    def decode(q, k, v, meta, scale, window, softcap, sinks=None, chunk=None):
        return decode_fn(q, k, v, meta.block_table, meta.kv_lens, scale, window, softcap, block_size=block_size,
                         sinks=sinks, chunk=chunk)

    def varlen(q, k, v, meta, scale, window, softcap, sinks=None, chunk=None):
        return varlen_fn(
            q, k, v, meta.block_table, meta.kv_lens, meta.cu_seqlens_q, meta.tile_request, meta.tile_start,
            scale, window, softcap, out=torch.zeros_like(q), block_size=block_size, sinks=sinks, chunk=chunk,
        )  # zeros: padding rows past the last request stay finite

    return decode, varlen


def load_backend(name: str, decode_fast_path: bool, block_size: int, prefill_kernel: bool = False) -> AttentionBackend:
    if name == "torch":
        from .torch_backend import TorchBackend

        return TorchBackend(decode_kernel=decode_fast_path, prefill_kernel=prefill_kernel)
    if name == "triton":
        from . import triton_kernels as tk

        decode, varlen = _paged_adapters(tk.paged_decode_attention, tk.paged_varlen_attention, block_size)
        return KernelBackend(name, decode if decode_fast_path else None, varlen, tk.varlen_tiles, tk.max_varlen_tiles)
    if name == "reference":
        from . import varlen_reference as ref

        decode, varlen = _paged_adapters(ref.reference_decode_attention, ref.reference_varlen_attention, block_size)
        return KernelBackend(name, decode if decode_fast_path else None, varlen)
    if name == "flash":
        from .flash import flash_decode, flash_varlen

        return KernelBackend(name, flash_decode if decode_fast_path else None, flash_varlen, kv_keyed=True)
    raise ValueError(f"unknown attention backend {name!r}")
