"""Training the adaptation ``f(x) = ReLU(W x)`` (W without bias) on PCA features of pairs: the
symmetric cross-entropy of sigma * cosine against the identity, with Adam."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from similarity.afn.config import AdaptationFunctionError, AfnConfig


class Adaptation(nn.Module):
    """x -> ReLU(W x), W (``in_dim`` -> ``hidden_dim``) without bias (the authors' adaptation module)."""

    def __init__(self, in_dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.weight_matrix = nn.Linear(in_dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight_matrix(x).relu()


def symmetric_loss(left: torch.Tensor, right: torch.Tensor, sigma: float) -> torch.Tensor:
    """Mean of the cross-entropies of sigma * cos(left_i, right_j) against the identity, row-wise
    (left -> right) and column-wise (right -> left)."""
    sim = F.normalize(left, dim=1, eps=1e-8) @ F.normalize(right, dim=1, eps=1e-8).T
    target = torch.arange(len(sim), device=sim.device)
    return 0.5 * F.cross_entropy(sigma * sim, target) + 0.5 * F.cross_entropy(sigma * sim.T, target)


def train_adaptation(left: np.ndarray, right: np.ndarray, conf: AfnConfig) -> tuple[Adaptation, list[float]]:
    """Train ReLU(W x) on (n, k) PCA features of n pairs; returns (module in eval mode, mean loss per epoch)."""
    left = np.asarray(left, dtype=np.float32)
    right = np.asarray(right, dtype=np.float32)
    if left.ndim != 2 or left.shape != right.shape or len(left) < 2:
        raise AdaptationFunctionError(
            f"training needs two (n >= 2, k) arrays of pair features, got {left.shape} and {right.shape}"
        )
    torch.manual_seed(conf.seed)
    module = Adaptation(left.shape[1], conf.hidden_dim)
    optimizer = torch.optim.Adam(module.parameters(), lr=conf.lr, weight_decay=conf.weight_decay)
    L, R = torch.from_numpy(left), torch.from_numpy(right)
    generator = torch.Generator().manual_seed(conf.seed)
    n = len(left)
    history = []
    module.train()
    for _ in tqdm(range(conf.epochs), desc="afn train", unit="epoch", leave=False, disable=conf.epochs * n < 10**6):
        if conf.batch_size == 0 or conf.batch_size >= n:
            steps = [torch.arange(n)]
        else:
            order = torch.randperm(n, generator=generator)
            # A last batch of one pair has no negative (loss 0): it joins the previous batch.
            cuts = list(range(0, n, conf.batch_size))
            if n - cuts[-1] < 2:
                cuts.pop()
            steps = [order[a:b] for a, b in zip(cuts, [*cuts[1:], n])]
        losses = []
        for idx in steps:
            loss = symmetric_loss(module(L[idx]), module(R[idx]), conf.sigma)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(float(loss.detach()))
        history.append(float(np.mean(losses)))
    return module.eval(), history
