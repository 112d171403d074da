"""A convolutional network with batch norm whose layers differ a lot in cost (the AmoebaNet lesson:
a split by layer count leaves one slow stage), classifying generated images of bars and blobs."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lab.zoo.cards import Card

CARD = Card(name="cnn", description="uneven convolutional network with batch norm classifying bars and blobs",
            extra_layers=2, page_blocks=8, page_widths=(8, 16, 32), page_batches=(4, 8, 16, 32, 64),
            page_width=32, page_batch=32, test_width=8, cpu_table=((8, 32), (32, 64)),
            gpu_table=((32, 64), (64, 128)), sequence=0)
IMAGE = 32
SHAPES = ("horizontal bar", "vertical bar", "diagonal", "blob")


def conv_block(channels_in: int, channels_out: int, stride: int = 1) -> nn.Sequential:
    """A 3x3 convolution, batch norm and ReLU."""
    return nn.Sequential(nn.Conv2d(channels_in, channels_out, 3, stride, 1, bias=False),
                         nn.BatchNorm2d(channels_out), nn.ReLU())


def build(blocks: int, width: int, seed: int = 0) -> nn.Sequential:
    """A stem, `blocks` conv blocks of `width` channels, and a classifier head. The first third of
    the blocks work at 32x32, the next third at 16x16 and the rest at 8x8, so an early block costs
    4 to 16 times a late one: equal layer counts per stage make very unequal stages."""
    torch.manual_seed(seed)
    layers = [conv_block(1, width)]
    for b in range(blocks):
        downsample = b > 0 and b in (blocks // 3, 2 * blocks // 3)
        layers.append(conv_block(width, width, 2 if downsample else 1))
    layers.append(nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width, len(SHAPES))))
    return nn.Sequential(*layers)


def batch(size: int, width: int = 0, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Noisy 32x32 images, each of a horizontal bar, vertical bar, diagonal or blob; labels 0-3."""
    gen = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, len(SHAPES), (size,), generator=gen)
    rows = torch.arange(IMAGE).view(IMAGE, 1).float()
    cols = torch.arange(IMAGE).view(1, IMAGE).float()
    images = 0.3 * torch.randn(size, 1, IMAGE, IMAGE, generator=gen)
    centers = torch.randint(8, IMAGE - 8, (size, 2), generator=gen).float()
    for i, (label, (r, c)) in enumerate(zip(labels.tolist(), centers.tolist())):
        masks = (((rows - r).abs() < 2) & ((cols - c).abs() < 10), ((cols - c).abs() < 2) & ((rows - r).abs() < 10),
                 ((rows - r - (cols - c)).abs() < 2) & ((rows - r).abs() < 9), (rows - r) ** 2 + (cols - c) ** 2 < 20)
        images[i, 0] += masks[label].float()
    return images, labels


loss = F.cross_entropy
