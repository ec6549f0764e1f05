"""GPU tests of mamba3_mimo_bwd_fwd through the PyTorch front end.

Every output is compared with the float64 torch reference of the chunked forward (mimo_ref.py,
written from golden/include/mamba3_golden/mimo.hpp; gradients by autograd) under the SPEC.md
section 3 rule, over a pairwise grid of every axis (R 1..8, N 16..256, P 32..128, C 8..64,
S with partial last chunks, gate / norm, reduce-O or per rank, D, GQA, B, rotary divisor, all
dtype sets and output dtypes, strided inputs), with NaN where the operator must not read
(segsum's upper triangle, the last partial chunk's segsum / da_cs_rev). Every grid case is run
twice (bitwise repeat), every other one through the _out API with NaN-poisoned outputs. Also:
long sequences at the benchmark's sizes, torch.compile (fullgraph), CUDA-graph capture and
replay, side streams, the custom op, bad input, and CPU tensors through the same front end.
The whole module is skipped without CUDA.
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


def _equal_all(a, b):
    return len(a) == len(b) and all((x is None and y is None) or torch.equal(x, y)
                                    for x, y in zip(a, b))


def _out_fn(outs):
    return lambda *a, output_dtype, **k: mimo.mamba3_mimo_bwd_fwd_out(*a, **k, **outs)


# ----------------------------------------------------------------------------- the grid

GRID = M.grid()


@pytest.mark.parametrize("i", range(len(GRID)), ids=[c["id"] for c in GRID])
def test_grid(i):
    case = GRID[i]
    od = case["out"]
    inp = M.case_inputs(case, DEV, seed=100 + i)
    if i % 2:
        outs = M.outputs_like(inp, od)  # NaN: an element the kernels do not write fails
        got = M.run_and_check(_out_fn(outs), inp, od)
        assert all(M.as_dict(got)[n] is o for n, o in outs.items())
        got = tuple(t.clone() if t is not None else None for t in got)
        again = M.run_and_check(_out_fn(outs), inp, od)
    else:
        got = M.run_and_check(mimo.mamba3_mimo_bwd_fwd, inp, od)
        a, kw = M.op_args(inp)
        again = mimo.mamba3_mimo_bwd_fwd(*a, output_dtype=od, **kw)
    assert _equal_all(got, again), "two runs are not bitwise identical"


LARGE = [
    # B, S, H, G, N, P, R, C, options (the benchmark's sizes at smaller B*H, long sequences)
    (2, 2048, 4, 1, 128, 64, 4, 16, dict(act=BF16, trap=BF16, z=True, d=True), BF16),
    (1, 2048, 4, 1, 16, 64, 4, 8, dict(act=BF16, trap=BF16, z=True, d=True), BF16),
    (1, 2048, 2, 1, 256, 64, 4, 8, dict(act=BF16, trap=BF16, z=True, d=True), BF16),
    (1, 2048, 2, 1, 128, 128, 8, 8, dict(act=BF16, z=True, d=True, norm=True), F32),
    (1, 2048, 4, 1, 128, 64, 1, 64, dict(act=F16, z=True, d=True), F16),
    (1, 4000, 4, 2, 64, 128, 2, 32, dict(act=F32, reduce_o=False, z=True), F32),
    (2, 1001, 8, 4, 128, 32, 4, 16, dict(act=BF16, param=BF16, decay=BF16, z=True, norm=True,
                                         d=True), BF16),
]


@pytest.mark.parametrize("case", LARGE, ids=str)
def test_large(case):
    B, S, H, G, N, P, R, C, opts, od = case
    inp = M.make_inputs(B, S, H, G, N, P, R, C, device=DEV, seed=S + N, **opts)
    M.run_and_check(mimo.mamba3_mimo_bwd_fwd, inp, od)


# ----------------------------------------------------------------------------- API behaviour

@pytest.mark.parametrize("opts", [dict(z=True, d=True, norm=True), dict(reduce_o=False, z=True),
                                  dict(reduce_o=False), dict(d=True)], ids=str)
def test_out_api_poisoned_tail(opts):
    # S % C != 0 and S < C: the partial chunk's outputs must all be written.
    for S, C in ((77, 32), (5, 64)):
        inp = M.make_inputs(2, S, 4, 2, 64, 32, 4, C, act=BF16, device=DEV, seed=S, **opts)
        for od in (F32, BF16):
            outs = M.outputs_like(inp, od)
            M.run_and_check(_out_fn(outs), inp, od)


def test_out_api_strided_outputs():
    inp = M.make_inputs(2, 50, 4, 2, 32, 64, 2, 16, act=BF16, z=True, d=True, norm=True,
                        device=DEV, seed=3)
    outs = M.outputs_like(inp, BF16)
    kinds = dict(states="pad", qk_dot="T", dmimo_o="outer", dmimo_z="step", dz="T",
                 dnorm_weight="pad", dout_pre_rms="step")
    outs = {k: M.relayout(v, kinds[k]) for k, v in outs.items()}
    M.run_and_check(_out_fn(outs), inp, BF16)


def test_noncontiguous_inputs_equal_contiguous():
    inp = M.make_inputs(2, 100, 4, 2, 128, 64, 4, 16, act=BF16, z=True, d=True, device=DEV,
                        seed=4)
    a, kw = M.op_args(inp)
    a2, kw2 = M.op_args(M.noncontiguous(inp))
    assert _equal_all(mimo.mamba3_mimo_bwd_fwd(*a, **kw), mimo.mamba3_mimo_bwd_fwd(*a2, **kw2))


def test_deterministic_large():
    inp = M.make_inputs(4, 2048, 16, 1, 128, 64, 4, 16, act=BF16, trap=BF16, z=True, d=True,
                        device=DEV, seed=5, nan_unread=False)
    a, kw = M.op_args(inp)
    r1 = mimo.mamba3_mimo_bwd_fwd(*a, output_dtype=BF16, **kw)
    r2 = mimo.mamba3_mimo_bwd_fwd(*a, output_dtype=BF16, **kw)
    assert _equal_all(r1, r2)


def test_custom_op_matches_eager_path():
    inp = M.make_inputs(2, 70, 4, 2, 64, 32, 2, 16, act=BF16, z=True, d=True, norm=True,
                        device=DEV, seed=6)
    a, kw = M.op_args(inp)
    eager = mimo.mamba3_mimo_bwd_fwd(*a, output_dtype=F16, **kw)
    op = torch.ops.mamba3.mimo_bwd_fwd(*a, kw["mimo_z"], kw["d"], kw["z"], kw["norm_weight"],
                                       kw["norm_eps"], kw["chunk_size"],
                                       kw["rotary_dim_divisor"], F16)
    assert _equal_all(eager, op)


def test_side_stream():
    inp = M.make_inputs(2, 300, 4, 1, 64, 64, 4, 16, act=BF16, z=True, d=True, device=DEV,
                        seed=7)
    a, kw = M.op_args(inp)
    ref = mimo.mamba3_mimo_bwd_fwd(*a, **kw)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        got = mimo.mamba3_mimo_bwd_fwd(*a, **kw)
    s.synchronize()
    assert _equal_all(ref, got)


def _pipeline(*args, kw):
    """Two calls (with the norm in f16 and without it in bf16), plus torch ops on the results."""
    o = mimo.mamba3_mimo_bwd_fwd(*args, **kw, output_dtype=F16)
    kw2 = {k: v for k, v in kw.items() if k not in ("norm_weight", "norm_eps")}
    o2 = mimo.mamba3_mimo_bwd_fwd(*args, **kw2, output_dtype=BF16)
    return o + o2 + (o[2].sum(0), o2[3].sum(0))


def _pipeline_args(seed):
    inp = M.make_inputs(2, 150, 4, 2, 64, 32, 4, 32, act=BF16, z=True, d=True, norm=True,
                        device=DEV, seed=seed, nan_unread=False)
    return M.op_args(inp)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_torch_compile_fullgraph(backend):
    a, kw = _pipeline_args(8)
    torch._dynamo.reset()
    compiled = torch.compile(lambda *x: _pipeline(*x, kw=kw), fullgraph=True, backend=backend)
    got, want = compiled(*a), _pipeline(*a, kw=kw)
    assert len(got) == len(want) == 14
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        assert torch.equal(g, w)


def test_cuda_graph_capture_and_replay():
    a, kw = _pipeline_args(9)
    static = [t for t in a] + [kw[k] for k in ("mimo_z", "d", "z", "norm_weight")]

    def run():
        k = dict(kw, mimo_z=static[14], d=static[15], z=static[16], norm_weight=static[17])
        return _pipeline(*static[:14], kw=k)
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
        fa, fkw = _pipeline_args(seed)
        fresh = list(fa) + [fkw[k] for k in ("mimo_z", "d", "z", "norm_weight")]
        for dst, src in zip(static, fresh):
            dst.copy_(src)
        g.replay()
        torch.cuda.synchronize()
        assert _equal_all(outs, run())


def test_cpu_tensors_through_the_same_front_end():
    inp = M.make_inputs(1, 40, 2, 1, 32, 16, 2, 16, act=BF16, z=True, d=True, norm=True,
                        device="cpu", seed=12)
    M.run_and_check(mimo.mamba3_mimo_bwd_fwd, inp, BF16)


# ----------------------------------------------------------------------------- bad input

def _small(**over):
    kw = dict(z=True, d=True)
    kw.update(over)
    return M.make_inputs(2, 12, 4, 2, 16, 8, 2, 8, device=DEV, seed=13, **kw)


@pytest.mark.parametrize("name,mutate", [
    ("q", lambda i: i.update(q=i["q"].double())),
    ("k", lambda i: i.update(k=i["k"].cpu())),            # mixed devices
    ("segsum", lambda i: i.update(segsum=i["segsum"].cpu())),
    ("angles", lambda i: i.update(angles=i["angles"][..., :3])),
    ("H % G", lambda i: i.update(q=torch.randn(2, 12, 2, 3, 16, device=DEV),
                                 k=torch.randn(2, 12, 2, 3, 16, device=DEV))),
    ("z and mimo_z", lambda i: i.update(z=None)),
    ("dout", lambda i: i.update(dout=i["dout"][:, :5])),
])
def test_bad_input(name, mutate):
    inp = _small()
    mutate(inp)
    a, kw = M.op_args(inp)
    with pytest.raises(ValueError, match=re.escape(name)):
        mimo.mamba3_mimo_bwd_fwd(*a, **kw)


def test_bad_options_and_outputs():
    inp = _small()
    a, kw = M.op_args(inp)
    with pytest.raises(ValueError, match="chunk_size"):
        mimo.mamba3_mimo_bwd_fwd(*a, **dict(kw, chunk_size=128))
    outs = M.outputs_like(inp, F32)
    outs["dz"] = outs["dz"].cpu()
    with pytest.raises(ValueError, match="dz"):
        mimo.mamba3_mimo_bwd_fwd_out(*a, **kw, **outs)
