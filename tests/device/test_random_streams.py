"""Random draws in a compiled step at an Inductor preset: eager's numbers by default.

A VAE-style step (dropout, then a reparameterized sample from torch.distributions.Normal, plus
a torch.randn term) at O1 draws what eager draws with the same seed, so losses and weights
match eager's. `random="inductor"` (a compile option, or a preset's "random" field) is the
explicit choice of Inductor's own in-kernel generator: other numbers than eager's.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from mncore_device import load_preset
from tests.device.device_testing import assert_state_close, make_sgd, register, training_step, twin


class TinyVAE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Linear(6, 8)
        self.drop = nn.Dropout(0.3)
        self.decoder = nn.Linear(4, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mu, log_var = self.drop(self.encoder(x)).chunk(2, dim=-1)
        normal = torch.distributions.Normal(mu, (0.5 * log_var).exp(), validate_args=False)
        z = normal.rsample()
        return F.mse_loss(self.decoder(z), x) + 0.01 * torch.randn(()).abs()


def _losses(context, random: str | None):
    torch.manual_seed(0)
    model = TinyVAE()
    reference = twin(model)
    optimizer = make_sgd(model.parameters(), 0.05, 0.9)
    register(context, model, optimizer)
    batches = [{"x": torch.randn(5, 6)} for _ in range(3)]
    options = {"option_json": "O1"} | ({"random": random} if random else {})
    step = training_step(model, optimizer, lambda m, b: m(b["x"]))
    compiled = context.compile(step, batches[0], options=options)
    torch.manual_seed(1)
    losses = [compiled(batch)["loss"].item() for batch in batches]
    context.synchronize()
    eager_step = training_step(
        reference, make_sgd(reference.parameters(), 0.05, 0.9), lambda m, b: m(b["x"])
    )
    torch.manual_seed(1)
    expected = [eager_step(batch)["loss"].item() for batch in batches]
    return model, reference, losses, expected


def test_o1_draws_eagers_random_numbers(context):
    model, reference, losses, expected = _losses(context, None)
    torch.testing.assert_close(losses, expected, rtol=0, atol=1e-5)
    assert_state_close(model, reference, atol=1e-5)


def test_random_inductor_is_the_explicit_choice_of_other_numbers(context):
    model, reference, losses, expected = _losses(context, "inductor")
    assert all(torch.isfinite(torch.tensor(losses)))
    assert abs(losses[0] - expected[0]) > 1e-4  # another stream: other numbers


def test_the_random_stream_is_a_preset_field_saved_with_it():
    preset = load_preset("O1")
    assert preset.random == "eager" and preset.to_json()["random"] == "eager"
    assert dataclasses.replace(preset, random="inductor").to_json()["random"] == "inductor"
    with pytest.raises(ValueError, match=r"random='fast'.*eager, inductor"):
        dataclasses.replace(preset, random="fast")
