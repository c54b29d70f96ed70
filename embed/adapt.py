"""``needle adapt train``: the ILIAS linear adaptation of frozen global descriptors.

One ``nn.Linear(d, out)`` (Xavier-uniform weights, zero bias) followed by L2 normalisation, trained
as the first layer of a cosine classifier over all classes (class weights L2-normalised, no bias)
with a normalised-softmax loss (CosFace form, margin 0, scale 16), Adam lr 1e-3, weight decay 1e-6,
batches of 128 (the last incomplete batch dropped), 2 epochs by default. Trained from descriptors
in Parquet plus labels (CSV or Parquet with columns ``key,label[,domain]``).

Saved as a small state dict ``{"weight" (out, d), "bias" (out,)}`` with a JSON beside it; ILIAS's
published adapters (``{"layer.weight", "layer.bias"}``) load too.
"""

from __future__ import annotations

import csv
import logging
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from core.atomic import write_atomic, write_json_atomic
from core.checkpoint import load_torch_file
from core.errors import NeedleInputError
from embed import AdaptConfig
from ingest.descriptors import STATUS_OK, list_descriptor_files, read_global

log = logging.getLogger(__name__)


class AdapterError(NeedleInputError):
    """An adapter file, label file or training input that is missing or does not fit."""


class LinearAdapter(nn.Module):
    """x -> L2-normalised (W x + b)."""

    def __init__(self, in_dim: int, out_dim: int):
        super().__init__()
        self.layer = nn.Linear(in_dim, out_dim)
        nn.init.xavier_uniform_(self.layer.weight)
        nn.init.zeros_(self.layer.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.normalize(self.layer(x), dim=-1)

    @property
    def in_dim(self) -> int:
        return int(self.layer.in_features)

    @property
    def out_dim(self) -> int:
        return int(self.layer.out_features)

    @torch.inference_mode()
    def apply(self, x: np.ndarray) -> np.ndarray:
        """(n, d) descriptors -> (n, out) float32 adapted, L2-normalised descriptors."""
        x = np.asarray(x, dtype=np.float32)
        if x.ndim != 2 or x.shape[1] != self.in_dim:
            raise AdapterError(f"descriptors of shape {x.shape} do not fit an adapter for d={self.in_dim}")
        return self(torch.from_numpy(x)).numpy()


def train_adapter(
    x: np.ndarray,
    labels: np.ndarray,
    conf: AdaptConfig = AdaptConfig(),  # noqa: B008 (a frozen dataclass)
) -> tuple[LinearAdapter, list[float]]:
    """Train on (n, d) descriptors and their integer class labels; returns (adapter, mean loss per epoch)."""
    x = np.asarray(x, dtype=np.float32)
    labels = np.asarray(labels, dtype=np.int64)
    if x.ndim != 2 or len(x) != len(labels) or len(x) < 2:
        raise AdapterError(f"need (n >= 2, d) descriptors and n labels, got {x.shape} and {labels.shape}")
    classes = int(labels.max()) + 1
    torch.manual_seed(conf.seed)
    adapter = LinearAdapter(x.shape[1], conf.out_dim)
    classifier = nn.Linear(conf.out_dim, classes, bias=False)
    optimizer = torch.optim.Adam(
        [*adapter.parameters(), *classifier.parameters()], lr=conf.lr, weight_decay=conf.weight_decay
    )
    X, y = torch.from_numpy(x), torch.from_numpy(labels)
    generator = torch.Generator().manual_seed(conf.seed)
    batch = min(conf.batch_size, len(x))
    history = []
    for epoch in range(conf.epochs):
        order = torch.randperm(len(x), generator=generator)
        steps = [order[s : s + batch] for s in range(0, len(x) - batch + 1, batch)]
        losses = []
        for idx in tqdm(steps, desc=f"adapt epoch {epoch + 1}/{conf.epochs}", unit="batch", leave=False):
            cosine = adapter(X[idx]) @ F.normalize(classifier.weight, dim=1).T
            target = F.one_hot(y[idx], classes).float()
            loss = F.cross_entropy(conf.scale * (cosine - conf.margin * target), y[idx])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(float(loss.detach()))
        history.append(float(np.mean(losses)))
        log.info("adapt epoch %d/%d: loss %.4f", epoch + 1, conf.epochs, history[-1])
    return adapter.eval(), history


def save_adapter(adapter: LinearAdapter, path: Path | str) -> Path:
    state = {"weight": adapter.layer.weight.detach().clone(), "bias": adapter.layer.bias.detach().clone()}
    return write_atomic(Path(path), lambda tmp: torch.save(state, tmp))


def load_adapter(path: Path | str) -> LinearAdapter:
    """A needle adapter (``weight``, ``bias``) or an ILIAS one (``layer.weight``, ``layer.bias``)."""
    path = Path(path)
    state = load_torch_file(path, AdapterError, "adapter")
    if not isinstance(state, dict):
        raise AdapterError(f"adapter {path} holds a {type(state).__name__}, not a state dict")
    state = {k.removeprefix("layer."): v for k, v in state.items()}
    if (
        set(state) != {"weight", "bias"}
        or state["weight"].ndim != 2
        or state["bias"].shape != state["weight"].shape[:1]
    ):
        raise AdapterError(
            f"adapter {path} must hold weight (out, d) and bias (out,), got "
            f"{ {k: tuple(v.shape) for k, v in state.items()} }"
        )
    out_dim, in_dim = state["weight"].shape
    adapter = LinearAdapter(in_dim, out_dim)
    adapter.layer.load_state_dict(state)
    return adapter.eval()


def read_labels(path: Path) -> dict[str, str]:
    """``key -> label`` from a CSV or Parquet with columns ``key,label[,domain]``."""
    path = Path(path)
    if not path.is_file():
        raise AdapterError(f"label file {path} does not exist")
    if path.suffix == ".parquet":
        table = pq.read_table(path)
        if not {"key", "label"} <= set(table.column_names):
            raise AdapterError(f"label file {path} needs columns key and label, has {table.column_names}")
        return dict(zip(table["key"].to_pylist(), map(str, table["label"].to_pylist())))
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows or not {"key", "label"} <= set(rows[0]):
        raise AdapterError(f"label file {path} needs a header with key and label")
    return {row["key"]: row["label"] for row in rows}


def labelled_descriptors(descriptors: Path, labels: dict[str, str]) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """(x, integer labels, class names) of the labelled ok rows; every labelled key must exist."""
    blocks, names, found = [], [], set()
    for path in list_descriptor_files(descriptors):
        table, xb = read_global(path, ("key", "status"))
        keys = table["key"].to_pylist()
        ok = pc.equal(table["status"], STATUS_OK).to_numpy(zero_copy_only=False)
        keep = np.array([ok[i] and keys[i] in labels for i in range(len(keys))], bool)
        blocks.append(xb[keep].astype(np.float32))
        names += [labels[keys[i]] for i in np.flatnonzero(keep)]
        found.update(keys[i] for i in np.flatnonzero(keep))
    missing = [k for k in labels if k not in found]
    if missing:
        raise AdapterError(
            f"{len(missing)} labelled keys have no valid descriptor in {descriptors}, e.g. {missing[:3]}"
        )
    classes = sorted(set(names))
    index = {c: i for i, c in enumerate(classes)}
    return np.concatenate(blocks), np.array([index[n] for n in names]), classes


def main(conf: AdaptConfig, descriptors: Path, labels: Path, output: Path) -> Path:
    """Train the adapter of ``descriptors`` with ``labels``; write ``output`` and ``output``.json."""
    start = time.perf_counter()
    x, y, classes = labelled_descriptors(Path(descriptors), read_labels(Path(labels)))
    adapter, history = train_adapter(x, y, conf)
    path = save_adapter(adapter, Path(output))
    write_json_atomic(
        {
            "config": asdict(conf),
            "descriptors": str(descriptors),
            "labels": str(labels),
            "samples": len(x),
            "classes": len(classes),
            "in_dim": adapter.in_dim,
            "out_dim": adapter.out_dim,
            "loss_history": history,
            "seconds": round(time.perf_counter() - start, 3),
        },
        path.with_name(path.name + ".json"),
    )
    log.info(
        "adapter %s: %d -> %d from %d descriptors of %d classes",
        path,
        adapter.in_dim,
        adapter.out_dim,
        len(x),
        len(classes),
    )
    return path
