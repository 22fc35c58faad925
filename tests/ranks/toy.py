"""The toy model and data shared by the multi-rank workers and the in-process reference.

Odd sizes (the trainable parameter count is divisible by neither 2 nor 3), tied weights (the
output projection shares the embedding) and a frozen parameter."""

from __future__ import annotations

from typing import List

import torch
import torch.nn.functional as F

VOCAB, DIM, HIDDEN = 13, 6, 10
MICRO_BATCH, SEQ = 4, 5


class Toy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, DIM)
        self.fc1 = torch.nn.Linear(DIM, HIDDEN)
        self.frozen = torch.nn.Parameter(torch.randn(HIDDEN) * 0.1, requires_grad=False)
        self.fc2 = torch.nn.Linear(HIDDEN, DIM)
        self.out = torch.nn.Linear(DIM, VOCAB)
        self.out.weight = self.emb.weight  # tied

    def forward(self, x, y):
        h = self.emb(x)
        h = h + self.fc2(F.gelu(self.fc1(h) + self.frozen))
        logits = self.out(h).float()
        return F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))


def build(seed: int = 0) -> Toy:
    torch.manual_seed(seed)
    return Toy()


def trainable(model: torch.nn.Module) -> List[torch.nn.Parameter]:
    """The trainable parameters in DeepSpeed's order (module.parameters() de-duplicates ties)."""
    return [p for p in model.parameters() if p.requires_grad]


def micro_batch(rank: int, index: int):
    g = torch.Generator().manual_seed(7919 * rank + 104729 + index)
    x = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ), generator=g)
    y = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ), generator=g)
    return x, y


def flat(tensors) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1).float() for t in tensors])


def make_grad_fn(dtype: torch.dtype):
    """grad_fn for acco_ds.core.reference: gradient of the mean loss of (rank, index) at params."""
    model = build().to(dtype)
    params = trainable(model)

    def grad_fn(views, rank, index):
        (theta,) = views
        off = 0
        with torch.no_grad():
            for p in params:
                p.copy_(theta[off : off + p.numel()].view_as(p))
                off += p.numel()
        for p in params:
            p.grad = None
        loss = model(*micro_batch(rank, index))
        loss.backward()
        return [flat(p.grad if p.grad is not None else torch.zeros_like(p) for p in params)]

    return grad_fn


# -- a linear loss for exact comparisons: loss = <w, c>, so a micro-batch's gradient is c, whatever w is ----------
LINEAR_DIM = 77  # divisible by neither 2 nor 3


class Linear(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(LINEAR_DIM))

    def forward(self, c):
        return (self.w * c.to(self.w.dtype)).sum()


def linear_input(rank: int, index: int) -> torch.Tensor:
    """Multiples of 1/16 in [-4, 4]: exact in fp16 and bf16, and times any power-of-two loss scale in range."""
    g = torch.Generator().manual_seed(1_000_003 * rank + 7 * index + 11)
    return torch.randint(-64, 65, (LINEAR_DIM,), generator=g).float() / 16


def linear_grad_fn(views, rank, index):
    """grad_fn for acco_ds.core.reference: the linear loss's gradient, ``linear_input``."""
    return [linear_input(rank, index)]
