"""Small models the engine tests share: plain functions of torch alone, so that a stage process
that rebuilds one from its recipe imports this module and torch, never pytest (tests/conftest.py
would cost each stage process an import of pytest)."""
import torch
from torch import nn


def mlp(width=16, depth=4, dropout=0.0, batch_norm=False, out=3, dtype=torch.float32, seed=0):
    """A Linear/(BatchNorm|Dropout)/ReLU stack as an nn.Sequential, identically initialized per seed."""
    torch.manual_seed(seed)
    layers = []
    for _ in range(depth):
        layers.append(nn.Linear(width, width))
        if batch_norm:
            layers.append(nn.BatchNorm1d(width))
        if dropout:
            layers.append(nn.Dropout(dropout))
        layers.append(nn.ReLU())
    layers.append(nn.Linear(width, out))
    return nn.Sequential(*layers).to(dtype)


def grads(model):
    return [p.grad.clone() for p in model.parameters()]


class _Split(nn.Module):
    """Turns a tensor into (features, keep): a tuple value with a bool entry, as stages may pass."""

    def forward(self, x):
        return x, x[:, :1] > -0.5


class _Masked(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, pair):
        x, keep = pair
        return torch.relu(self.linear(x)) * keep, keep


class _Head(nn.Module):
    def __init__(self, width, out):
        super().__init__()
        self.linear = nn.Linear(width, out)

    def forward(self, pair):
        return self.linear(pair[0])


def pair_model(width=16, out=3, seed=0):
    """Layers that hand on (features, bool mask) tuples; their gradients come back as (grad, None)."""
    torch.manual_seed(seed)
    return nn.Sequential(_Split(), _Masked(width), _Masked(width), _Masked(width), _Head(width, out))
