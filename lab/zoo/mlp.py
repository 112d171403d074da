"""A uniform stack of Linear+ReLU blocks, every stage costing the same, learning a fixed random
teacher network: the zoo's "mlp", the benchmark's stack, the peers' workload and, with "tanh"
(smooth gradients, no kinks for float64 comparisons), the model lab.doctor's checks train."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from lab.zoo.cards import Card

CARD = Card(name="mlp", description="uniform stack of Linear+ReLU blocks learning a random teacher",
            extra_layers=0, page_blocks=8, page_widths=(128, 256, 512, 1024), page_batches=(4, 8, 16, 32, 64),
            page_width=512, page_batch=32, test_width=32, cpu_table=((32, 32), (128, 64)),
            gpu_table=((1024, 128), (4096, 256)), sequence=0)
ACTIVATIONS = {"relu": nn.ReLU, "tanh": nn.Tanh}


def build(blocks: int, width: int, seed: int = 0, dropout: float = 0.0, activation: str = "relu") -> nn.Sequential:
    """`blocks` x (Linear(width, width) + activation [+ Dropout]), each block one pipeline layer."""
    torch.manual_seed(seed)
    extra = [nn.Dropout(dropout)] if dropout else []
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), ACTIVATIONS[activation](), *extra)
                           for _ in range(blocks)])


def batch(size: int, width: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and the outputs of a fixed random teacher (seed 1234) the MLP learns to imitate."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(size, width, generator=gen)
    teacher = torch.Generator().manual_seed(1234)
    weight = torch.randn(width, width, generator=teacher) / math.sqrt(width)
    return x, torch.tanh(x @ weight)


loss = F.mse_loss
