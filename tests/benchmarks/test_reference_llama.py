"""benchmarks/reference_llama.py: a few steps make a checkpoint directory and an f32 GGUF that cflow reads as the
same model (the float source of benchmarks/quantization.py), and the held-out excerpt stays out of training."""

from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("transformers")
pytest.importorskip("gguf")


def test_two_steps_make_a_checkpoint_and_its_gguf(tmp_path):
    import torch
    from transformers import LlamaForCausalLM

    from benchmarks import reference_llama as R
    from cflow.frontend.load import load_graph
    from cflow.ir import Interpreter

    out = tmp_path / "ref"
    p = Path(R.DEFAULT_DATA)
    info = R.train(out, str(p if p.exists() else R.EXCERPT), steps=2, threads=1)
    assert info["steps"] == 2 and np.isfinite(info["val_loss"])
    gguf_path = R.export_f32_gguf(out)
    ids = np.array([5, 17, 300, 42, 7, 1999], np.int64)
    with torch.no_grad():
        ref = LlamaForCausalLM.from_pretrained(out).float()(input_ids=torch.from_numpy(ids[None])).logits[0].numpy()
    for src in (out, gguf_path):
        got = Interpreter(load_graph(str(src)), max_seq_len=16).prefill(ids)
        assert np.abs(got - ref).max() <= 1e-3 * np.abs(ref).max(), src
    if p.exists():
        assert R.EXCERPT.read_text(encoding="utf-8")[:200] not in R.training_text(str(p))
