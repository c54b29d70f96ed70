"""``needle similarity <method> ...``: each method's CLI module (``similarity/<method>/cli.py``) adds
its own subcommands with ``add_cli(subparsers)``; those modules import no torch, the handlers import
the heavy modules they run (no work at import time)."""

from __future__ import annotations

import argparse
import importlib

METHOD_MODULES = (
    "similarity.afn.cli",  # needle similarity afn ...
    "similarity.adaptors.cli",  # needle similarity adaptors ...
    "similarity.ffa.cli",  # needle similarity ffa ...
    "similarity.twoafc.cli",  # needle similarity 2afc ...
)


def add_similarity_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("similarity", help="similarity methods on frozen features: afn, adaptors, ffa, 2afc")
    methods = p.add_subparsers(dest="similarity_method", required=True)
    for name in METHOD_MODULES:
        importlib.import_module(name).add_cli(methods)
