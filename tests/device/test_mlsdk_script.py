"""A training script in the style of PFN's MLSDK examples runs through `mncore_lightning.mlsdk`.

The script below is this repository's own, written the way PFN's recommendation-training
example is (a helper that names and registers the model and the optimizer and forwards extra
compile keywords, separate train and eval contexts, `MNCoreAdam(..., chainer_use_torch=True)`,
`CacheOptions` with MLSDK's flags, a Perfetto trace around the run, `output["result"].item()`
logging, synchronize then save). Only its import line and device string differ from an MLSDK
script. Its results are checked against the same training in eager PyTorch.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

from mncore_device.capture.compiled_step import CapturedFunction
from mncore_lightning.mlsdk import (
    CacheOptions,
    Context,
    MNCoreAdam,
    MNCoreOptimizer,
    MNDevice,
    TensorProxy,
    get_tensor_name,
    set_buffer_name_in_optimizer,
    set_tensor_name_in_module,
    storage,
    trace_event,
    trace_scope,
)

USERS, ITEMS, BATCH = 20, 30, 16


class Recommender(nn.Module):
    """A small NeuMF-like model: user and item embeddings, a dot product and an MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.user = nn.Embedding(USERS, 8)
        self.item = nn.Embedding(ITEMS, 8)
        self.mlp = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, user: torch.Tensor, item: torch.Tensor) -> torch.Tensor:
        u, i = self.user(user), self.item(item)
        return (u * i).sum(-1, keepdim=True) + self.mlp(torch.cat([u, i], -1))


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    users = torch.randint(0, USERS, (64,), generator=g)
    items = torch.randint(0, ITEMS, (64,), generator=g)
    labels = ((users + items) % 3 == 0).float()
    return TensorDataset(users, items, labels)


def register_model(context: Context, name: str, model: nn.Module) -> None:
    if get_tensor_name(next(model.parameters())) is None:
        set_tensor_name_in_module(model, name)
    for p in model.parameters():
        context.register_param(p)
    for b in model.buffers():
        context.register_buffer(b)


def compile_fn(context, target_fn, model, sample, outdir, model_name, optimizers=None, **kwargs):
    compile_args = {
        "function": target_fn,
        "inputs": sample,
        "options": {"option_json": "O0"},
        "codegen_dir": storage.path(outdir) / model_name,
        "cache_options": CacheOptions(
            f"{outdir}/{model_name}/cache",
            enable_app_cache=True,
            enable_onnx_cache=True,
            enable_codegen_cache=True,
            enable_gpfn2obj_cache=True,
        ),
    }
    register_model(context, model_name, model)
    for index, optimizer in enumerate(optimizers or []):
        set_buffer_name_in_optimizer(optimizer, f"optimizer{index}")
        context.register_optimizer_buffers(optimizer)
    compile_args.update(kwargs)
    return context.compile(**compile_args)


def run_train(model, context, optimizer: MNCoreOptimizer, outdir: str, epochs: int):
    loss_fn = nn.BCEWithLogitsLoss(reduction="none")

    def train_step(sample_d):
        optimizer.zero_grad()
        outputs = model(sample_d["user"], sample_d["item"])
        loss = loss_fn(outputs, sample_d["label"]).float()
        loss = torch.mean(loss.view(-1), 0)
        loss.backward()
        optimizer.step()
        return {"result": loss}

    samples = {
        "user": torch.randint(1, (BATCH,), dtype=torch.int64),
        "item": torch.randint(1, (BATCH,), dtype=torch.int64),
        "label": torch.rand(BATCH).view(-1, 1),
    }
    train_fn = compile_fn(
        context,
        train_step,
        model,
        samples,
        outdir,
        "ncf_train",
        optimizers=[optimizer],
        num_compiler_threads=1,
        quiet=True,
    )
    losses = []
    for epoch in range(epochs):
        loader = DataLoader(dataset(), batch_size=BATCH, shuffle=False, drop_last=True)
        with trace_event(f"epoch {epoch}"):
            for users, items, labels in loader:
                samples["user"], samples["item"] = users, items
                samples["label"] = labels.view(-1, 1)
                output = train_fn(samples)
                assert isinstance(output["result"], TensorProxy)
                losses.append(output["result"].item())
    context.synchronize()
    return losses, train_fn


def main(outdir: str, device_name: str = "pfvm:cpu") -> dict:
    torch.manual_seed(0)
    model = Recommender()
    optimizer = MNCoreAdam(model.parameters(), lr=0.05, chainer_use_torch=True)
    device = MNDevice(device_name)
    train_context = Context(device)
    eval_context = Context(device)
    Context.switch_context(train_context)
    with trace_scope(Path(outdir) / "perfetto_trace.pb"):
        losses, train_fn = run_train(model, train_context, optimizer, outdir, epochs=3)
        torch.save({"model": model.state_dict()}, storage.path(outdir) / "model.pt")
        Context.switch_context(eval_context)
        users, items, _ = dataset().tensors
        eval_fn = compile_fn(
            eval_context,
            lambda inp: {"score": torch.sigmoid(model(inp["user"], inp["item"]))},
            model,
            {"user": users, "item": items},
            outdir,
            "ncf_eval",
            training=False,
        )
        scores = eval_fn({"user": users, "item": items})["score"].cpu()
    return {"losses": losses, "scores": scores, "model": model, "train_fn": train_fn}


def eager_reference() -> tuple[list[float], nn.Module]:
    torch.manual_seed(0)
    model = Recommender()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    loss_fn = nn.BCEWithLogitsLoss(reduction="none")
    losses = []
    for _ in range(3):
        for users, items, labels in DataLoader(dataset(), batch_size=BATCH, drop_last=True):
            optimizer.zero_grad()
            loss = loss_fn(model(users, items), labels.view(-1, 1)).mean()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
    return losses, model


def test_a_pfn_style_training_script_runs_through_mncore_lightning_mlsdk(tmp_path):
    result = main(str(tmp_path))
    losses, reference = eager_reference()
    # float32 rounding of the same ops over 12 Adam steps
    torch.testing.assert_close(
        torch.tensor(result["losses"]), torch.tensor(losses), rtol=1e-4, atol=1e-5
    )
    assert result["losses"][-1] < result["losses"][0]
    for got, want in zip(result["model"].parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    users, items, _ = dataset().tensors
    with torch.no_grad():
        expected_scores = torch.sigmoid(copy.deepcopy(result["model"])(users, items))
    torch.testing.assert_close(result["scores"], expected_scores)
    saved = torch.load(tmp_path / "model.pt")["model"]
    torch.testing.assert_close(
        saved["user.weight"], reference.user.weight.detach(), rtol=1e-4, atol=1e-5
    )
    assert (tmp_path / "ncf_train" / "specs.json").is_file()
    events = json.loads((tmp_path / "perfetto_trace.pb").read_text())["traceEvents"]
    names = [e["name"] for e in events]
    assert names.count("compile") == 2 and names.count("ncf_train") == 12
    # captured by TorchDynamo (Context.compile's default): one graph, one device call a step
    train_fn = result["train_fn"]
    assert isinstance(train_fn, CapturedFunction) and train_fn.frontend.device_calls == 1
    assert len(train_fn.functions) == 1 and train_fn.functions[0].calls == 12
    assert "synchronize" in names and names.count("epoch 0") == 2
