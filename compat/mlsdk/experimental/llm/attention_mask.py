"""`mlsdk.experimental.llm.attention_mask` on the emulated device."""

from mncore_lightning.llm import prepare_4d_causal_attention_mask_with_cache_position

__all__ = ["prepare_4d_causal_attention_mask_with_cache_position"]
