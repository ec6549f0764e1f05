"""The compiled SISO binding mamba3_kernels._C against the ctypes path (CPU).

Both bindings run the same argument checks and the same library calls, so their outputs must be
bitwise identical and their errors must carry the same type and message. The comparisons need
the compiled module (built by CMake when torch is found); without it they skip, and only the
binding() report is tested.
"""
import os
import re
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

import siso_ref as R  # noqa: E402
import mamba3_kernels  # noqa: E402
from mamba3_kernels import _ext, siso  # noqa: E402

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
DEV = "cpu"

_C = _ext.load()
needs_compiled = pytest.mark.skipif(
    _C is None, reason="mamba3_kernels._C not built or disabled (MAMBA3_TORCH_EXT)")


def _dqk_both(args, chunk=64, cu=None):
    a = _C.compute_dqktheta(*args, chunk, cu)
    b = siso._dqktheta_functional_ctypes(*args, chunk, cu)
    return a, b


def _ddt_both(args, cu=None):
    args = list(args) + [None] * (7 - len(args))
    a = _C.compute_ddt_dtrap_dinput_states(*args, cu)
    b = siso._ddt_functional_ctypes(*args, cu)
    return a, b


def _assert_identical(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        if x is None or y is None:
            assert x is None and y is None
            continue
        assert x.shape == y.shape and x.dtype == y.dtype and x.device == y.device
        assert x.stride() == y.stride()
        assert torch.equal(x.view(torch.uint8) if x.dim() else x, y.view(torch.uint8)
                           if y.dim() else y)  # bitwise, NaN-safe


# ----------------------------------------------------------------------------- binding()

def test_binding_reports_the_active_path():
    assert mamba3_kernels.binding() == ("ctypes" if _C is None else "compiled")
    assert siso._compiled() is _C


def _binding_in_subprocess(env_value):
    env = dict(os.environ)
    env["MAMBA3_TORCH_EXT"] = env_value
    code = "import mamba3_kernels as m; print(m.binding())"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)


def test_binding_disabled_by_environment():
    r = _binding_in_subprocess("0")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ctypes"


def test_binding_bad_environment_path_is_an_error():
    r = _binding_in_subprocess("/nonexistent/_C.so")
    assert r.returncode != 0
    assert "MAMBA3_TORCH_EXT='/nonexistent/_C.so' does not name an existing file" in r.stderr


@needs_compiled
def test_binding_by_explicit_path():
    r = _binding_in_subprocess(_C.__file__)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "compiled"


@needs_compiled
def test_compiled_module_bound_to_the_loaded_library():
    assert os.path.realpath(_C.library_path()) == os.path.realpath(mamba3_kernels.library_path())
    assert _C.library_version() == mamba3_kernels.library_version()


def test_module_of_another_torch_or_library_is_not_used():
    import types
    lib = mamba3_kernels.library_path()
    good = types.SimpleNamespace(torch_version=torch.__version__, library_path=lambda: lib)
    assert _ext._checked(good, "x") is good
    other_torch = types.SimpleNamespace(torch_version="0.0.1", library_path=lambda: lib)
    with pytest.warns(RuntimeWarning, match="built against torch 0.0.1"):
        assert _ext._checked(other_torch, "x") is None
    other_lib = types.SimpleNamespace(torch_version=torch.__version__,
                                      library_path=lambda: "/elsewhere/libmamba3.so")
    with pytest.warns(RuntimeWarning, match="/elsewhere/libmamba3.so"):
        assert _ext._checked(other_lib, "x") is None


# ----------------------------------------------------------------------------- identical outputs

DQK_CASES = [
    # B, S, G, H, N, A, chunk, nseq, dok
    (1, 1, 1, 1, 16, 8, 64, 0, False),
    (2, 17, 1, 4, 16, 4, 32, 0, True),     # GQA: one q/k head for four heads
    (2, 64, 2, 4, 32, 16, 64, 0, True),    # GQA 2:4
    (1, 100, 1, 1, 64, 16, 32, 3, True),   # varlen
    (1, 100, 2, 4, 96, 48, 16, 4, False),  # varlen + GQA
]


@needs_compiled
@pytest.mark.parametrize("dtype", [F32, F16, BF16], ids=str)
@pytest.mark.parametrize("case", DQK_CASES, ids=str)
@pytest.mark.parametrize("layout", ["contiguous", "strided"])
def test_dqktheta_identical(case, dtype, layout):
    B, S, G, H, N, A, chunk, nseq, dok = case
    inp = R.make_dqktheta_inputs(B, S, G, H, N, A, dtype, nseq=nseq, dok=dok, device=DEV)
    if layout == "strided":
        inp = R.noncontiguous(inp)
    _assert_identical(*_dqk_both(R.dqk_args(inp), chunk, inp.get("cu_seqlens")))
    # and through the public entry point and the custom op
    pub = siso.compute_dqktheta(*R.dqk_args(inp), chunk, inp.get("cu_seqlens"))
    op = torch.ops.mamba3.compute_dqktheta(*R.dqk_args(inp), chunk, inp.get("cu_seqlens"))
    ref = siso._dqktheta_functional_ctypes(*R.dqk_args(inp), chunk, inp.get("cu_seqlens"))
    _assert_identical(pub, ref)
    _assert_identical(op, ref)


DDT_CASES = [
    # B, H, S, nseq, P, N
    (1, 1, 1, 0, 0, 0),
    (2, 4, 17, 0, 0, 0),
    (2, 3, 1, 0, 8, 16),       # states
    (2, 4, 64, 0, 16, 32),     # states
    (1, 4, 100, 3, 64, 128),   # varlen + states
    (1, 8, 256, 4, 0, 0),      # varlen
]


@needs_compiled
@pytest.mark.parametrize("dtype", [F32, F16, BF16], ids=str)
@pytest.mark.parametrize("case", DDT_CASES, ids=str)
@pytest.mark.parametrize("layout", ["contiguous", "strided"])
def test_ddt_identical(case, dtype, layout):
    B, H, S, nseq, P, N = case
    inp = R.make_ddt_inputs(B, H, S, dtype, nseq=nseq, P=P, N=N, device=DEV)
    if layout == "strided":
        inp = R.noncontiguous(inp)
    _assert_identical(*_ddt_both(R.ddt_args(inp), inp.get("cu_seqlens")))
    pub = siso.compute_ddt_dtrap_dinput_states(*R.ddt_args(inp),
                                                cu_seqlens=inp.get("cu_seqlens"))
    ref = siso._ddt_functional_ctypes(*(list(R.ddt_args(inp)) + [None] * 3)[:7],
                                      inp.get("cu_seqlens"))
    _assert_identical(pub, ref)


# ----------------------------------------------------------------------------- identical errors

def _error_of(fn, *args):
    try:
        fn(*args)
    except Exception as e:  # noqa: BLE001 - the type is compared
        return type(e), str(e)
    return None


def _dqk(**over):
    inp = R.make_dqktheta_inputs(2, 8, 2, 4, 16, 4, F32, dok=True, device=DEV)
    inp.update(over)
    return inp


DQK_BAD = R.DQK_BAD_CPU + [
    ("angles", lambda i: i.update(angles=i["angles"][0])),
    ("scale", lambda i: i.update(scale=None)),
    ("angles", lambda i: i.update(angles=None)),
    ("dq_in", lambda i: i.update(dq_in=None)),
    ("dqk", lambda i: i.update(dqk=None)),
    ("dk_in", lambda i: i.update(dk_in=torch.randn(1, 1, 1, 1, 1, 1, 1))),   # rank 7
    ("dk_in", lambda i: i.update(dk_in=i["dk_in"].bool())),
    ("dk_in", lambda i: i.update(dk_in=i["dk_in"].to(torch.complex64))),
    ("dk_in", lambda i: i.update(dk_in=i["dk_in"].to(torch.float8_e4m3fn))),
    ("dk_in", lambda i: i.update(dk_in=i["dk_in"].to("meta"))),
]


@needs_compiled
@pytest.mark.parametrize("name,mutate", DQK_BAD, ids=[n for n, _ in DQK_BAD])
def test_dqktheta_same_errors(name, mutate):
    inp = _dqk()
    mutate(inp)
    args = R.dqk_args(inp)
    a = _error_of(_C.compute_dqktheta, *args, 64, None)
    b = _error_of(siso._dqktheta_functional_ctypes, *args, 64, None)
    assert a is not None and a == b
    assert a[0] is ValueError and re.search(re.escape(name), a[1])
    assert _error_of(siso.compute_dqktheta, *args) == a


@needs_compiled
def test_dqktheta_same_errors_chunk_and_cu_seqlens():
    inp = _dqk()
    one = R.make_dqktheta_inputs(1, 8, 1, 2, 16, 4, F32, dok=False, device=DEV)
    calls = [(inp, 48, None), (inp, 64, torch.tensor([0, 4, 8], dtype=torch.int32)),
             (one, 64, torch.tensor([0.0, 8.0])),
             (one, 64, torch.zeros(1, 1, 1, 1, 1, 1, 2, dtype=torch.int32))]
    calls += [(one, 64, torch.tensor(cu, dtype=torch.int32))
              for cu in ([0, 5, 5, 8], [0, 6, 3, 8], [1, 4, 8], [0, 4, 7])]
    for i, chunk, cu in calls:
        # twice: the second call finds its workspace size in the cache
        for _ in range(2):
            a = _error_of(_C.compute_dqktheta, *R.dqk_args(i), chunk, cu)
            b = _error_of(siso._dqktheta_functional_ctypes, *R.dqk_args(i), chunk, cu)
            assert a is not None and a == b and a[0] is ValueError


@needs_compiled
def test_ddt_same_errors():
    d = R.make_ddt_inputs(2, 4, 8, F32, P=4, N=8, device=DEV)
    s = (d["dscale"], d["dgamma"], d["dt"], d["trap"])
    calls = [
        ("input_k_state", s + (d["d_issm_state"], None, d["input_v_state"])),
        ("input_k_state", s + (None, d["input_k_state"], None)),
        ("trap", s[:3] + (d["trap"].double(), None, None, None)),
        ("d_issm_state", s + (d["d_issm_state"][:1], d["input_k_state"], d["input_v_state"])),
        ("d_issm_state", s + (d["d_issm_state"][0], d["input_k_state"], d["input_v_state"])),
        ("dscale", (d["dscale"][0],) + s[1:] + (None, None, None)),
        ("dscale", (None,) + s[1:] + (None, None, None)),
        ("dgamma", (s[0], None) + s[2:] + (None, None, None)),
        ("dt", s[:2] + (torch.zeros(1, 1, 1, 1, 1, 1, 1),) + s[3:] + (None, None, None)),
    ]
    for name, args in calls:
        a = _error_of(_C.compute_ddt_dtrap_dinput_states, *args, None)
        b = _error_of(siso._ddt_functional_ctypes, *args, None)
        assert a is not None and a == b, name
        assert a[0] is ValueError and re.search(re.escape(name), a[1]), (name, a)
