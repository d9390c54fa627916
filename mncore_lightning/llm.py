"""MLSDK's `mlsdk.experimental.llm` helpers, for compiling Hugging Face causal LMs.

A compiled step takes and returns tensors only, so the KV cache crosses a compiled call as
one tensor of shape `[layers, 2 (key, value), batch, kv_heads, tokens, head_dim]`; inside the
step it is turned back into the cache object the model takes. PFN's `llm_infer.py`,
`compile_pp_llama.py` and `run_pp_llama.py` use these helpers (reached there as
`mlsdk.experimental.llm.attention_mask`, `.kv_cache` and `.modeling_staged_llama`):

* `prepare_4d_causal_attention_mask_with_cache_position(mask, position_ids, dtype)`: a 2-D
  padding mask as the additive 4-D mask the model takes as is (left padding, static shapes).
* `kv_cache_to_tensor(cache)`, `kv_cache_to_legacy(tensor)`, `kv_cache_to_plamo(tensor)`.
* `split_llama(model, n_stages)`: a Llama-style causal LM as pipeline stages.

`transformers` is imported only by the functions that need it.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.nn as nn


def prepare_4d_causal_attention_mask_with_cache_position(
    attention_mask: torch.Tensor, position_ids: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """The additive attention mask `[batch, 1, tokens, tokens]` of a padded batch.

    `attention_mask` is the tokenizer's `[batch, tokens]` mask (1: a token, 0: padding) and
    `position_ids` the tokens' positions (PFN's scripts use `attention_mask.cumsum(1)`).
    Query `i` may attend to key `j` when `j` is a token and comes no later than `i`
    (`position_ids[j] <= position_ids[i]`): there the mask is 0, elsewhere the most negative
    `dtype` number, so the model adds it to the attention scores as it adds a prepared 4-D
    mask. A padding query sees no key; its row is finite (no NaN) and its output unused.
    For decoding, the last row, rolled by one token, is the next step's `[batch, 1, 1,
    tokens]` mask.
    """
    if attention_mask.dim() != 2 or position_ids.shape != attention_mask.shape:
        raise ValueError(
            "prepare_4d_causal_attention_mask_with_cache_position: expected a [batch, tokens] "
            f"attention mask and position ids of its shape, got {list(attention_mask.shape)} "
            f"and {list(position_ids.shape)}"
        )
    keys = attention_mask[:, None, :].bool()
    earlier = position_ids[:, None, :] <= position_ids[:, :, None]
    visible = (keys & earlier)[:, None]
    blocked = torch.full((), torch.finfo(dtype).min, dtype=dtype, device=attention_mask.device)
    return torch.where(visible, torch.zeros((), dtype=dtype), blocked)


def _layer_pairs(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(key, value) per layer of a Hugging Face cache object or a legacy tuple of pairs."""
    layers = getattr(cache, "layers", None)
    if layers is not None:  # transformers' Cache: DynamicCache, StaticCache, ...
        return [(layer.keys, layer.values) for layer in layers]
    if hasattr(cache, "key_cache") and hasattr(cache, "value_cache"):  # transformers 4.x
        return list(zip(cache.key_cache, cache.value_cache, strict=True))
    if isinstance(cache, Iterable):  # the legacy format: ((key, value), ...) per layer
        return [(pair[0], pair[1]) for pair in cache]
    raise TypeError(f"kv_cache_to_tensor: {type(cache).__name__} is not a KV cache")


def kv_cache_to_tensor(cache: Any) -> torch.Tensor:
    """A model's KV cache (a transformers Cache, or the legacy tuple of (key, value) per
    layer) as one tensor `[layers, 2, batch, kv_heads, tokens, head_dim]`."""
    pairs = _layer_pairs(cache)
    if not pairs:
        raise ValueError("kv_cache_to_tensor: the cache holds no layer")
    return torch.stack([torch.stack(pair) for pair in pairs])


def _pairs_of(tensor: torch.Tensor, what: str) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
    if tensor.dim() != 6 or tensor.shape[1] != 2:
        raise ValueError(
            f"{what}: expected a KV cache tensor [layers, 2, batch, kv_heads, tokens, head_dim], "
            f"got shape {list(tensor.shape)}"
        )
    return tuple((layer[0], layer[1]) for layer in tensor.unbind(0))


def _transformers_major() -> int:
    import transformers

    return int(transformers.__version__.split(".")[0])


def kv_cache_to_legacy(tensor: torch.Tensor) -> Any:
    """The cache a transformers model takes as `past_key_values`, from a KV cache tensor.

    The legacy format is a tuple of (key, value) per layer. transformers 5 no longer takes
    it, so with transformers >= 5 the same pairs come in a `DynamicCache` (built from them,
    as `DynamicCache.from_legacy_cache` did); with transformers 4 the tuple itself.
    """
    pairs = _pairs_of(tensor, "kv_cache_to_legacy")
    if _transformers_major() < 5:
        return pairs
    from transformers import DynamicCache

    return DynamicCache(ddp_cache_data=pairs)


def kv_cache_to_plamo(tensor: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The KV cache PFN's PLaMo models (remote code) take: a list of (key, value) per layer,
    each `[batch, kv_heads, tokens, head_dim]`. (PLaMo's code is not on this machine; the
    format is the one its attention concatenates new keys and values onto.)"""
    return list(_pairs_of(tensor, "kv_cache_to_plamo"))


# --- pipeline stages ---------------------------------------------------------------------


class LlamaEmbeddingStage(nn.Module):
    """Stage 0: token embeddings and the rotary position embeddings every layer uses."""

    def __init__(self, embed_tokens: nn.Module, rotary_emb: nn.Module) -> None:
        super().__init__()
        self.embed_tokens = embed_tokens
        self.rotary_emb = rotary_emb

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> dict[str, Any]:
        hidden_states = self.embed_tokens(input_ids)
        cos, sin = self.rotary_emb(hidden_states, position_ids)
        return {
            "hidden_states_out": hidden_states,
            "position_embeddings_cos_out": cos,
            "position_embeddings_sin_out": sin,
        }


class LlamaDecoderStage(nn.Module):
    """A run of decoder layers, with its own KV cache (its layers numbered from 0).

    Takes what the stage before returns (hidden states, the rotary cos and sin), the 4-D
    additive attention mask, position ids and, when decoding, this stage's past KV cache
    (the object `kv_cache_to_legacy` makes); returns the hidden states, the cos and sin for
    the next stage (not from the last decoder stage) and `past_key_values_out`, the cache
    after this call (`kv_cache_to_tensor` makes it a tensor)."""

    def __init__(self, config: Any, layers: Sequence[nn.Module], last: bool) -> None:
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList(layers)
        self.last = last

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings_cos: torch.Tensor,
        position_embeddings_sin: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        past_key_values: Any = None,
    ) -> dict[str, Any]:
        from transformers import DynamicCache
        from transformers.masking_utils import create_causal_mask

        cache = past_key_values if past_key_values is not None else DynamicCache()
        if isinstance(cache, tuple):  # the legacy format (transformers 4)
            cache = DynamicCache(ddp_cache_data=cache)
        mask = create_causal_mask(
            config=self.config,
            inputs_embeds=hidden_states,
            attention_mask=attention_mask,
            cache=cache,
            position_ids=position_ids,
        )
        embeddings = (position_embeddings_cos, position_embeddings_sin)
        for layer in self.layers:
            hidden_states = layer(
                hidden_states,
                attention_mask=mask,
                position_ids=position_ids,
                cache=cache,
                use_cache=True,
                position_embeddings=embeddings,
            )
        outputs: dict[str, Any] = {"hidden_states_out": hidden_states}
        if not self.last:
            outputs["position_embeddings_cos_out"] = position_embeddings_cos
            outputs["position_embeddings_sin_out"] = position_embeddings_sin
        outputs["past_key_values_out"] = cache
        return outputs


class LlamaHeadStage(nn.Module):
    """The last stage: the final norm and the LM head."""

    def __init__(self, norm: nn.Module, lm_head: nn.Module) -> None:
        super().__init__()
        self.norm = norm
        self.lm_head = lm_head

    def forward(self, hidden_states: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"logits": self.lm_head(self.norm(hidden_states))}


def _renumbered(layer: nn.Module, index: int) -> nn.Module:
    """`layer` for a stage's own KV cache: a shallow copy whose attention has layer index
    `index`. Parameters and buffers are shared with the model, not copied."""
    layer = copy.copy(layer)
    layer._modules = dict(layer._modules)
    attention = copy.copy(layer._modules["self_attn"])
    attention.layer_idx = index
    layer._modules["self_attn"] = attention
    return layer


def split_llama(model: nn.Module, n_stages: int) -> list[nn.Module]:
    """A Llama-style causal LM (`LlamaForCausalLM`, `Qwen2ForCausalLM`, ...) as `n_stages`
    pipeline stages: the embeddings, `n_stages - 2` runs of ceil(layers / (n_stages - 2))
    decoder layers, and the head. Run in order, they compute the model's logits and KV cache.

    The stages share the model's parameters (nothing is copied); the model itself is left
    as it was. Each stage is compiled on its own device (PFN's `compile_pp_llama.py`) and
    the stages pass their outputs along (`run_pp_llama.py`).
    """
    body = getattr(model, "model", None)
    needed = ("embed_tokens", "rotary_emb", "layers", "norm")
    if body is None or not all(hasattr(body, n) for n in needed) or not hasattr(model, "lm_head"):
        raise TypeError(
            f"split_llama: {type(model).__name__} is not a Llama-style causal LM "
            "(model.model.embed_tokens / rotary_emb / layers / norm and model.lm_head)"
        )
    layers = list(body.layers)
    n_decoder_stages = n_stages - 2
    if n_decoder_stages < 1:
        raise ValueError(f"split_llama: n_stages={n_stages}; at least 3 (embeddings, layers, head)")
    per_stage = -(-len(layers) // n_decoder_stages)
    if per_stage * (n_decoder_stages - 1) >= len(layers):
        raise ValueError(
            f"split_llama: {len(layers)} layers cannot fill {n_decoder_stages} decoder stages "
            f"of {per_stage} layers: use fewer stages"
        )
    stages: list[nn.Module] = [LlamaEmbeddingStage(body.embed_tokens, body.rotary_emb)]
    for stage in range(n_decoder_stages):
        chunk = layers[per_stage * stage : per_stage * (stage + 1)]
        renumbered = [_renumbered(layer, i) for i, layer in enumerate(chunk)]
        stages.append(
            LlamaDecoderStage(model.config, renumbered, last=stage == n_decoder_stages - 1)
        )
    stages.append(LlamaHeadStage(body.norm, model.lm_head))
    for stage in stages:
        stage.train(model.training)
    return stages
