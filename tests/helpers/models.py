"""The toy models the rank scripts train, in one place.

Sizes are odd on purpose (uneven shards and padding). Each model makes its submodules in a fixed order and draws
nothing else from the random generator, so a script that seeds, then builds, gets the same initial values it got
when it defined the model itself: every comparison against a reference stays as tight as it was. A change here
changes the numbers of every script that trains the model.

- ``gpt``: the app's GPT, small (the model most engine tests train; ``lightning_mics.app.models.gpt.Block`` units).
- ``Block`` / ``Net``: a classifier: an embedding, residual MLP blocks (``ln``, ``fc1``, ``fc2``) in a ModuleList,
  and a head on the sequence's mean (the Trainer compatibility cases, the meta-device initialization).
- ``MLPBlock`` / ``Tiny``: a language model: an embedding, residual MLP blocks (``up``, ``down``), an optional final
  LayerNorm and a head (the Fabric loops, the host-read budget).
- ``TiedFrozen``: tied embedding and head, a frozen projection, a parameter unused in the loss, a module called twice,
  a module using another's weight; ``DemoTransformer``: Lightning's demo encoder-decoder.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

import lightning_mics
from lightning_mics.app.models import GPT, GPTConfig

VOCAB, SEQ = 61, 12  # the language models' vocabulary and sequence length
V, D, H, C = 37, 24, 48, 32  # the classifier's (Net's defaults): vocabulary, width, hidden, classes


def gpt(layers: int = 2, vocab: int = VOCAB, block_size: int = SEQ, n_embd: int = 32, **config) -> GPT:
    """The app's GPT with two heads: ``GPTConfig(vocab_size=vocab, block_size=block_size, n_layer=layers, ...)``."""
    return GPT(GPTConfig(vocab_size=vocab, block_size=block_size, n_layer=layers, n_head=2, n_embd=n_embd, **config))


class Block(nn.Module):
    """``x + fc2(gelu(fc1(ln(x))))``; ``norm=False``: no LayerNorm (an Identity, no parameters)."""

    def __init__(self, d: int = D, hidden: int = H, norm: bool = True) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d) if norm else nn.Identity()
        self.fc1 = nn.Linear(d, hidden)
        self.fc2 = nn.Linear(hidden, d)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


class Net(nn.Module):
    """An embedding and a head (the root unit's) around ``blocks`` Blocks in a ModuleList (one unit each); all of its
    initialization is its modules' ``reset_parameters`` (sharded initialization replays that)."""

    def __init__(self, vocab: int = V, d: int = D, hidden: int = H, classes: int = C, blocks: int = 2) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d, hidden) for _ in range(blocks))
        self.head = nn.Linear(d, classes)

    def forward(self, idx):
        x = self.emb(idx)
        for b in self.blocks:
            x = b(x)
        return self.head(x.mean(1))


class MLPBlock(nn.Module):
    """``x + down(gelu(up(x)))``."""

    def __init__(self, d: int, hidden: int = 40) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(d, hidden), nn.Linear(hidden, d)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(x)))


class Tiny(nn.Module):
    """Logits for every position: embedding, ``layers`` MLPBlocks, a final LayerNorm (``norm``), a head."""

    def __init__(self, vocab: int = VOCAB, d: int = 24, layers: int = 2, norm: bool = True) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(MLPBlock(d) for _ in range(layers))
        self.norm = nn.LayerNorm(d) if norm else nn.Identity()
        self.head = nn.Linear(d, vocab)

    def forward(self, idx):
        x = self.emb(idx)
        for b in self.blocks:
            x = b(x)
        return self.head(self.norm(x))


class TiedFrozen(nn.Module):
    """Tied embedding/head, a frozen projection, a parameter unused in the loss, a module called twice,
    and a module whose forward uses another module's weight (the seed's register_parameter case)."""

    def __init__(self, vocab: int = VOCAB) -> None:
        super().__init__()
        d = 24
        self.emb = nn.Embedding(vocab, d)
        self.frozen = nn.Linear(d, d)
        self.frozen.requires_grad_(False)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(d, 40), nn.GELU(), nn.Linear(40, d)) for _ in range(2))
        self.shared = nn.Linear(d, d)  # called twice per forward
        self.unused = nn.Linear(d, 17)  # never part of the loss
        self.mix = nn.Linear(d, d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight
        lightning_mics.register_parameter(self.mix, self.frozen.weight)

    def forward(self, idx):
        x = self.emb(idx)
        x = x + self.frozen(x)
        for b in self.blocks:
            x = x + b(x)
        x = self.shared(torch.tanh(self.shared(x)))
        x = self.mix(x) + F.linear(x, self.frozen.weight) * 0.1
        return self.head(x)

    def loss(self, idx, tgt):
        logits = self(idx)
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), tgt.reshape(-1))


class DemoTransformer(nn.Module):
    """Lightning's demo encoder-decoder (nn.Transformer): units are its encoder and decoder layers."""

    def __init__(self, vocab: int = VOCAB) -> None:
        super().__init__()
        from lightning.pytorch.demos import Transformer

        self.net = Transformer(vocab_size=vocab, ninp=32, nhead=2, nhid=48, nlayers=2, dropout=0.0)

    def loss(self, idx, tgt):
        return F.nll_loss(self.net(idx, tgt), tgt.reshape(-1))
