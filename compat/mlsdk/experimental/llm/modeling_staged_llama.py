"""`mlsdk.experimental.llm.modeling_staged_llama` on the emulated device."""

from mncore_lightning.llm import (
    LlamaDecoderStage,
    LlamaEmbeddingStage,
    LlamaHeadStage,
    split_llama,
)

__all__ = ["LlamaDecoderStage", "LlamaEmbeddingStage", "LlamaHeadStage", "split_llama"]
