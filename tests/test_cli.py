import argparse
import json
import os
import shutil
import subprocess
import sys

import pytest

from cflow.cli import cflowc_main


def run(argv, capsys):
    code = cflowc_main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_analysis_table_and_json(capsys):
    code, out, _ = run(["preset:arch1@114m", "--emit", "analysis"], capsys)
    assert code == 0 and out.rstrip().splitlines()[-1] == "critical-path reduction: 1.00x"
    code, out, _ = run(["preset:arch2_4_combined@114m", "--emit", "analysis", "--json"], capsys)
    assert code == 0 and json.loads(out)["reduction"] > 1


def test_emit_ir_to_file(tmp_path, capsys):
    p = tmp_path / "a.ir"
    assert run(["preset:arch3@tiny", "--emit", "ir", "-o", str(p)], capsys)[0] == 0
    assert p.read_text().startswith("graph arch3(")


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["preset:arch9", "--emit", "ir"], "unknown preset 'arch9'"),
        (["preset:arch1@huge", "--emit", "ir"], "unknown size 'huge'"),
        (["preset:arch1@tiny", "--emit", "ir", "--delays", "0,9"], "0..3"),
        (["/no/such/model", "--emit", "ir"], "no such file"),
    ],
)
def test_bad_input_is_one_line_and_nonzero(argv, needle, capsys):
    code, _, err = run(argv, capsys)
    assert code != 0 and needle in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_debug_shows_traceback():
    r = subprocess.run([sys.executable, "-m", "cflow.cli", "preset:arch9", "--emit", "ir", "--debug"],
                       capture_output=True, text=True, check=False)
    assert r.returncode != 0 and "Traceback" in r.stderr


def test_delay_rewrite_warns_on_one_line():
    r = subprocess.run([sys.executable, "-m", "cflow.cli", "preset:arch1@tiny", "--emit", "ir", "--delays", "1,2"],
                       capture_output=True, text=True, check=False)
    assert r.returncode == 0 and "warning:" in r.stderr and "changes the model's function" in r.stderr
    assert "Traceback" not in r.stderr


# --- the command-line layout: --version, --help and help text for every option -----------------
def _parsers():
    """(name, parser) for cflowc, cflow and every `cflow` sub-command."""
    from cflow.cli import cflow_parser, cflowc_parser

    top = cflow_parser()
    out = [("cflowc", cflowc_parser()), ("cflow", top)]
    for action in top._actions:
        if isinstance(action, argparse._SubParsersAction):
            out += sorted(action.choices.items())
    return out


@pytest.mark.parametrize("main", ["cflow_main", "cflowc_main"])
def test_version(main, capsys):
    import cflow
    import cflow.cli

    with pytest.raises(SystemExit) as e:
        getattr(cflow.cli, main)(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"cflow {cflow.__version__}"


def test_version_console_scripts():
    import cflow

    for script in ("cflow", "cflowc"):
        exe = shutil.which(script, path=os.path.dirname(sys.executable)) or shutil.which(script)
        if exe is None:
            pytest.skip(f"{script} is not installed as a console script")
        r = subprocess.run([exe, "--version"], capture_output=True, text=True, check=False)
        assert r.returncode == 0 and r.stdout.strip() == f"cflow {cflow.__version__}", r.stderr


def test_every_command_is_listed():
    from cflow.cli import COMMANDS

    names = [name for name, _ in _parsers()[2:]]
    assert names == sorted(COMMANDS)
    assert set(COMMANDS) == {"bench", "demo", "export-onnx", "inspect", "perplexity", "run", "serve", "train", "tune"}


@pytest.mark.parametrize("argv", [["--help"]] + [[c, "--help"] for c in ("bench", "demo", "export-onnx", "inspect",
                                                                         "perplexity", "run", "serve", "train")])
def test_cflow_help_exits_0(argv, capsys):
    from cflow.cli import cflow_main

    with pytest.raises(SystemExit) as e:
        cflow_main(argv)
    assert e.value.code == 0 and capsys.readouterr().out.startswith("usage: cflow")


def test_cflowc_help_exits_0(capsys):
    with pytest.raises(SystemExit) as e:
        cflowc_main(["--help"])
    assert e.value.code == 0 and capsys.readouterr().out.startswith("usage: cflowc")


@pytest.mark.parametrize("name, parser", _parsers(), ids=[n for n, _ in _parsers()])
def test_every_option_has_help_and_states_its_default(name, parser):
    for a in parser._actions:
        if isinstance(a, (argparse._HelpAction, argparse._VersionAction, argparse._SubParsersAction)):
            continue
        assert a.help and a.help.strip() and a.help is not argparse.SUPPRESS, f"{name} {a.dest}: no help"
        takes_value = a.option_strings and a.nargs != 0 and not a.required
        if takes_value:  # an optional option with a value: its help says what happens without it
            assert "default" in a.help, f"{name} {a.option_strings[0]}: help does not state the default"
        if a.default not in (None, False, argparse.SUPPRESS) and not isinstance(a.default, tuple):
            assert str(a.default) in a.help, f"{name} {a.dest}: help does not show the default {a.default!r}"
    printed = parser.format_help()
    assert "(default: None)" not in printed and "(default: False)" not in printed


def test_train_defaults_match_train_config():
    from cflow.cli.train import DEFAULTS
    from cflow.models.train import TrainConfig

    d = TrainConfig()
    assert DEFAULTS == {k: getattr(d, k) for k in DEFAULTS}


def test_help_imports_nothing_heavy():
    code = ("import sys\nfrom cflow.cli import cflow_parser, cflowc_parser\ncflow_parser(); cflowc_parser()\n"
            "print(sorted(m for m in ('torch', 'numpy', 'networkx', 'llvmlite', 'onnx', 'cflow.api', 'cflow.models')"
            " if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr
