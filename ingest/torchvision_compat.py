"""Make ``import torchvision`` (and so timm and open_clip) work with a torchvision build whose
compiled ops cannot load next to the installed torch.

The registry's torchvision 0.28.0 is a CUDA build. On a CPU-only torch its ``_C`` extension fails to
load, and then ``torchvision._meta_registrations`` raises ``operator torchvision::nms does not
exist`` at import time. Declaring the ``nms``/``qnms`` schemas (no kernels) before the first import
lets torchvision import; needle never calls these ops. Where the real extension loads, this does
nothing, so a working torchvision keeps its real kernels.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_SCHEMAS = {
    "nms": "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms": "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
}


def _op_exists(name: str) -> bool:
    try:
        getattr(torch.ops.torchvision, name)
        return True
    except (AttributeError, RuntimeError):
        return False


def _load_real_extension() -> bool:
    """Load torchvision's own compiled ops the way torchvision does; True when they are usable."""
    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        return False
    for candidate in Path(next(iter(spec.submodule_search_locations))).glob("_C*.so"):
        try:
            torch.ops.load_library(str(candidate))
            return True
        except OSError:
            return False
    return False


@functools.cache
def ensure_torchvision_importable() -> torch.library.Library | None:
    """Declare the missing torchvision op schemas once per process; no-op where the real ops load.

    Returns the ``torch.library.Library`` holding the declarations (it must stay referenced for the
    schemas to live; ``functools.cache`` keeps it), or None when nothing was needed.
    """
    if all(_op_exists(name) for name in _SCHEMAS) or _load_real_extension():
        return None
    lib = torch.library.Library("torchvision", "FRAGMENT")
    for name, schema in _SCHEMAS.items():
        if not _op_exists(name):
            lib.define(schema)
    log.debug("declared torchvision op schemas %s (compiled extension unavailable)", list(_SCHEMAS))
    return lib
