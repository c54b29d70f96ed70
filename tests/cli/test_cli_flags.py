"""cli/flags.py: flags from a frozen config dataclass (help declared with each field, type and
default from the field, bools and tuples), back to the config; and the ``needle`` commands that use it."""

from __future__ import annotations

import argparse
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from cli.flags import add_config_flags, config_from_args, field_flags
from core.settings import setting

if TYPE_CHECKING:
    from rerank.rerank import RerankConfig  # as a config module names a stage's nested config

ROOT = Path(__file__).resolve().parents[2]
LIMIT = 3 * 4  # a module constant the example's default refers to


@dataclass(frozen=True)
class Example:
    local_top_k: int | None = setting(None, "tokens per image; None: the preset's")
    batch_size: int = setting(32, "images per forward pass (100% of them)")
    name: str = setting("run", "The name of the run, in a block comment of two lines.")
    overwrite: bool = setting(False, "redo what is done")
    recursive: bool = setting(True, "walk sub-directories")
    scales: tuple[float, ...] = setting((1.0,), "scales averaged")
    sizes: tuple[int, ...] | None = setting(None, "sizes to run")
    pair: tuple[int, int] = setting((1, 2), "a fixed pair")
    limit: int = setting(LIMIT, "from a module constant")
    budget: int = setting(16 << 20, "arithmetic on literals")
    nested: Example | None = None  # a nested config: no flag
    rerank: RerankConfig | None = None  # a type imported for type checking only: no flag
    made: tuple[str, ...] = field(default_factory=tuple, metadata={"help": "made by a factory"})
    plain: int = 7  # a field without declared help: a flag without help

    def describe(self) -> str:
        return self.name  # not a field either


@dataclass(frozen=True)
class Required:
    path: str = field(metadata={"help": "where it goes"})
    count: int = setting(1, "how many")


def parser_for(**kwargs) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="t")
    add_config_flags(parser, Example, **kwargs)
    return parser


def test_fields_read_from_the_declaration():
    flags = {f.name: f for f in field_flags(Example)}
    assert "nested" not in flags and "rerank" not in flags and "describe" not in flags
    assert flags["local_top_k"].help == "tokens per image; None: the preset's"
    assert flags["name"].help == "The name of the run, in a block comment of two lines."
    assert (flags["local_top_k"].type, flags["local_top_k"].optional, flags["local_top_k"].default) == (int, True, None)
    assert (flags["scales"].kind, flags["scales"].type, flags["scales"].length) == ("tuple", float, None)
    assert (flags["pair"].kind, flags["pair"].length, flags["pair"].default) == ("tuple", 2, (1, 2))
    assert flags["limit"].default == 12 and flags["budget"].default == 16 << 20
    assert flags["made"].default == () and not flags["made"].required and flags["made"].help == "made by a factory"
    assert (flags["plain"].default, flags["plain"].help) == (7, "")
    assert [f.name for f in field_flags(Required)] == ["path", "count"] and field_flags(Required)[0].required


def test_a_field_without_default_is_a_required_flag():
    parser = argparse.ArgumentParser(prog="t")
    add_config_flags(parser, Required)
    with pytest.raises(SystemExit):
        parser.parse_args([])
    assert config_from_args(Required, parser.parse_args(["--path", "p"])) == Required("p")


def test_flag_names_defaults_and_help():
    parser = parser_for()
    args = parser.parse_args([])
    assert (args.local_top_k, args.batch_size, args.name, args.overwrite, args.recursive) == (
        None,
        32,
        "run",
        False,
        True,
    )
    assert (args.scales, args.sizes, args.pair, args.limit) == ((1.0,), None, (1, 2), 12)
    text = parser.format_help()
    assert "--local-top-k LOCAL_TOP_K" in text and "tokens per image; None: the preset's" in text
    assert "(100% of them)" in text  # a % in a comment is not an argparse format
    assert "--recursive, --no-recursive" in text and "--overwrite " in text and "--no-overwrite" not in text
    assert "--nested" not in text


def test_bools_tuples_and_round_trip():
    parser = parser_for()
    assert config_from_args(Example, parser.parse_args([])) == Example()
    args = parser.parse_args(
        [
            "--local-top-k",
            "7",
            "--overwrite",
            "--no-recursive",
            "--scales",
            "0.5, 1,2",
            "--sizes",
            "0,100",
            "--pair",
            "3,4",
            "--name",
            "x",
            "--made",
            "a,b",
        ]
    )
    assert config_from_args(Example, args) == Example(
        local_top_k=7,
        overwrite=True,
        recursive=False,
        scales=(0.5, 1.0, 2.0),
        sizes=(0, 100),
        pair=(3, 4),
        name="x",
        made=("a", "b"),
    )
    assert config_from_args(Example, args, name="given").name == "given"  # given fields win
    for bad in (["--sizes", "1,x"], ["--pair", "1,2,3"], ["--scales", ","], ["--batch-size", "many"]):
        with pytest.raises(SystemExit):
            parser.parse_args(bad)


def test_only_skip_and_overrides():
    parser = parser_for(
        only=("batch_size", "scales", "local_top_k"),
        skip=("local_top_k",),
        overrides={
            "batch_size": {"flag": "--batch", "choices": (16, 32)},
            "scales": {"flag": "--multiscale", "default": None},  # None on a field that cannot be None: not given
        },
    )
    text = parser.format_help()
    assert "--batch {16,32}" in text and "--local-top-k" not in text and "--name" not in text
    assert config_from_args(Example, parser.parse_args([])) == Example()
    args = parser.parse_args(["--batch", "16", "--multiscale", "2"])
    assert (args.batch, args.multiscale) == (16, (2.0,))
    assert config_from_args(Example, args) == Example(batch_size=16, scales=(2.0,))
    with pytest.raises(ValueError, match="no flag-able fields"):
        parser_for(only=("nested",))


CONFIG_MODULES = (
    "ingest.config",
    "embed",
    "index.build.config",
    "index.live.config",
    "query.config",
    "rerank.config",
    "eval.config",
    "cluster.demo",
)


def test_configs_are_read_without_importing_their_stages():
    code = (
        "import sys; from cli.flags import field_flags; from eval.config import EvalConfig; "
        f"import {', '.join(CONFIG_MODULES)}; "
        "f = {x.name: x for x in field_flags(EvalConfig)}; "
        "assert f['k'].default == 1000 and 'mAP@k' in f['k'].help, f['k']; "
        "sys.exit(1 if 'torch' in sys.modules or 'eval.evaluate' in sys.modules else 0)"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]


def test_the_stages_reexport_their_configs():
    """The configs moved to torch-free modules stay importable from the stages that use them."""
    import embed
    import embed.adapt
    import embed.augment
    import embed.train_itq
    import embed.whiten
    import eval.config
    import eval.evaluate
    import eval.scaling
    import index.build.config
    import index.build.stage
    import index.live.add_rows
    import index.live.compact
    import index.live.config
    import index.live.delete_rows
    import ingest.config
    import ingest.demo_data
    import ingest.pack
    import query.config
    import query.retrieve
    import rerank.ames_train
    import rerank.config

    pairs = [
        (embed.adapt.AdaptConfig, embed.AdaptConfig),
        (embed.augment.AugmentConfig, embed.AugmentConfig),
        (embed.train_itq.TrainITQConfig, embed.TrainITQConfig),
        (embed.whiten.WhitenConfig, embed.WhitenConfig),
        (eval.evaluate.EvalConfig, eval.config.EvalConfig),
        (eval.scaling.ScalingConfig, eval.config.ScalingConfig),
        (index.build.stage.IndexConfig, index.build.config.IndexConfig),
        (index.live.add_rows.AddConfig, index.live.config.AddConfig),
        (index.live.compact.CompactConfig, index.live.config.CompactConfig),
        (index.live.delete_rows.DeleteConfig, index.live.config.DeleteConfig),
        (ingest.pack.PackConfig, ingest.config.PackConfig),
        (query.retrieve.QueryConfig, query.config.QueryConfig),
        (rerank.ames_train.TrainConfig, rerank.config.TrainConfig),
        (rerank.ames_train.WarpConfig, rerank.config.WarpConfig),
        (ingest.demo_data.DemoConfig, ingest.config.DemoConfig),
    ]
    assert all(old is new for old, new in pairs)


def test_every_command_flag_has_declared_help():
    """Each flag of a stage config carries the help its field declares (none is left without)."""
    from cluster.demo import DemoRunConfig
    from embed import AdaptConfig, AugmentConfig, TrainITQConfig, WhitenConfig
    from eval.config import EvalConfig, ScalingConfig
    from index.build.config import IndexConfig
    from index.live.config import AddConfig, CompactConfig, DeleteConfig
    from ingest.config import IngestConfig, PackConfig
    from query.config import QueryConfig
    from rerank.config import TrainConfig

    configs = [DemoRunConfig, AdaptConfig, AugmentConfig, TrainITQConfig, WhitenConfig, EvalConfig, ScalingConfig]
    configs += [IndexConfig, AddConfig, CompactConfig, DeleteConfig, IngestConfig, PackConfig, QueryConfig, TrainConfig]
    bare = [f"{c.__qualname__}.{f.name}" for c in configs for f in field_flags(c) if not f.help]
    assert not bare, f"flag-able fields without declared help: {bare}"


# --- the needle commands ------------------------------------------------------------------------
def _config(argv: list[str], config: type, **given):
    from cli.main import build_parser

    return config_from_args(config, build_parser().parse_args(argv), **given)


def test_commands_default_to_the_configs_defaults():
    """Every command's flags, left alone, give its config's own defaults."""
    from cli.main import build_parser
    from cli.search import page_config, rerank_config
    from cli.spec_flags import query_files, serve_spec
    from cluster.demo import DemoRunConfig
    from embed.adapt import AdaptConfig
    from embed.augment import AugmentConfig
    from embed.train_itq import TrainITQConfig
    from embed.whiten import WhitenConfig
    from eval.evaluate import EvalConfig
    from eval.scaling import ScalingConfig
    from index.build.stage import IndexConfig
    from ingest.config import IngestConfig
    from ingest.pack import PackConfig
    from query.recorded import QueryFiles
    from query.retrieve import QueryConfig
    from rerank.ames_train import TrainConfig
    from rerank.ensemble import EnsembleConfig
    from rerank.matching import MatchConfig
    from rerank.rerank import RerankConfig
    from webapi.spec import ServeSpec
    from webapi.webpage import PageConfig

    assert _config(["ingest", "--shards", "x", "--out", "o"], IngestConfig) == IngestConfig()
    assert _config(["pack", "src", "--out", "o"], PackConfig) == PackConfig()
    assert _config(["locals", "train-itq", "--descriptors", "d", "--out", "o"], TrainITQConfig) == TrainITQConfig()
    assert _config(["index", "build", "--descriptors", "d", "--out", "o"], IndexConfig) == IndexConfig()
    query = ["query", "--index", "i"]
    assert _config(query, QueryConfig) == QueryConfig()
    assert query_files(build_parser().parse_args(query)) == QueryFiles()
    reranked = rerank_config(build_parser().parse_args([*query, "--rerank", "sp"]))
    assert reranked == RerankConfig()
    assert reranked.ensemble == EnsembleConfig() and reranked.match == MatchConfig()
    assert serve_spec(build_parser().parse_args(["serve", "--index", "i"])) == ServeSpec(index="i")
    assert page_config(build_parser().parse_args(["serve", "--index", "i"])) == PageConfig()
    evaluate = ["eval", "map", "--index", "i", "--ground-truth", "g", "--out", "o"]
    assert _config(evaluate, EvalConfig) == EvalConfig()
    scaling = ["eval", "scaling", "--descriptors", "d", "--ground-truth", "g", "--out", "o"]
    # --sizes stops at a million distractors, as before; ScalingConfig's default goes on.
    assert _config(scaling, ScalingConfig) == ScalingConfig(sizes=ScalingConfig().sizes[:10])
    assert (
        _config(["adapt", "train", "--descriptors", "d", "--labels", "l", "--out", "o"], AdaptConfig) == AdaptConfig()
    )
    assert _config(["adapt", "whiten", "--descriptors", "d", "--out", "o"], WhitenConfig) == WhitenConfig()
    assert _config(["adapt", "make-classes", "--images", "i", "--out", "o"], AugmentConfig) == AugmentConfig()
    assert _config(["ames", "train", "--images", "i", "--out", "o"], TrainConfig) == TrainConfig()
    assert _config(["demo"], DemoRunConfig) == DemoRunConfig()


def test_renamed_flags_reach_their_fields():
    from embed.whiten import WhitenConfig
    from eval.scaling import ScalingConfig
    from index.build.stage import IndexConfig
    from ingest.pack import PackConfig
    from query.retrieve import QueryConfig

    assert _config(["pack", "s", "--out", "o", "--no-recursive", "--extensions", "jpg, png"], PackConfig) == PackConfig(
        recursive=False, extensions=("jpg", "png")
    )
    assert _config(
        ["index", "build", "--descriptors", "d", "--out", "o", "--quantizer-ef", "64", "--nlist", "8"], IndexConfig
    ) == IndexConfig(quantizer_ef=64, nlist=8)
    assert _config(["query", "--index", "i", "--qe", "3", "--k", "5"], QueryConfig) == QueryConfig(k=5, qe_top=3)
    assert _config(
        ["adapt", "whiten", "--descriptors", "d", "--out", "o", "--dim", "64", "--method", "learned"], WhitenConfig
    ) == WhitenConfig(out_dim=64, method="learned")
    scaling = [
        "eval",
        "scaling",
        "--descriptors",
        "d",
        "--ground-truth",
        "g",
        "--out",
        "o",
        "--sizes",
        "0,10",
        "--modes",
        "exact, ivfpq+sp",
        "--k",
        "5",
        "--shortlist",
        "9",
        "--rerank-lambda",
        "0.3",
        "--order",
        "shuffle",
    ]
    assert _config(scaling, ScalingConfig) == ScalingConfig(
        sizes=(0, 10), modes=("exact", "ivfpq+sp"), k=5, shortlist=9, rerank_lambda=0.3, order="shuffle"
    )


def test_rerank_flags_leave_the_kind_defaults_open_unless_given():
    """--rerank sp alone leaves the threshold and α-QE to the index's token kind (None); given
    flags are kept; QE's details without --rerank-qe are an error, not ignored."""
    from cli.main import build_parser
    from cli.search import rerank_config
    from core.errors import NeedleInputError
    from rerank.expand import ExpansionConfig

    def parsed(*flags):
        return rerank_config(build_parser().parse_args(["query", "--index", "i", "--rerank", "sp", *flags]))

    conf = parsed()
    assert conf.match.max_distance is None and conf.expansion is None
    conf = parsed("--max-hamming", "30", "--rerank-qe", "3", "--rerank-qe-alpha", "1")
    assert conf.match.max_distance == 30 and conf.expansion == ExpansionConfig(top=3, alpha=1.0)
    assert parsed("--rerank-qe", "0").expansion == ExpansionConfig(top=0)
    with pytest.raises(NeedleInputError, match="need --rerank-qe"):
        parsed("--rerank-qe-min-inliers", "4")


def test_eval_without_a_subcommand_is_a_usage_error(capsys):
    from cli.main import main

    assert main(["eval"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: needle eval") and "required" in err and "{map,scaling,plot}" in err
    assert main(["eval", "map", "--index", "i"]) == 2
    assert "the following arguments are required: --ground-truth, --out" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv",
    [
        ["--help"],
        ["ingest", "--help"],
        ["eval", "map", "--help"],
        ["query", "--help"],
        ["serve", "--help"],
        ["adapt", "whiten", "--help"],
        ["ames", "train", "--help"],
        ["index", "build", "--help"],
        ["index", "add", "--help"],
        ["locals", "train-itq", "--help"],
        ["pack", "--help"],
        ["demo", "--help"],
    ],
)
def test_help_imports_no_torch(argv):
    code = (
        "import runpy, sys; sys.argv = ['needle', *sys.argv[1:]]\ntry:\n    runpy.run_module('cli.main', "
        "run_name='__main__')\nexcept SystemExit as exc:\n    assert exc.code == 0, exc.code\n"
        "sys.exit(3 if 'torch' in sys.modules else 0)"
    )
    result = subprocess.run([sys.executable, "-c", code, *argv], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, f"needle {' '.join(argv)}: " + result.stderr[-2000:]
    assert "usage: needle" in result.stdout


def test_similarity_parser_only_for_similarity_or_help():
    """``needle index add`` and the like skip importing the similarity methods' CLI modules; a typo's
    error still lists every command."""
    from cli.main import parser_for

    def commands(parser):
        return set(next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices)

    assert "similarity" not in commands(parser_for(["index", "add", "--index", "x", "--descriptors", "y"]))
    assert "similarity" not in commands(parser_for(["-v", "serve", "--index", "x"]))
    assert parser_for(["-v", "serve", "--index", "x"]).parse_args(["-v", "serve", "--index", "x"]).command == "serve"
    for argv in (["similarity", "afn", "--help"], [], ["--help"], ["simil"]):
        assert "similarity" in commands(parser_for(argv))
