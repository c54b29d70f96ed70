"""Where the query side's re-ranking runs: a property of the process (the machine it runs on), never
of a request, so it is not part of ``RerankConfig`` (which a coordinator sends its shards).

``--device`` of ``needle query``, ``needle serve`` and ``needle eval map`` takes one of ``DEVICES``:
"cpu" (the default: what needle always did), "cuda" (the AMES model and spatial verification's
heavy tables on the GPU; an error where torch sees none, never a silent fall back) or "auto" (cuda
where torch sees a GPU, else cpu; logged, so a run says where it went).
"""

from __future__ import annotations

import logging

import torch

from core.errors import NeedleInputError
from rerank.config import DEVICES  # --device choices

log = logging.getLogger(__name__)


class DeviceUnavailableError(NeedleInputError):
    """A device asked for that this process does not have (``--device cuda`` without a CUDA GPU)."""


def resolve_device(device: str | torch.device = "cpu", flag: str = "--device") -> torch.device:
    """The torch device of ``device`` ("auto", "cpu", "cuda", "cuda:N" or a torch.device).

    "cuda" where ``torch.cuda.is_available()`` is False is a ``DeviceUnavailableError`` naming
    ``flag`` (the setting the user gave), so a server asked for a GPU never quietly serves from its
    CPU; "auto" chooses and logs its choice."""
    if isinstance(device, torch.device):
        device = str(device)
    name = str(device).strip().lower()
    if name == "auto":
        chosen = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        log.info("%s auto: re-ranking on %s", flag, chosen)
        return chosen
    kind = name.split(":", 1)[0]
    if kind not in ("cpu", "cuda"):
        raise NeedleInputError(f"{flag} must be one of {', '.join(DEVICES)}, got {device!r}")
    try:
        chosen = torch.device(name)
    except RuntimeError as exc:
        raise NeedleInputError(f"{flag} {device!r}: {exc}") from None
    if chosen.type == "cuda":
        if not torch.cuda.is_available():
            raise DeviceUnavailableError(f"{flag} {device}: torch sees no CUDA GPU here (use {flag} cpu or auto)")
        if chosen.index is not None and chosen.index >= torch.cuda.device_count():
            raise DeviceUnavailableError(
                f"{flag} {device}: only {torch.cuda.device_count()} CUDA device(s) are visible here"
            )
    return chosen
