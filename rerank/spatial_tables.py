"""Spatial verification's (hypotheses x matches) inlier tables in torch, on any device.

rerank/spatial.py chooses hypotheses, fits LO's affines and keeps its results in numpy on the host;
the tables it counts inliers in are the one part whose size grows with the square of the matches,
so they are built here, on the device ``verify`` is given (a GPU where the query side runs on one).
Each is float64 elementwise arithmetic in the reference's order (``verify_pair``): IEEE rounds every
such operation exactly, on a CPU or a GPU alike, so the inlier counts are identical everywhere.
Only the counts and each candidate's chosen row go back to the host.
"""

from __future__ import annotations

import numpy as np
import torch


def on_device(device: torch.device, *arrays: np.ndarray) -> list[torch.Tensor]:
    """``arrays`` as tensors on ``device`` (shared with numpy on the CPU, copied elsewhere)."""
    return [torch.from_numpy(np.ascontiguousarray(a)).to(device) for a in arrays]


def rows_of(table: torch.Tensor, best: np.ndarray) -> np.ndarray:
    """``table[g, best[g]]`` for every g, (G, m) bool on the host: the one row of each candidate's
    table that is kept, so a GPU's (G, h, m) table never crosses to the host whole."""
    rows = torch.arange(len(best), device=table.device)
    return table[rows, torch.from_numpy(best).to(table.device)].cpu().numpy()


def hypothesis_inliers(
    xq: np.ndarray,
    xd: np.ndarray,
    s: np.ndarray,
    tx: np.ndarray,
    ty: np.ndarray,
    thr2: float,
    device: torch.device | None = None,
) -> tuple[np.ndarray, torch.Tensor]:
    """For every hypothesis h (the similarity s_h, t_h of match h) and match j of each candidate:
    is ``s_h xq_j + t_h`` within the threshold of ``xd_j``? Returns counts (G, m) int64 (numpy)
    and the table (G, m, m) bool (a tensor on ``device``). torch, in place: this (G, m, m) float64
    work dominates SP, and torch spreads it over the threads (2x numpy here) or a GPU. Padded
    matches sit far away (``rerank.spatial._FAR``) and never count. The operations and their order
    are ``verify_pair``'s, so the roundings are identical (elementwise IEEE float64, any device)."""
    xq_t, xd_t, s_t, tx_t, ty_t = on_device(device or torch.device("cpu"), xq, xd, s, tx, ty)
    s_t = s_t[:, :, None]
    total = None
    for axis, t in ((0, tx_t), (1, ty_t)):
        r = s_t * xq_t[:, None, :, axis]  # (G, h, j)
        r += t[:, :, None]
        r -= xd_t[:, None, :, axis]
        r *= r
        total = r if total is None else total.add_(r)
    table = total <= thr2
    return table.sum(2).cpu().numpy(), table


def pair_table(
    q: np.ndarray,
    d_: np.ndarray,
    c: np.ndarray,
    d: np.ndarray,
    tx: np.ndarray,
    ty: np.ndarray,
    valid: np.ndarray,
    thr2: float,
    device: torch.device,
) -> tuple[np.ndarray, torch.Tensor]:
    """(g, P) inlier counts (numpy) and the (g, P, m) inlier table (on ``device``) of the pair
    hypotheses ``z -> (c + i d) z + t``: torch float64, in place, the reference's operations in
    its order (identical roundings on any device)."""
    qt, dt, ct, st, txt, tyt, vt = on_device(device, q, d_, c, d, tx, ty, valid)
    x, y = qt[:, None, :, 0], qt[:, None, :, 1]  # (g, 1, m)
    ct, st = ct[..., None], st[..., None]
    rx = ct * x
    rx -= st * y
    rx += txt[..., None]
    rx -= dt[:, None, :, 0]
    ry = st * x
    ry += ct * y
    ry += tyt[..., None]
    ry -= dt[:, None, :, 1]
    rx *= rx
    ry *= ry
    rx += ry
    table = (rx <= thr2) & vt[:, None, :]  # (g, P, m)
    return table.sum(2).cpu().numpy(), table
