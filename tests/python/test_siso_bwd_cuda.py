"""GPU tests of the SISO backward operators through the PyTorch front end.

Every output of both operators is compared with a float64 autograd golden of the operators'
forward relations (siso_ref.py, written from SPEC.md section 1), under the SPEC.md section 3 rule
(rel_l2 <= tol of the I/O dtype AND <= 2x the float32 reference's error or <= the noise floor max(tol/100, 4 fp32 ulps)). Also:
poisoned outputs through the *_out API, strided inputs, bitwise determinism, torch.compile
(fullgraph), CUDA-graph capture and replay, bad-input errors, and CPU tensors through the same
front end (more CPU coverage in test_siso_bwd_cpu.py). The whole module is skipped without CUDA.
"""
import re

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

import siso_ref as R  # noqa: E402
from mamba3_kernels import siso  # noqa: E402

DEV = "cuda"
F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


pytestmark = pytest.mark.usefixtures("cuda_backend")


def _equal_all(a, b):
    return all((x is None and y is None) or torch.equal(x, y) for x, y in zip(a, b))


# ----------------------------------------------------------------------------- compute_dqktheta

DQK_CASES = [
    # B, S, G, H, N, A, chunk, nseq (varlen sequences, 0 = batch), d_ok_state
    (1, 1, 1, 1, 16, 8, 64, 0, False),
    (2, 1, 1, 4, 32, 16, 32, 0, True),
    (2, 17, 1, 4, 16, 4, 32, 0, True),
    (2, 17, 2, 4, 64, 32, 64, 0, False),
    (1, 17, 1, 4, 32, 5, 64, 2, True),
    (2, 64, 2, 4, 32, 16, 64, 0, True),
    (1, 64, 1, 1, 128, 32, 32, 1, True),
    (1, 100, 1, 1, 64, 16, 32, 3, True),
    (2, 100, 1, 4, 128, 64, 64, 0, True),
    (1, 100, 2, 4, 96, 48, 32, 4, False),
    (2, 100, 2, 4, 48, 7, 64, 0, True),
    (2, 256, 2, 4, 128, 32, 64, 0, False),
    (1, 256, 1, 4, 128, 64, 64, 4, True),
    (2, 256, 1, 4, 256, 128, 32, 0, True),
    (1, 256, 2, 4, 256, 100, 32, 3, True),
    (2, 64, 1, 1, 16, 1, 32, 0, True),
    (2, 33, 1, 2, 80, 40, 16, 0, True),
    (2, 33, 1, 2, 64, 32, 256, 0, True),
]


@pytest.mark.parametrize("dtype", [F32, F16, BF16], ids=str)
@pytest.mark.parametrize("case", DQK_CASES, ids=str)
def test_dqktheta(case, dtype):
    B, S, G, H, N, A, chunk, nseq, dok = case
    inp = R.make_dqktheta_inputs(B, S, G, H, N, A, dtype, nseq=nseq, dok=dok, device=DEV,
                                 seed=hash(case) % 1000)
    R.run_and_check_dqktheta(siso.compute_dqktheta, inp, chunk)


@pytest.mark.parametrize("io,param", [(BF16, BF16), (F16, F16), (F16, BF16), (F32, BF16)],
                         ids=str)
def test_dqktheta_low_precision_params(io, param):
    # scale/gamma/biases/angles/dqk in 16-bit too: dangles/dscale/dgamma come back in those dtypes.
    inp = R.make_dqktheta_inputs(2, 70, 2, 4, 64, 24, io, param, dok=True, device=DEV)
    R.run_and_check_dqktheta(siso.compute_dqktheta, inp)
    inp = R.make_dqktheta_inputs(1, 70, 1, 2, 128, 64, io, param, nseq=3, dok=True, device=DEV)
    R.run_and_check_dqktheta(siso.compute_dqktheta, inp)


DQK_LARGE = [
    # the benchmark's shapes (upstream's tuned point, long sequence, GQA) and varlen variants
    (4, 2048, 1, 32, 128, 32, 64, 0, True, BF16),
    (4, 2048, 1, 32, 128, 32, 64, 0, False, F32),
    (2, 2048, 4, 16, 64, 16, 64, 0, True, BF16),
    (1, 8192, 1, 32, 128, 64, 64, 4, True, BF16),
    (1, 4096, 2, 8, 256, 128, 64, 3, True, F16),
    (2, 4096, 1, 32, 128, 32, 64, 0, True, BF16),
    # 1700 rows: three whole rounds of the block walk's 4-row blocks on a 132-SM card, then 116
    # rows with batch-row and sequence ends among them
    (17, 100, 1, 32, 128, 32, 64, 0, True, BF16),
    (1, 1700, 1, 32, 128, 32, 64, 5, True, BF16),
    # f16 with 16 heads per group at N = 128: the block walk with two rows of warps (the CTA's bias
    # partial summed over them in shared memory)
    (2, 512, 1, 16, 128, 32, 64, 0, True, F16),
]


@pytest.mark.parametrize("case", DQK_LARGE, ids=str)
def test_dqktheta_large(case):
    B, S, G, H, N, A, chunk, nseq, dok, dtype = case
    inp = R.make_dqktheta_inputs(B, S, G, H, N, A, dtype, nseq=nseq, dok=dok, device=DEV)
    R.run_and_check_dqktheta(siso.compute_dqktheta, inp, chunk)


# ----------------------------------------------------------------------------- compute_ddt_dtrap

DDT_CASES = [
    # B, H, S, nseq, P, N
    (1, 1, 1, 0, 0, 0),
    (1, 1, 1, 0, 16, 16),
    (2, 4, 17, 0, 0, 0),
    (2, 3, 1, 0, 8, 16),
    (2, 4, 64, 0, 16, 32),
    (1, 4, 100, 3, 64, 128),
    (2, 4, 100, 0, 64, 128),
    (1, 8, 256, 4, 0, 0),
    (1, 8, 256, 1, 32, 64),
    (2, 32, 256, 0, 64, 128),
    (1, 4, 17, 2, 128, 256),
    (2, 2, 64, 0, 48, 80),
]


@pytest.mark.parametrize("dtype", [F32, F16, BF16], ids=str)
@pytest.mark.parametrize("case", DDT_CASES, ids=str)
def test_ddt(case, dtype):
    B, H, S, nseq, P, N = case
    inp = R.make_ddt_inputs(B, H, S, dtype, nseq=nseq, P=P, N=N, device=DEV,
                            seed=hash(case) % 1000)
    R.run_and_check_ddt(siso.compute_ddt_dtrap_dinput_states, inp)


@pytest.mark.parametrize("dtype,state_dtype", [(F32, BF16), (BF16, F32), (F16, F16)], ids=str)
def test_ddt_mixed_state_dtype(dtype, state_dtype):
    inp = R.make_ddt_inputs(2, 4, 50, dtype, P=32, N=64, state_dtype=state_dtype, device=DEV)
    R.run_and_check_ddt(siso.compute_ddt_dtrap_dinput_states, inp)


DDT_LARGE = [
    (4, 32, 2048, 0, 0, 0),
    (4, 32, 2048, 0, 64, 128),
    (8, 32, 4096, 0, 0, 0),
    (1, 32, 8192, 4, 64, 128),
    (2, 16, 2048, 0, 64, 64),
]


@pytest.mark.parametrize("case", DDT_LARGE, ids=str)
def test_ddt_large(case):
    B, H, S, nseq, P, N = case
    inp = R.make_ddt_inputs(B, H, S, F32, nseq=nseq, P=P, N=N, device=DEV)
    R.run_and_check_ddt(siso.compute_ddt_dtrap_dinput_states, inp)


# ----------------------------------------------------------------------------- API behaviour

@pytest.mark.parametrize("dtype", [F32, BF16], ids=str)
def test_out_api_poisoned(dtype):
    # Outputs start as NaN: an element the kernels do not write fails the comparison.
    inp = R.make_dqktheta_inputs(1, 300, 2, 8, 128, 32, dtype, nseq=3, dok=True, device=DEV)
    outs = R.dqktheta_outputs_like(inp)
    ret = R.run_and_check_dqktheta(lambda *a: siso.compute_dqktheta_out(*a, **outs), inp)
    assert all(r is o for r, o in zip(ret, outs.values()))
    inp = R.make_dqktheta_inputs(2, 129, 1, 4, 64, 32, dtype, dok=True, device=DEV)
    outs = R.dqktheta_outputs_like(inp)
    R.run_and_check_dqktheta(lambda *a: siso.compute_dqktheta_out(*a, **outs), inp)
    for P, N in ((0, 0), (64, 128)):
        inp = R.make_ddt_inputs(1, 8, 300, dtype, nseq=3, P=P, N=N, device=DEV)
        outs = R.ddt_outputs_like(inp)
        ret = R.run_and_check_ddt(
            lambda *a: siso.compute_ddt_dtrap_dinput_states_out(*a, **outs), inp)
        assert all(r is o for r, o in zip(ret, outs.values()) if o is not None)


def test_out_api_strided_outputs():
    # Outputs that are strided views: unit-stride ones are written in place, others through a
    # temporary that is copied back.
    inp = R.make_dqktheta_inputs(2, 40, 2, 4, 32, 8, BF16, dok=True, device=DEV)
    outs = R.dqktheta_outputs_like(inp)
    outs = {k: R.relayout(v, kind) for (k, v), kind in
            zip(outs.items(), ("pad", "outer", "T", "pad", "T", "pad", "step"))}
    for v in outs.values():
        v.fill_(float("nan"))
    R.run_and_check_dqktheta(lambda *a: siso.compute_dqktheta_out(*a, **outs), inp)


@pytest.mark.parametrize("dtype", [F32, BF16], ids=str)
def test_noncontiguous_inputs(dtype):
    inp = R.make_dqktheta_inputs(2, 77, 2, 4, 64, 20, dtype, dok=True, device=DEV)
    R.run_and_check_dqktheta(siso.compute_dqktheta, R.noncontiguous(inp))
    inp = R.make_dqktheta_inputs(1, 77, 1, 4, 128, 64, dtype, nseq=2, dok=True, device=DEV)
    R.run_and_check_dqktheta(siso.compute_dqktheta, R.noncontiguous(inp))
    inp = R.make_ddt_inputs(2, 4, 77, dtype, P=16, N=32, device=DEV)
    R.run_and_check_ddt(siso.compute_ddt_dtrap_dinput_states, R.noncontiguous(inp))


def test_deterministic():
    inp = R.make_dqktheta_inputs(1, 4096, 4, 16, 128, 32, BF16, nseq=4, dok=True, device=DEV)
    a = siso.compute_dqktheta(*R.dqk_args(inp), 64, inp["cu_seqlens"])
    b = siso.compute_dqktheta(*R.dqk_args(inp), 64, inp["cu_seqlens"])
    assert _equal_all(a, b)
    inp = R.make_dqktheta_inputs(4, 2048, 1, 32, 128, 32, BF16, dok=True, device=DEV)
    a = siso.compute_dqktheta(*R.dqk_args(inp))
    b = siso.compute_dqktheta(*R.dqk_args(inp))
    assert _equal_all(a, b)
    d = R.make_ddt_inputs(1, 32, 4096, F32, nseq=4, P=64, N=128, device=DEV)
    a = siso.compute_ddt_dtrap_dinput_states(*R.ddt_args(d), d["cu_seqlens"])
    b = siso.compute_ddt_dtrap_dinput_states(*R.ddt_args(d), d["cu_seqlens"])
    assert _equal_all(a, b)


def test_chunk_size_does_not_change_results():
    inp = R.make_dqktheta_inputs(2, 300, 1, 4, 64, 32, BF16, dok=True, device=DEV)
    ref = siso.compute_dqktheta(*R.dqk_args(inp), 64)
    for c in (16, 32, 128, 256):
        assert _equal_all(ref, siso.compute_dqktheta(*R.dqk_args(inp), c))


def test_int64_cu_seqlens_and_upstream_alias():
    inp = R.make_dqktheta_inputs(1, 500, 1, 4, 64, 32, BF16, nseq=4, dok=True, device=DEV,
                                 cu_dtype=torch.int64)
    R.run_and_check_dqktheta(siso.compute_dqktheta, inp)
    a = siso.compute_dqktheta(*R.dqk_args(inp), 64, inp["cu_seqlens"])
    b = siso.compute_dqktheta(*R.dqk_args(inp), 64, Cu_Seqlens=inp["cu_seqlens"])
    assert _equal_all(a, b)
    d = R.make_ddt_inputs(1, 4, 500, F32, nseq=4, P=16, N=32, device=DEV, cu_dtype=torch.int64)
    R.run_and_check_ddt(siso.compute_ddt_dtrap_dinput_states, d)
    a = siso.compute_ddt_dtrap_dinput_states(*R.ddt_args(d), Cu_Seqlens=d["cu_seqlens"])
    b = siso.compute_ddt_dtrap_dinput_states(*R.ddt_args(d), d["cu_seqlens"])
    assert _equal_all(a, b)


def test_custom_ops_match_eager_path():
    inp = R.make_dqktheta_inputs(1, 200, 2, 4, 64, 32, BF16, nseq=2, dok=True, device=DEV)
    eager = siso.compute_dqktheta(*R.dqk_args(inp), 64, inp["cu_seqlens"])
    op = torch.ops.mamba3.compute_dqktheta(*R.dqk_args(inp), 64, inp["cu_seqlens"])
    assert _equal_all(eager, op)
    d = R.make_ddt_inputs(2, 4, 200, F32, P=16, N=32, device=DEV)
    eager = siso.compute_ddt_dtrap_dinput_states(*R.ddt_args(d))
    op = torch.ops.mamba3.compute_ddt_dtrap_dinput_states(*R.ddt_args(d), None)
    assert _equal_all(eager, op)
    eager = siso.compute_ddt_dtrap_dinput_states(d["dscale"], d["dgamma"], d["dt"], d["trap"])
    op = torch.ops.mamba3.compute_ddt_dtrap(d["dscale"], d["dgamma"], d["dt"], d["trap"], None,
                                            None, None)
    assert _equal_all(eager[:2], op)


def test_side_stream():
    # Work goes to the current stream: results on a side stream equal the default stream's.
    inp = R.make_dqktheta_inputs(2, 1024, 1, 8, 128, 32, BF16, dok=True, device=DEV)
    ref = siso.compute_dqktheta(*R.dqk_args(inp))
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        got = siso.compute_dqktheta(*R.dqk_args(inp))
        d = R.make_ddt_inputs(2, 8, 1024, F32, P=16, N=32, device=DEV)
        got_d = siso.compute_ddt_dtrap_dinput_states(*R.ddt_args(d))
    s.synchronize()
    assert _equal_all(ref, got)
    assert _equal_all(siso.compute_ddt_dtrap_dinput_states(*R.ddt_args(d)), got_d)


def _pipeline(q, k, scale, gamma, qb, kb, ang, dqi, dki, dqk, dok, cu, dt, trap, dis, ks, vs):
    o = siso.compute_dqktheta(q, k, scale, gamma, qb, kb, ang, dqi, dki, dqk, dok, 64, cu)
    r = siso.compute_ddt_dtrap_dinput_states(o[5], o[6], dt, trap, dis, ks, vs, cu)
    r2 = siso.compute_ddt_dtrap_dinput_states(o[5] * 2, o[6], dt, trap, cu_seqlens=cu)
    return o + r + r2[:2]


def _pipeline_args(seed=0):
    inp = R.make_dqktheta_inputs(1, 600, 2, 8, 64, 32, BF16, nseq=3, dok=True, device=DEV,
                                 seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    H, S, nseq = 8, 600, 3
    dt = (torch.rand(1, H, S, generator=gen) * 0.5 + 0.01).to(DEV)
    trap = torch.randn(1, H, S, generator=gen).to(DEV)
    dis = torch.randn(nseq, H, 16, 64, generator=gen).to(DEV)
    ks = torch.randn(nseq, H, 64, generator=gen).to(DEV)
    vs = torch.randn(nseq, H, 16, generator=gen).to(DEV)
    return R.dqk_args(inp) + [inp["cu_seqlens"], dt, trap, dis, ks, vs]


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_torch_compile_fullgraph(backend):
    args = _pipeline_args()
    torch._dynamo.reset()
    compiled = torch.compile(_pipeline, fullgraph=True, backend=backend)
    got, want = compiled(*args), _pipeline(*args)
    assert len(got) == len(want) == 14
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        assert torch.equal(g, w)


def test_cuda_graph_capture_and_replay():
    static = _pipeline_args(seed=0)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):  # warm-up outside capture (library load, workspace size)
            _pipeline(*static)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        outs = _pipeline(*static)
    for seed in (5, 6):
        fresh = _pipeline_args(seed=seed)
        for dst, src in zip(static, fresh):
            dst.copy_(src)  # same cu_seqlens length: values may change between replays
        g.replay()
        torch.cuda.synchronize()
        want = _pipeline(*fresh)
        assert _equal_all(outs, want)


def test_cpu_tensors_through_the_same_front_end():
    inp = R.make_dqktheta_inputs(1, 60, 2, 4, 64, 32, BF16, nseq=2, dok=True, device="cpu")
    R.run_and_check_dqktheta(siso.compute_dqktheta, inp)
    d = R.make_ddt_inputs(2, 4, 60, F16, P=16, N=32, device="cpu")
    R.run_and_check_ddt(siso.compute_ddt_dtrap_dinput_states, d)


# ----------------------------------------------------------------------------- bad input

def _dqk():
    return R.make_dqktheta_inputs(2, 8, 2, 4, 16, 4, F32, dok=True, device=DEV)


@pytest.mark.parametrize("name,mutate", [
    ("q", lambda i: i.update(q=i["q"].double())),
    ("q", lambda i: i.update(q=i["q"][0])),
    ("k", lambda i: i.update(k=i["k"][:, :, :, :14])),
    ("k", lambda i: i.update(k=i["k"].cpu())),  # mixed devices
    ("dk_in", lambda i: i.update(dk_in=i["dk_in"].to(F16))),
    ("H % G", lambda i: i.update(q=torch.randn(2, 8, 3, 16, device=DEV),
                                 k=torch.randn(2, 8, 3, 16, device=DEV))),
    ("N=15", lambda i: i.update(q=torch.randn(2, 8, 2, 15, device=DEV),
                                k=torch.randn(2, 8, 2, 15, device=DEV))),
    ("angles", lambda i: i.update(angles=torch.randn(2, 8, 4, 9, device=DEV))),
    ("d_ok_state", lambda i: i.update(d_ok_state=torch.randn(3, 4, 16, device=DEV))),
    ("dqk", lambda i: i.update(dqk=i["dqk"].to(torch.int32))),
    ("cu_seqlens", lambda i: i.update(cu_seqlens=torch.tensor([0, 4, 8], dtype=torch.int32,
                                                              device=DEV))),  # B=2
    ("cu_seqlens", lambda i: i.update(cu_seqlens=torch.tensor([0.0, 8.0], device=DEV))),
])
def test_dqktheta_bad_input(name, mutate):
    inp = _dqk()
    mutate(inp)
    with pytest.raises(ValueError, match=re.escape(name)):
        siso.compute_dqktheta(*R.dqk_args(inp), 64, inp["cu_seqlens"])


def test_bad_chunk_size_and_outputs():
    inp = _dqk()
    with pytest.raises(ValueError, match="chunk_size"):
        siso.compute_dqktheta(*R.dqk_args(inp), 48)
    outs = R.dqktheta_outputs_like(inp)
    outs["dq_bias"] = outs["dq_bias"].to(BF16)
    with pytest.raises(ValueError, match="dq_bias"):
        siso.compute_dqktheta_out(*R.dqk_args(inp), **outs)
    outs = R.dqktheta_outputs_like(inp)
    outs["dgamma"] = outs["dgamma"].cpu()
    with pytest.raises(ValueError, match="dgamma"):
        siso.compute_dqktheta_out(*R.dqk_args(inp), **outs)


def test_ddt_bad_input():
    d = R.make_ddt_inputs(2, 4, 8, F32, P=4, N=8, device=DEV)
    with pytest.raises(ValueError, match="input_k_state"):
        siso.compute_ddt_dtrap_dinput_states(d["dscale"], d["dgamma"], d["dt"], d["trap"],
                                             d["d_issm_state"], None, d["input_v_state"])
    with pytest.raises(ValueError, match="input_v_state"):
        siso.compute_ddt_dtrap_dinput_states(d["dscale"], d["dgamma"], d["dt"], d["trap"],
                                             None, None, d["input_v_state"])
    with pytest.raises(ValueError, match="dt"):
        siso.compute_ddt_dtrap_dinput_states(d["dscale"], d["dgamma"], d["dt"][:, :, :5],
                                             d["trap"])
    with pytest.raises(ValueError, match="trap"):
        siso.compute_ddt_dtrap_dinput_states(d["dscale"], d["dgamma"], d["dt"],
                                             d["trap"].cpu())
    with pytest.raises(ValueError, match="d_issm_state"):
        siso.compute_ddt_dtrap_dinput_states(d["dscale"], d["dgamma"], d["dt"], d["trap"],
                                             d["d_issm_state"][:1], d["input_k_state"],
                                             d["input_v_state"])
    with pytest.raises(ValueError, match="cu_seqlens"):
        siso.compute_ddt_dtrap_dinput_states(*R.ddt_args(d), torch.tensor(
            [0, 3, 8], dtype=torch.int32, device=DEV))
