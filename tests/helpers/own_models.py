"""Four models the lab did not write, as a user of `python -m lab.check` would bring them (tests/lab/
test_check.py): a ResNet-like CNN with batch norm, a Transformer whose output layer is its input
embedding, an MLP with dropout, and a model with a layer that normalizes over the batch; and models
the check must refuse."""
import torch
from torch import nn


class Residual(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(width, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU(),
                                  nn.Conv2d(width, width, 3, padding=1, bias=False), nn.BatchNorm2d(width))

    def forward(self, x):
        return torch.relu(x + self.body(x))


def resnet():
    """A ResNet-like CNN with batch norm: stem, four residual blocks, head."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
                         *[Residual(8) for _ in range(4)], nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10))


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.attention = nn.MultiheadAttention(width, 4, batch_first=True)
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x):
        h = self.norm1(x)
        x = x + self.attention(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


def tied_transformer():
    """A Transformer language model whose output layer is its input embedding."""
    torch.manual_seed(0)
    embedding, head = nn.Embedding(64, 32), nn.Linear(32, 64, bias=False)
    head.weight = embedding.weight
    return nn.Sequential(embedding, *[Block(32) for _ in range(3)], nn.LayerNorm(32), head)


def dropout_mlp():
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Dropout(0.2)) for _ in range(6)],
                         nn.Linear(64, 10))


class BatchCentering(nn.Module):
    """Subtracts the batch's mean from every sample: a layer that sees the batch as a whole."""

    def forward(self, x):
        return x - x.mean(dim=0, keepdim=True)


def batch_centered():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.Tanh(), BatchCentering(), nn.Linear(64, 64), nn.Tanh(),
                         nn.Linear(64, 10))


class Skipping(nn.Module):
    """Not a chain: its forward adds the first layer's output to the third's."""

    def __init__(self):
        super().__init__()
        self.first, self.second, self.third = nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8)

    def forward(self, x):
        h = self.first(x)
        return self.third(self.second(h)) + h


def skipping():
    return Skipping()


class Chained(nn.Module):
    """A chain in all but name: its forward calls its children one after another."""

    def __init__(self):
        super().__init__()
        self.first, self.second, self.third = nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3)

    def forward(self, x):
        return self.third(self.second(self.first(x)))


def chained():
    return Chained()


def a_number():
    return 3
