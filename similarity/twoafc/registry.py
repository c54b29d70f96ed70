"""The registry of 2AFC similarity models: names -> factories (each model built once per process,
on first use), the defaults the ensemble combines, and ``--models`` parsing. Register your own
:class:`similarity.twoafc.models.SimilarityModel` with :func:`register_model`."""

from __future__ import annotations

from collections.abc import Callable

from similarity.data import SimilarityDataError
from similarity.twoafc.models import (
    ChamferTokens,
    ColourHistogram,
    GlobalCosine,
    MultiStageCosine,
    SimilarityModel,
    TinyImage,
)

MODELS: dict[str, Callable[[], SimilarityModel]] = {
    "lite0-gem-384": lambda: GlobalCosine("lite0-gem-384", 384),
    "lite0-gem-224": lambda: GlobalCosine("lite0-gem-224", 224),
    "lite0-multistage-384": lambda: MultiStageCosine("lite0-multistage-384", 384),
    "lite0-chamfer-s16": lambda: ChamferTokens("lite0-chamfer-s16", "lite0-s16"),
    "colour-hist-8": lambda: ColourHistogram("colour-hist-8", bins=8),
    "tiny-32": lambda: TinyImage("tiny-32", 32),
    # Not evaluated by default: a miner of hard B's that look alike to Lite0's GeM (so adversarial to it).
    "lite0-gem-320": lambda: GlobalCosine("lite0-gem-320", 320),
}
DEFAULT_MODELS = ("lite0-gem-384", "lite0-gem-224", "lite0-multistage-384", "lite0-chamfer-s16", "colour-hist-8")
DEFAULT_CONTEXT = "lite0-gem-384"
# Each model built once: its torch network and weights' hash are costly; register_model drops a stale one.
_INSTANCES: dict[str, SimilarityModel] = {}


def register_model(name: str, factory: Callable[[], SimilarityModel]) -> None:
    """Make ``name`` usable in --models and ensembles (factory: builds the model, called once)."""
    MODELS[name] = factory
    _INSTANCES.pop(name, None)


def get_model(name: str) -> SimilarityModel:
    """The model registered as ``name`` (built on the first call); a typed error naming the known ones."""
    if name not in MODELS:
        raise SimilarityDataError(f"unknown similarity model {name!r}; known: {sorted(MODELS)}")
    if name not in _INSTANCES:
        _INSTANCES[name] = MODELS[name]()
    return _INSTANCES[name]


def parse_models(text: str) -> tuple[str, ...]:
    """``--models`` (comma-separated registered names, none twice) as a tuple."""
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    if not names:
        raise SimilarityDataError(f"--models needs comma-separated model names, got {text!r}")
    for n in names:
        get_model(n)  # fail early on a typo
    if len(set(names)) != len(names):
        raise SimilarityDataError(f"--models names a model twice: {text!r}")
    return names
