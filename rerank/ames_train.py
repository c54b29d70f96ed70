"""Train an AMES model on unlabelled images, with synthetic positives.

No retrieval labels are needed: a positive pair is an image and a randomly warped, recoloured copy
of it (a random homography: rotation, scale, crop, perspective jitter; then brightness, contrast,
saturation, per-channel gain and blur), a negative pair is an image and a warped copy of a
*different* image. Both kinds warp their second image the same way, so that warp artefacts (black
borders, blur) say nothing about the label and the model has to match content.

Describing images (the caller's ``describe``, in needle the local extractor) is the expensive part,
so the token sets of a fixed pool of pairs are computed once and the model is then trained for
several epochs over that pool with Adam and a binary cross-entropy on the logits. A binarised model
is trained on the 128-bit codes (``AMES.forward_codes``), i.e. on exactly what the index stores; a
full-precision one on the float descriptors, which ``describe`` must then return (``desc``).

Writes ``{"state": state_dict, "config": ...}`` (loadable by ``rerank.ames.load_ames``) and a JSON
beside it recording how the model was made.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image, ImageEnhance, ImageFilter
from tqdm import tqdm

from core.atomic import write_atomic
from core.errors import NeedleInputError
from core.tokens import LocalTokens, TokenBatch, unpack_signs
from rerank.ames import AMES, AMESConfig, load_ames, pad_descriptors, save_ames
from rerank.config import TrainConfig, WarpConfig

log = logging.getLogger(__name__)

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp", ".bmp")

Describe = Callable[[list[np.ndarray]], list[LocalTokens]]


class AMESTrainError(NeedleInputError):
    """Unusable training input: too few images, an unreadable file, a describe that misbehaves."""


@dataclass(frozen=True)
class Pair:
    """Two images' tokens and whether they show the same thing (src = query side, tgt = database)."""

    src: LocalTokens
    tgt: LocalTokens
    label: float  # 1.0 positive, 0.0 negative


# --- random views ---------------------------------------------------------------------------------


def homography_from_points(src: np.ndarray, dst: np.ndarray) -> np.ndarray:
    """The 3x3 H (H[2,2] = 1) mapping 4 points ``src`` (4, 2) onto ``dst`` (4, 2)."""
    a = np.zeros((8, 8))
    b = np.zeros(8)
    for k, ((x, y), (u, v)) in enumerate(zip(src, dst)):
        a[2 * k] = [x, y, 1, 0, 0, 0, -u * x, -u * y]
        a[2 * k + 1] = [0, 0, 0, x, y, 1, -v * x, -v * y]
        b[2 * k], b[2 * k + 1] = u, v
    return np.append(np.linalg.solve(a, b), 1.0).reshape(3, 3)


def random_homography(width: int, height: int, rng: np.random.Generator, warp: WarpConfig = WarpConfig()) -> np.ndarray:  # noqa: B008 (a frozen dataclass)
    """A random H mapping pixel coordinates of the image to those of its (same-size) view.

    A similarity about the centre (rotation, zoom, shift) followed by independent jitter of the
    four corners, which makes it a general perspective change.
    """
    corners = np.array([[0, 0], [width, 0], [width, height], [0, height]], dtype=np.float64)
    centre = np.array([width, height], dtype=np.float64) / 2
    theta = math.radians(rng.uniform(-warp.rotation_deg, warp.rotation_deg))
    zoom = math.exp(rng.uniform(math.log(warp.scale[0]), math.log(warp.scale[1])))
    rot = zoom * np.array([[math.cos(theta), -math.sin(theta)], [math.sin(theta), math.cos(theta)]])
    shift = rng.uniform(-warp.translate, warp.translate, size=2) * [width, height]
    jitter = rng.uniform(-warp.perspective, warp.perspective, size=(4, 2)) * min(width, height)
    dst = (corners - centre) @ rot.T + centre + shift + jitter
    return homography_from_points(corners, dst)


def warp_image(image: np.ndarray, h: np.ndarray) -> np.ndarray:
    """``image`` (H, W, 3) uint8 seen through homography ``h``, same size, black outside."""
    inv = np.linalg.inv(h)
    inv = inv / inv[2, 2]  # PIL wants output->input coefficients with the last one 1
    pil = Image.fromarray(image).transform(
        (image.shape[1], image.shape[0]), Image.Transform.PERSPECTIVE, tuple(inv.ravel()[:8]), Image.Resampling.BILINEAR
    )
    return np.asarray(pil)


def photometric(image: np.ndarray, rng: np.random.Generator, warp: WarpConfig = WarpConfig()) -> np.ndarray:  # noqa: B008 (a frozen dataclass)
    """Random brightness, contrast, saturation, colour cast and (sometimes) blur."""
    pil = Image.fromarray(image)
    pil = ImageEnhance.Brightness(pil).enhance(rng.uniform(1 - warp.brightness, 1 + warp.brightness))
    pil = ImageEnhance.Contrast(pil).enhance(rng.uniform(1 - warp.contrast, 1 + warp.contrast))
    pil = ImageEnhance.Color(pil).enhance(rng.uniform(1 - warp.saturation, 1 + warp.saturation))
    # Draw the blur regardless of whether it is applied, so that one view's randomness does not
    # shift the next one's.
    blur, radius = rng.uniform() < warp.blur_prob, rng.uniform(*warp.blur_radius)
    if blur:
        pil = pil.filter(ImageFilter.GaussianBlur(radius))
    gain = rng.uniform(1 - warp.gain, 1 + warp.gain, size=3)
    return np.clip(np.asarray(pil, dtype=np.float32) * gain, 0, 255).astype(np.uint8)


def random_view(image: np.ndarray, rng: np.random.Generator, warp: WarpConfig = WarpConfig()) -> np.ndarray:  # noqa: B008 (a frozen dataclass)
    """A random geometric and photometric view of ``image`` (H, W, 3) uint8, same size."""
    h = random_homography(image.shape[1], image.shape[0], rng, warp)
    return photometric(warp_image(image, h), rng, warp)


# --- inputs ---------------------------------------------------------------------------------------


def load_images(images: str | Path | Sequence[str | Path | np.ndarray]) -> list[np.ndarray]:
    """uint8 RGB (H, W, 3) arrays from a directory (its image files, sorted), paths, or arrays."""
    if isinstance(images, (str, Path)):
        folder = Path(images)
        if not folder.is_dir():
            raise AMESTrainError(f"training images directory {folder} does not exist")
        items: Sequence[str | Path | np.ndarray] = sorted(
            p for p in folder.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES
        )
        if not items:
            raise AMESTrainError(f"no images ({', '.join(IMAGE_SUFFIXES)}) in {folder}")
    else:
        items = images
    out = []
    for item in items:
        if isinstance(item, np.ndarray):
            if item.ndim != 3 or item.shape[2] != 3 or item.dtype != np.uint8:
                raise AMESTrainError(f"training image arrays must be (H, W, 3) uint8, got {item.shape} {item.dtype}")
            out.append(item)
            continue
        try:
            with Image.open(item) as im:
                out.append(np.asarray(im.convert("RGB")))
        except (OSError, ValueError) as exc:
            raise AMESTrainError(f"cannot read training image {item}: {exc}") from exc
    return out


def _describe(
    describe: Describe, images: list[np.ndarray], keep_desc: bool, max_tokens: int | None
) -> list[LocalTokens]:
    tokens = describe(images)
    if len(tokens) != len(images) or not all(isinstance(t, LocalTokens) for t in tokens):
        raise AMESTrainError(
            f"describe returned {len(tokens)} items for {len(images)} images; expected one LocalTokens each"
        )
    out = []
    for t in tokens:
        if max_tokens is not None:
            t = t.top(max_tokens)
        if not keep_desc and t.desc is not None:
            t = LocalTokens(t.codes, t.xy, t.scale, t.weight)  # codes only: the pool stays small
        out.append(t)
    return out


def build_pool(images: list[np.ndarray], describe: Describe, conf: TrainConfig, rng: np.random.Generator) -> list[Pair]:
    """Sample ``conf.pairs`` pairs over ``images`` and describe them (each anchor once, each view once)."""
    n = len(images)
    if n < 2:
        raise AMESTrainError(f"AMES training needs at least 2 images (negatives pair different ones), got {n}")
    if conf.pairs < 2:
        raise AMESTrainError(f"AMES training needs at least 2 pairs, got {conf.pairs}")
    n_pos = round(conf.pairs * conf.positive_fraction)
    labels = rng.permutation(np.r_[np.ones(n_pos), np.zeros(conf.pairs - n_pos)])
    # Anchors cycle through shuffled images so that every image is used before any repeats.
    anchors = np.concatenate([rng.permutation(n) for _ in range(-(-conf.pairs // n))])[: conf.pairs]
    others = (anchors + rng.integers(1, n, size=conf.pairs)) % n  # uniform over the other images
    sources = np.where(labels == 1, anchors, others)  # the image each pair's view is made from
    keep_desc = not conf.binarized
    step = max(1, conf.describe_batch)

    used = np.unique(anchors)
    anchor_tokens: dict[int, LocalTokens] = {}
    for start in range(0, len(used), step):
        ids = used[start : start + step]
        anchor_tokens.update(
            zip(ids.tolist(), _describe(describe, [images[i] for i in ids], keep_desc, conf.max_tokens))
        )
    view_tokens: list[LocalTokens] = []
    for start in tqdm(range(0, conf.pairs, step), desc="describing views", disable=None):
        views = [random_view(images[i], rng, conf.warp) for i in sources[start : start + step]]
        view_tokens += _describe(describe, views, keep_desc, conf.max_tokens)
    return [Pair(anchor_tokens[int(a)], v, float(y)) for a, v, y in zip(anchors, view_tokens, labels)]


# --- training -------------------------------------------------------------------------------------


def _batch_logits(model: AMES, pairs: Sequence[Pair]) -> torch.Tensor:
    """Logits of a batch of pairs, padded together."""
    device = next(model.parameters()).device
    if model.conf.binarized:
        a, b = TokenBatch.stack([p.src for p in pairs]), TokenBatch.stack([p.tgt for p in pairs])

        def t(x: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(x).to(device)

        return model.forward_codes(t(unpack_signs(a.codes)), t(~a.mask), t(unpack_signs(b.codes)), t(~b.mask))
    sa, sm = pad_descriptors([p.src for p in pairs], model.conf.local_dim)
    ta, tm = pad_descriptors([p.tgt for p in pairs], model.conf.local_dim)
    return model(*(torch.from_numpy(x).to(device) for x in (sa, sm, ta, tm)))


def evaluate(model: AMES, pairs: Sequence[Pair], batch_size: int = 64) -> dict[str, float | None]:
    """Mean BCE loss and the accuracy (logit > 0 means "same") on positives and on negatives."""
    if not pairs:
        return {"loss": None, "pos_acc": None, "neg_acc": None}
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            logits = torch.cat(
                [_batch_logits(model, pairs[i : i + batch_size]) for i in range(0, len(pairs), batch_size)]
            )
    finally:
        model.train(was_training)
    labels = torch.tensor([p.label for p in pairs])
    loss = float(torch.nn.functional.binary_cross_entropy_with_logits(logits, labels))
    pos, neg = labels == 1, labels == 0
    correct = (logits > 0) == pos
    return {
        "loss": loss,
        "pos_acc": float(correct[pos].float().mean()) if pos.any() else None,
        "neg_acc": float(correct[neg].float().mean()) if neg.any() else None,
    }


def train(model: AMES, pairs: Sequence[Pair], conf: TrainConfig, rng: np.random.Generator) -> list[float]:
    """Adam + BCE-with-logits over ``pairs`` for ``conf.epochs``; returns the mean loss per epoch."""
    if conf.batch_size < 1 or conf.epochs < 1:
        raise AMESTrainError(f"batch_size and epochs must be >= 1, got {conf.batch_size} and {conf.epochs}")
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.Adam(params, lr=conf.lr, weight_decay=conf.weight_decay)
    device = next(model.parameters()).device
    n_batches = -(-len(pairs) // conf.batch_size)
    history = []
    model.train()
    with tqdm(total=conf.epochs * n_batches, desc="training AMES", disable=None) as bar:
        for epoch in range(conf.epochs):
            order = rng.permutation(len(pairs))
            total, correct = 0.0, 0
            for start in range(0, len(pairs), conf.batch_size):
                batch = [pairs[i] for i in order[start : start + conf.batch_size]]
                labels = torch.tensor([p.label for p in batch], device=device)
                logits = _batch_logits(model, batch)
                loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, labels)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                total += loss.item() * len(batch)
                correct += int(((logits.detach() > 0) == (labels == 1)).sum())
                bar.update(1)
                bar.set_postfix(loss=f"{loss.item():.4f}")
            history.append(total / len(pairs))
            log.info("epoch %d/%d: loss %.4f, accuracy %.3f", epoch + 1, conf.epochs, history[-1], correct / len(pairs))
    model.eval()
    return history


def _token_dim(pairs: Sequence[Pair]) -> int | None:
    for p in pairs:
        for t in (p.src, p.tgt):
            if t.desc is not None:
                return int(t.desc.shape[1])
    return None


def _build_model(conf: TrainConfig, pool: Sequence[Pair], projection: np.ndarray | None) -> AMES:
    if conf.init is not None:
        model = load_ames(conf.init)
        if model.conf.binarized != conf.binarized:
            kind = "binarised" if model.conf.binarized else "full precision"
            raise AMESTrainError(
                f"init checkpoint {conf.init} is {kind}, but the config says binarized={conf.binarized}"
            )
    else:
        dim = _token_dim(pool)
        if conf.binarized:
            # The codes skip the sign projection, so its W only has to be the one they were made
            # with for forward() on float descriptors to agree; without one it stays random.
            local_dim = projection.shape[0] if projection is not None else (dim or AMESConfig.local_dim)
            if projection is None:
                log.warning(
                    "no ITQ projection given: the checkpoint's remap_local.0.W is random (forward_codes is unaffected)"
                )
        else:
            if dim is None:
                raise AMESTrainError(
                    "full-precision AMES training needs float descriptors; describe returned tokens without desc"
                )
            local_dim = dim
        with torch.random.fork_rng(devices=[]):  # seeded init without touching the caller's RNG
            torch.manual_seed(conf.seed)
            model = AMES(
                AMESConfig(
                    local_dim=int(local_dim),
                    model_dim=conf.model_dim,
                    heads=conf.heads,
                    layers=conf.layers,
                    ff_dim=conf.ff_dim,
                    binarized=conf.binarized,
                )
            )
    if projection is not None:
        model.set_projection(projection)
    if model.conf.binarized:
        model.remap_local[0].W.requires_grad_(False)  # unused by codes; keep it the ITQ projection
    return model


def main(
    conf: TrainConfig,
    images: str | Path | Sequence[str | Path | np.ndarray],
    output: str | Path,
    *,
    describe: Describe,
    projection: np.ndarray | None = None,
) -> Path:
    """Train AMES on ``images`` (a directory, paths, or arrays) and write the checkpoint.

    ``output`` is the checkpoint file if it ends in .pt/.pth, else a directory that gets ames.pt;
    the JSON record is the checkpoint's name with .json. ``describe`` turns uint8 RGB images into
    tokens; ``projection`` is the ITQ projection (d x 128) the codes are made with, stored as the
    binarised model's sign projection. Returns the checkpoint path.
    """
    output = Path(output)
    ckpt = output if output.suffix in (".pt", ".pth") else output / "ames.pt"
    if not 0 < conf.positive_fraction < 1 or not 0 <= conf.val_fraction < 1:
        raise AMESTrainError(
            f"positive_fraction must be in (0, 1) and val_fraction in [0, 1), "
            f"got {conf.positive_fraction} and {conf.val_fraction}"
        )
    rng = np.random.default_rng(conf.seed)
    t0 = time.perf_counter()
    imgs = load_images(images)
    pool = build_pool(imgs, describe, conf, rng)
    t_describe = time.perf_counter() - t0
    n_val = int(len(pool) * conf.val_fraction)
    val, trn = pool[:n_val], pool[n_val:]  # the pool is already in random order
    log.info(
        "AMES pool: %d images, %d pairs (%d train, %d held out), described in %.1f s",
        len(imgs),
        len(pool),
        len(trn),
        n_val,
        t_describe,
    )

    model = _build_model(conf, pool, projection)
    t1 = time.perf_counter()
    history = train(model, trn, conf, rng)
    t_train = time.perf_counter() - t1
    on_train, on_val = evaluate(model, trn), evaluate(model, val)
    log.info(
        "AMES trained in %.1f s: final loss %.4f; train pos/neg acc %s/%s; held-out pos/neg acc %s/%s",
        t_train,
        history[-1],
        on_train["pos_acc"],
        on_train["neg_acc"],
        on_val["pos_acc"],
        on_val["neg_acc"],
    )

    record: dict[str, Any] = {
        "checkpoint": ckpt.name,
        "model_config": asdict(model.conf),
        "train_config": asdict(conf),
        "images": len(imgs),
        "pairs": len(pool),
        "train_pairs": len(trn),
        "val_pairs": len(val),
        "positives": int(sum(p.label for p in pool)),
        "itq_projection": projection is not None,
        "loss_history": history,
        "final_loss": history[-1],
        "train": on_train,
        "val": on_val,
        "seconds": {"describe": round(t_describe, 2), "train": round(t_train, 2)},
    }
    save_ames(model, ckpt, extra={"train_config": json.loads(json.dumps(asdict(conf)))})
    write_atomic(ckpt.with_suffix(".json"), lambda tmp: tmp.write_text(json.dumps(record, indent=2)))
    return ckpt
