"""examples/ray_serve.py: two replicas of the cflow engine behind Ray Serve on 127.0.0.1, both answer."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("ray.serve")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "ray_serve.py"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url):
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.headers.get("x-cflow-instance"), json.loads(r.read())


def _complete(url):
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(
        {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 4, "temperature": 0}).encode(),
        headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return r.headers.get("x-cflow-instance"), json.loads(r.read())


def test_two_replicas_both_answer(tiny_path, tmp_path):
    port = _free_port()
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    log = open(tmp_path / "ray_serve.log", "w+")
    p = subprocess.Popen([sys.executable, str(EXAMPLE), tiny_path, "--replicas", "2", "--threads", "1",
                          "--port", str(port), "--model-name", "tiny"], stdout=log, stderr=subprocess.STDOUT,
                         env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 150
        while "ready:" not in (tmp_path / "ray_serve.log").read_text():
            assert p.poll() is None, (tmp_path / "ray_serve.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "Ray Serve did not come up"
            time.sleep(0.5)
        seen, answers = set(), {}
        for _ in range(40):  # Ray routes each request to one of the two: both show up within a few
            inst, body = _complete(url)
            seen.add(inst)
            answers.setdefault(inst, body["choices"][0]["text"])
            if len(seen) == 2:
                break
        assert len(seen) == 2 and None not in seen, seen
        cpus = {inst.rsplit("@cpu", 1)[1] for inst in seen}
        assert len(cpus) == min(2, len(os.sched_getaffinity(0)))  # pinned to different cores
        assert len(set(answers.values())) == 1  # the same model, greedy: the same answer from both
        inst, health = _get(url + "/health")
        assert health["status"] == "ok" and health["instance"] == inst
    finally:
        p.send_signal(signal.SIGINT)  # the example itself shuts Serve and Ray down
        try:
            p.wait(90)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)  # our own process group: the example and what it started
            p.wait(10)
        log.close()
    assert p.returncode == 0, (tmp_path / "ray_serve.log").read_text()[-3000:]
