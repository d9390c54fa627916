"""A Hugging Face transformers model trains in a compiled step, with its default attention.

A tiny random Qwen2 (a Llama-family decoder: RoPE, grouped-query attention, RMSNorm, SwiGLU)
is built from a config on the spot (nothing is downloaded) and trained for a few steps as
PFN's slm_sft example trains one: the model's own loss from `labels`, an attention mask,
MNCoreAdamW. The compiled steps must match eager PyTorch.
"""

from __future__ import annotations

import copy

import pytest
import torch

from mncore_lightning.mlsdk import Context, MNCoreAdamW, MNDevice

transformers = pytest.importorskip("transformers")


def _tiny_qwen2() -> torch.nn.Module:
    config = transformers.Qwen2Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    torch.manual_seed(0)
    return transformers.Qwen2ForCausalLM(config).train()


def _batches(n: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(n):
        ids = torch.randint(0, 64, (2, 12), generator=g)
        labels = ids.clone()
        labels[:, :4] = -100  # the prompt is not learned, as in slm_sft
        mask = torch.ones_like(ids)
        mask[1, -3:] = 0  # a padded sample
        batches.append({"input_ids": ids, "labels": labels, "attention_mask": mask})
    return batches


def _step(model, optimizer):
    def train_step(inp):
        optimizer.zero_grad()
        out = model(
            input_ids=inp["input_ids"], labels=inp["labels"], attention_mask=inp["attention_mask"]
        )
        out.loss.backward()
        optimizer.step()
        return {"loss": out.loss}

    return train_step


def test_tiny_qwen2_trains_in_a_compiled_step_like_eager():
    model = _tiny_qwen2()
    reference = copy.deepcopy(model)
    assert model.config._attn_implementation == "sdpa"  # the default attention
    context = Context(MNDevice("pfvm:cpu"))
    Context.switch_context(context)
    optimizer = MNCoreAdamW(model.parameters(), lr=1e-2)
    context.registry.register("model", model)
    context.registry.register("optimizer", optimizer)
    batches = _batches(3)
    compiled = context.compile(_step(model, optimizer), batches[0], options={"option_json": "O0"})
    losses = [compiled(b)["loss"].cpu() for b in batches]
    context.synchronize()

    eager_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    eager_step = _step(reference, eager_optimizer)
    expected = [eager_step(b)["loss"].detach() for b in batches]
    # Tolerance: float32 rounding of the same ops, grown over 3 Adam steps.
    torch.testing.assert_close(torch.stack(losses), torch.stack(expected), rtol=1e-4, atol=1e-5)
    assert losses[-1] < losses[0]
    for (name, got), want in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, msg=name)
