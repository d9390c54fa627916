"""torchvision's model families train bit-identical to eager PyTorch at O0.

One small member of each op family of torchvision's classifiers (residual BatchNorm convs with
grouped convolutions, depthwise convs with squeeze-excitation and hardswish, channel shuffle,
dense concatenation, inception branches, LayerNorm + GELU + stochastic depth, ViT attention,
Swin's shifted windows, dropout) runs three SGD-momentum steps compiled at O0 and eagerly, on
the same batches with the same seed: losses, parameters and buffers must be equal bit for bit
(tolerance 0). benchmarks/bench_zoo.py checks the full-size models the same way.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from tests.device.device_testing import (
    compile_o0,
    cross_entropy,
    device_train,
    eager_train,
    make_sgd,
    register,
    training_step,
)

models = pytest.importorskip("torchvision.models")


def resnext() -> nn.Module:
    """Residual bottlenecks, BatchNorm, grouped 3x3 convolutions, max pooling."""
    from torchvision.models.resnet import Bottleneck, ResNet

    return ResNet(Bottleneck, [1, 1, 1, 1], num_classes=10, groups=2, width_per_group=8)


def mobilenet_v3() -> nn.Module:
    """Depthwise convolutions, squeeze-excitation (hardsigmoid), hardswish, dropout."""
    from torchvision.models.mobilenetv3 import InvertedResidualConfig as C
    from torchvision.models.mobilenetv3 import MobileNetV3

    setting = [C(16, 3, 16, 16, True, "RE", 2, 1, 1.0), C(16, 5, 32, 24, True, "HS", 2, 1, 1.0)]
    return MobileNetV3(setting, last_channel=32, num_classes=10)


def shufflenet() -> nn.Module:
    """Channel shuffle (view/transpose), chunked branches, depthwise convolutions."""
    from torchvision.models.shufflenetv2 import ShuffleNetV2

    return ShuffleNetV2([1, 1, 1], [8, 16, 32, 64, 64], num_classes=10)


def densenet() -> nn.Module:
    """Dense blocks: every layer's input is the concatenation of all earlier outputs."""
    from torchvision.models.densenet import DenseNet

    return DenseNet(8, (2, 2), num_init_features=16, bn_size=2, num_classes=10)


def inception() -> nn.Module:
    """GoogLeNet's inception branches (1x1, 3x3, 5x5-as-3x3, pooled) concatenated."""
    from torchvision.models.googlenet import BasicConv2d, Inception

    return nn.Sequential(
        BasicConv2d(3, 16, kernel_size=3, padding=1),
        nn.MaxPool2d(3, stride=2, ceil_mode=True),
        Inception(16, 8, 8, 12, 4, 4, 4),
        Inception(28, 8, 8, 12, 4, 4, 4),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Dropout(0.2),
        nn.Linear(28, 10),
    )


def convnext() -> nn.Module:
    """Depthwise 7x7 convolutions, channels-last LayerNorm, GELU, layer scale, stochastic
    depth."""
    from torchvision.models.convnext import CNBlockConfig, ConvNeXt

    setting = [CNBlockConfig(16, 32, 1), CNBlockConfig(32, None, 1)]
    return ConvNeXt(setting, stochastic_depth_prob=0.2, num_classes=10)


def vit() -> nn.Module:
    """Patch embedding, class token, multi-head self-attention, GELU MLP, dropout."""
    return models.VisionTransformer(
        image_size=16, patch_size=4, num_layers=1, num_heads=2, hidden_dim=16, mlp_dim=32,
        dropout=0.1, attention_dropout=0.1, num_classes=10,
    )  # fmt: skip


def swin() -> nn.Module:
    """Windowed attention with relative position bias, shifted windows (roll + mask), patch
    merging, stochastic depth."""
    return models.SwinTransformer(
        patch_size=[2, 2], embed_dim=16, depths=[2, 1], num_heads=[2, 2], window_size=[2, 2],
        stochastic_depth_prob=0.2, num_classes=10,
    )  # fmt: skip


@pytest.mark.parametrize(
    "build", [resnext, mobilenet_v3, shufflenet, densenet, inception, convnext, vit, swin]
)
def test_torchvision_family_trains_bit_identical_to_eager_at_o0(context, build):
    torch.manual_seed(0)
    model = build()
    reference = copy.deepcopy(model)
    optimizer = make_sgd(model.parameters(), 0.05, 0.9)
    register(context, model, optimizer)
    generator = torch.Generator().manual_seed(1)
    batches = [
        {"x": torch.randn(4, 3, 16, 16, generator=generator), "t": torch.arange(4) + i}
        for i in range(3)
    ]
    step = training_step(model, optimizer, cross_entropy)
    compiled = compile_o0(context, step, batches[0])
    torch.manual_seed(7)  # dropout and stochastic depth draw the same masks in both runs
    losses = device_train(compiled, batches)
    torch.manual_seed(7)
    expected = eager_train(
        reference, make_sgd(reference.parameters(), 0.05, 0.9), cross_entropy, batches
    )
    assert losses == expected
    context.synchronize()
    theirs = reference.state_dict()
    for name, mine in model.state_dict().items():
        torch.testing.assert_close(mine, theirs[name], rtol=0, atol=0, msg=name)


def test_o1_trains_a_batchnorm_conv_net_as_eager(context):
    """O1 (Inductor, convolutions in the weights' stored layout) trains a grouped BatchNorm
    conv net as eager does; its fused BatchNorm and update round differently, within 1e-5."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, stride=2, groups=2),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 10),
    )
    reference = copy.deepcopy(model)
    optimizer = make_sgd(model.parameters(), 0.05, 0.9)
    register(context, model, optimizer)
    batches = [{"x": torch.randn(4, 3, 8, 8), "t": torch.arange(4) + i} for i in range(3)]
    step = training_step(model, optimizer, cross_entropy)
    compiled = context.compile(step, batches[0], options={"option_json": "O1"})
    losses = device_train(compiled, batches)
    expected = eager_train(
        reference, make_sgd(reference.parameters(), 0.05, 0.9), cross_entropy, batches
    )
    torch.testing.assert_close(losses, expected, rtol=0, atol=1e-5)
    context.synchronize()
    theirs = reference.state_dict()
    for name, mine in model.state_dict().items():
        torch.testing.assert_close(mine, theirs[name], rtol=1e-5, atol=1e-5, msg=name)
