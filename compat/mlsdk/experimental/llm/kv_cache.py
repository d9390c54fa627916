"""`mlsdk.experimental.llm.kv_cache` on the emulated device."""

from mncore_lightning.llm import kv_cache_to_legacy, kv_cache_to_plamo, kv_cache_to_tensor

__all__ = ["kv_cache_to_legacy", "kv_cache_to_plamo", "kv_cache_to_tensor"]
