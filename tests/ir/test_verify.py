import pytest

from cflow.errors import VerifyError
from cflow.ir import Add, build_graph, verify
from cflow.models import get_preset


def g():
    return build_graph(get_preset("arch2_4_combined", "tiny"))


def test_presets_verify():
    for name in ("arch1", "arch2_4_combined", "arch3", "arch4_async_experts", "arch5_shared"):
        verify(build_graph(get_preset(name, "114m")))


def test_undefined_read_names_node():
    x = g()
    x.replace(x["attn_norm.2"].with_inputs("b.9"))
    with pytest.raises(VerifyError, match=r"%attn_norm\.2.*undefined value %b\.9"):
        verify(x)


def test_cycle_is_reported():
    x = g()
    x.replace(x["attn_norm.1"].with_inputs("a.1"))
    with pytest.raises(VerifyError, match="cycle"):
        verify(x)


def test_inconsistent_dense_delay():
    x = g()
    x.replace(x["ffn_norm.3"].with_inputs("a.3"))  # dd=1 means reading a.2
    with pytest.raises(VerifyError, match=r"%ffn_norm\.3.*dense delay 1"):
        verify(x)


def test_wrong_width_and_duplicate():
    x = g()
    x.add(Add(name="bad", inputs=("a.1", "logits"), layer=1, dim=64))
    with pytest.raises(VerifyError, match="bad"):
        verify(x)
    with pytest.raises(VerifyError, match="duplicate"):
        x.add(Add(name="a.1", inputs=("x0", "x0"), layer=1, dim=64))


def test_error_prints_neighbourhood():
    x = g()
    x.replace(x["attn_norm.2"].with_inputs("nope"))
    with pytest.raises(VerifyError) as e:
        verify(x)
    assert "%attn.2 = attention" in str(e.value)
