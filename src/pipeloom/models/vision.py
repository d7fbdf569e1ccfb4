"""torchvision ResNets as consecutive blocks (2BP's non-transformer model), on synthetic images.

The blocks are the library's: the stem (conv, batch norm, ReLU, max-pool), every residual block
of layer1..layer4 in order, and the head (average pool, flatten, fully connected). Boundaries
change shape from block to block; the runtime infers them. Batch norm normalises over each
micro-batch, as one process given the same micro-batches does, so pipelines equal it exactly.
"""

from __future__ import annotations

import torch
from torch import nn

from pipeloom.errors import ConfigError
from pipeloom.models.compat import import_torchvision

__all__ = ["resnet_blocks", "resnet_workload", "synthetic_images"]

RESNETS = ("resnet18", "resnet34", "resnet50", "resnet101", "resnet152")


def resnet_blocks(name: str = "resnet18", num_classes: int = 10, seed: int = 0) -> list[nn.Module]:
    if name not in RESNETS:
        raise ConfigError(f"vision: unknown ResNet {name!r}; choose from {', '.join(RESNETS)}")
    torchvision = import_torchvision()
    state = torch.random.get_rng_state()
    torch.random.default_generator.manual_seed(seed)  # the host's only: the state restored below
    try:
        model = getattr(torchvision.models, name)(num_classes=num_classes)
    finally:
        torch.random.set_rng_state(state)
    stem = nn.Sequential(model.conv1, model.bn1, model.relu, model.maxpool)
    blocks = [block for layer in (model.layer1, model.layer2, model.layer3, model.layer4) for block in layer]
    head = nn.Sequential(model.avgpool, nn.Flatten(1), model.fc)
    return [stem, *blocks, head]


def synthetic_images(image_size: int, num_classes: int, seed: int):
    """(rows, step) → images and class labels, from (seed, step)."""

    def batch(rows: int, step: int):
        generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
        images = torch.randn(rows, 3, image_size, image_size, generator=generator)
        labels = torch.randint(0, num_classes, (rows,), generator=generator)
        return images, labels

    return batch


def resnet_workload(
    name: str = "resnet18",
    microbatch_size: int = 2,
    image_size: int = 32,
    num_classes: int = 10,
    seed: int = 0,
    counts=None,
):
    from dataclasses import replace

    from pipeloom.models.workload import blocks_workload

    work = blocks_workload(
        lambda: resnet_blocks(name, num_classes, seed),
        synthetic_images(image_size, num_classes, seed),
        nn.functional.cross_entropy,
        microbatch_size=microbatch_size,
        counts=counts,
        name=f"torchvision:{name}",
    )
    what = f"synthetic {image_size}×{image_size} images of {num_classes} classes, seed {seed}"
    return replace(work, data={"kind": "images", "what": what})
