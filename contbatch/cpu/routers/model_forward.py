"""The decoder model's forward around the one-call stack: engine steps skip the model's loop.

Once the decoder stack runs every layer in one call (fused_layer.py's `FusedStack`), the
model's own forward still calls each later layer to be handed the stack's output, and builds
what the engine's steps never use (masks from the engine's 4-D placeholder, which
transformers returns as it is). For the model classes whose forward is exactly
embed -> rotary -> layers -> norm (`FORWARD_AS_WRITTEN`), an engine step takes this forward
instead: the same modules called in the same order with the same arguments, the first layer
called as the loop calls it (its routed forward runs the whole stack), the later layers
skipped when the stack ran and called one by one when it did not. So its output is the
model's own bit for bit; anything else (a call outside a step, hooks, a cache, embeddings
passed in, a compiled trace) takes the model's own forward.
"""

from __future__ import annotations

import types

import torch
from transformers.modeling_outputs import BaseModelOutputWithPast

from .fused_layer import FusedStack, SharedState

# Decoder models whose forward, for an engine step (input ids, positions, the engine's 4-D
# mask, no cache), is embed_tokens -> rotary_emb -> each of `layers` -> norm.
FORWARD_AS_WRITTEN = ("LlamaModel", "MistralModel", "Qwen2Model", "Qwen3Model")


def decoder_model(model: torch.nn.Module, first_layer: torch.nn.Module) -> torch.nn.Module | None:
    """The module of one of FORWARD_AS_WRITTEN whose `layers` start with `first_layer`, with its
    class's own forward, or None."""
    for m in model.modules():
        layers = getattr(m, "layers", None)
        if (type(m).__name__ in FORWARD_AS_WRITTEN and isinstance(layers, torch.nn.ModuleList) and len(layers)
                and layers[0] is first_layer and "forward" not in m.__dict__
                and all(hasattr(m, n) for n in ("embed_tokens", "rotary_emb", "norm"))):
            return m
    return None


def _hooked(*modules: torch.nn.Module) -> bool:
    return any(m._forward_hooks or m._forward_pre_hooks for m in modules)


def _stack_forward(self: torch.nn.Module, input_ids: torch.Tensor | None = None,
                   attention_mask: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                   cache=None, inputs_embeds: torch.Tensor | None = None, use_cache: bool | None = None,
                   **kwargs) -> BaseModelOutputWithPast:
    shared: SharedState = self._contbatch_shared
    stack: FusedStack = shared.stack
    layers = self.layers[: self.config.num_hidden_layers] if len(self.layers) > self.config.num_hidden_layers \
        else self.layers
    engine_step = (not torch.compiler.is_compiling() and shared.enabled and shared.in_step()
                   and input_ids is not None and inputs_embeds is None and position_ids is not None
                   and cache is None and not use_cache
                   and isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 4
                   and set(kwargs) <= {"step_metadata"} and len(layers) == len(stack.layers)
                   and not _hooked(self, self.embed_tokens, self.rotary_emb, self.norm))
    if not engine_step:
        return type(self).forward(self, input_ids=input_ids, attention_mask=attention_mask,
                                  position_ids=position_ids, cache=cache, inputs_embeds=inputs_embeds,
                                  use_cache=use_cache, **kwargs)
    hidden = self.embed_tokens(input_ids)
    emb = self.rotary_emb(hidden, position_ids=position_ids)
    for position, layer in enumerate(layers):
        if position == 1 and stack.done[1] is hidden:  # the first layer's call ran the whole stack
            stack.done = (None, None)
            break
        hidden = layer(hidden, attention_mask=attention_mask, position_embeddings=emb, position_ids=position_ids,
                       cache=None, use_cache=use_cache, **kwargs)
    return BaseModelOutputWithPast(last_hidden_state=self.norm(hidden))


def install(model: torch.nn.Module, shared: SharedState, first_layer: torch.nn.Module) -> torch.nn.Module | None:
    """Gives the decoder model (where it is one of FORWARD_AS_WRITTEN) the stack's forward;
    returns it (for `uninstall`), or None."""
    decoder = decoder_model(model, first_layer)
    if decoder is None or shared.stack is None:
        return None
    decoder._contbatch_shared = shared
    decoder.forward = types.MethodType(_stack_forward, decoder)
    return decoder


def uninstall(decoder: torch.nn.Module | None) -> None:
    if decoder is not None:
        decoder.__dict__.pop("forward", None)
        decoder.__dict__.pop("_contbatch_shared", None)
