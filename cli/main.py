"""The ``needle`` command: one subcommand per stage. Each group of commands registers its own
subcommands (cli.build, cli_search, cli_eval, cli_train; similarity.cli), whose flags come
from the stages' frozen configs (cli.flags), or for ``needle serve`` and the re-ranking flags from
a declared table (cli.spec_flags); a handler parses its flags into the stage's config and calls
the stage's ``main``. No stage is imported until a handler runs, so that ``needle
--help`` and ``needle <cmd> --help`` import no torch."""

from __future__ import annotations

import argparse
import logging
import sys

from cli.build import add_build_parsers, add_tool_parsers
from cli.eval import add_eval_parsers
from cli.search import add_search_parsers
from cli.search import page_config as _page_config  # noqa: F401  (the serve flags' PageConfig, for tests)
from cli.train import add_train_parsers
from core.blas import choose_openblas_core
from core.errors import NeedleInputError, ShardReadError

log = logging.getLogger("needle")


def build_parser(with_similarity: bool = True) -> argparse.ArgumentParser:
    """Every subcommand's parser; ``with_similarity`` False leaves out ``similarity`` (its methods'
    modules take ~0.2 s to import: every other command would pay it, ``needle index add`` included)."""
    parser = argparse.ArgumentParser(prog="needle", description="Instance-level image retrieval at scale.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)
    add_build_parsers(sub)  # ingest, pack, locals, index
    add_search_parsers(sub)  # query, serve
    add_eval_parsers(sub)  # eval map, scaling, plot
    add_train_parsers(sub)  # adapt, ames
    if with_similarity:
        from similarity.cli import add_similarity_parser

        add_similarity_parser(sub)
    add_tool_parsers(sub)  # demo, models
    return parser


def parser_for(argv: list[str]) -> argparse.ArgumentParser:
    """The parser for ``argv``: without ``similarity`` where ``argv`` names another command it knows."""
    command = next((a for a in argv if not a.startswith("-")), None)
    if command is None or command == "similarity":
        return build_parser()
    parser = build_parser(with_similarity=False)
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    return parser if command in commands else build_parser()  # a typo: its error lists every command


def main(argv: list[str] | None = None) -> int:
    """Run one command; returns its exit status (2 for bad flags or input, as argparse exits)."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        args = parser_for(argv).parse_args(argv)
    except SystemExit as exc:  # --help, or bad flags (argparse has printed the usage)
        return 0 if exc.code is None else exc.code if isinstance(exc.code, int) else 2
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if (
        not args.verbose
    ):  # FAISS's loader reports at INFO which CPU builds it tried: a failed AVX2 try reads like an error
        logging.getLogger("faiss.loader").setLevel(logging.WARNING)
    choose_openblas_core()  # before any stage imports FAISS (core/blas.py: its bundled OpenBLAS misjudges new CPUs)
    try:
        return args.func(args)
    except (NeedleInputError, ShardReadError) as exc:
        log.error("%s", exc)
        return 2


if __name__ == "__main__":
    sys.exit(main())
