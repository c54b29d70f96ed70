"""AMES re-ranking model: checkpoint compatibility, forward semantics, scoring, and training."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from core.errors import NeedleInputError
from core.tokens import LocalTokens, TokenBatch, unpack_signs
from rerank.ames import AMES, AMESCheckpointError, AMESConfig, AMESInputError, ensemble, load_ames, score_shortlist
from rerank.ames_train import (
    AMESTrainError,
    TrainConfig,
    homography_from_points,
    main,
    random_view,
    warp_image,
)

REFERENCE = Path(__file__).resolve().parents[3] / "shared" / "reference" / "ames_state_dict_shapes.json"
VARIANTS = [(True, "ames_binarized"), (False, "ames_full_precision")]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """These tensors are tiny: threads only add overhead, and spin badly when the CPUs are busy."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def reference_shapes() -> dict[str, dict[str, list[int]]]:
    if not REFERENCE.is_file():
        pytest.skip(f"reference shapes of the official AMES checkpoints not found at {REFERENCE}")
    return json.loads(REFERENCE.read_text())


def random_state(shapes: dict[str, list[int]], seed: int, scale: float = 0.05) -> dict[str, torch.Tensor]:
    """Random weights (larger than the trained-from-scratch init, not so large that the mtc token
    saturates) under which a wrong attention mask visibly changes the logit;
    LayerNorm weights around 1 keep activations in a sane range."""
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for k, shape in shapes.items():
        t = torch.randn(shape, generator=g) * scale
        if ".norm" in k or (k.startswith("remap_local") and len(shape) == 1 and k.endswith("weight")):
            t = 1 + t
        sd[k] = t
    return sd


def model_with_random_weights(binarized: bool, local_dim: int = 768, seed: int = 0, **kw) -> AMES:
    model = AMES(AMESConfig(local_dim=local_dim, binarized=binarized, **kw))
    shapes = {k: list(v.shape) for k, v in model.state_dict().items()}
    model.load_state_dict(random_state(shapes, seed))
    return model.eval()


def random_inputs(dim: int, seed: int = 1):
    """A batch of 3 pairs with different paddings, and garbage in the padded slots."""
    g = torch.Generator().manual_seed(seed)
    src = torch.randn(3, 6, dim, generator=g)
    tgt = torch.randn(3, 9, dim, generator=g)
    src_pad = torch.zeros(3, 6, dtype=torch.bool)
    tgt_pad = torch.zeros(3, 9, dtype=torch.bool)
    src_pad[1, 4:] = True
    src_pad[2, 1:] = True
    tgt_pad[0, 5:] = True
    tgt_pad[2, 2:] = True
    src[src_pad] *= 100  # padded tokens must not matter, however large
    tgt[tgt_pad] *= 100
    return src, src_pad, tgt, tgt_pad


# --- an independent forward, from the paper's description, with plain tensor ops ---------------------


def ref_layer_norm(x, w, b, eps=1e-5):
    mu = x.mean(-1, keepdim=True)
    var = ((x - mu) ** 2).mean(-1, keepdim=True)
    return (x - mu) / torch.sqrt(var + eps) * w + b


def ref_l2n(x):
    return x / torch.sqrt((x * x).sum(-1, keepdim=True)).clamp_min(1e-12)


def ref_attention(x, sd, prefix, forbidden, heads):
    """Multi-head attention done by hand; ``forbidden`` (B, L, L) True = query i may not see key j."""
    _B, _L, D = x.shape
    w, b = sd[prefix + "in_proj_weight"], sd[prefix + "in_proj_bias"]
    q, k, v = (x @ w[i * D : (i + 1) * D].T + b[i * D : (i + 1) * D] for i in range(3))
    dh = D // heads
    outs = []
    for h in range(heads):
        qh, kh, vh = (t[..., h * dh : (h + 1) * dh] for t in (q, k, v))
        scores = qh @ kh.transpose(1, 2) / math.sqrt(dh)
        scores = scores.masked_fill(forbidden, float("-inf"))
        outs.append(torch.softmax(scores, -1) @ vh)
    return torch.cat(outs, -1) @ sd[prefix + "out_proj.weight"].T + sd[prefix + "out_proj.bias"]


def ref_forward(sd, binarized, heads, src, src_pad, tgt, tgt_pad, codes=False, masks=True):
    """The AMES logit of the paper, in float64. ``masks=False`` drops the attention restrictions
    (only to show that the comparison would notice them missing)."""
    sd = {k: v.double() for k, v in sd.items()}
    src, tgt = src.double(), tgt.double()

    def lin(x, p):
        return x @ sd[p + "weight"].T + sd[p + "bias"]

    def ln(x, p):
        return ref_layer_norm(x, sd[p + "weight"], sd[p + "bias"])

    def remap(x, is_tgt):
        if binarized:
            if not codes:
                x = torch.sign(ref_l2n(ref_l2n(x)) @ sd["remap_local.0.W"])
            return ln(lin(x, "remap_local.1."), "remap_local.2.")
        y = ln(lin(ref_l2n(x), "remap_local.0."), "remap_local.1.")
        return y.half().double() if is_tgt else y  # the official float16 database tokens

    B, Q, T = len(src), src.shape[1], tgt.shape[1]
    x = torch.cat([sd["mtc_token"].expand(B, 1, -1), remap(src, False), remap(tgt, True)], 1)
    group = [0] + [1] * Q + [2] * T  # 0 = mtc, 1 = query image, 2 = database image
    L = len(group)
    same = torch.tensor([[group[i] == group[j] for j in range(L)] for i in range(L)])
    mtc = torch.tensor([[group[i] == 0 or group[j] == 0 for j in range(L)] for i in range(L)])
    sa_forbid = ~same & ~mtc if masks else torch.zeros(L, L, dtype=torch.bool)  # within an image
    ca_forbid = same & ~mtc if masks else torch.zeros(L, L, dtype=torch.bool)  # across images
    pad = torch.cat([torch.zeros(B, 1, dtype=torch.bool), src_pad, tgt_pad], 1)[:, None, :]
    n_layers = 1 + max(int(k.split(".")[2]) for k in sd if k.startswith("decoder.layers."))
    for i in range(n_layers):
        p = f"decoder.layers.{i}."
        x = ln(x + ref_attention(x, sd, p + "self_attn.", sa_forbid | pad, heads), p + "norm1.")
        x = ln(x + ref_attention(x, sd, p + "cross_attn.", ca_forbid | pad, heads), p + "norm2.")
        x = ln(x + lin(torch.relu(lin(x, p + "linear1.")), p + "linear2."), p + "norm3.")
    return lin(x[:, 0], "classifier.").view(-1)


# --- 1. architecture = official checkpoints ---------------------------------------------------------


@pytest.mark.parametrize("binarized,key", VARIANTS)
def test_names_and_shapes_match_official(binarized, key):
    ref = reference_shapes()[key]
    got = {k: list(v.shape) for k, v in AMES(AMESConfig(local_dim=768, binarized=binarized)).state_dict().items()}
    assert got == ref


# --- 2. loading -------------------------------------------------------------------------------------


@pytest.mark.parametrize("binarized,key", VARIANTS)
def test_official_layout_loads_unchanged(tmp_path, binarized, key):
    shapes = reference_shapes()[key]
    sd = random_state(shapes, seed=3)
    path = tmp_path / "ames.pt"
    torch.save({"state": sd, "epoch": 7}, path)
    model = load_ames(path)
    assert model.conf == AMESConfig(binarized=binarized) and not model.training
    for k, v in model.state_dict().items():
        assert torch.equal(v, sd[k]), k
    # Other wrappers and DataParallel's "module." prefix.
    torch.save({"state_dict": {"module." + k: v for k, v in sd.items()}}, path)
    assert torch.equal(load_ames(path).mtc_token.data, sd["mtc_token"])
    torch.save(sd, path)
    assert torch.equal(load_ames(path).classifier.weight.data, sd["classifier.weight"])


@pytest.mark.parametrize("binarized,key", VARIANTS)
def test_bad_checkpoints_raise_typed_errors(tmp_path, binarized, key):
    shapes = reference_shapes()[key]
    sd = random_state(shapes, seed=4)
    path = tmp_path / "bad.pt"

    bad = dict(sd, **{"decoder.layers.2.linear1.weight": torch.zeros(512, 128)})
    torch.save({"state": bad}, path)
    with pytest.raises(AMESCheckpointError, match=r"bad\.pt.*decoder\.layers\.2\.linear1\.weight.*\[512, 128\]"):
        load_ames(path)

    missing = {k: v for k, v in sd.items() if k != "decoder.layers.1.norm2.bias"}
    torch.save({"state": missing}, path)
    with pytest.raises(AMESCheckpointError, match=r"decoder\.layers\.1\.norm2\.bias"):
        load_ames(path)

    torch.save({"state": dict(sd, extra_head=torch.zeros(3))}, path)
    with pytest.raises(AMESCheckpointError, match="extra_head"):
        load_ames(path)

    torch.save({"state": sd}, path)
    with pytest.raises(AMESCheckpointError, match=r"heads|layers|linear1"):
        load_ames(path, conf=AMESConfig(binarized=binarized, ff_dim=256))

    path.write_bytes(b"not a torch file")
    with pytest.raises(AMESCheckpointError, match=r"bad\.pt"):
        load_ames(path)
    with pytest.raises(AMESCheckpointError, match=r"nope\.pt"):
        load_ames(tmp_path / "nope.pt")
    assert issubclass(AMESCheckpointError, NeedleInputError)


# --- 3. forward = the paper's computation ------------------------------------------------------------


@pytest.mark.parametrize("binarized", [True, False])
def test_forward_matches_independent_reference(binarized):
    model = model_with_random_weights(binarized)
    src, src_pad, tgt, tgt_pad = random_inputs(768)
    with torch.inference_mode():
        got = model(src, src_pad, tgt, tgt_pad)
    ref = ref_forward(model.state_dict(), binarized, 2, src, src_pad, tgt, tgt_pad).float()
    assert got.shape == (3,)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    # The comparison has teeth: dropping the attention masks moves the logits far more.
    unmasked = ref_forward(model.state_dict(), binarized, 2, src, src_pad, tgt, tgt_pad, masks=False).float()
    assert (unmasked - ref).abs().max() > 1e-3
    # Garbage in padded slots does not matter: each pair alone, unpadded, scores the same.
    for b in range(3):
        s, t = src[b : b + 1, ~src_pad[b]], tgt[b : b + 1, ~tgt_pad[b]]
        with torch.inference_mode():
            alone = model(s, torch.zeros(s.shape[:2], dtype=torch.bool), t, torch.zeros(t.shape[:2], dtype=torch.bool))
        torch.testing.assert_close(alone, got[b : b + 1], rtol=1e-5, atol=1e-5)


def test_forward_rejects_bad_shapes():
    model = AMES(AMESConfig(local_dim=32, layers=1, ff_dim=16))
    x = torch.randn(2, 3, 32)
    m = torch.zeros(2, 3, dtype=torch.bool)
    with pytest.raises(AMESInputError, match="32"):
        model(torch.randn(2, 3, 31), m, x, m)
    with pytest.raises(AMESInputError, match="mask"):
        model(x, m[:, :2], x, m)
    with pytest.raises(AMESInputError, match="full precision"):
        AMES(AMESConfig(local_dim=32, binarized=False, layers=1)).forward_codes(x, m, x, m)


# --- 4. codes path = float path -------------------------------------------------------------------------


@pytest.mark.parametrize("local_dim", [768, 112])
def test_forward_codes_equals_forward(local_dim):
    model = model_with_random_weights(True, local_dim=768, seed=5)
    if local_dim != 768:  # our CNN tokens: an ITQ projection for another descriptor size
        proj, _ = np.linalg.qr(np.random.default_rng(0).normal(size=(local_dim, local_dim)))
        noise = 0.01 * np.random.default_rng(1).normal(size=(local_dim, 128))
        model.set_projection(np.pad(proj, ((0, 0), (0, 128 - local_dim))) + noise)
        assert model.conf.local_dim == local_dim and model.remap_local[0].W.shape == (local_dim, 128)
    src, src_pad, tgt, tgt_pad = random_inputs(local_dim, seed=2)
    w = model.remap_local[0].W.detach().numpy()

    def signs(x: torch.Tensor) -> torch.Tensor:
        codes = np.packbits(x.numpy() @ w >= 0, axis=-1)  # how needle stores tokens: 16 bytes each
        return torch.from_numpy(unpack_signs(codes))

    with torch.inference_mode():
        via_float = model(src, src_pad, tgt, tgt_pad)
        via_codes = model.forward_codes(signs(src), src_pad, signs(tgt), tgt_pad)
    torch.testing.assert_close(via_codes, via_float, rtol=1e-5, atol=1e-5)
    ref = ref_forward(model.state_dict(), True, 2, signs(src), src_pad, signs(tgt), tgt_pad, codes=True).float()
    torch.testing.assert_close(via_codes, ref, rtol=1e-5, atol=1e-5)


# --- 5. shortlist scoring -------------------------------------------------------------------------------


def random_tokens(rng: np.random.Generator, n: int, dim: int | None = None) -> LocalTokens:
    return LocalTokens(
        rng.integers(0, 256, size=(n, 16), dtype=np.uint8),
        rng.random((n, 2), dtype=np.float32) * 100,
        np.ones(n, np.float32),
        rng.random(n, dtype=np.float32),
        None if dim is None else rng.normal(size=(n, dim)).astype(np.float32),
    )


def test_score_shortlist_binarized_equals_loop():
    model = model_with_random_weights(True, seed=6)
    rng = np.random.default_rng(0)
    query = random_tokens(rng, 10)
    cands = [random_tokens(rng, n) for n in (5, 12, 1, 30, 7, 0, 18)]
    got = score_shortlist(model, query, TokenBatch.stack(cands), batch_size=3)
    with torch.inference_mode():
        q = torch.from_numpy(unpack_signs(query.codes))[None]
        loop = [
            float(
                model.forward_codes(
                    q,
                    torch.zeros(1, len(query), dtype=torch.bool),
                    torch.from_numpy(unpack_signs(c.codes))[None],
                    torch.zeros(1, len(c), dtype=torch.bool),
                )
            )
            for c in cands
        ]
    assert got.shape == (7,) and got.dtype == np.float32
    np.testing.assert_allclose(got, loop, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(score_shortlist(model, query, cands, batch_size=100), got, rtol=1e-5, atol=1e-5)
    assert score_shortlist(model, query, []).shape == (0,)


def test_score_shortlist_does_not_depend_on_the_other_candidates():
    """Gathered to one width, a shortlist split into parts (as over shards) scores exactly as a
    whole: every batch has one shape, whatever it holds."""
    model = model_with_random_weights(True, seed=8)
    rng = np.random.default_rng(2)
    query = random_tokens(rng, 10)
    cands = [random_tokens(rng, int(n)) for n in rng.integers(1, 30, 150)]
    whole = score_shortlist(model, query, TokenBatch.stack(cands, 30))
    parts = np.array_split(rng.permutation(len(cands)), 3)
    for part in parts:
        got = score_shortlist(model, query, TokenBatch.stack([cands[i] for i in part], 30))
        np.testing.assert_array_equal(got, whole[part])


def test_score_shortlist_full_precision_equals_loop():
    model = model_with_random_weights(False, local_dim=48, seed=7)
    model.train()  # scoring must switch to eval (float16 database tokens) and back
    rng = np.random.default_rng(1)
    query = random_tokens(rng, 6, 48)
    cands = [random_tokens(rng, n, 48) for n in (4, 9, 2, 13)]
    got = score_shortlist(model, query, cands, batch_size=2)
    assert model.training
    model.eval()
    with torch.inference_mode():
        loop = [
            float(
                model(
                    torch.from_numpy(query.desc)[None],
                    torch.zeros(1, 6, dtype=torch.bool),
                    torch.from_numpy(c.desc)[None],
                    torch.zeros(1, len(c), dtype=torch.bool),
                )
            )
            for c in cands
        ]
    np.testing.assert_allclose(got, loop, rtol=1e-5, atol=1e-5)
    with pytest.raises(AMESInputError, match="desc"):
        score_shortlist(model, query, TokenBatch.stack(cands))


def test_ensemble_is_official_formula():
    g, z = np.array([0.2, 0.9]), np.array([-3.0, 4.0])
    np.testing.assert_allclose(ensemble(g, z, 0.3, 0.5), 0.3 * g + 0.7 / (1 + np.exp(-0.5 * z)))


# --- 6. training ---------------------------------------------------------------------------------


def test_warps_are_seeded_and_homographies_exact():
    img = np.asarray(
        Image.fromarray((np.random.default_rng(0).random((8, 8, 3)) * 255).astype(np.uint8)).resize((64, 48))
    )
    a = random_view(img, np.random.default_rng(5))
    b = random_view(img, np.random.default_rng(5))
    assert a.shape == img.shape and a.dtype == np.uint8 and np.array_equal(a, b)
    assert not np.array_equal(a, random_view(img, np.random.default_rng(6)))
    src = np.array([[0, 0], [64, 0], [64, 48], [0, 48]], float)
    dst = src + np.array([[3, -2], [1, 4], [-5, 2], [2, 2]])
    h = homography_from_points(src, dst)
    mapped = np.c_[src, np.ones(4)] @ h.T
    np.testing.assert_allclose(mapped[:, :2] / mapped[:, 2:], dst, atol=1e-9)
    assert np.array_equal(warp_image(img, np.eye(3)), img)


def textures(n: int, size: int = 64, seed: int = 0) -> list[np.ndarray]:
    """Smooth random colour textures: distinct enough to tell apart, cheap to make."""
    rng = np.random.default_rng(seed)
    return [
        np.asarray(
            Image.fromarray((rng.random((6, 6, 3)) * 255).astype(np.uint8)).resize(
                (size, size), Image.Resampling.BICUBIC
            )
        )
        for _ in range(n)
    ]


GRID_PROJ = np.random.default_rng(123).normal(size=(9, 128)).astype(np.float32)


def grid_describe(images: list[np.ndarray], cell: int = 8) -> list[LocalTokens]:
    """A cheap deterministic 'extractor': the mean colour and gradients of each grid cell, binarised
    by a fixed random projection, with the cell contrast as weight."""
    proj = GRID_PROJ
    out = []
    for img in images:
        x = img.astype(np.float32) / 255
        h, w = (s // cell for s in x.shape[:2])
        cells = x[: h * cell, : w * cell].reshape(h, cell, w, cell, 3).transpose(0, 2, 1, 3, 4)
        mean = cells.mean((2, 3))
        dy = (cells[:, :, -1] - cells[:, :, 0]).mean(2)
        dx = (cells[:, :, :, -1] - cells[:, :, :, 0]).mean(2)
        f = np.concatenate([mean - 0.5, dy, dx], -1).reshape(-1, 9)
        ys, xs = np.mgrid[:h, :w]
        xy = np.stack([xs, ys], -1).reshape(-1, 2).astype(np.float32) * cell + cell / 2
        out.append(
            LocalTokens(
                np.packbits(f @ proj >= 0, axis=-1),
                xy,
                np.ones(len(f), np.float32),
                cells.std((2, 3, 4)).reshape(-1).astype(np.float32),
                f,
            )
        )
    return out


def test_tiny_training_run(tmp_path):
    imgs = textures(16)
    folder = tmp_path / "images"
    folder.mkdir()
    for i, img in enumerate(imgs):
        Image.fromarray(img).save(folder / f"{i:02d}.png")
    conf = TrainConfig(
        pairs=48, epochs=6, batch_size=8, lr=1e-3, layers=1, ff_dim=64, val_fraction=0.25, max_tokens=40, seed=3
    )
    ckpt = main(conf, folder, tmp_path / "out", describe=grid_describe, projection=GRID_PROJ)
    assert ckpt == tmp_path / "out" / "ames.pt" and not (tmp_path / "out" / "ames.pt.tmp").exists()
    record = json.loads(ckpt.with_suffix(".json").read_text())
    assert record["pairs"] == 48 and record["train_pairs"] == 36 and record["images"] == 16
    assert record["train_config"]["layers"] == 1 and record["model_config"]["ff_dim"] == 64
    hist = record["loss_history"]
    assert len(hist) == 6 and hist[-1] < hist[0]
    assert 0 <= record["train"]["pos_acc"] <= 1 and 0 <= record["val"]["neg_acc"] <= 1
    model = load_ames(ckpt)
    assert model.conf == AMESConfig(local_dim=9, layers=1, ff_dim=64, binarized=True)
    assert np.array_equal(model.remap_local[0].W.detach().numpy(), GRID_PROJ)  # float path = codes path
    # Same seed, same images (here as arrays): the same model.
    ckpt2 = main(conf, imgs, tmp_path / "again.pt", describe=grid_describe, projection=GRID_PROJ)
    assert json.loads(ckpt2.with_suffix(".json").read_text())["loss_history"] == hist


def test_training_input_errors(tmp_path):
    with pytest.raises(AMESTrainError, match="at least 2 images"):
        main(TrainConfig(pairs=4), textures(1), tmp_path / "x.pt", describe=grid_describe)
    with pytest.raises(AMESTrainError, match="describe returned"):
        main(TrainConfig(pairs=4), textures(3), tmp_path / "x.pt", describe=lambda ims: [])
    with pytest.raises(AMESTrainError, match="does not exist"):
        main(TrainConfig(pairs=4), tmp_path / "missing", tmp_path / "x.pt", describe=grid_describe)
