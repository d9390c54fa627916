"""Every preset runs every model family the interpreter runs, and trains as eager does.

Seven small model families (an MLP, a CNN with BatchNorm, a MobileNet block with a depthwise
convolution, an LSTM, a GRU, a Transformer encoder with dropout, an embedding with multi-head
attention) x the presets debug, O0, O1 and O2: two
training steps of SGD with momentum from the same seed give eager's losses, weights and
buffers within 1e-5 (the Transformer's dropout masks too: every preset draws eager's random
stream), and no graph falls back from Inductor to the interpreter. Models and batches are
tiny; the O1/O2 part (marked inductor_matrix) is one Inductor compile per family and preset.
"""

from __future__ import annotations

import collections
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import fx

from mncore_device import InductorFallbackWarning
from tests.device.device_testing import (
    assert_state_close,
    make_sgd,
    recording_small_map_rewrites,
    register,
    training_step,
    twin,
)

ATOL = 1e-5
VOCAB, CLASSES = 11, 3


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, CLASSES))

    def forward(self, x):
        return self.net(x)


class CNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(2, 4, 3, padding=1),
            nn.BatchNorm2d(4),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Conv2d(4, 4, 3, padding=1, groups=4),  # on a 1x1 map, as MobileNet v3's last
            nn.Flatten(),
            nn.Linear(4, CLASSES),
        )

    def forward(self, x):
        return self.net(x)


class DepthwiseCNN(nn.Module):
    """A MobileNet block: O1 and O2 compile it with channels_last convolutions; its last
    depthwise convolution runs on a 1x1 map, where both the input's and the weight's layout
    are ambiguous (see test_ambiguous_weights_are_read_with_channels_last_strides)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(2, 4, 1, bias=False),
            nn.BatchNorm2d(4),
            nn.ReLU6(),
            nn.Conv2d(4, 4, 3, padding=1, groups=4, bias=False),
            nn.BatchNorm2d(4),
            nn.ReLU6(),
            nn.AdaptiveAvgPool2d(1),
            nn.Conv2d(4, 4, 3, padding=1, groups=4),  # on a 1x1 map, as MobileNet v3's last
            nn.Flatten(),
            nn.Linear(4, CLASSES),
        )

    def forward(self, x):
        return self.net(x)


class Recurrent(nn.Module):
    def __init__(self, cell: type[nn.Module]) -> None:
        super().__init__()
        self.rnn = cell(4, 6, num_layers=2, batch_first=True)
        self.head = nn.Linear(6, CLASSES)

    def forward(self, x):
        out, _ = self.rnn(x)
        return self.head(out[:, -1])


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)
        self.head = nn.Linear(8, CLASSES)

    def forward(self, x):
        return self.head(self.encoder(x).mean(1))


class EmbeddingAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 8)
        self.attention = nn.MultiheadAttention(8, 2, batch_first=True)
        self.head = nn.Linear(8, CLASSES)

    def forward(self, tokens):
        x = self.embed(tokens)
        mask = torch.triu(torch.ones(5, 5, dtype=torch.bool), diagonal=1)
        y, _ = self.attention(x, x, x, attn_mask=mask, need_weights=False)
        return self.head(y.mean(1))


def _sequences(generator):
    return torch.randn(3, 5, 4, generator=generator)


FAMILIES = {
    "mlp": (MLP, lambda g: torch.randn(3, 6, generator=g)),
    "cnn_batchnorm": (CNN, lambda g: torch.randn(3, 2, 5, 5, generator=g)),
    "depthwise_cnn": (DepthwiseCNN, lambda g: torch.randn(3, 2, 5, 5, generator=g)),
    "lstm": (lambda: Recurrent(nn.LSTM), _sequences),
    "gru": (lambda: Recurrent(nn.GRU), _sequences),
    "transformer_encoder": (Encoder, lambda g: torch.randn(3, 5, 8, generator=g)),
    "embedding_attention": (
        EmbeddingAttention,
        lambda g: torch.randint(0, VOCAB, (3, 5), generator=g),
    ),
}


def loss_fn(model, batch):
    return F.cross_entropy(model(batch["x"]), batch["t"])


def _batches(family: str, n: int = 2) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    make_input = FAMILIES[family][1]
    return [
        {"x": make_input(generator), "t": torch.randint(0, CLASSES, (3,), generator=generator)}
        for _ in range(n)
    ]


def _train_as_eager(context, model, loss, batches, preset):
    """Two compiled steps at `preset` and two eager ones from the same seed (the same dropout
    masks: every preset draws eager's stream) give the same losses, weights and buffers; no
    graph fell back from Inductor."""
    reference = twin(model)
    optimizer = make_sgd(model.parameters(), 0.1, 0.9)
    register(context, model, optimizer)
    with warnings.catch_warnings():
        warnings.simplefilter("error", InductorFallbackWarning)
        compiled = context.compile(
            training_step(model, optimizer, loss), batches[0], options={"option_json": preset}
        )
        torch.manual_seed(2)
        losses = [compiled(batch)["loss"].item() for batch in batches]
    context.synchronize()

    reference_step = training_step(reference, make_sgd(reference.parameters(), 0.1, 0.9), loss)
    torch.manual_seed(2)
    expected = [reference_step(batch)["loss"].item() for batch in batches]
    torch.testing.assert_close(losses, expected, rtol=0, atol=ATOL)
    assert_state_close(model, reference, atol=ATOL)


@pytest.mark.parametrize("preset", ["debug", "O0"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_interpreter_presets_train_every_family_as_eager(context, family, preset):
    torch.manual_seed(0)
    model = FAMILIES[family][0]()
    _train_as_eager(context, model, loss_fn, _batches(family), preset)


@pytest.mark.inductor_matrix
@pytest.mark.parametrize("preset", ["O1", "O2"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_inductor_presets_train_every_family_as_eager(context, family, preset):
    """One Inductor compile per family and preset, 3-26 s each on 2 busy cores (about two
    minutes for the fourteen with an empty Inductor cache; all six families in one graph took
    as long). Deselect with -m "not inductor_matrix" for a quick run."""
    torch.manual_seed(0)
    model = FAMILIES[family][0]()
    _train_as_eager(context, model, loss_fn, _batches(family), preset)


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_an_lstm_step_called_without_grad_mode_trains_as_eager(context, mode):
    """The CPU LSTM kernel keeps the workspace its backward reads only in grad mode: a step
    called inside no_grad or inference_mode still trains (the kernel runs in grad mode)."""
    torch.manual_seed(0)
    model = FAMILIES["lstm"][0]()
    reference = twin(model)
    optimizer = make_sgd(model.parameters(), 0.1, 0.9)
    register(context, model, optimizer)
    batches = _batches("lstm")
    compiled = context.compile(
        training_step(model, optimizer, loss_fn), batches[0], options={"option_json": "O0"}
    )
    with mode():
        losses = [compiled(batch)["loss"].item() for batch in batches]
    context.synchronize()
    reference_step = training_step(reference, make_sgd(reference.parameters(), 0.1, 0.9), loss_fn)
    expected = [reference_step(batch)["loss"].item() for batch in batches]
    torch.testing.assert_close(losses, expected, rtol=0, atol=ATOL)
    assert_state_close(model, reference, atol=ATOL)


@pytest.fixture
def layout_decisions(tmp_path, monkeypatch):
    """Layout decisions made afresh, kept in a folder of this test's (not Inductor's cache)."""
    from mncore_device.runtime import convolution_layout, timed_layouts

    monkeypatch.setattr(timed_layouts, "_DECIDED", {})
    monkeypatch.setattr(timed_layouts, "_inductor_cache_dir", lambda: tmp_path)
    return convolution_layout


@pytest.mark.parametrize(("timed", "channels_last"), [((1.0, 2.0), False), ((2.0, 1.0), True)])
@pytest.mark.parametrize("preset", ["O1", "O2"])
def test_convolutions_go_channels_last_where_they_ran_faster_there(
    layout_decisions, monkeypatch, preset, timed, channels_last
):
    """O1 and O2 turn Inductor's layout optimization on where the graph's convolutions,
    timed at compile time (stored layout, channels_last), ran faster in channels_last. The
    shapes timed are the graph's, found without its metadata (as the executor gets it)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from mncore_device.presets import load_preset
    from mncore_device.runtime.convolution_layout import Convolution
    from mncore_device.runtime.executors import _inductor_options

    args = [torch.randn(2, 4, 6, 6), torch.randn(4, 2, 3, 3)]
    gm = make_fx(lambda x, w: F.conv2d(torch.relu(x), w, stride=2, groups=2))(*args)
    for node in gm.graph.nodes:  # as the executor gets the graph: from JSON, no metadata
        node.meta.clear()
    seen = []
    monkeypatch.setattr(layout_decisions, "_time_both", lambda c, device: seen.append(c) or timed)
    options = _inductor_options(gm, load_preset(preset), args, None)
    assert options["layout_optimization"] is channels_last
    (convolutions,) = seen
    expected = Convolution((2, 4, 6, 6), (4, 2, 3, 3), (2, 2), (0, 0), (1, 1), 2, True, "float32")
    assert dict(convolutions) == {expected: 1}


def test_a_graph_without_convolutions_times_nothing(layout_decisions, monkeypatch):
    from mncore_device.presets import load_preset
    from mncore_device.runtime.executors import _inductor_options

    monkeypatch.setattr(layout_decisions, "_time_both", lambda *a: pytest.fail("timed"))
    args = [torch.randn(3, 4)]
    options = _inductor_options(fx.symbolic_trace(lambda x: x * 2), load_preset("O1"), args, None)
    assert options["layout_optimization"] is False


def test_a_layout_decision_is_timed_once_per_set_of_convolutions(layout_decisions, monkeypatch):
    """Kept in the process and in Inductor's cache directory: a warm compile in another
    process reads it instead of timing again; another thread count times again."""
    from mncore_device.runtime import timed_layouts
    from mncore_device.runtime.convolution_layout import Convolution

    timings = []
    monkeypatch.setattr(
        layout_decisions, "_time_both", lambda c, device: timings.append(c) or (2.0, 1.0)
    )
    convolutions = collections.Counter(
        {Convolution((2, 4, 6, 6), (4, 1, 3, 3), (1, 1), (1, 1), (1, 1), 4, True, "float32"): 3}
    )
    cpu = torch.device("cpu")
    assert layout_decisions.channels_last_is_faster(convolutions, cpu)
    assert layout_decisions.channels_last_is_faster(convolutions, cpu)
    monkeypatch.setattr(timed_layouts, "_DECIDED", {})  # another process
    assert layout_decisions.channels_last_is_faster(convolutions, cpu)
    assert len(timings) == 1
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        assert layout_decisions.channels_last_is_faster(convolutions, cpu)
    finally:
        torch.set_num_threads(threads)
    assert len(timings) == 2


def test_the_timing_runs_each_convolution_in_both_layouts(layout_decisions, monkeypatch):
    """What the timing measures (not which layout wins: that is this machine's, and timed
    assertions are flaky): each convolution, forward and backward, once untimed and then
    timed, with its input, its weight and its output's gradient in the stored layout and in
    channels_last (the weight as the device holds it for a graph in that layout)."""
    from mncore_device.runtime.convolution_layout import Convolution

    seen = collections.Counter()
    real = torch.ops.aten

    class Recording:
        def __getattr__(self, name):
            return getattr(real, name)

        def convolution_backward(self, grad, x, weight, *args):
            last = x.is_contiguous(memory_format=torch.channels_last) and x.dim() == 4
            assert grad.is_contiguous(memory_format=torch.channels_last) == last
            layout = torch.channels_last if last else torch.contiguous_format
            assert weight.is_contiguous(memory_format=layout)
            seen[(tuple(x.shape), "channels_last" if last else "stored")] += 1
            return real.convolution_backward(grad, x, weight, *args)

    monkeypatch.setattr(layout_decisions, "aten", Recording())
    convolutions = collections.Counter(
        {
            Convolution((2, 8, 6, 6), (8, 1, 3, 3), (1, 1), (1, 1), (1, 1), 8, True, "float32"): 2,
            Convolution((2, 8, 4, 4), (4, 8, 3, 3), (1, 1), (1, 1), (1, 1), 1, True, "float32"): 1,
        }
    )
    stored, in_channels_last = layout_decisions._time_both(convolutions, torch.device("cpu"))
    assert stored > 0 and in_channels_last > 0
    passes = set(seen.values())
    assert len(passes) == 1 and 2 <= passes.pop() <= 4  # one untimed, then up to three
    assert set(seen) == {
        (shape, layout)
        for shape in [(2, 8, 6, 6), (2, 8, 4, 4)]
        for layout in ("stored", "channels_last")
    }


def test_ambiguous_weights_are_read_with_channels_last_strides():
    """Under the channels_last layout optimization, a convolution weight whose memory is the
    same in both layouts (a depthwise or a 1x1 kernel) is read through a channels_last view,
    so that oneDNN, which picks the format from the weight where the input is ambiguous too
    (a 1x1 map), takes its channels_last kernel (MobileNet v3 small: 31 ms a step instead
    of 52); a dense 3x3 weight is Inductor's to lay out. The views are of the inputs
    themselves (no copy), and the graph computes what it did."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from mncore_device.runtime.convolution_rewrites import channels_last_weights

    def convolutions(x, depthwise, pointwise, dense):
        y = F.conv2d(x, depthwise, padding=1, groups=4)
        return F.conv2d(F.conv2d(y, pointwise), dense, padding=1)

    args = [
        torch.randn(2, 4, 1, 1).to(memory_format=torch.channels_last),
        torch.randn(4, 1, 3, 3),
        torch.randn(4, 4, 1, 1),
        torch.randn(4, 4, 3, 3),
    ]
    gm = make_fx(convolutions)(*args)
    viewed = channels_last_weights(gm, args)
    views = [n for n in viewed.graph.nodes if n.target is torch.ops.aten.as_strided.default]
    assert [view.args[0].name for view in views] == ["depthwise_1", "pointwise_1"]
    assert [tuple(view.args[2]) for view in views] == [(9, 1, 3, 1), (4, 1, 4, 4)]
    assert not any(n.target is torch.ops.aten.as_strided.default for n in gm.graph.nodes)
    torch.testing.assert_close(viewed(*args), gm(*args), rtol=0, atol=0)


def test_convolutions_wider_than_their_input_keep_only_the_taps_that_meet_it():
    """A convolution whose padding is wider than its input (ConvNeXt's 7x7 depthwise kernels
    on its 1x1 and 2x2 maps) is compiled on the kernel taps that meet the input, with the
    padding less by as much, and its weight gradient padded back with zeros: the same numbers
    without oneDNN's whole-kernel pass (18 ms instead of 1.4 for ConvNeXt's
    backward on a 1x1 map in channels_last); a depthwise kernel's one tap on the input is
    a product per channel. A convolution whose taps all meet the input is left as it is."""
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.fx.passes.shape_prop import ShapeProp

    from mncore_device.runtime.convolution_rewrites import rewritten_convolutions

    def step(x1, x2, x8, dw1, dw2, dense, strided, normal):
        y = F.conv2d(x1, dw1, padding=3, groups=4).sum()  # 7x7 on 1x1: the center tap
        y = y + F.conv2d(x2, dw2, padding=3, groups=4).pow(2).sum()  # 7x7 on 2x2: 3x3
        y = y + F.conv2d(x1, dense, padding=1).sum()  # dense 3x3 on 1x1: the center
        y = y + F.conv2d(x8, strided, stride=2, padding=2).pow(2).sum()  # 5x5 on 8x8: all
        y = y + F.conv2d(x8, normal, padding=1).pow(2).sum()
        inputs = (x1, x2, x8, dw1, dw2, dense, strided, normal)
        return (y, *torch.autograd.grad(y, inputs))

    args = [
        torch.randn(2, 4, 1, 1, requires_grad=True),
        torch.randn(2, 4, 2, 2, requires_grad=True),
        torch.randn(2, 4, 8, 8, requires_grad=True),
        torch.randn(4, 1, 7, 7, requires_grad=True),
        torch.randn(4, 1, 7, 7, requires_grad=True),
        torch.randn(3, 4, 3, 3, requires_grad=True),
        torch.randn(3, 4, 5, 5, requires_grad=True),
        torch.randn(3, 4, 3, 3, requires_grad=True),
    ]
    gm = make_fx(step)(*args)
    trimmed = rewritten_convolutions(gm, args)

    def convolutions(graph_module):
        ShapeProp(graph_module).propagate(*args)
        ops = (torch.ops.aten.convolution.default, torch.ops.aten.convolution_backward.default)
        found = []
        for node in graph_module.graph.nodes:
            if node.target in ops:
                weight = node.args[1 if node.target is ops[0] else 2]
                padding = node.args[4 if node.target is ops[0] else 5]
                found.append((tuple(weight.meta["tensor_meta"].shape[2:]), tuple(padding)))
        return found

    before, after = convolutions(gm), convolutions(trimmed)
    assert sorted(before) == sorted(
        [((7, 7), (3, 3))] * 4 + [((3, 3), (1, 1))] * 4 + [((5, 5), (2, 2))] * 2
    )
    assert sorted(after) == sorted([((3, 3), (1, 1))] * 4 + [((5, 5), (2, 2))] * 2), (
        "7x7 on 2x2 to its middle 3x3; dense 3x3 on 1x1 to its center tap, a matmul"
    )
    matmuls = trimmed.graph.find_nodes(op="call_function", target=torch.ops.aten.mm.default)
    assert len(matmuls) == 3  # the center tap's forward, input gradient, weight gradient
    # the depthwise 7x7 on 1x1: its center tap times the input, channel by channel
    products = trimmed.graph.find_nodes(op="call_function", target=torch.ops.aten.mul.Tensor)
    assert len(products) > len(
        gm.graph.find_nodes(op="call_function", target=torch.ops.aten.mul.Tensor)
    )
    pads = [n for n in trimmed.graph.nodes if n.target is torch.ops.aten.constant_pad_nd.default]
    assert len(pads) == 3  # each trimmed backward's weight gradient, back to the full kernel
    assert gm.graph.find_nodes(op="call_function", target=torch.ops.aten.slice.Tensor) == []
    # each trimmed kernel (dw1, dw2, dense) copied contiguous once, for its forward and its
    # backward: a strided view would be copied by each of them, with aten's slower copy
    copies = trimmed.graph.find_nodes(op="call_function", target=torch.ops.aten.clone.default)
    assert len(copies) == 3 and all(len(copy.users) == 2 for copy in copies)
    assert all(c.kwargs["memory_format"] == torch.contiguous_format for c in copies)
    # the same numbers; a product's weight gradient sums the batch in another order
    torch.testing.assert_close(trimmed(*args), gm(*args), rtol=1e-6, atol=1e-6)


def test_one_by_one_convolutions_on_a_few_pixels_are_matmuls():
    """A 1x1 convolution on a map of at most 4 pixels (ResNet-50's and DenseNet-121's last
    stages on 32x32 images), forward and backward, becomes matrix multiplications over the
    pixels as rows: oneDNN took 13.2 ms for ResNet-50's [2048 -> 512] on a 1x1 map where
    the matmuls take 2.5. A strided one reads every other pixel and scatters its input's
    gradient back; a bias is added to the rows. Larger maps and grouped kernels keep their
    convolution. The same numbers up to rounding, in either memory format."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from mncore_device.runtime.convolution_rewrites import rewritten_convolutions

    def step(x1, x2, x4, w, w_strided, bias, grouped, w4):
        y = F.conv2d(x1, w, bias).pow(2).sum()  # 1x1 map, with a bias
        y = y + F.conv2d(x2, w).pow(2).sum()  # 2x2 map
        y = y + F.conv2d(x2, w_strided, stride=2).pow(2).sum()  # 2x2 -> 1x1
        y = y + F.conv2d(x2, grouped, groups=2).pow(2).sum()  # grouped: a convolution
        y = y + F.conv2d(x4, w4).pow(2).sum()  # 4x4 map: a convolution
        inputs = (x1, x2, x4, w, w_strided, bias, grouped, w4)
        return (y, *torch.autograd.grad(y, inputs))

    for memory_format in (torch.contiguous_format, torch.channels_last):
        args = [
            torch.randn(3, 8, 1, 1),
            torch.randn(3, 8, 2, 2).to(memory_format=memory_format),
            torch.randn(3, 8, 4, 4).to(memory_format=memory_format),
            torch.randn(6, 8, 1, 1),
            torch.randn(5, 8, 1, 1),
            torch.randn(6),
            torch.randn(6, 4, 1, 1),
            torch.randn(6, 8, 1, 1),
        ]
        args = [a.requires_grad_() for a in args]
        gm = make_fx(step)(*args)
        rewritten = rewritten_convolutions(gm, args)
        ops = (torch.ops.aten.convolution.default, torch.ops.aten.convolution_backward.default)
        left = [n.args[1 if n.target is ops[0] else 2].name for n in rewritten.graph.nodes
                if n.target in ops]  # fmt: skip
        assert sorted(left) == ["grouped_1", "grouped_1", "w4_1", "w4_1"]
        assert (
            len(rewritten.graph.find_nodes(op="call_function", target=torch.ops.aten.mm.default))
            == 8
        )
        torch.testing.assert_close(rewritten(*args), gm(*args), rtol=1e-5, atol=1e-5)


def test_convolutions_on_a_few_pixels_are_dense_matmuls(monkeypatch):
    """A dense convolution whose input and output maps have at most 4 pixels each (ResNet's
    3x3 kernels on their 2x2 maps at 32x32) is the linear map [N, C_in * Q] ->
    [N, C_out * P] it computes: its forward, input gradient and weight gradient become
    matmuls by a weight built from the kernel's taps (oneDNN took 6.0-7.3 ms for ResNet's
    [256 -> 256] 3x3 on 2x2 at batch 32, the matmuls 2.7). Strided kernels, non-square maps
    (taps that join no pair of pixels give zeros) and a bias are covered; grouped kernels,
    larger maps and, unless the rewrite is allowed for any size as here, matrices of fewer
    than SMALL_MAP_MIN_ELEMENTS elements and batches under SMALL_MAP_MIN_BATCH keep their
    convolution. In float64 the numbers are
    the convolution's to 1e-12, in float32 to rounding, in either memory format."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from mncore_device.runtime import convolution_rewrites
    from mncore_device.runtime.convolution_rewrites import rewritten_convolutions

    def step(x2, x14, x4, w3, bias, w3_strided, w2, w4, grouped):
        y = F.conv2d(x2, w3, bias, padding=1).pow(2).sum()  # 3x3 on 2x2, with a bias
        y = y + F.conv2d(x2, w3_strided, stride=2, padding=1).pow(2).sum()  # 2x2 -> 1x1
        y = y + F.conv2d(x2, w2).pow(2).sum()  # a 2x2 kernel on 2x2 -> 1x1
        y = y + F.conv2d(x14, w3, padding=1).pow(2).sum()  # a 1x4 row: corner taps unused
        y = y + F.conv2d(x4, w4, padding=1).pow(2).sum()  # 4x4 map: a convolution
        y = y + F.conv2d(x2, grouped, padding=1, groups=2).pow(2).sum()  # a convolution
        inputs = (x2, x14, x4, w3, bias, w3_strided, w2, w4, grouped)
        return (y, *torch.autograd.grad(y, inputs))

    generator = torch.Generator().manual_seed(0)
    shapes = [(3, 8, 2, 2), (3, 8, 1, 4), (3, 8, 4, 4), (6, 8, 3, 3), (6,), (5, 8, 3, 3),
              (5, 8, 2, 2), (6, 8, 3, 3), (6, 4, 3, 3)]  # fmt: skip
    ops = (torch.ops.aten.convolution.default, torch.ops.aten.convolution_backward.default)
    matmul_ops = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)

    # the pairs of pixels are listed only for maps of a few pixels: a 224x224 image's would
    # be millions of entries, at every compile
    paired_maps = []
    real_pairs = convolution_rewrites._pixel_pairs

    def recording_pairs(x_shape, *args):
        paired_maps.append(x_shape[2] * x_shape[3])
        return real_pairs(x_shape, *args)

    def convolutions_and_matmuls(graph_module):
        nodes = graph_module.graph.nodes
        left = [n.args[1 if n.target is ops[0] else 2].name for n in nodes if n.target in ops]
        return sorted(left), sum(n.target in matmul_ops for n in nodes)

    for dtype, tolerance in ((torch.float64, 1e-12), (torch.float32, 1e-4)):
        for memory_format in (torch.contiguous_format, torch.channels_last):
            args = [torch.randn(shape, generator=generator, dtype=dtype) for shape in shapes]
            args[:3] = [a.to(memory_format=memory_format) for a in args[:3]]
            args = [a.requires_grad_() for a in args]
            gm = make_fx(step)(*args)
            # these matrices are small: as the preset has it, all six keep their convolution
            assert convolutions_and_matmuls(rewritten_convolutions(gm, args))[1] == 0
            monkeypatch.setattr(convolution_rewrites, "SMALL_MAP_MIN_ELEMENTS", 0)
            assert convolutions_and_matmuls(rewritten_convolutions(gm, args))[1] == 0  # batch
            monkeypatch.setattr(convolution_rewrites, "SMALL_MAP_MIN_BATCH", 1)
            monkeypatch.setattr(convolution_rewrites, "_pixel_pairs", recording_pairs)
            rewritten = rewritten_convolutions(gm, args)
            monkeypatch.undo()
            assert paired_maps and max(paired_maps) <= 4  # not the 4x4 map's 16 pixels
            # four forwards (the one with a bias an addmm) and four backwards of two each
            assert convolutions_and_matmuls(rewritten) == (
                ["grouped_1", "grouped_1", "w4_1", "w4_1"],
                12,
            )
            torch.testing.assert_close(rewritten(*args), gm(*args), rtol=tolerance, atol=tolerance)


class SmallMapsCNN(nn.Module):
    """The end of a ResNet on small images: 1x1 convolutions on a 2x2 map (one strided to
    1x1), a 3x3 on the 2x2 map and one on a 1x1 map, with BatchNorm."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(2, 6, 3, stride=2, padding=1),  # 4x4 -> 2x2: a convolution
            nn.BatchNorm2d(6),
            nn.ReLU(),
            nn.Conv2d(6, 8, 1),  # 2x2, with a bias
            nn.ReLU(),
            nn.Conv2d(8, 8, 3, padding=1),  # 3x3 on 2x2: a dense matmul
            nn.ReLU(),
            nn.Conv2d(8, 8, 1, stride=2, bias=False),  # 2x2 -> 1x1
            nn.BatchNorm2d(8),
            nn.ReLU(),
            nn.Conv2d(8, 4, 3, padding=1),  # 3x3 on 1x1: its center tap
            nn.Flatten(),
            nn.Linear(4, CLASSES),
        )

    def forward(self, x):
        return self.net(x)


def _small_map_batches(sample_shape: tuple[int, ...]) -> list[dict[str, torch.Tensor]]:
    """Two batches of 3 samples of `sample_shape`, from a fixed seed."""
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)
    return [
        {
            "x": torch.randn(3, *sample_shape, generator=generator),
            "t": torch.randint(0, CLASSES, (3,), generator=generator),
        }
        for _ in range(2)
    ]


class ViewsAroundSmallMaps(nn.Module):
    """A 1x1 and a 3x3 convolution on a 2x2 map made by a view of a Linear's rows, their
    output viewed again: in NCHW (a plain CNN's flatten) or channels_last (ConvNeXt's
    LayerNorm over channels). Each `view`, and its backward's view of the gradient, holds
    only for the strides PyTorch's convolutions give their output and input gradient."""

    def __init__(self, channels_last: bool) -> None:
        super().__init__()
        self.channels_last = channels_last
        self.rows = nn.Linear(8, 8)
        self.pointwise = nn.Conv2d(8, 8, 1)
        self.dense = nn.Conv2d(8, 8, 3, padding=1)
        self.head = nn.Linear(32, CLASSES)

    def forward(self, x):  # x: [N, 32], each sample 4 pixels of 8 channels
        rows = self.rows(x.view(-1, 8))  # [N * 4, 8]
        if self.channels_last:
            maps = rows.view(-1, 2, 2, 8).permute(0, 3, 1, 2)
        else:
            maps = rows.view(-1, 8, 2, 2)
        y = torch.relu(self.pointwise(maps)) + self.dense(maps)
        if self.channels_last:
            return self.head(y.permute(0, 2, 3, 1).view(-1, 32))
        return self.head(y.view(-1, 32))


@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "channels_last"])
def test_convolutions_on_a_few_pixels_keep_their_layout(context, monkeypatch, channels_last):
    """A convolution rewritten as matmuls gives its output and its input's gradient the
    memory format the convolution would (its input's), so that the views traced around it
    still hold: the dense rewrite's NCHW gradient of a channels_last input failed such a view
    in ConvNeXt-tiny's backward, and O1 ran the whole step op by op. Both rewrites, both
    layouts, through Context.compile at O1: no fallback, the same training as eager."""
    rewritten = recording_small_map_rewrites(monkeypatch)
    batches = _small_map_batches((32,))
    _train_as_eager(context, ViewsAroundSmallMaps(channels_last), loss_fn, batches, "O1")
    assert collections.Counter(name for name, _ in rewritten) == {
        "_pointwise_as_matmul": 2,
        "_small_map_as_matmul": 2,
    }


@pytest.mark.parametrize("preset", ["O1", "O2"])
def test_convolutions_on_a_few_pixels_train_as_eager(context, monkeypatch, preset):
    """Through Context.compile: a step whose convolutions on 2x2 and 1x1 maps run as matmuls
    trains as eager does (losses, weights, BatchNorm buffers within 1e-5); the three 1x1
    products and the 3x3 on 2x2, forwards and backwards, were rewritten, the first
    convolution (on 4x4) was not."""
    rewritten = recording_small_map_rewrites(monkeypatch)
    batches = _small_map_batches((2, 4, 4))
    _train_as_eager(context, SmallMapsCNN(), loss_fn, batches, preset)
    forward, backward = (
        torch.ops.aten.convolution.default,
        torch.ops.aten.convolution_backward.default,
    )
    assert collections.Counter(rewritten) == {
        ("_pointwise_as_matmul", forward): 3,
        ("_pointwise_as_matmul", backward): 3,
        ("_small_map_as_matmul", forward): 1,
        ("_small_map_as_matmul", backward): 1,
    }
