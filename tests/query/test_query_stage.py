"""query/stage.py: ``needle query`` as a stage, ``main(conf, index, inputs, output)``; the command
prints the same answer without --out."""

import json

import numpy as np
import pytest

from tests.support.indexes import QUERY_FLAT


@pytest.fixture(scope="module")
def index_dir(synthetic_indexes):
    return synthetic_indexes.get(QUERY_FLAT)[0]


def test_main_writes_the_answer_and_its_info(index_dir, tmp_path):
    from index.search import load_index
    from query.retrieve import QueryConfig
    from query.stage import QueryInputs, answer, info_path, main

    index = load_index(index_dir)
    np.save(tmp_path / "q.npy", np.asarray(index.vectors[[3]], np.float32))
    inputs = QueryInputs(keys=("000001/00007",), vectors=str(tmp_path / "q.npy"))
    out = main(QueryConfig(k=4), index_dir, inputs, tmp_path / "answers.json")
    assert out == tmp_path / "answers.json"
    written = json.loads(out.read_text())
    assert written == json.loads(json.dumps(answer(QueryConfig(k=4), index, inputs)))
    assert [q["results"][0]["key"] for q in written] == ["000001/00007", "000000/00003"]
    info = json.loads(info_path(out).read_text())
    assert info_path(out).name == "answers.info.json"
    assert info["config"]["k"] == 4 and info["queries"] == 2 and info["index"] == str(index_dir)
    assert info["inputs"]["keys"] == ["000001/00007"]


def test_needle_query_prints_without_out_and_writes_with_it(index_dir, tmp_path, capsys):
    from cli.main import main

    argv = ["query", "--index", str(index_dir), "--key", "000000/00005", "--k", "3"]
    assert main(argv) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["results"][0]["key"] == "000000/00005" and len(printed["results"]) == 3
    assert main([*argv, "--out", str(tmp_path / "r.json")]) == 0
    assert capsys.readouterr().out == ""
    assert json.loads((tmp_path / "r.json").read_text()) == printed
    assert (tmp_path / "r.info.json").is_file()
    assert main(["query", "--index", str(index_dir), "--k", "3", "--out", str(tmp_path / "none.json")]) == 2
    assert not (tmp_path / "none.json").exists()


def test_a_query_file_that_is_no_image_is_one_line_exit_2(index_dir, tmp_path, caplog):
    """Issue 57, item 5: a text file given as --image ended in a 30-line traceback (exit 1)."""
    import logging

    from cli.main import main
    from query.query_images import QueryImageError, decode_query_image

    junk = tmp_path / "notes.txt"
    junk.write_text("this is not an image\n")
    with caplog.at_level(logging.ERROR):
        assert main(["query", "--index", str(index_dir), "--image", str(junk), "--k", "3"]) == 2
    [record] = [r for r in caplog.records if r.levelno >= logging.ERROR]
    message = record.getMessage()
    assert message.startswith(f"query image {junk}: not an image of JPEG") and "\n" not in message, message
    with pytest.raises(QueryImageError, match=r"notes\.txt: not an image"):
        decode_query_image(junk, 64)  # where the model's side decodes it (the check above runs first)
    with pytest.raises(QueryImageError, match=r"cannot read query image .*missing\.jpg"):
        decode_query_image(tmp_path / "missing.jpg", 64)
