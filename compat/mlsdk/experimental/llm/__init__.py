"""`mlsdk.experimental.llm`: helpers for compiling Hugging Face causal LMs (see
`mncore_lightning.llm`, which implements them)."""
