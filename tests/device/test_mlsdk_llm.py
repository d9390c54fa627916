"""`mlsdk.experimental.llm` against Hugging Face's own eager results, on tiny random models.

The helpers are used as PFN's llm_infer.py / compile_pp_llama.py use them: a left-padded
prompt with its 4-D mask prepared on the host, the KV cache crossing compiled calls as one
tensor, greedy decoding with compiled prefill and decode steps, and a Llama split into
pipeline stages compiled one Context each. Nothing is downloaded: the models are built from
small configs with random weights.
"""

from __future__ import annotations

import pytest
import torch

from mncore_lightning.llm import (
    kv_cache_to_legacy,
    kv_cache_to_plamo,
    kv_cache_to_tensor,
    prepare_4d_causal_attention_mask_with_cache_position,
    split_llama,
)
from mncore_lightning.mlsdk import Context, MNDevice

transformers = pytest.importorskip("transformers")

VOCAB, LENGTH = 64, 12


def tiny_llm(kind: str = "llama", layers: int = 2) -> torch.nn.Module:
    common = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    if kind == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    else:
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
    return model.eval()


def left_padded(prompts: list[list[int]], length: int = LENGTH) -> dict[str, torch.Tensor]:
    """The tokenizer's output for `padding="max_length"` with padding_side="left"."""
    ids = torch.zeros(len(prompts), length, dtype=torch.long)
    mask = torch.zeros(len(prompts), length, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, length - len(prompt) :] = torch.tensor(prompt)
        mask[row, length - len(prompt) :] = 1
    return {"input_ids": ids, "attention_mask": mask}


PROMPTS = [[5, 9, 13, 2, 40, 7, 33], [11, 3, 60, 21]]


def test_prepared_mask_gives_each_prompt_its_unpadded_logits():
    model = tiny_llm()
    batch = left_padded(PROMPTS)
    positions = batch["attention_mask"].cumsum(1)
    mask = prepare_4d_causal_attention_mask_with_cache_position(
        batch["attention_mask"], positions, torch.float32
    )
    assert mask.shape == (2, 1, LENGTH, LENGTH) and mask.dtype == torch.float32
    assert set(mask.unique().tolist()) == {0.0, torch.finfo(torch.float32).min}
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=mask, position_ids=positions)
        for row, prompt in enumerate(PROMPTS):
            alone = model(input_ids=torch.tensor([prompt])).logits[0]
            got = logits.logits[row, LENGTH - len(prompt) :]
            torch.testing.assert_close(got, alone, rtol=1e-5, atol=1e-5)
    assert torch.isfinite(logits.logits).all()  # padding rows: finite, unused


def test_mask_arguments_are_checked():
    with pytest.raises(ValueError, match=r"\[batch, tokens\]"):
        prepare_4d_causal_attention_mask_with_cache_position(
            torch.ones(2, 3), torch.ones(2, 4), torch.float32
        )


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_kv_cache_tensor_round_trip_continues_like_the_models_own_cache(kind):
    model = tiny_llm(kind)
    ids = torch.tensor([PROMPTS[0]])
    with torch.no_grad():
        first = model(input_ids=ids, use_cache=True)
        tensor = kv_cache_to_tensor(first.past_key_values)
        assert tensor.shape == (2, 2, 1, 2, len(PROMPTS[0]), 8)
        following = torch.tensor([[17]])
        expected = model(input_ids=following, past_key_values=first.past_key_values).logits
        rebuilt = kv_cache_to_legacy(tensor.clone())
        got = model(input_ids=following, past_key_values=rebuilt, use_cache=True)
    torch.testing.assert_close(got.logits, expected, rtol=0, atol=0)
    grown = kv_cache_to_tensor(got.past_key_values)
    assert grown.shape[4] == len(PROMPTS[0]) + 1
    torch.testing.assert_close(grown[..., :-1, :], tensor, rtol=0, atol=0)
    plamo = kv_cache_to_plamo(tensor)
    assert len(plamo) == 2 and all(torch.equal(k, tensor[i, 0]) for i, (k, _) in enumerate(plamo))
    torch.testing.assert_close(kv_cache_to_tensor(plamo), tensor, rtol=0, atol=0)
    with pytest.raises(ValueError, match="KV cache tensor"):
        kv_cache_to_legacy(tensor[0])


def _greedy_reference(model, prompt: list[int], new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False,
            max_new_tokens=new_tokens,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_compiled_prefill_and_decode_generate_what_generate_does(kind):
    """llm_infer.py's loop: a compiled prefill, then a compiled decode step whose KV cache
    goes in and out as a tensor, shifted by one token each step (static shapes)."""
    model = tiny_llm(kind)
    prompt, new_tokens = PROMPTS[0], 4
    context = Context(MNDevice("pfvm:cpu"))
    Context.switch_context(context)
    context.registry.register("model", model)

    def forward(inputs):
        past = inputs.get("past_key_values")
        out = model.forward(
            input_ids=inputs["input_ids"],
            attention_mask=inputs["attention_mask"],
            position_ids=inputs["position_ids"],
            past_key_values=kv_cache_to_legacy(past) if past is not None else None,
            use_cache=True,
        )
        return {
            "logits": out.logits,
            "next_past_key_values": kv_cache_to_tensor(out.past_key_values)[:, :, :, :, 1:, :],
        }

    inputs = left_padded([prompt])
    inputs["position_ids"] = inputs["attention_mask"].cumsum(1)
    inputs["attention_mask"] = prepare_4d_causal_attention_mask_with_cache_position(
        inputs["attention_mask"], inputs["position_ids"], model.dtype
    )
    options = {"option_json": "O0"}
    compiled, tokens = {}, []
    for step in range(new_tokens):
        phase = "prefill" if step == 0 else "decode"
        if phase not in compiled:
            compiled[phase] = context.compile(forward, inputs, options=options)
        outputs = compiled[phase](inputs)
        with torch.no_grad():
            eager = forward(inputs)
        torch.testing.assert_close(outputs["logits"], eager["logits"], rtol=1e-5, atol=1e-5)
        token = outputs["logits"].cpu().argmax(dim=2)[:, -1:]
        mask = torch.roll(inputs["attention_mask"][:, :, -1:, :], shifts=-1, dims=-1)
        mask[:, :, :, -1] = 0
        inputs = {
            "input_ids": token,
            "attention_mask": mask,
            "position_ids": inputs["position_ids"][:, -1:] + 1,
            "past_key_values": outputs["next_past_key_values"].cpu(),
        }
        tokens.append(token.item())
    assert tokens == _greedy_reference(model, prompt, new_tokens)


def _stage_step(stage, middle: bool):
    """The step compiled for one stage; a decoder stage's KV cache crosses it as a tensor,
    shifted by one token (static shapes)."""

    def forward(batch):
        batch = dict(batch)
        if middle:
            past = batch.get("past_key_values")
            batch["past_key_values"] = kv_cache_to_legacy(past) if past is not None else None
        outputs = stage(**batch)
        if middle:
            outputs["past_key_values_out"] = kv_cache_to_tensor(outputs["past_key_values_out"])[
                :, :, :, :, 1:, :
            ]
        return outputs

    return forward


def _run_stages(stages, inputs, n_layers_per_stage, compile_each: bool):
    """compile_pp_llama.py's flow: one Context per stage, compiled, called, invalidated."""
    h, caches = None, []
    for index, stage in enumerate(stages):
        if index == 0:
            stage_inputs = {k: inputs[k] for k in ("input_ids", "position_ids")}
        elif index == len(stages) - 1:
            stage_inputs = {"hidden_states": h["hidden_states_out"]}
        else:
            stage_inputs = {
                "hidden_states": h["hidden_states_out"],
                "position_embeddings_cos": h["position_embeddings_cos_out"],
                "position_embeddings_sin": h["position_embeddings_sin_out"],
                "attention_mask": inputs["attention_mask"],
                "position_ids": inputs["position_ids"],
            }
            if "past_key_values" in inputs:
                first = n_layers_per_stage * (index - 1)
                stage_inputs["past_key_values"] = inputs["past_key_values"][
                    first : first + n_layers_per_stage
                ]

        forward = _stage_step(stage, middle=0 < index < len(stages) - 1)

        if compile_each:
            context = Context(MNDevice("pfvm:cpu"))
            Context.switch_context(context)
            context.registry.register("model", stage)
            h = context.compile(forward, stage_inputs, options={"option_json": "O0"})(stage_inputs)
            h = {k: v.cpu() for k, v in h.items()}
            context.invalidate()
        else:
            with torch.no_grad():
                h = forward(stage_inputs)
        if "past_key_values_out" in h:
            caches.append(h["past_key_values_out"])
    return h["logits"], torch.cat(caches)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_split_llama_stages_compute_the_models_logits_and_cache(kind):
    model = tiny_llm(kind, layers=4)
    batch = left_padded(PROMPTS)
    positions = batch["attention_mask"].cumsum(1)
    inputs = {
        "input_ids": batch["input_ids"],
        "position_ids": positions,
        "attention_mask": prepare_4d_causal_attention_mask_with_cache_position(
            batch["attention_mask"], positions, torch.float32
        ),
    }
    with torch.no_grad():
        expected = model(**inputs, use_cache=True)
    stages = split_llama(model, 4)
    assert len(stages) == 4 and [len(s.layers) for s in stages[1:3]] == [2, 2]
    assert {p.data_ptr() for s in stages for p in s.parameters()} <= {
        p.data_ptr() for p in model.parameters()
    }  # shared, not copied
    assert [layer.self_attn.layer_idx for layer in model.model.layers] == [0, 1, 2, 3]
    expected_cache = kv_cache_to_tensor(expected.past_key_values)[:, :, :, :, 1:, :]
    for compile_each in (False, True):
        logits, cache = _run_stages(stages, inputs, 2, compile_each)
        torch.testing.assert_close(logits, expected.logits, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(cache, expected_cache, rtol=1e-5, atol=1e-5)


def test_split_llama_refuses_what_it_cannot_split():
    model = tiny_llm(layers=2)
    with pytest.raises(ValueError, match="at least 3"):
        split_llama(model, 2)
    with pytest.raises(ValueError, match="cannot fill"):
        split_llama(model, 5)
    with pytest.raises(TypeError, match="Llama-style"):
        split_llama(torch.nn.Linear(2, 2), 3)


# --- a pipeline over processes (run_pp_llama.py) ----------------------------------------------

HIDDEN, HEAD_DIM = 32, 8


def _compile_stage_dirs(model, n_stages: int, length: int, root) -> dict[str, list[str]]:
    """Each stage compiled twice, for prefill and for one-token decode, into codegen dirs."""
    config = model.config
    layers_per_stage = -(-config.num_hidden_layers // (n_stages - 2))
    dirs: dict[str, list[str]] = {"prefill": [], "decode": []}
    for phase, tokens in (("prefill", length), ("decode", 1)):
        for index, stage in enumerate(split_llama(model, n_stages)):
            if index == 0:
                sample = {
                    "input_ids": torch.zeros(1, tokens, dtype=torch.long),
                    "position_ids": torch.ones(1, tokens, dtype=torch.long),
                }
            elif index == n_stages - 1:
                sample = {"hidden_states": torch.zeros(1, tokens, HIDDEN)}
            else:
                sample = {
                    "hidden_states": torch.zeros(1, tokens, HIDDEN),
                    "position_embeddings_cos": torch.zeros(1, tokens, HEAD_DIM),
                    "position_embeddings_sin": torch.zeros(1, tokens, HEAD_DIM),
                    "attention_mask": torch.zeros(1, 1, tokens, length),
                    "position_ids": torch.ones(1, tokens, dtype=torch.long),
                }
                if phase == "decode":
                    kv_heads = config.num_key_value_heads
                    sample["past_key_values"] = torch.zeros(
                        layers_per_stage, 2, 1, kv_heads, length - 1, HEAD_DIM
                    )
            context = Context(MNDevice("pfvm:cpu"))
            Context.switch_context(context)
            context.registry.register("model", stage)
            path = root / phase / f"stage_{index}"
            context.compile(
                _stage_step(stage, 0 < index < n_stages - 1),
                sample,
                str(path),
                options={"option_json": "O0"},
            )
            context.invalidate()
            dirs[phase].append(str(path))
    return dirs


def _pipeline_rank(rank, world, dirs, port, prompt, length, new_tokens, result_file):
    """One process of run_pp_llama.py's pipeline: load its stage, pass activations on with
    gloo, greedy-decode; rank 0 writes the tokens it received."""
    import json
    import os

    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    context = Context(MNDevice("pfvm:cpu"))
    Context.switch_context(context)
    prefill = context.load_codegen_dir(dirs["prefill"][rank])
    decode = context.load_codegen_dir(dirs["decode"][rank])
    padded = left_padded([prompt], length)
    positions = padded["attention_mask"].cumsum(1)
    mask = prepare_4d_causal_attention_mask_with_cache_position(
        padded["attention_mask"], positions, torch.float32
    )
    input_ids, past, tokens = padded["input_ids"], None, []
    last = world - 1
    for step in range(new_tokens):
        tokens_now = length if step == 0 else 1
        if rank == 0:
            inputs = {"input_ids": input_ids, "position_ids": positions}
        else:
            width = HIDDEN if rank == last else HIDDEN + 2 * HEAD_DIM
            buffer = torch.zeros(1, tokens_now, width)
            dist.recv(buffer, src=rank - 1)
            if rank == last:
                inputs = {"hidden_states": buffer}
            else:
                inputs = {
                    "hidden_states": buffer[:, :, :HIDDEN],
                    "position_embeddings_cos": buffer[:, :, HIDDEN : HIDDEN + HEAD_DIM],
                    "position_embeddings_sin": buffer[:, :, HIDDEN + HEAD_DIM :],
                    "attention_mask": mask,
                    "position_ids": positions,
                }
                if past is not None:
                    inputs["past_key_values"] = past
        outputs = context.to_host((prefill if step == 0 else decode)(inputs))
        if rank == last:
            dist.send(outputs["logits"].argmax(dim=2)[:, -1:].contiguous(), dst=0)
        else:
            parts = [outputs["hidden_states_out"]]
            if "position_embeddings_cos_out" in outputs:
                parts += [
                    outputs["position_embeddings_cos_out"],
                    outputs["position_embeddings_sin_out"],
                ]
            dist.send(torch.cat(parts, dim=-1).contiguous(), dst=rank + 1)
            past = outputs.get("past_key_values_out")
        mask = torch.roll(mask[:, :, -1:, :], shifts=-1, dims=-1)
        mask[:, :, :, -1] = 0
        positions = positions[:, -1:] + 1
        if rank == 0:
            input_ids = torch.zeros(1, 1, dtype=torch.long)
            dist.recv(input_ids, src=last)
            tokens.append(input_ids.item())
        dist.barrier()
    context.invalidate()
    dist.destroy_process_group()
    if rank == 0:
        with open(result_file, "w") as file:
            json.dump(tokens, file)


def test_a_pipeline_of_loaded_stages_over_gloo_processes_generates_what_generate_does(tmp_path):
    """compile_pp_llama.py then run_pp_llama.py: three stages compiled into codegen dirs,
    each loaded by its own process (no model there: the dirs carry the weights), activations
    passed on with gloo. The greedy tokens are those of model.generate."""
    import json
    import socket

    import torch.multiprocessing as mp

    model = tiny_llm("llama", layers=2)
    prompt, length, new_tokens = PROMPTS[0], LENGTH, 3
    dirs = _compile_stage_dirs(model, 3, length, tmp_path)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    result = tmp_path / "tokens.json"
    mp.spawn(
        _pipeline_rank,
        args=(3, dirs, port, prompt, length, new_tokens, str(result)),
        nprocs=3,
        join=True,
    )
    assert json.loads(result.read_text()) == _greedy_reference(model, prompt, new_tokens)
