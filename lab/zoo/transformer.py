"""A character-level Transformer language model on a short text shipped beside it (corpus.txt):
an embedding, pre-norm blocks of causal self-attention and an MLP, and a head."""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from lab.zoo.cards import Card

CARD = Card(name="transformer", description="character-level Transformer language model on a short story",
            extra_layers=2, page_blocks=6, page_widths=(32, 64, 128), page_batches=(4, 8, 16, 32),
            page_width=128, page_batch=32, test_width=32, cpu_table=((32, 32), (128, 64)), gpu_table=None,
            sequence=32)
CORPUS = Path(__file__).parent / "data" / "corpus.txt"
CONTEXT = CARD.sequence  # characters per window unless a run asks for another length


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


def build(blocks: int, width: int, seed: int = 0, dropout: float = 0.1, context: int = CONTEXT) -> nn.Sequential:
    """Embedding (of positions up to `context`), `blocks` Transformer blocks (4 heads, or 1 per 16
    channels if narrower), head."""
    torch.manual_seed(seed)
    vocab = len(corpus()[1])
    heads = 4 if width % 4 == 0 and width >= 64 else max(1, width // 16)
    return nn.Sequential(Embedding(vocab, width, context), *[Block(width, heads, dropout) for _ in range(blocks)],
                         Head(width, vocab))


def batch(size: int, width: int = 0, seed: int = 0, context: int = CONTEXT) -> tuple[torch.Tensor, torch.Tensor]:
    """`size` random windows of `context` characters of the corpus: inputs, and the next character
    at every position."""
    ids, _ = corpus()
    if not 1 <= context < len(ids) - 1:
        raise ValueError(f"context={context}: expected 1 to {len(ids) - 2} characters, the corpus's length")
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(ids) - context - 1, (size,), generator=gen)
    windows = torch.stack([ids[s:s + context + 1] for s in starts.tolist()])
    return windows[:, :-1], windows[:, 1:]


def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of next-character prediction."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())
