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
passed in, a compiled trace) takes the model's own forward. Their causal LMs
(`CAUSAL_AS_WRITTEN`) likewise take, for an engine step, the decoder's step output into the
lm_head on the rows kept, as their forward does, without the decorators and output classes
around it (a lone decode step of a small model is short enough for those to show).
"""

from __future__ import annotations

import types
from dataclasses import dataclass

import torch
from transformers.modeling_outputs import BaseModelOutputWithPast
from transformers.modeling_utils import slice_logits_to_keep

from .fused_layer import FusedStack, SharedState

# Decoder models whose forward, for an engine step (input ids, positions, the engine's 4-D
# mask, no cache), is embed_tokens -> rotary_emb -> each of `layers` -> norm.
FORWARD_AS_WRITTEN = ("LlamaModel", "MistralModel", "Qwen2Model", "Qwen3Model")
# Their causal LMs, whose forward is the decoder -> `slice_logits_to_keep` -> lm_head (-> a loss
# only with labels).
CAUSAL_AS_WRITTEN = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


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


def _step_hidden(decoder: torch.nn.Module, input_ids: torch.Tensor | None, attention_mask: torch.Tensor | None,
                 position_ids: torch.Tensor | None, cache, inputs_embeds: torch.Tensor | None,
                 use_cache: bool | None, kwargs: dict) -> torch.Tensor | None:
    """The decoder's normed output for an engine step, by the modules in the model's order (the
    first layer's call running the whole stack); None for any other call, which then takes
    the model's own forward."""
    shared: SharedState = decoder._contbatch_shared
    stack: FusedStack = shared.stack
    layers = decoder.layers[: decoder.config.num_hidden_layers] \
        if len(decoder.layers) > decoder.config.num_hidden_layers else decoder.layers
    engine_step = (not torch.compiler.is_compiling() and shared.enabled and shared.in_step()
                   and input_ids is not None and inputs_embeds is None and position_ids is not None
                   and cache is None and not use_cache
                   and isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 4
                   and set(kwargs) <= {"step_metadata"} and len(layers) == len(stack.layers)
                   and not _hooked(decoder, decoder.embed_tokens, decoder.rotary_emb, decoder.norm))
    if not engine_step:
        return None
    hidden = decoder.embed_tokens(input_ids)
    emb = decoder.rotary_emb(hidden, position_ids=position_ids)
    for position, layer in enumerate(layers):
        if position == 1 and stack.done[1] is hidden:  # the first layer's call ran the whole stack
            stack.done = (None, None)
            break
        hidden = layer(hidden, attention_mask=attention_mask, position_embeddings=emb, position_ids=position_ids,
                       cache=None, use_cache=use_cache, **kwargs)
    return decoder.norm(hidden)


def _stack_forward(self: torch.nn.Module, input_ids: torch.Tensor | None = None,
                   attention_mask: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                   cache=None, inputs_embeds: torch.Tensor | None = None, use_cache: bool | None = None,
                   **kwargs) -> BaseModelOutputWithPast:
    hidden = _step_hidden(self, input_ids, attention_mask, position_ids, cache, inputs_embeds, use_cache, kwargs)
    if hidden is None:
        return type(self).forward(self, input_ids=input_ids, attention_mask=attention_mask,
                                  position_ids=position_ids, cache=cache, inputs_embeds=inputs_embeds,
                                  use_cache=use_cache, **kwargs)
    return BaseModelOutputWithPast(last_hidden_state=hidden)


@dataclass(slots=True)
class StepLogits:
    """What an engine step reads of the causal LM's output: its logits (the rows kept)."""

    logits: torch.Tensor


def _causal_forward(self: torch.nn.Module, input_ids: torch.Tensor | None = None,
                    attention_mask: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                    cache=None, inputs_embeds: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                    use_cache: bool | None = None, logits_to_keep: int | torch.Tensor = 0, **kwargs):
    """CAUSAL_AS_WRITTEN's forward (decoder -> keep the logits' rows -> lm_head) for an engine
    step, without the decorators and output classes around it; any other call (labels, hooks on
    the decoder or the head, anything `_step_hidden` refuses) takes the model's own forward."""
    decoder = self.model
    hidden = None
    if labels is None and "forward" in decoder.__dict__ and not _hooked(decoder, self.lm_head):
        hidden = _step_hidden(decoder, input_ids, attention_mask, position_ids, cache, inputs_embeds, use_cache,
                              kwargs)
    if hidden is None:
        return type(self).forward(self, input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                  cache=cache, inputs_embeds=inputs_embeds, labels=labels, use_cache=use_cache,
                                  logits_to_keep=logits_to_keep, **kwargs)
    return StepLogits(self.lm_head(slice_logits_to_keep(hidden, logits_to_keep)))


def causal_model(model: torch.nn.Module, decoder: torch.nn.Module) -> bool:
    """Whether `model` is one of CAUSAL_AS_WRITTEN around `decoder`, with its class's forward."""
    return (type(model).__name__ in CAUSAL_AS_WRITTEN and getattr(model, "model", None) is decoder
            and isinstance(getattr(model, "lm_head", None), torch.nn.Module) and "forward" not in model.__dict__)


def install(model: torch.nn.Module, shared: SharedState, first_layer: torch.nn.Module) -> list[torch.nn.Module]:
    """Gives the decoder model (where it is one of FORWARD_AS_WRITTEN) the stack's forward, and
    the causal LM around it (where it is one of CAUSAL_AS_WRITTEN) its step forward; returns the
    modules given one (for `uninstall`)."""
    decoder = decoder_model(model, first_layer)
    if decoder is None or shared.stack is None:
        return []
    decoder._contbatch_shared = shared
    decoder.forward = types.MethodType(_stack_forward, decoder)
    if not causal_model(model, decoder):
        return [decoder]
    model.forward = types.MethodType(_causal_forward, model)
    return [decoder, model]


def uninstall(modules: list[torch.nn.Module]) -> None:
    for m in modules:
        m.__dict__.pop("forward", None)
        m.__dict__.pop("_contbatch_shared", None)
