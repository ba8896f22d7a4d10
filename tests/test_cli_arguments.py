"""Every argument of the `longft` commands is checked as it is parsed, before any work, and a bad
one is refused with its allowed range (issue 49): sizes > 0, finite numbers, lengths within the
model's positions, output paths that can be written. The mechanism (longft/argtypes.py) first, then
the cases users met in `longft placement` and `longft max-context`."""

import argparse

import pytest

from longft.argtypes import integer, number, out_dir, out_file
from longft.cli.estimate import main


@pytest.mark.parametrize("text", ["-8", "0", "nan", "inf", "-inf", "lots"])
def test_a_size_must_be_a_finite_number_above_zero(text):
    with pytest.raises(argparse.ArgumentTypeError,
                       match=f"must be a finite number > 0 \\(GiB\\), got {text}"):
        number(above=0, what="GiB")(text)
    assert number(above=0)("0.5") == 0.5


def test_bounds_are_inclusive_or_exclusive_as_said():
    top_p = number(above=0, most=1)
    assert top_p("1") == 1.0
    with pytest.raises(argparse.ArgumentTypeError, match="> 0 and <= 1"):
        top_p("1.01")
    seq = integer(least=1024, what="tokens")
    assert seq("1024") == 1024
    for bad in ("1023", "-4096", "4096.5", "x"):
        with pytest.raises(argparse.ArgumentTypeError,
                           match=f"must be a whole number >= 1024 \\(tokens\\), got {bad}"):
            seq(bad)


def test_output_paths_are_checked_before_any_work(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(argparse.ArgumentTypeError, match="is a directory; name a file"):
        out_file(str(tmp_path))
    with pytest.raises(argparse.ArgumentTypeError, match="file is a file, not a directory"):
        out_file(str(tmp_path / "file" / "o.yaml"))
    with pytest.raises(argparse.ArgumentTypeError, match="is a file; name a folder"):
        out_dir(str(tmp_path / "file"))
    with pytest.raises(argparse.ArgumentTypeError, match="file is a file, not a directory"):
        out_dir(str(tmp_path / "file" / "work"))
    assert out_file(str(tmp_path / "new" / "o.yaml")) == tmp_path / "new" / "o.yaml"
    assert out_dir(str(tmp_path / "new")) == tmp_path / "new"


PLACE = ["--host-mem", "60", "--model", "llama3.1-8b"]


@pytest.mark.parametrize("command, args, said", [
    ("placement", ["--gpu-mem", "-8", "--seq", "4096", *PLACE],
     "argument --gpu-mem: must be a finite number > 0 (GiB of one GPU), got -8"),
    ("placement", ["--gpu-mem", "16", "--seq", "4096", "--gpus", "0", *PLACE],
     "argument --gpus: must be a whole number >= 1"),
    ("placement", ["--gpu-mem", "16", "--seq", "-1", *PLACE], "argument --seq: must be a whole"),
    ("placement", ["--gpu-mem", "16", "--seq", "4096", "--out", ".", *PLACE],
     "argument --out: . is a directory; name a file to write"),
    ("max-context", ["--gpu-mem", "16", "--max-seq", "-4096"],
     "argument --max-seq: must be a whole number >= 1024 (tokens), got -4096"),
    ("max-context", ["--gpu-mem", "nan"], "argument --gpu-mem: must be a finite number > 0"),
    ("max-context", ["--gpu-mem", "16", "--iterations", "0", "--confirm"],
     "argument --iterations: must be a whole number >= 1"),
])
def test_impossible_numbers_and_paths_are_refused_with_the_range(command, args, said, capsys,
                                                                  tmp_path):
    assert main(command, ["--params", str(tmp_path / "none.yaml"), *args]) == 2
    assert said in capsys.readouterr().err


def test_a_work_folder_that_is_a_file_is_refused(tmp_path, capsys):
    (tmp_path / "work").write_text("x")
    assert main("max-context", ["--gpu-mem", "16", "--confirm", "--work", str(tmp_path / "work")]) == 2
    assert "argument --work: " in capsys.readouterr().err


def test_a_length_past_the_models_positions_is_refused_not_written(tmp_path, capsys):
    out = tmp_path / "overlay.yaml"
    assert main("placement", ["--params", str(tmp_path / "none.yaml"), "--gpu-mem", "16",
                              "--seq", "1048576", "--out", str(out), *PLACE]) == 2
    err = capsys.readouterr().err
    assert ("--seq 1,048,576 is past the 131,072 positions model 'llama3.1-8b' covers: give --seq "
            "from 1 to 131,072, or use a model with longer positions or RoPE scaling") in err
    assert not out.exists()
