"""``needle serve``'s spec (webapi/spec.py): from a TOML file (``--config``), the flags on top of
it, ``--print-config`` read back to an equal spec, typed errors naming the bad key, the flag table
covering every setting, and ``--help`` listing the everyday flags first."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import typing
from pathlib import Path

import pytest

from cli.main import build_parser, main
from cli.spec_flags import RERANK_FLAGS, SERVE_FLAGS, serve_spec, setting_field
from core.errors import SettingsFileError
from query.recorded import QueryFiles
from rerank.options import RerankOptions
from webapi.limits import ConnectionLimits, RequestLimits, ServiceLimits
from webapi.spec import Listen, LiveReload, Page, ServeSpec, Shards
from webapi.spec_toml import spec_from_toml

ROOT = Path(__file__).resolve().parents[2]

EVERY_CONCERN = """
index = "runs/idx"

[listen]
host = "0.0.0.0"
port = 9100
allow_hosts = ["search.lan", "10.0.0.7"]
ray = true
replicas = 3
address = "head:6379"

[request]
max_queries = 50
max_k_total = 2000
max_body_mb = 8

[connection]
max_inflight = 2
queue_timeout = 3
max_connections = 100

[rerank]
method = "sp"
shortlist = 200
max_hamming = 30
mutual = false
qe_top = 5
device = "auto"

[shards]
ray = true
replicas = 2
cpus = 1.5
transport = "ray"
cache_dir = "/data/needle-{node}"
s3_endpoint_url = "http://127.0.0.1:9000"
stage_local = false

[reload]
interval = 0.5

[files]
weights = "w.pt"
itq = "itq.npz"

[page]
report = "report.json"
shard_dirs = ["tars/a", "tars/b"]
max_upload_mb = 4
"""

EXPECTED = ServeSpec(
    index="runs/idx",
    listen=Listen(
        host="0.0.0.0", port=9100, allow_hosts=("search.lan", "10.0.0.7"), ray=True, replicas=3, address="head:6379"
    ),
    request=RequestLimits(max_queries=50, max_k_total=2000, max_body_mb=8),
    connection=ConnectionLimits(max_inflight=2, queue_timeout=3.0, max_connections=100),
    rerank=RerankOptions(method="sp", shortlist=200, max_hamming=30, mutual=False, qe_top=5, device="auto"),
    shards=Shards(
        ray=True,
        replicas=2,
        cpus=1.5,
        transport="ray",
        cache_dir="/data/needle-{node}",
        s3_endpoint_url="http://127.0.0.1:9000",
        stage_local=False,
    ),
    reload=LiveReload(interval=0.5),
    files=QueryFiles(weights="w.pt", itq="itq.npz"),
    page=Page(report="report.json", shard_dirs=("tars/a", "tars/b"), max_upload_mb=4),
)


def _spec(*argv: str) -> ServeSpec:
    return serve_spec(build_parser().parse_args(["serve", *argv]))


def _printed(capsys, *argv: str) -> str:
    assert main(["serve", *argv, "--print-config"]) == 0
    return capsys.readouterr().out


def test_a_file_sets_every_concern(tmp_path):
    path = tmp_path / "serve.toml"
    path.write_text(EVERY_CONCERN)
    spec = _spec("--config", str(path))
    assert spec == EXPECTED
    assert spec.service_limits() == ServiceLimits(
        max_queries=50,
        max_k_total=2000,
        max_body_mb=8,
        max_inflight=2,
        queue_timeout=3.0,
        max_connections=100,
        allow_hosts=("search.lan", "10.0.0.7"),
    )
    assert spec.page_config().max_upload_bytes == 4 << 20 and spec.page_config().shard_dirs == ("tars/a", "tars/b")
    conf = spec.rerank.to_config()
    assert (conf.shortlist, conf.match.max_distance, conf.match.mutual, conf.expansion.top) == (200, 30, False, 5)


def test_flags_override_the_file_only_where_given(tmp_path):
    path = tmp_path / "serve.toml"
    path.write_text(EVERY_CONCERN)
    spec = _spec(
        *("--config", str(path), "--port", "9200", "--max-queries", "7", "--allow-host", "other.lan"),
        *("--no-mutual", "--mutual", "--index", "elsewhere", "--reload-interval", "0", "--shard-dir", "c"),
    )
    assert spec == dataclasses.replace(
        EXPECTED,
        index="elsewhere",
        listen=dataclasses.replace(EXPECTED.listen, port=9200, allow_hosts=("other.lan",)),
        request=dataclasses.replace(EXPECTED.request, max_queries=7),
        rerank=dataclasses.replace(EXPECTED.rerank, mutual=True),
        reload=LiveReload(interval=0.0),
        page=dataclasses.replace(EXPECTED.page, shard_dirs=("c",)),
    )
    assert _spec("--index", "i") == ServeSpec(index="i")  # no file: the defaults, as the flags always gave


def test_print_config_reads_back_to_an_equal_spec(tmp_path, capsys):
    path = tmp_path / "serve.toml"
    path.write_text(EVERY_CONCERN)
    odd = 'a "quoted" \\ path ünï\tcode'  # TOML string escapes
    printed = _printed(capsys, "--config", str(path), "--report", odd, "--rerank-qe-alpha", "0.25")
    again = tmp_path / "printed.toml"
    again.write_text(printed)
    spec = _spec("--config", str(again))
    assert spec == dataclasses.replace(
        EXPECTED,
        page=dataclasses.replace(EXPECTED.page, report=odd),
        rerank=dataclasses.replace(EXPECTED.rerank, qe_alpha=0.25),
    )
    assert _printed(capsys, "--config", str(again)) == printed  # a fixed point
    defaults = _printed(capsys)  # no index: printed without one, read back the same
    assert spec_from_toml(defaults) == ServeSpec()
    assert "# index = (unset)" in defaults and "[connection]" in defaults


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('[request]\nmax_k_total = "x"\n', "serve.toml: request.max_k_total: expected an integer, got 'x'"),
        ("[request]\nmax_k = 3\n", "serve.toml: request.max_k: unknown key"),
        ("[limits]\nmax_k = 3\n", "serve.toml: limits: unknown key"),
        ("[listen]\nport = 80.5\n", "serve.toml: listen.port: expected an integer"),
        ("[listen]\nport = true\n", "serve.toml: listen.port: expected an integer"),
        ('[listen]\nallow_hosts = "a"\n', "serve.toml: listen.allow_hosts: expected a list of strings"),
        ("[shards]\nray = 1\n", "serve.toml: shards.ray: expected true or false"),
        ('[connection]\nqueue_timeout = "10"\n', "serve.toml: connection.queue_timeout: expected a number"),
        ("listen = 3\n", "serve.toml: listen: expected a table"),
        ("index = 3\n", "serve.toml: index: expected a string"),
        ("[listen\n", "serve.toml: not TOML"),
    ],
)
def test_bad_files_are_refused_naming_the_key(text, message):
    with pytest.raises(SettingsFileError) as caught:
        spec_from_toml(text, "serve.toml")
    assert str(caught.value).startswith(message)


def test_bad_config_is_a_usage_error(tmp_path, caplog):
    bad = tmp_path / "serve.toml"
    bad.write_text("[request]\nmax_queries = 0\n")
    assert main(["serve", "--config", str(bad), "--index", "i"]) == 2
    assert "--max-queries must be at least 1, got 0" in caplog.text
    assert main(["serve", "--config", str(tmp_path / "missing.toml")]) == 2
    assert "missing.toml: cannot read it" in caplog.text
    assert main(["serve"]) == 2 and "give the index with --index DIR" in caplog.text


def _sample(hint) -> tuple[list[str], object]:
    """Flag words that set a setting of type ``hint`` away from any default, and the value set."""
    kind = next(a for a in typing.get_args(hint) if a is not type(None)) if typing.get_args(hint) else hint
    if typing.get_origin(hint) is tuple:
        return ["x.lan"], ("x.lan",)
    return {int: (["7"], 7), float: (["0.75"], 0.75), str: (["given"], "given")}[kind]


def test_every_setting_has_one_flag_and_each_flag_reaches_it():
    paths = [flag.path for flag in SERVE_FLAGS]
    settings = ["index"] + [
        f"{section.name}.{f.name}"
        for section in dataclasses.fields(ServeSpec)
        if section.name != "index"
        for f in dataclasses.fields(getattr(ServeSpec(), section.name))
    ]
    assert sorted(paths) == sorted(settings) and len(set(paths)) == len(paths)
    choices = {"--rerank": "ames", "--device": "auto", "--shard-transport": "ray"}
    for flag in SERVE_FLAGS:
        setting, hint = setting_field(flag.path)
        if hint is bool:
            words, value = ([f"--no-{flag.option[2:]}"], False) if setting.default else ([flag.option], True)
        else:
            words, value = _sample(hint)
            if flag.option in choices:
                words, value = [choices[flag.option]], choices[flag.option]
            words = [flag.option, *words]
        spec = _spec("--index", "i", *words) if flag.option != "--index" else _spec(*words)
        section, _, name = flag.path.rpartition(".")
        assert getattr(getattr(spec, section) if section else spec, name) == value, flag.option


def test_rerank_options_default_to_the_stage_configs():
    """The options' defaults are the stage configs' own (declared twice: this keeps them equal)."""
    from rerank.ensemble import EnsembleConfig
    from rerank.glue import GlueConfig
    from rerank.matching import MatchConfig
    from rerank.rerank import RerankConfig

    assert RerankOptions().to_config() is None
    for method, ames in (("sp", None), ("chamfer", None), ("ames", "ames.pt")):
        assert RerankOptions(method=method, ames=ames).to_config() == RerankConfig(method=method, ames=ames)
    assert (RerankConfig().ensemble, RerankConfig().match, RerankConfig().glue) == (
        EnsembleConfig(),
        MatchConfig(),
        GlueConfig(),
    )
    assert {f.option for f in RERANK_FLAGS} <= {f.option for f in SERVE_FLAGS}


def test_help_lists_the_everyday_flags_first(capsys):
    assert main(["serve", "--help"]) == 0
    text = capsys.readouterr().out
    options = text[text.index("\noptions:") :]
    first_group = options[: options.index("\n\n", 1)]
    for flag in ("--index", "--host", "--port", "--rerank", "--config", "--print-config"):
        assert f"  {flag} " in first_group, flag
    assert "--max-queries" not in first_group and "--shard-replicas" not in first_group
    for title in ("listening", "shards in Ray actors", "limits of one request", "limits of the connections"):
        assert f"\n{title}" in options


def test_print_config_imports_no_torch(tmp_path):
    code = (
        "import sys\nfrom cli.main import main\n"
        "code = main(['serve', '--index', 'i', '--rerank', 'sp', '--print-config'])\n"
        "sys.exit(code or (3 if 'torch' in sys.modules else 0))"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    assert 'method = "sp"' in result.stdout


def test_the_docs_example_is_a_spec():
    import re

    text = (ROOT / "docs" / "serving.md").read_text()
    (example,) = re.findall(r"^```toml\n(.*?)^```", text, re.M | re.S)
    spec = spec_from_toml(example, "docs/serving.md")
    assert spec.index == "idx/" and spec.listen.allow_hosts == ("search.example.org",)
    assert spec.rerank.method == "sp" and spec.connection.max_inflight == 8
