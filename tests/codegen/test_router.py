"""ops.router: the gate's logits, softmax and top-k, against NumPy, for input widths that exercise every part of
its loop (whole groups of four 16-lane chains, left-over vectors, a scalar tail), with and without renormalising
the top-k weights."""

import numpy as np
import pytest

from benchmarks import router  # the router JIT-compiled alone


@pytest.mark.parametrize("d", [8, 40, 100, 1024, 2048])
@pytest.mark.parametrize("normalize", [False, True])
def test_router_matches_numpy(d, normalize):
    E, k = 8, 2
    f = router.router_fn(d, E, k, normalize)
    rng = np.random.default_rng(d)
    for _ in range(20):
        x = (rng.standard_normal(d) / np.sqrt(d)).astype(np.float32)
        w = rng.standard_normal((E, d)).astype(np.float32)
        probs = np.zeros(E, np.float32)
        route = np.zeros(4 * 2 * k, np.uint8)
        f(x.ctypes.data, w.ctypes.data, probs.ctypes.data, route.ctypes.data)
        logits = w.astype(np.float64) @ x.astype(np.float64)
        p = np.exp(logits - logits.max())
        p /= p.sum()
        np.testing.assert_allclose(probs, p, rtol=1e-5, atol=1e-7)
        top = np.argsort(-p, kind="stable")[:k]
        assert list(route.view(np.int32)[:k]) == list(top)
        want = p[top] / (p[top].sum() if normalize else 1.0)
        np.testing.assert_allclose(route.view(np.float32)[k : 2 * k], want, rtol=1e-5)


def test_router_benchmark_runs(capsys):
    assert router.main(["--d", "64", "--calls", "10"]) > 0
    assert "us per call" in capsys.readouterr().out
