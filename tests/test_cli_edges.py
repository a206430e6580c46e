"""The command line as a new user meets it (issue 14): every item that once failed, each checked here.

Every option is validated before any work; every error is one line `error: ...` naming the option or field,
exit 1, nothing half-done on stdout; exit 2 only for real bugs."""

import re
import shlex
from pathlib import Path

import numpy as np
import pytest

import cflow
from cflow.cli import cflow_main, cflowc_main
from cflow.errors import CflowError

README = Path(__file__).resolve().parent.parent / "README.md"
UNWRITABLE = "/sys"  # sysfs refuses new files, even to root


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """arch1@tiny at q4: no tokenizer, a context of 128 tokens."""
    path = tmp_path_factory.mktemp("cli") / "tiny.vflow"
    assert cflowc_main(["preset:arch1@tiny", "-o", str(path)]) == 0
    return path


def run(main, argv, capsys):
    code = main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def one_line_error(code, err, *needles):
    assert code == 1, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    for n in needles:
        assert n in err, err


def test_readme_using_it_runs(tmp_path, capsys, monkeypatch):
    """The README's "Using it" lines, as written (the preset at its tiny size, fewer tokens)."""
    from cflow.models.bundled import default_model_dir

    monkeypatch.chdir(tmp_path)
    block = README.read_text().split("## Using it", 1)[1].split("```sh", 1)[1].split("```", 1)[0]
    lines = [ln.split("  #")[0].strip() for ln in block.strip().splitlines()]
    ran = 0
    for line in lines:
        argv = shlex.split(line.replace("@114m", "@tiny").replace("-n 128", "-n 16").replace("DIR",
                                                                                           str(default_model_dir())))
        if argv[:2] == ["cflow", "tune"]:  # the shortest search (its own tests cover the full one)
            argv += ["--mb", "1", "--rounds", "1", "--passes", "1", "--budget", "1"]
            from cflow.codegen import tune
            from tests.codegen.test_tune import small_space

            monkeypatch.setattr(tune, "space", small_space)
        if argv[:2] in (["cflow", "bench"], ["cflow", "serve"]):
            continue  # bench and serve have their own tests (serve never returns)
        main = cflowc_main if argv[0] == "cflowc" else cflow_main
        code, out, err = run(main, argv[1:], capsys)
        assert code == 0, f"{line}: {err}"
        if argv[:2] == ["cflow", "tune"]:  # its columns explained above the tables
            assert "  pass     which step" in out and "  GB/s     packed weights" in out and "<- chosen  the" in out
        ran += 1
    assert ran == 9


def test_preset_prompt_text_explains(tiny, capsys):
    code, out, err = run(cflow_main, ["run", tiny, "--prompt", "Once upon a time", "--threads", 1], capsys)
    one_line_error(code, err, "no tokenizer", "presets", "--prompt '1 2 3'")
    assert out == ""


# --- what FILE may be: a compiled file, or a directory holding exactly one ---------------------------------
def test_run_takes_a_directory_holding_one_compiled_file(tiny, tmp_path, capsys):
    d = tmp_path / "out"
    d.mkdir()
    (d / "tiny.vflow").symlink_to(tiny)
    (d / "notes.txt").write_text("not a model")
    code, out, err = run(cflow_main, ["run", d, "--prompt", "1 2 3", "-n", 2, "--threads", 1], capsys)
    assert code == 0, err
    assert out.split()[:3] == ["1", "2", "3"] and len(out.split()) == 5


@pytest.mark.parametrize("content, needles", [
    ({}, ["a directory without a compiled model", ".vflow or .cflow"]),
    ({"a.vflow": None, "b.cflow": None}, ["2 compiled models", "a.vflow, b.cflow", "give one of them"]),
    ({"config.json": "{}"}, ["a model directory", "cflowc"]),
])
@pytest.mark.parametrize("command", ["run", "bench", "tune"])
def test_a_directory_without_one_compiled_file_says_what_it_needs(tiny, tmp_path, capsys, content, needles,
                                                                   command):
    for name, text in content.items():
        if text is None:
            (tmp_path / name).symlink_to(tiny)
        else:
            (tmp_path / name).write_text(text)
    code, out, err = run(cflow_main, [command, tmp_path], capsys)
    one_line_error(code, err, str(tmp_path), *needles)
    assert out == ""


# --- the prompt from standard input --------------------------------------------------------------------------
def test_prompt_file_dash_reads_standard_input(tiny, capsys, monkeypatch):
    import io

    monkeypatch.setattr("sys.stdin", io.StringIO("4 5 6\n"))
    code, out, err = run(cflow_main, ["run", tiny, "-f", "-", "-n", 2, "--threads", 1], capsys)
    assert code == 0, err
    assert out.split()[:3] == ["4", "5", "6"] and len(out.split()) == 5
    code, out, err = run(cflow_main, ["run", tiny, "-f", "-", "--chat"], capsys)
    one_line_error(code, err, "-f -", "--chat", "standard input")


# --- output paths: checked (directories created) before any work -----------------------------------------
def test_output_directories_are_created(tmp_path, capsys):
    out = tmp_path / "nodir" / "sub" / "x.vflow"
    assert run(cflowc_main, ["preset:arch1@tiny", "-o", out], capsys)[0] == 0 and out.is_file()
    ir = tmp_path / "a" / "b.ir"
    assert run(cflowc_main, ["preset:arch1@tiny", "--emit", "ir", "-o", ir], capsys)[0] == 0 and ir.is_file()


@pytest.mark.parametrize("target, needle", [("dir", "is a directory"), ("unwritable", "permission denied"),
                                            ("file-parent", "is not a directory")])
def test_bad_output_paths(tmp_path, capsys, target, needle):
    if target == "dir":
        out = tmp_path / "d.vflow"
        out.mkdir()
    elif target == "file-parent":
        (tmp_path / "f").write_text("x")
        out = tmp_path / "f" / "x.vflow"
    else:
        out = f"{UNWRITABLE}/x.vflow"
    code, _, err = run(cflowc_main, ["preset:arch1@tiny", "-o", out], capsys)
    one_line_error(code, err, "-o", needle)


def test_bench_json_and_inspect_plot_checked_first(tiny, tmp_path, capsys):
    code, out, err = run(cflow_main, ["bench", tiny, "--json", f"{UNWRITABLE}/b.json"], capsys)
    one_line_error(code, err, "--json")
    assert out == ""  # refused before loading or measuring anything
    code, out, err = run(cflow_main, ["inspect", tiny, "--plot", f"{UNWRITABLE}/p.png"], capsys)
    one_line_error(code, err, "--plot")
    assert out == ""
    png = tmp_path / "new" / "p.png"
    assert run(cflow_main, ["inspect", tiny, "--no-verify", "--plot", png], capsys)[0] == 0 and png.is_file()


# --- numbers in range, before any work -------------------------------------------------------------------
@pytest.mark.parametrize("argv, needle", [
    (["bench", "{f}", "--threads", "0"], "--threads"),
    (["bench", "{f}", "--threads", "1,x"], "--threads"),
    (["bench", "{f}", "--tokens", "0"], "--tokens"),
    (["bench", "{f}", "--reps", "-1"], "--reps"),
    (["run", "{f}", "-n", "-1"], "--max-new-tokens"),
    (["run", "{f}", "-n", "0"], "--max-new-tokens"),
    (["run", "{f}", "--temperature", "-1"], "--temperature"),
    (["run", "{f}", "--temperature", "nan"], "--temperature"),
    (["run", "{f}", "--top-p", "0"], "--top-p"),
    (["run", "{f}", "--top-p", "1.5"], "--top-p"),
    (["run", "{f}", "--top-k", "-2"], "--top-k"),
    (["run", "{f}", "--seed", "-1"], "--seed"),
    (["run", "{f}", "--threads", "0"], "--threads"),
    (["run", "{f}", "--max-seq", "0"], "--max-seq"),
    (["run", "{f}", "--expert-cache-mb", "0", "--experts-on-disk"], "--expert-cache-mb"),
    (["run", "{f}", "--read-ahead", "-1", "--weights-on-disk"], "--read-ahead"),
    (["run", "{f}", "--max-ram", "0"], "--max-ram"),
    (["run", "{f}", "--max-ram", "8X"], "--max-ram"),
    (["run", "{f}", "--no-such-option"], "unrecognized arguments"),
    (["demo", "-n", "0"], "--max-new-tokens"),
    (["train", "arch1", "--data", "x", "--lr", "0"], "--lr"),
    (["train", "arch1", "--data", "x", "--steps", "0"], "--steps"),
    (["export-onnx", "preset:arch1@tiny", "-o", "x.onnx", "--seed", "-1"], "--seed"),
])
def test_options_out_of_range_are_one_line(tiny, capsys, argv, needle):
    with pytest.raises(SystemExit) as e:
        cflow_main([a.format(f=tiny) for a in argv])
    err = capsys.readouterr().err
    assert e.value.code == 1
    one_line_error(1, err, needle)


@pytest.mark.parametrize("argv, needle", [
    (["run", "{f}", "--max-ram", "1G", "--expert-cache-mb", "4"], "--max-ram"),
    (["run", "{f}", "--no-expert-guess"], "--no-expert-guess"),
    (["serve", "{f}", "--max-ram", "1G", "--max-batch", "2"], "--max-ram"),
])
def test_option_combinations_are_one_line(tiny, capsys, argv, needle):
    code, _, err = run(cflow_main, [a.format(f=tiny) for a in argv], capsys)
    one_line_error(code, err, needle)


@pytest.mark.parametrize("argv, needle", [
    (["preset:arch1@tiny", "--tile", "100x7", "--emit", "ir"], "--tile"),
    (["preset:arch1@tiny", "--tile", "1024x32", "--emit", "ir"], "--tile"),
    (["preset:arch1@tiny", "--tile", "big", "--emit", "ir"], "--tile"),
    (["preset:arch1@tiny", "--quant", "q2"], "--quant"),
    (["preset:arch1@tiny", "--delays", "1"], "--delays"),
])
def test_cflowc_options_out_of_range_are_one_line(capsys, argv, needle):
    with pytest.raises(SystemExit) as e:
        cflowc_main(argv)
    assert e.value.code == 1
    one_line_error(1, capsys.readouterr().err, needle)


def test_tokenizer_checked_at_compile_time(tmp_path, capsys):
    bad = tmp_path / "notatokenizer.txt"
    bad.write_text("hello\n")
    out = tmp_path / "m.vflow"
    code, _, err = run(cflowc_main, ["preset:arch1@tiny", "-o", out, "--tokenizer", bad], capsys)
    one_line_error(code, err, "--tokenizer", "not a valid tokenizer.json")
    assert not out.exists()


def test_inspect_checks_the_stored_tokenizer(tiny, tmp_path, capsys):
    import json

    from tests.runtime import Container

    c = Container(tiny.read_bytes())
    h = json.loads(c.header)
    h["tokenizer"] = "not a tokenizer"
    c.header = json.dumps(h).encode()
    path = tmp_path / "badtok.vflow"
    path.write_bytes(c.tobytes())
    code, out, err = run(cflow_main, ["inspect", path], capsys)
    one_line_error(code, err, "tokenizer")
    assert "model: FAILED" in out and "checksums: ok" in out
    code, out, err = run(cflow_main, ["inspect", tiny, "--no-verify"], capsys)
    assert code == 0 and "model: ok" in out


# --- the context, and nothing printed before the checks ------------------------------------------------------
def test_more_tokens_than_the_context_is_an_error(tiny, capsys):
    code, out, err = run(cflow_main, ["run", tiny, "--prompt", "1 2 3", "-n", "400", "--threads", 1], capsys)
    one_line_error(code, err, "-n 400", "at most 126 new tokens fit")
    assert out == ""
    code, out, err = run(cflow_main, ["run", tiny, "--prompt", "1 2 3", "-n", "126", "--threads", 1], capsys)
    assert code == 0 and len(out.split()) == 3 + 126, err
    code, out, err = run(cflow_main, ["run", tiny, "--prompt", "1 2 3", "--threads", 1], capsys)  # default -n fits
    assert code == 0 and len(out.split()) == 3 + 126, err


def test_long_prompt_and_bad_sampling_print_nothing(tiny, capsys):
    long = " ".join(["7"] * 3000)
    code, out, err = run(cflow_main, ["run", tiny, "--prompt", long, "--threads", 1], capsys)
    one_line_error(code, err, "3000 tokens", "context is 128")
    assert out == ""
    code, out, err = run(cflow_main, ["run", tiny, "--prompt", "1 2 999", "--threads", 1], capsys)
    one_line_error(code, err, "token id 999")
    assert out == ""


def test_max_seq_is_not_silently_capped(tiny):
    with pytest.raises(CflowError, match="max_seq 1024 exceeds the model's context of 128"):
        cflow.load(tiny, max_seq=1024)
    with cflow.load(tiny, max_seq=16, threads=1) as m:
        assert m.session.max_seq == 16
        with pytest.raises(CflowError, match="at most 14 new tokens fit"):
            m.generate([1, 2, 3], max_new_tokens=15)
        assert len(m.generate([1, 2, 3], max_new_tokens=14, stop=False)) == 14


@pytest.mark.parametrize("kw, needle", [
    (dict(max_new_tokens=-1), "max_new_tokens"), (dict(max_new_tokens=2.5), "max_new_tokens"),
    (dict(temperature=-1), "temperature"), (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=0), "top_p"), (dict(top_k=-1), "top_k"), (dict(seed=-5), "seed"),
])
def test_api_arguments_checked_when_called(tiny, kw, needle):
    with cflow.load(tiny, threads=1) as m:
        with pytest.raises(CflowError, match=needle):
            m.stream([1, 2], **kw)  # at the call, not at the first token
        for prompt in ([1.5, 2], ["a"], [[1], [2, 3]], [300]):
            with pytest.raises(CflowError):
                m.generate(prompt, 2)


# --- the reference interpreter on a loaded file --------------------------------------------------------------
@pytest.mark.parametrize("spec, tile", [("preset:arch2_4_combined@tiny", (128, 256)), ("preset:arch5_shared@tiny",
                                                                                    (32, 64))])
def test_interpreter_runs_on_a_loaded_quantised_file(tmp_path, spec, tile):
    """`interpret(m.ir, ids, act_quant="q8")` on a loaded q4 file (fused QKV and gate+up streams unpacked
    by the weights view) agrees with the compiled step."""
    from cflow.compiler import compile_file
    from cflow.frontend.load import load_graph
    from cflow.ir.interp import Interpreter

    path = tmp_path / "m.vflow"
    compile_file(load_graph(spec), path, "q4", tile)
    with cflow.load(path, threads=1) as m:
        ids = [3, 1, 4, 1, 5, 9]
        ref = Interpreter(m.ir, act_quant="q8", kv=m.kv).run(ids)[-1]  # the model's KV cache type
        assert np.abs(ref - m.logits(ids)).max() <= 1e-2


def test_analysis_agrees_with_the_compiled_bytes_per_token(capsys):
    from cflow.models.bundled import default_model_dir

    code, out, _ = run(cflowc_main, [default_model_dir(), "--emit", "analysis"], capsys)
    assert code == 0
    seq = re.search(r"sequential bytes/token:\s+([\d,]+)", out).group(1)
    code, out, _ = run(cflowc_main, [default_model_dir(), "--emit", "schedule"], capsys)
    assert f"{seq} weight bytes/token" in out.splitlines()[0]
