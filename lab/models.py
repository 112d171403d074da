"""A small model zoo, each an nn.Sequential with a small real task to train on.

- "mlp": a uniform stack of Linear+ReLU blocks (every stage costs the same) learning a fixed
  random teacher network;
- "transformer": a character-level Transformer language model on a short text shipped in
  lab/data/corpus.txt;
- "cnn": a convolutional network with batch norm whose layers differ a lot in cost (the
  AmoebaNet lesson: a split by layer count leaves one slow stage), classifying generated images
  of bars and blobs.

Every model counts its "layers" as entries of the nn.Sequential, the units a pipeline cuts between.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .config import MODEL_CARDS, ModelCard, card

CORPUS = Path(__file__).parent / "data" / "corpus.txt"


@dataclass(frozen=True)
class ZooModel(ModelCard):
    """How to build one zoo model and its task (its card, lab.config, says what it is)."""

    build: Callable[[int, int, int], nn.Sequential]    # (blocks, width, seed) -> model
    batch: Callable[[int, int, int], tuple]            # (size, width, seed) -> (inputs, targets)
    loss_fn: Callable


# --- uniform MLP ------------------------------------------------------------------------------

ACTIVATIONS = {"relu": nn.ReLU, "tanh": nn.Tanh}


def build_mlp(blocks: int, width: int, seed: int = 0, dropout: float = 0.0, activation: str = "relu") -> nn.Sequential:
    """`blocks` x (Linear(width, width) + activation [+ Dropout]), each block one pipeline layer: the
    zoo's "mlp", the benchmark's stack, the peers' workload and, with "tanh" (smooth gradients,
    no kinks for float64 comparisons), the model lab.doctor's checks train."""
    torch.manual_seed(seed)
    extra = [nn.Dropout(dropout)] if dropout else []
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), ACTIVATIONS[activation](), *extra)
                           for _ in range(blocks)])


def mlp_batch(size: int, width: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and the outputs of a fixed random teacher (seed 1234) the MLP learns to imitate."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(size, width, generator=gen)
    teacher = torch.Generator().manual_seed(1234)
    weight = torch.randn(width, width, generator=teacher) / math.sqrt(width)
    return x, torch.tanh(x @ weight)


# --- character-level Transformer ---------------------------------------------------------------

@lru_cache(maxsize=1)
def corpus() -> tuple[torch.Tensor, list[str]]:
    """The shipped text as a tensor of character ids, and the vocabulary. Kept on the host whatever
    device is the default when it is first read (a model counted on the meta device, say)."""
    text = CORPUS.read_text()
    vocab = sorted(set(text))
    index = {c: i for i, c in enumerate(vocab)}
    return torch.tensor([index[c] for c in text], dtype=torch.long, device="cpu"), vocab


class Embedding(nn.Module):
    """Token plus learned position embeddings."""

    def __init__(self, vocab: int, width: int, context: int):
        super().__init__()
        self.token = nn.Embedding(vocab, width)
        self.position = nn.Embedding(context, width)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        return self.token(ids) + self.position(positions)


class Block(nn.Module):
    """Pre-norm Transformer block: causal self-attention and an MLP, each with a residual."""

    def __init__(self, width: int, heads: int, dropout: float):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(width, dim=2)
        q, k, v = (t.view(batch, length, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        attention = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.dropout(self.proj(attention.transpose(1, 2).reshape(batch, length, width)))
        return x + self.dropout(self.mlp(self.norm2(x)))


class Head(nn.Module):
    """Final layer norm and the projection to next-character logits."""

    def __init__(self, width: int, vocab: int):
        super().__init__()
        self.norm, self.out = nn.LayerNorm(width), nn.Linear(width, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(x))


CONTEXT = 32


def build_transformer(blocks: int, width: int, seed: int = 0, dropout: float = 0.1) -> nn.Sequential:
    """Embedding, `blocks` Transformer blocks (4 heads, or 1 per 16 channels if narrower), head."""
    torch.manual_seed(seed)
    vocab = len(corpus()[1])
    heads = 4 if width % 4 == 0 and width >= 64 else max(1, width // 16)
    return nn.Sequential(Embedding(vocab, width, CONTEXT), *[Block(width, heads, dropout) for _ in range(blocks)],
                         Head(width, vocab))


def text_batch(size: int, width: int = 0, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """`size` random windows of the corpus: inputs, and the next character at every position."""
    ids, _ = corpus()
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(ids) - CONTEXT - 1, (size,), generator=gen)
    windows = torch.stack([ids[s:s + CONTEXT + 1] for s in starts.tolist()])
    return windows[:, :-1], windows[:, 1:]


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of next-character prediction."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


# --- uneven CNN with batch norm -----------------------------------------------------------------

IMAGE = 32
SHAPES = ("horizontal bar", "vertical bar", "diagonal", "blob")


def conv_block(channels_in: int, channels_out: int, stride: int = 1) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(channels_in, channels_out, 3, stride, 1, bias=False),
                         nn.BatchNorm2d(channels_out), nn.ReLU())


def build_cnn(blocks: int, width: int, seed: int = 0) -> nn.Sequential:
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


def shapes_batch(size: int, width: int = 0, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Noisy 32x32 images, each of a horizontal bar, vertical bar, diagonal or blob; labels 0-3."""
    gen = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, len(SHAPES), (size,), generator=gen)
    rows = torch.arange(IMAGE).view(IMAGE, 1).float()
    cols = torch.arange(IMAGE).view(1, IMAGE).float()
    images = 0.3 * torch.randn(size, 1, IMAGE, IMAGE, generator=gen)
    centers = torch.randint(8, IMAGE - 8, (size, 2), generator=gen).float()
    for i, (label, (r, c)) in enumerate(zip(labels.tolist(), centers.tolist())):
        masks = ((rows - r).abs() < 2) & ((cols - c).abs() < 10), ((cols - c).abs() < 2) & ((rows - r).abs() < 10), \
            ((rows - r - (cols - c)).abs() < 2) & ((rows - r).abs() < 9), (rows - r) ** 2 + (cols - c) ** 2 < 20
        images[i, 0] += masks[label].float()
    return images, labels


def _zoo_model(name: str, build, batch, loss_fn) -> ZooModel:
    return ZooModel(**asdict(MODEL_CARDS[name]), build=build, batch=batch, loss_fn=loss_fn)


ZOO: dict[str, ZooModel] = {
    "mlp": _zoo_model("mlp", build_mlp, mlp_batch, F.mse_loss),
    "transformer": _zoo_model("transformer", build_transformer, text_batch, next_token_loss),
    "cnn": _zoo_model("cnn", build_cnn, shapes_batch, F.cross_entropy),
}


def build(name: str, blocks: int, width: int, seed: int = 0) -> nn.Sequential:
    """The zoo model `name`, by name: what stage processes call to make their own copy
    (lab.pool recipes must be importable functions)."""
    return get(name).build(blocks, width, seed)


def get(name: str) -> ZooModel:
    """The zoo entry called `name`, or a ValueError listing the choices."""
    return ZOO[card(name).name]
