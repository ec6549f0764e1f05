"""GPU tests of mamba3_mimo_bwd_combined through the PyTorch front end.

Each of the 15 gradients is compared with torch.autograd of the chunked forward as a function of
the raw inputs (mimo_ref.combined_reference, float64 gold and float32 reference) under SPEC.md
section 3's rule, over cases covering the gate, the fused norm, reduce-O and per-rank dout, D,
GQA, R 1..8, N 16..256, P 32..128, C 8..64, partial last chunks and the dtype sets; every case
runs twice (bitwise repeat). Also: strided inputs give the bits of contiguous ones, CUDA-graph
capture and replay, a side stream, the custom op, and the same front end on CPU tensors. The
whole module is skipped without CUDA.
"""
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

import mimo_ref as M  # noqa: E402
from mamba3_kernels import mimo  # noqa: E402

DEV = "cuda"
F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


pytestmark = pytest.mark.usefixtures("cuda_backend", "fp32_reference_matmuls")


def _call(inp, **extra):
    a, kw = M.combined_args(inp)
    kw.update(extra)
    return mimo.mamba3_mimo_bwd_combined(*a, **kw)


def _equal(a, b):
    return len(a) == len(b) and all(
        (x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))
        for x, y in zip(a, b))


CASES = [
    # B, S, H, G, N, P, R, C, options, dtypes, out
    (2, 33, 4, 2, 16, 32, 2, 16, dict(z=True, d=True), dict(act=BF16), None),
    (1, 40, 2, 1, 32, 64, 4, 8, dict(z=True, norm=True, d=True), dict(), F32),
    (1, 50, 2, 2, 64, 32, 1, 32, dict(reduce_o=False, z=True, d=True), dict(act=F16), F16),
    (2, 64, 2, 1, 64, 32, 8, 16, dict(d=True), dict(act=BF16, param=BF16, decay=BF16), BF16),
    (1, 5, 2, 1, 16, 32, 8, 8, dict(reduce_o=False), dict(), None),
    (1, 100, 2, 1, 128, 64, 2, 32, dict(z=True, norm=True), dict(act=BF16), None),
    (2, 17, 4, 4, 32, 32, 4, 64, dict(z=True, d=True), dict(), F32),
    (1, 70, 2, 1, 256, 128, 8, 64, dict(z=True, d=True), dict(act=BF16), BF16),
    (1, 300, 8, 2, 32, 32, 2, 8, dict(z=True, d=True), dict(act=BF16), None),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"S{c[1]}N{c[4]}P{c[5]}R{c[6]}C{c[7]}-" +
                         "-".join(k for k, v in c[8].items() if v))
def test_matches_reference(case):
    B, S, H, G, N, P, R, C, opts, dts, out = case
    inp = M.make_inputs(B, S, H, G, N, P, R, C, device=DEV, seed=S + R, **opts, **dts)
    res = _call(inp, output_dtype=out)
    assert len(res) == 15
    failures = M.check_combined(res, inp, out)
    assert not failures, "\n".join(failures)
    assert _equal(res, _call(inp, output_dtype=out)), "two runs are not bitwise identical"


def test_large():
    # The benchmark's per-head sizes at a smaller B*H: many chunks and bias segments.
    inp = M.make_inputs(2, 2048, 4, 1, 128, 64, 4, 16, z=True, d=True, act=BF16, device=DEV,
                        seed=2048)
    failures = M.check_combined(_call(inp), inp)
    assert not failures, "\n".join(failures)


def test_large_norm():
    # test_large with the fused norm: dD from the float64 kernels over 128 chunks of 8 heads
    # (their blocks wait on one another where the state chain runs between them), run three
    # times for the bits.
    inp = M.make_inputs(2, 2048, 4, 1, 128, 64, 4, 16, z=True, norm=True, d=True, act=BF16,
                        device=DEV, seed=2049)
    res = _call(inp)
    failures = M.check_combined(res, inp)
    assert not failures, "\n".join(failures)
    for _ in range(2):
        assert _equal(res, _call(inp)), "runs are not bitwise identical"


def test_noncontiguous_inputs_equal_contiguous():
    inp = M.make_inputs(2, 30, 4, 2, 32, 16, 2, 8, z=True, d=True, act=F16, device=DEV, seed=8)
    assert _equal(_call(inp), _call(M.noncontiguous(inp)))


def test_side_stream():
    inp = M.make_inputs(2, 100, 4, 1, 64, 32, 4, 16, z=True, norm=True, d=True, act=BF16,
                        device=DEV, seed=7)
    ref = _call(inp)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        got = _call(inp)
    s.synchronize()
    assert _equal(ref, got)


def test_custom_op_matches_eager_path():
    inp = M.make_inputs(2, 21, 2, 1, 16, 8, 2, 8, z=True, d=True, device=DEV, seed=11,
                        nan_unread=False)
    a, kw = M.combined_args(inp)
    eager = mimo.mamba3_mimo_bwd_combined(*a, **kw)

    def f(*args):
        return mimo.mamba3_mimo_bwd_combined(*args, **kw)
    torch._dynamo.reset()
    got = torch.compile(f, fullgraph=True, backend="aot_eager")(*a)
    assert _equal(eager, got)


@pytest.mark.parametrize("norm", [False, True])  # (with the norm: the float64 dD kernels too)
def test_cuda_graph_capture_and_replay(norm):
    def inputs(seed):
        return M.make_inputs(2, 70, 4, 2, 32, 32, 2, 16, z=True, d=True, norm=norm, act=BF16,
                             device=DEV, seed=seed, nan_unread=False)
    a, kw = M.combined_args(inputs(9))
    static = [t for t in a]

    def run():
        return mimo.mamba3_mimo_bwd_combined(*static, **kw)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):  # warm-up outside capture (library load, workspace size)
            run()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        outs = run()
    for seed in (10, 11):
        fresh, _ = M.combined_args(inputs(seed))
        for dst, src in zip(static, fresh):
            if isinstance(dst, torch.Tensor):
                dst.copy_(src)
        g.replay()
        torch.cuda.synchronize()
        assert _equal(outs, run())


def test_cpu_tensors_through_the_same_front_end():
    inp = M.make_inputs(1, 40, 2, 1, 32, 16, 2, 16, z=True, d=True, act=BF16, device="cpu",
                        seed=12)
    failures = M.check_combined(_call(inp), inp)
    assert not failures, "\n".join(failures)
