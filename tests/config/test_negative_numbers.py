"""Negative numbers are option values in every notation (-1e-3, -.5, -1_000.5), as -0.001 is:
argparse before Python 3.14 took `--lr -1e-3` for two flags and said "expected one argument"
instead of checking the value. Command line, YAML config and tools/generate.py."""

import os
import subprocess
import sys

import pytest

from megalite.config.arguments import parse_args, validate_args
from megalite.inference.cli import main as generate_main
from tests.config.test_arguments import BASE, parsed, refused
from tests.training.launch import REPO, drop_flags


@pytest.mark.parametrize("value, number", [("-0.001", -0.001), ("-1e-3", -0.001), ("-1E-3", -0.001),
                                           ("-2.5e+2", -250.0), ("-.5", -0.5), ("-1_000.5", -1000.5), ("-3", -3.0)])
def test_negative_numbers_are_values(value, number):
    assert parsed(f"--lr {value}").lr == number
    assert refused(f"--lr {value}") == f"--lr must not be negative, got {number}"


def test_what_is_not_a_number_is_still_a_flag():
    assert refused("--lr -e3") == "argument --lr: expected one argument"
    assert refused("--lr --min-lr 0.1") == "argument --lr: expected one argument"


def test_yaml_negative_numbers(tmp_path):
    """PyYAML reads 1e-3 (no dot) as a string; the value is converted like the command line's."""
    config = tmp_path / "run.yaml"
    config.write_text("lr: -1e-3\nmin-lr: -1.0e-4\n")
    args = parse_args(drop_flags(BASE, "--lr") + ["--config", str(config)])
    assert (args.lr, args.min_lr) == (-0.001, -0.0001)
    with pytest.raises(ValueError, match=r"--lr must not be negative, got -0\.001"):
        validate_args(args, 1)


def test_pretrain_gpt_checks_the_value_of_a_negative_lr():
    argv = drop_flags(BASE, "--lr") + ["--lr", "-1e-3"]
    proc = subprocess.run([sys.executable, "-m", "megalite.pretrain_gpt", *argv], capture_output=True, text=True,
                          cwd=REPO, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == ["pretrain_gpt: error: --lr must not be negative, got -0.001"]


def test_generate_checks_the_value_of_a_negative_temperature(tmp_path, capsys):
    assert generate_main(["--load", str(tmp_path), "--prompt", "x", "--temperature", "-1e-3"]) == 2
    assert capsys.readouterr().err.splitlines() == ["generate: error: --temperature must be >= 0, got -0.001"]


@pytest.mark.parametrize("flag", ["--gpu-memory-gib", "--peak-tflops", "--intra-node-gbps", "--memory-fraction"])
def test_plan_checks_the_value_of_a_negative_number(flag, capsys):
    from megalite.planner.cli import main as plan_main

    with pytest.raises(SystemExit) as stopped:
        plan_main([flag, "-1e-3", "--", "--num-layers", "2"])
    assert stopped.value.code == 2
    assert capsys.readouterr().err.splitlines() == [f"plan.py: error: argument {flag}: {flag} must be > 0"
                                                    + (" and <= 1" if flag == "--memory-fraction" else "")
                                                    + ", got -1e-3"]
