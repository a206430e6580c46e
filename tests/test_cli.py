import json
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
    code, out, err = run(argv, capsys)
    assert code != 0 and needle in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_debug_shows_traceback():
    r = subprocess.run([sys.executable, "-m", "cflow.cli", "preset:arch9", "--emit", "ir", "--debug"],
                       capture_output=True, text=True)
    assert r.returncode != 0 and "Traceback" in r.stderr


def test_delay_rewrite_warns_on_one_line():
    r = subprocess.run([sys.executable, "-m", "cflow.cli", "preset:arch1@tiny", "--emit", "ir", "--delays", "1,2"],
                       capture_output=True, text=True)
    assert r.returncode == 0 and "warning:" in r.stderr and "changes the model's function" in r.stderr
    assert "Traceback" not in r.stderr
