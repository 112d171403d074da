"""A small residual CNN with batch norm on the CNN's task (bars and blobs): every block adds its
input back, so a stage boundary inside the network carries the sum, and the blocks cost alike."""
from __future__ import annotations

import torch
from torch import nn

from lab.zoo import cnn
from lab.zoo.cards import Card

CARD = Card(name="resnet", description="residual CNN with batch norm classifying bars and blobs",
            extra_layers=2, page_blocks=8, page_widths=(8, 16, 32), page_batches=(4, 8, 16, 32, 64),
            page_width=16, page_batch=32, test_width=8, cpu_table=((8, 32), (16, 64)),
            gpu_table=((32, 64), (64, 128)), sequence=0)


class Residual(nn.Module):
    """Two 3x3 convolutions with batch norm, added to the block's input, then ReLU."""

    def __init__(self, width: int):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(width, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(),
                                  nn.Conv2d(width, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x + self.body(x))


def build(blocks: int, width: int, seed: int = 0) -> nn.Sequential:
    """A stem that halves the image to 16x16, `blocks` residual blocks, and a classifier head."""
    torch.manual_seed(seed)
    return nn.Sequential(cnn.conv_block(1, width, stride=2), *[Residual(width) for _ in range(blocks)],
                         nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width, len(cnn.SHAPES))))


batch = cnn.batch
loss = cnn.loss
