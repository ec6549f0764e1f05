"""GPU tests of mamba3_mimo_bwd_bwd through the PyTorch front end.

Every one of the 12 outputs is compared with the float64 autograd reference of mimo_ref.py
(bwd_bwd_reference) under the SPEC.md section 3 rule, over cases covering the three dout layouts
(reduce-O, per rank, packed pre-RMS), D, GQA, R 1..8, N 16..256, P 32..128, C 8..64, S with
partial last chunks, all dtype sets, the states / qk_dot dtype and the output dtype, with NaN
where the operator must not read (segsum's upper triangle, the last partial chunk's segsum /
da_cs_rev). Every case runs twice (bitwise repeat). Also: strided inputs, torch.compile
(fullgraph), CUDA-graph capture and replay, a side stream, the custom op, bad input, and CPU
tensors through the same front end. The whole module is skipped without CUDA.
"""
import re

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
    a, kw = M.bb_args(inp)
    kw.update(extra)
    return mimo.mamba3_mimo_bwd_bwd(*a, **kw)


def _equal_all(a, b):
    return a.keys() == b.keys() and all(
        (a[n] is None and b[n] is None) or torch.equal(a[n], b[n]) for n in a)


# ----------------------------------------------------------------------------- numerics

CASES = [
    # B, S, H, G, N, P, R, C, layout, dtypes, cache, out, d, rdd
    (2, 33, 4, 2, 16, 32, 2, 16, "reduce", dict(act=BF16), F32, None, True, 4),
    (1, 50, 2, 1, 32, 64, 4, 8, "rank", dict(act=F16, param=F16, decay=F16), BF16, F32, False, 2),
    (1, 40, 2, 2, 64, 32, 1, 32, "packed", dict(), F32, None, True, 4),
    (2, 64, 2, 1, 64, 32, 8, 16, "reduce", dict(act=BF16, param=BF16, decay=BF16), BF16, BF16,
     False, 4),
    (1, 5, 2, 1, 16, 32, 2, 8, "packed", dict(act=F16), F16, F16, True, 2),
    (1, 100, 2, 1, 128, 64, 2, 32, "rank", dict(act=BF16, trap=BF16), F32, None, True, 4),
    (2, 17, 4, 4, 32, 32, 4, 64, "reduce", dict(), F32, F32, False, 4),
    (1, 70, 2, 1, 256, 128, 8, 64, "rank", dict(act=BF16), BF16, BF16, True, 4),
    (1, 300, 4, 2, 32, 32, 2, 8, "reduce", dict(act=BF16), BF16, BF16, True, 4),
    (1, 45, 2, 1, 256, 32, 4, 16, "packed", dict(act=F16, param=F16), F16, F16, True, 2),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"S{c[1]}N{c[4]}P{c[5]}R{c[6]}C{c[7]}-{c[8]}")
def test_matches_reference(case):
    B, S, H, G, N, P, R, C, layout, dts, cache, out, d, rdd = case
    inp = M.make_bwd_bwd_inputs(B, S, H, G, N, P, R, C, layout=layout, cache=cache, d=d, rdd=rdd,
                                device=DEV, seed=S + R, **dts)
    res = _call(inp, output_dtype=out)
    failures = M.check_bwd_bwd(res, inp, out)
    assert not failures, "\n".join(failures)
    assert _equal_all(res, _call(inp, output_dtype=out)), "two runs are not bitwise identical"


LARGE = [
    # B, S, H, G, N, P, R, C (the benchmark's sizes at smaller B*H)
    (2, 2048, 4, 1, 128, 64, 4, 16),
    (1, 2048, 2, 1, 128, 64, 1, 64),
]


@pytest.mark.parametrize("case", LARGE, ids=str)
def test_large(case):
    B, S, H, G, N, P, R, C = case
    inp = M.make_bwd_bwd_inputs(B, S, H, G, N, P, R, C, act=BF16, cache=BF16, d=True,
                                device=DEV, seed=S + N)
    failures = M.check_bwd_bwd(_call(inp), inp)
    assert not failures, "\n".join(failures)


# ----------------------------------------------------------------------------- API behaviour

def test_noncontiguous_inputs_equal_contiguous():
    inp = M.make_bwd_bwd_inputs(2, 30, 2, 1, 32, 16, 2, 8, layout="rank", act=F16, d=True,
                                device=DEV, seed=8)
    ref = _call(inp)
    strided = dict(M.noncontiguous(inp))
    for i, n in enumerate(("states", "qk_dot")):
        strided[n] = M.relayout(inp[n], ("T", "outer")[i])
    assert _equal_all(ref, _call(strided))


def test_custom_op_matches_eager_path():
    for layout, d in (("reduce", True), ("rank", False), ("packed", True)):
        inp = M.make_bwd_bwd_inputs(2, 21, 2, 1, 16, 8, 2, 8, layout=layout, d=d, device=DEV,
                                    seed=11)
        a, kw = M.bb_args(inp)
        eager = mimo.mamba3_mimo_bwd_bwd(*a, output_dtype=F16, **kw)
        op = torch.ops.mamba3.mimo_bwd_bwd(*a, kw["mimo_o"], kw["d"], kw["chunk_size"],
                                           kw["rotary_dim_divisor"], F16)
        assert len(op) == 12
        for name, o in zip(M.BB_OUTPUTS, op):
            if eager[name] is None:
                assert o.numel() == 0
            else:
                assert torch.equal(eager[name], o)


def test_side_stream():
    inp = M.make_bwd_bwd_inputs(2, 100, 4, 1, 64, 32, 4, 16, act=BF16, d=True, device=DEV,
                                seed=7)
    ref = _call(inp)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        got = _call(inp)
    s.synchronize()
    assert _equal_all(ref, got)


def _pipeline_inputs(seed):
    return M.make_bwd_bwd_inputs(2, 70, 4, 2, 32, 32, 2, 16, act=BF16, d=True, device=DEV,
                                 seed=seed, nan_unread=False)


def _pipeline(*args, kw):
    o = mimo.mamba3_mimo_bwd_bwd(*args, **kw)
    return (o["DQ"].float().sum(0), o["DK"], o["DV"], o["DMIMO_V"].sum(0), o["DSSDA"], o["DD"],
            o["DDA"] + o["DDA_CS"])


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_torch_compile_fullgraph(backend):
    a, kw = M.bb_args(_pipeline_inputs(8))
    torch._dynamo.reset()
    compiled = torch.compile(lambda *x: _pipeline(*x, kw=kw), fullgraph=True, backend=backend)
    got, want = compiled(*a), _pipeline(*a, kw=kw)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        assert torch.equal(g, w)


def test_cuda_graph_capture_and_replay():
    a, kw = M.bb_args(_pipeline_inputs(9))
    static = list(a) + [kw["mimo_o"], kw["d"]]

    def run():
        k = dict(kw, mimo_o=static[15], d=static[16])
        return _pipeline(*static[:15], kw=k)
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
        fa, fkw = M.bb_args(_pipeline_inputs(seed))
        fresh = list(fa) + [fkw["mimo_o"], fkw["d"]]
        for dst, src in zip(static, fresh):
            dst.copy_(src)
        g.replay()
        torch.cuda.synchronize()
        want = run()
        assert all(torch.equal(x, y) for x, y in zip(outs, want))


def test_cpu_tensors_through_the_same_front_end():
    inp = M.make_bwd_bwd_inputs(1, 40, 2, 1, 32, 16, 2, 16, act=BF16, d=True, device="cpu",
                                seed=12)
    failures = M.check_bwd_bwd(_call(inp), inp)
    assert not failures, "\n".join(failures)


# ----------------------------------------------------------------------------- bad input

def _small(**over):
    kw = dict(d=True)
    kw.update(over)
    return M.make_bwd_bwd_inputs(2, 12, 4, 2, 16, 8, 2, 8, device=DEV, seed=13, **kw)


@pytest.mark.parametrize("name,mutate", [
    ("q", lambda i: i.update(q=i["q"].double())),
    ("k", lambda i: i.update(k=i["k"].cpu())),            # mixed devices
    ("states", lambda i: i.update(states=i["states"].cpu())),
    ("angles", lambda i: i.update(angles=i["angles"][..., :3])),
    ("H % G", lambda i: i.update(q=torch.randn(2, 12, 2, 3, 16, device=DEV),
                                 k=torch.randn(2, 12, 2, 3, 16, device=DEV))),
    ("segsum", lambda i: i.update(segsum=i["segsum"][:, :, :, :4])),
])
def test_bad_input(name, mutate):
    inp = _small()
    mutate(inp)
    with pytest.raises(ValueError, match=re.escape(name)):
        _call(inp)


def test_bad_options():
    inp = _small()
    with pytest.raises(ValueError, match="chunk_size"):
        _call(inp, chunk_size=128)
    with pytest.raises(ValueError, match="rotary_dim_divisor"):
        _call(inp, rotary_dim_divisor=3)
