"""The ILIAS linear adaptation: training, the state-dict format (ours and ILIAS's), the stage."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from embed.adapt import AdaptConfig, AdapterError, LinearAdapter, load_adapter, save_adapter, train_adapter
from tests.support.index import write_descriptor_file


def _classes(n_classes: int, per_class: int, d: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Classes that differ only in a few dimensions, hidden under large shared noise elsewhere."""
    rng = np.random.default_rng(seed)
    centers = np.zeros((n_classes, d))
    centers[:, :4] = rng.normal(size=(n_classes, 4)) * 0.5
    labels = np.repeat(np.arange(n_classes), per_class)
    x = centers[labels] + 0.05 * rng.normal(size=(len(labels), d))
    x[:, 4:] += rng.normal(size=(len(labels), d - 4)) * 0.4
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32), labels


def _nn_accuracy(x: np.ndarray, labels: np.ndarray) -> float:
    sims = x @ x.T
    np.fill_diagonal(sims, -np.inf)
    return float((labels[sims.argmax(1)] == labels).mean())


def test_adaptation_separates_classes_the_raw_descriptors_confuse():
    x, labels = _classes(12, 30, 64)
    adapter, history = train_adapter(x, labels, AdaptConfig(out_dim=32, epochs=60, batch_size=64, lr=1e-2))
    assert history[-1] < history[0]
    adapted = adapter.apply(x)
    assert adapted.shape == (len(x), 32)
    np.testing.assert_allclose(np.linalg.norm(adapted, axis=1), 1, atol=1e-5)
    assert _nn_accuracy(adapted, labels) > _nn_accuracy(x, labels) + 0.1


def test_adapter_forward_is_normalised_linear_and_files_round_trip(tmp_path):
    adapter = LinearAdapter(16, 8)
    x = np.random.default_rng(0).normal(size=(5, 16)).astype(np.float32)
    w, b = adapter.layer.weight.detach().numpy(), adapter.layer.bias.detach().numpy()
    expected = x @ w.T + b
    np.testing.assert_allclose(
        adapter.apply(x), expected / np.linalg.norm(expected, axis=1, keepdims=True), rtol=1e-5, atol=1e-6
    )
    loaded = load_adapter(save_adapter(adapter, tmp_path / "a.pt"))
    np.testing.assert_array_equal(loaded.apply(x), adapter.apply(x))
    # ILIAS's published adapters: a LinearAdapter's state dict, keys layer.weight / layer.bias.
    torch.save({"layer.weight": torch.tensor(w), "layer.bias": torch.tensor(b)}, tmp_path / "ilias.pth")
    np.testing.assert_allclose(load_adapter(tmp_path / "ilias.pth").apply(x), adapter.apply(x), rtol=1e-6)
    torch.save({"weight": torch.zeros(8, 16)}, tmp_path / "bad.pt")
    with pytest.raises(AdapterError, match=r"bad\.pt"):
        load_adapter(tmp_path / "bad.pt")
    with pytest.raises(AdapterError, match="d=16"):
        adapter.apply(np.zeros((2, 5), np.float32))


def test_adapt_train_stage_from_parquet_and_csv(tmp_path):
    from cli.main import main as cli

    x, labels = _classes(4, 40, 32, seed=1)
    desc = tmp_path / "desc"
    write_descriptor_file(desc, "000000", 0, x.astype(np.float16))
    (tmp_path / "labels.csv").write_text(
        "key,label,domain\n" + "".join(f"000000/{i:05d},c{l},d\n" for i, l in enumerate(labels))
    )
    out = tmp_path / "adapter.pt"
    assert (
        cli(
            [
                "adapt",
                "train",
                "--descriptors",
                str(desc),
                "--labels",
                str(tmp_path / "labels.csv"),
                "--out",
                str(out),
                "--dim",
                "16",
                "--epochs",
                "3",
            ]
        )
        == 0
    )
    assert load_adapter(out).out_dim == 16
    record = json.loads((tmp_path / "adapter.pt.json").read_text())
    assert record["classes"] == 4 and record["samples"] == 160 and len(record["loss_history"]) == 3
    (tmp_path / "missing.csv").write_text("key,label\n000000/99999,c0\n")
    assert (
        cli(
            ["adapt", "train", "--descriptors", str(desc), "--labels", str(tmp_path / "missing.csv"), "--out", str(out)]
        )
        == 2
    )


@pytest.mark.parametrize("kind", ["flat", "ivfpq"])
def test_index_built_through_an_adapter_holds_adapted_vectors(tmp_path, kind):
    from index.build.stage import IndexConfig
    from index.build.stage import main as build
    from index.search import load_index
    from query.retrieve import adapt_queries

    x, _labels = _classes(4, 60, 32, seed=2)
    desc = tmp_path / "desc"
    write_descriptor_file(desc, "000000", 0, x[:120].astype(np.float16))
    write_descriptor_file(desc, "000001", 1, x[120:].astype(np.float16))
    adapter = LinearAdapter(32, 16)
    path = save_adapter(adapter, tmp_path / "a.pt")
    conf = IndexConfig(
        recall_target=None,
        kind=kind,
        adapt=str(path),
        nlist=4 if kind == "ivfpq" else None,
        pq_bytes=8 if kind == "ivfpq" else None,
    )
    index = load_index(build(conf, desc, tmp_path / "idx"))
    expected = adapter.apply(x.astype(np.float16).astype(np.float32)).astype(np.float16)
    assert index.d == 16 and index.infos["adapt"]["out_dim"] == 16 and index.infos["dim"] == 16
    np.testing.assert_array_equal(np.asarray(index.vectors), expected)
    xq = adapt_queries(index, x[:3])
    np.testing.assert_allclose(xq, adapter.apply(x[:3]), rtol=1e-6)
    if kind == "flat":  # (4-bit PQ trained on 240 vectors scores too coarsely to assert on)
        D, _I = index.search(xq, 1)
        best = (np.asarray(index.vectors, np.float32) @ xq.T).max(0)  # brute force over the adapted vectors
        np.testing.assert_allclose(D[:, 0], best, atol=1e-3)
        assert (D[:, 0] > 0.99).all()  # each query's own vector is in the index, adapted
    with pytest.raises(Exception, match="d=32"):
        build(
            IndexConfig(kind="flat", adapt=str(save_adapter(LinearAdapter(8, 4), tmp_path / "b.pt"))),
            desc,
            tmp_path / "idx2",
        )
