"""codegen.target: host detection and the CFLOW_CPU / CFLOW_FEATURES overrides."""

from cflow.codegen.target import ISA, generic_target, host_target


def test_host_is_consistent():
    t = host_target(env=False)
    assert t.triple and t.cpu and t.magic_tuple() == (t.triple, t.cpu, t.features)
    assert t.isa in ("avx512vnni", "avxvnni", "avx2", "generic")
    if t.has_avx512_vnni:
        assert t.has_avx512 and t.has_avx2 and t.isa == "avx512vnni"


def test_feature_edits_and_dependencies():
    t = host_target(env=False).with_features("+avx,+avx2,+fma,+f16c,+avx512f,+avx512bw,+avx512vl,+avx512vnni,"
                                             "-avxvnni")
    assert t.isa == "avx512vnni"
    assert t.with_features("-avx512vl").isa == "avx2"  # no 256-bit vpdpbusd without VL: not the VNNI kernels
    assert t.with_features("-avx512vnni").isa == "avx2"
    assert t.with_features("-avx512vnni,+avxvnni").isa == "avxvnni"
    assert t.with_features("-avx512f,+avxvnni").isa == "avxvnni"  # Alder Lake: AVX-VNNI without AVX-512
    assert t.with_features("-avx512f,+avxvnni,-fma").isa == "generic"
    assert t.with_features("-avx2").isa == "generic"  # AVX-512 builds on AVX2: it goes too
    assert not t.with_features("-avx2").has_avx512_vnni
    assert t.with_features("-avx512vnni").magic_tuple() != t.magic_tuple()


def test_env_overrides(monkeypatch):
    monkeypatch.setenv("CFLOW_FEATURES", "-avx512vnni,-avx2")
    t = host_target()
    assert not t.has("avx512vnni") and t.isa == "generic"
    assert host_target(env=False).features != t.features
    monkeypatch.setenv("CFLOW_CPU", "x86-64")
    monkeypatch.setenv("CFLOW_FEATURES", "+sse4.2")
    t = host_target()
    assert t.cpu == "x86-64" and t.features == "+sse4.2"
    monkeypatch.delenv("CFLOW_FEATURES")
    assert host_target().features == ""
    assert host_target(cpu="haswell", features="+avx2").cpu == "haswell"


def test_generic_target():
    g = generic_target()
    assert g.cpu == "generic" and g.isa == "generic"


def test_cpu_model_names_what_a_masked_model_hides(monkeypatch):
    # a hypervisor may report a family/model LLVM maps to the wrong core (the AMX Xeon VM: model 167, "rocketlake")
    from cflow.codegen import target as T

    info = {"model name": "Intel(R) Xeon(R) Processor", "cpu family": "6", "model": "167", "flags": "fpu avx2"}
    monkeypatch.setattr(T, "_cpuinfo", lambda: info)
    plain = T.cpu_model()
    assert plain.startswith("Intel(R) Xeon(R) Processor (") and "family 6 model 167" in plain and "AMX" not in plain
    info["flags"] += " amx_bf16 amx_tile amx_int8"
    assert T.cpu_model() == plain[:-1] + ", AMX)"


def test_isa_path_names_a_forced_path(monkeypatch):
    """Benchmarks record the path in use; a path forced on a host that has a better one says so."""
    from cflow.codegen.target import forced_env, host_target, isa_path

    for k in ("CFLOW_CPU", "CFLOW_FEATURES"):
        monkeypatch.delenv(k, raising=False)
    best = str(host_target().isa)
    assert isa_path() == best
    for isa in ("avx2", "generic"):
        if ISA.parse(isa).rank < ISA.parse(best).rank:
            for k, v in forced_env(isa).items():
                monkeypatch.setenv(k, v)
            assert isa_path().startswith(f"{isa} (forced: CFLOW_")



def test_forced_avx2_is_built_as_the_cpus_of_that_path():
    """Forcing AVX2 drops GFNI too (Zen 2 / 3 and Intel client cores before Alder Lake lack it): with it LLVM
    unpacks nibbles with vgf2p8affineqb, one instruction where those CPUs take two."""
    from cflow.codegen.target import FORCE_FEATURES, forced_target

    rich = host_target(env=False).with_features("+avx,+avx2,+fma,+f16c,+gfni,+avx512f,+avx512bw,+avx512vl,"
                                                "+avx512vnni,+avxvnni")
    t = rich.with_features(FORCE_FEATURES["avx2"])
    assert t.isa == "avx2" and not t.has("gfni") and not t.has("avx512f") and not t.has("avxvnni")
    assert rich.with_features(FORCE_FEATURES["avxvnni"]).has("gfni")  # Alder Lake has both
    forced = forced_target("avx2")
    assert forced is None or not forced.has("gfni")
