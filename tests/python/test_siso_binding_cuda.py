"""The compiled SISO binding mamba3_kernels._C against the ctypes path on CUDA: bitwise-identical
outputs (GQA, varlen, states, strided inputs), the current stream (side stream, CUDA-graph capture),
the device switch on a second GPU, and identical errors (incl. mixed devices). Skipped without
CUDA or without the compiled module (CPU counterpart: test_siso_binding_cpu.py)."""
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

import siso_ref as R  # noqa: E402
from mamba3_kernels import _ext, siso  # noqa: E402
from test_siso_binding_cpu import _assert_identical, _error_of  # noqa: E402

_C = _ext.load()
if _C is None:
    pytest.skip("mamba3_kernels._C not built or disabled (MAMBA3_TORCH_EXT)",
                allow_module_level=True)

pytestmark = pytest.mark.usefixtures("cuda_backend")
DEV = "cuda"
F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16

DQK_CASES = [
    # B, S, G, H, N, A, chunk, nseq, dok
    (1, 1, 1, 1, 16, 8, 64, 0, False),
    (2, 17, 1, 4, 16, 4, 32, 0, True),
    (2, 64, 2, 4, 32, 16, 64, 0, True),
    (1, 100, 2, 4, 96, 48, 16, 4, False),
    (2, 300, 1, 8, 128, 32, 64, 0, True),
]


@pytest.mark.parametrize("dtype", [F32, BF16], ids=str)
@pytest.mark.parametrize("case", DQK_CASES, ids=str)
@pytest.mark.parametrize("layout", ["contiguous", "strided"])
def test_dqktheta_identical(case, dtype, layout):
    B, S, G, H, N, A, chunk, nseq, dok = case
    inp = R.make_dqktheta_inputs(B, S, G, H, N, A, dtype, nseq=nseq, dok=dok, device=DEV)
    if layout == "strided":
        inp = R.noncontiguous(inp)
    cu = inp.get("cu_seqlens")
    a = _C.compute_dqktheta(*R.dqk_args(inp), chunk, cu)
    b = siso._dqktheta_functional_ctypes(*R.dqk_args(inp), chunk, cu)
    _assert_identical(a, b)


DDT_CASES = [(2, 4, 17, 0, 0, 0), (2, 4, 64, 0, 16, 32), (1, 4, 100, 3, 64, 128)]


@pytest.mark.parametrize("case", DDT_CASES, ids=str)
@pytest.mark.parametrize("layout", ["contiguous", "strided"])
def test_ddt_identical(case, layout):
    B, H, S, nseq, P, N = case
    inp = R.make_ddt_inputs(B, H, S, F32, nseq=nseq, P=P, N=N, device=DEV)
    if layout == "strided":
        inp = R.noncontiguous(inp)
    args = (list(R.ddt_args(inp)) + [None] * 3)[:7]
    a = _C.compute_ddt_dtrap_dinput_states(*args, inp.get("cu_seqlens"))
    b = siso._ddt_functional_ctypes(*args, inp.get("cu_seqlens"))
    _assert_identical(a, b)


def test_side_stream_and_graph_capture():
    inp = R.make_dqktheta_inputs(2, 64, 1, 4, 64, 16, BF16, dok=True, device=DEV)
    ref = siso._dqktheta_functional_ctypes(*R.dqk_args(inp), 64, None)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        # The inputs are produced on `s` after a long sleep: a launch on any other stream would
        # read them before they are written.
        torch.cuda._sleep(50_000_000)
        late = [None if t is None else t.clone() for t in R.dqk_args(inp)]
        out = _C.compute_dqktheta(*late, 64, None)
    torch.cuda.current_stream().wait_stream(s)
    _assert_identical(out, ref)
    g = torch.cuda.CUDAGraph()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        _C.compute_dqktheta(*R.dqk_args(inp), 64, None)  # warm-up (workspace size cached)
        with torch.cuda.graph(g):
            cap = _C.compute_dqktheta(*R.dqk_args(inp), 64, None)
    torch.cuda.current_stream().wait_stream(s)
    g.replay()
    torch.cuda.synchronize()
    _assert_identical(cap, ref)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_second_device():
    inp = R.make_dqktheta_inputs(1, 40, 1, 2, 32, 8, F32, dok=True, device="cuda:1")
    with torch.cuda.device(0):
        a = _C.compute_dqktheta(*R.dqk_args(inp), 64, None)
        b = siso._dqktheta_functional_ctypes(*R.dqk_args(inp), 64, None)
    assert all(t.device == torch.device("cuda:1") for t in a)
    torch.cuda.synchronize(1)
    _assert_identical(a, b)


def test_same_errors():
    inp = R.make_dqktheta_inputs(2, 8, 2, 4, 16, 4, F32, dok=True, device=DEV)
    for name, val in (("k", inp["k"].cpu()), ("dqk", inp["dqk"].cpu()),
                      ("q_bias", inp["q_bias"][:3]), ("dk_in", inp["dk_in"].double())):
        bad = dict(inp, **{name: val})
        a = _error_of(_C.compute_dqktheta, *R.dqk_args(bad), 64, None)
        b = _error_of(siso._dqktheta_functional_ctypes, *R.dqk_args(bad), 64, None)
        assert a is not None and a == b and a[0] is ValueError and name in a[1], (name, a, b)
    d = R.make_ddt_inputs(2, 4, 8, F32, P=4, N=8, device=DEV)
    args = [d["dscale"], d["dgamma"], d["dt"].cpu(), d["trap"], None, None, None]
    a = _error_of(_C.compute_ddt_dtrap_dinput_states, *args, None)
    b = _error_of(siso._ddt_functional_ctypes, *args, None)
    assert a is not None and a == b and a[0] is ValueError
