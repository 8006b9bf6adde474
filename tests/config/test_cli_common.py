"""jaxrl.cli_common: the exit-status table and command-line steps that jaxrl.train, jaxrl.sft and jaxrl.dpo share (the
commands themselves are run for real in tests/config/test_cli.py, tests/config/test_offline_config.py and
tests/faults/test_bad_inputs.py)."""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import pytest

from jaxrl.cli_common import (ExitRule, check_run_folder, exit_status, load_and_announce, parse_command_line,
                              run_errors)
from jaxrl.config import ConfigError


def _raise(e: BaseException):
    def run():
        raise e
    return run


def test_the_first_matching_rule_gives_the_status_line_and_extra_text(capsys):
    rules = [ExitRule((KeyError,), 2), ExitRule((ValueError,), 1, "config error", more=lambda e: f"more on {e}"),
             ExitRule((ValueError,), 3)]
    assert exit_status(_raise(ValueError("bad value")), rules) == 1
    err = capsys.readouterr().err
    assert err == "jaxrl: config error: bad value\nmore on bad value\n"
    assert exit_status(lambda: None, rules) == 0
    assert capsys.readouterr().err == ""


def test_an_error_no_rule_names_propagates():
    with pytest.raises(ZeroDivisionError):
        exit_status(lambda: 1 / 0, [ExitRule((ValueError,), 1)])


def test_the_shared_run_errors_map_lock_and_config_to_2_and_files_to_1(capsys):
    from jaxrl.data.sources import DataFileError
    from jaxrl.runlock import RunLockError

    rules = run_errors()
    assert exit_status(_raise(RunLockError("held by pid 7", path=None, holder={})), rules) == 2
    assert exit_status(_raise(ConfigError("mesh 3 > 2 devices")), rules) == 2
    assert exit_status(_raise(DataFileError("x.jsonl line 3: not JSON")), rules) == 1
    assert exit_status(_raise(FileNotFoundError("no such model")), rules) == 1
    assert capsys.readouterr().err.splitlines() == [
        "jaxrl: error: held by pid 7", "jaxrl: config error: mesh 3 > 2 devices",
        "jaxrl: error: x.jsonl line 3: not JSON", "jaxrl: error: no such model"]


def test_parse_command_line_refuses_an_unknown_flag_and_keeps_overrides(capsys):
    parser = argparse.ArgumentParser(prog="python -m jaxrl.train")
    parser.add_argument("--config")
    args, overrides = parse_command_line(parser, ["--config", "c.yaml", "data.train_batch_size=4"])
    assert args.config == "c.yaml" and overrides == ["data.train_batch_size=4"]
    assert parse_command_line(parser, ["--confg", "c.yaml"]) == 2
    assert "jaxrl: error: unrecognized arguments: --confg" in capsys.readouterr().err


def test_load_and_announce_prints_notes_config_errors_and_the_config(capsys):
    def bad():
        raise ConfigError("unknown key 'data.trian_files'")

    assert load_and_announce(bad, False) == 2
    assert capsys.readouterr().err == "jaxrl: config error: unknown key 'data.trian_files'\n"
    loaded = SimpleNamespace(config=SimpleNamespace(), notes=["verl key x has no JAX meaning"])
    assert load_and_announce(lambda: loaded, False) is loaded
    assert capsys.readouterr().err == "jaxrl: note: verl key x has no JAX meaning\n"


def test_check_run_folder_refuses_a_folder_under_a_file(tmp_path, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    cfg = SimpleNamespace(trainer=SimpleNamespace(default_local_dir=str(blocker / "run")))
    assert check_run_folder(cfg) == 1
    assert "trainer.default_local_dir" in capsys.readouterr().err
    cfg.trainer.default_local_dir = str(tmp_path / "run")
    assert check_run_folder(cfg) is None
