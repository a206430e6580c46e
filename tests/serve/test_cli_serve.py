"""`cflow serve`: the command end to end in a subprocess, the non-loopback warning, bad options."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from cflow.cli.serve import is_loopback


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_command_answers_and_stops_on_ctrl_c(tiny_path):
    port = _free_port()
    p = subprocess.Popen([sys.executable, "-c", "from cflow.cli import cflow_main; raise SystemExit(cflow_main())",
                          "serve", tiny_path, "--port", str(port), "--threads", "1", "--model-name", "tiny",
                          "--log-level", "warning"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            assert p.poll() is None, p.communicate()[1]
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as r:
                    assert json.loads(r.read())["model"] == "tiny"
                    break
            except OSError:
                assert time.monotonic() < deadline, "cflow serve did not come up"
                time.sleep(0.1)
        req = urllib.request.Request(url + "/v1/completions", data=json.dumps(
            {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 4, "temperature": 0}).encode(),
            headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as r:
            body = json.loads(r.read())
        assert body["usage"]["completion_tokens"] == 4 and len(body["choices"][0]["text"].split()) == 4
    finally:
        p.send_signal(signal.SIGINT)
        try:
            out, err = p.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate()
    assert p.returncode == 0, err
    assert f"on http://127.0.0.1:{port}/v1" in err and "warning" not in err


class _FakeServer:
    """Stands in for uvicorn.Server: nothing listens (the tests bind no address but loopback)."""

    def __init__(self, config):
        self.config, self.started = config, False

    def run(self):
        self.started = True
        self.config.app.state.engine.close()


@pytest.mark.parametrize("key", [None, "k"])
def test_non_loopback_bind_warns_without_api_key(tiny_path, monkeypatch, capsys, key):
    import uvicorn

    from cflow.cli import cflow_main

    monkeypatch.setattr(uvicorn, "Server", _FakeServer)
    monkeypatch.delenv("CFLOW_API_KEY", raising=False)
    argv = ["serve", tiny_path, "--host", "0.0.0.0", "--threads", "1"] + (["--api-key", key] if key else [])
    assert cflow_main(argv) == 0
    err = capsys.readouterr().err
    assert ("warning: listening on 0.0.0.0 without --api-key" in err) == (key is None)
    assert "API key required" in err if key else "API key required" not in err


@pytest.mark.parametrize("argv, says", [([], "prefix cache "), (["--cache-mb", "3"], "prefix cache 3 MB"),
                                         (["--cache-mb", "0"], "no prefix cache")])
def test_cache_mb(tiny_path, monkeypatch, capsys, argv, says):
    import uvicorn

    from cflow.cli import cflow_main

    monkeypatch.setattr(uvicorn, "Server", _FakeServer)
    assert cflow_main(["serve", tiny_path, "--threads", "1", "--max-batch", "2"] + argv) == 0
    assert says in capsys.readouterr().err


def test_loopback_addresses():
    assert all(is_loopback(h) for h in ("127.0.0.1", "127.3.2.1", "::1", "[::1]", "localhost"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "::", "10.1.2.3", "example.org"))


@pytest.mark.parametrize("argv, needle", [
    (["--max-batch", "0"], "--max-batch"),
    (["--max-queue", "-1"], "--max-queue"),
    (["--port", "70000"], "--port"),
    (["--threads", "0"], "--threads"),
    (["--cache-mb", "-1"], "--cache-mb"),
    (["--cache-mb", "nan"], "--cache-mb"),
    (["--cache-mb", "1e12"], "--cache-mb"),  # more than the memory there is
    (["--cache-mb", "4", "--experts-on-disk", "--max-batch", "2"], "--cache-mb"),
])
def test_bad_options_are_one_line(tiny_path, capsys, argv, needle):
    from cflow.cli import cflow_main

    assert cflow_main(["serve", tiny_path] + argv) == 1
    err = capsys.readouterr().err
    assert needle in err and len(err.strip().splitlines()) == 1


def test_busy_port_is_one_line_before_the_model_loads(tiny_path, capsys, monkeypatch):
    import socket

    from cflow.cli import cflow_main
    from cflow.serve import app

    def no_load(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(app, "build_app", no_load)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert cflow_main(["serve", tiny_path, "--port", str(port)]) == 1
    err = capsys.readouterr().err
    assert f"cannot listen on 127.0.0.1:{port}" in err and "--port" in err and len(err.strip().splitlines()) == 1


def test_missing_file(capsys):
    from cflow.cli import cflow_main

    assert cflow_main(["serve", os.devnull + ".nope.vflow"]) == 1
    assert "no such file" in capsys.readouterr().err
