"""mamba3_mimo_bwd_fwd through the PyTorch front end on CPU tensors (the library's CPU backend),
and checks of the torch reference itself (mimo_ref.py).

Needs torch (skipped without it) but no GPU. Small: the CPU backend's full case grid is in the
C++ suite (tests/cpp/test_mimo_bwd_fwd_cpu.cpp); the CUDA suite is test_mimo_bwd_fwd_cuda.py.
"""
import math
import re

import pytest

torch = pytest.importorskip("torch")

import mimo_ref as M  # noqa: E402
from mamba3_kernels import mimo  # noqa: E402

DEV = "cpu"
F32, F16, BF16, F64 = torch.float32, torch.float16, torch.bfloat16, torch.float64


def _equal_all(a, b):
    return len(a) == len(b) and all((x is None and y is None) or torch.equal(x, y)
                                    for x, y in zip(a, b))


# ----------------------------------------------------------------------------- the reference

@pytest.mark.parametrize("B,S,H,G,N,P,R,C,rdd", [
    (2, 33, 4, 2, 16, 8, 2, 16, 4),   # partial last chunk, GQA
    (1, 50, 2, 1, 32, 16, 4, 8, 2),   # partial, divisor 2
    (2, 64, 2, 2, 16, 4, 1, 32, 4),   # whole chunks, R = 1
    (1, 5, 1, 1, 8, 4, 3, 8, 2),      # one partial chunk shorter than C
])
def test_reference_chunked_equals_sequential(B, S, H, G, N, P, R, C, rdd):
    # The chunked form (from da_cs / da_cs_rev / segsum, NaN where not to be read) and the
    # recurrence (from adt) are two writings of one model: they agree to float64 rounding.
    inp = M.make_inputs(B, S, H, G, N, P, R, C, rdd=rdd, d=True, z=True, norm=True,
                        decay=F64, seed=B * S + N)
    y, states, _ = M.chunked_readout(inp)
    ys, states_s = M.sequential_readout(inp, inp["_adt"])
    assert torch.isfinite(y).all() and torch.isfinite(states).all()
    assert (y - ys).abs().max() <= 1e-12 * ys.abs().max()
    assert (states - states_s).abs().max() <= 1e-12 * max(states_s.abs().max(), 1e-30)


def test_reference_gradients_match_finite_differences():
    # dmimo_o / dmimo_z / dz / dnorm_weight / dout_pre_rms of sum(dout * out), central
    # differences on a tiny float64 problem (per-batch gradients: perturb one batch's copy).
    inp = M.make_inputs(2, 7, 2, 1, 8, 4, 2, 8, z=True, d=True, norm=True, decay=F64,
                        act=F64, param=F64, seed=3, nan_unread=False)
    gold = M.reference(inp)
    y, _, _ = M.chunked_readout(inp)
    B, S, R, H, P = y.shape
    eps = 1e-6

    def loss(yv=y, mo=None, mz=None, z=None, nw=None):
        return (inp["dout"] * M.project(inp, yv, F64, mo, mz, z, nw)).sum().item()

    def per_step(w):
        return w.permute(1, 0, 2).expand(B, S, R, H, P).clone()
    cases = [("dmimo_o", "mo", per_step(inp["mimo_o"])), ("dmimo_z", "mz", per_step(inp["mimo_z"])),
             ("dnorm_weight", "nw", inp["norm_weight"].expand(B, S, R, H, P).clone())]
    for name, arg, base in cases:
        for (b, h, r, p) in ((0, 1, 1, 2), (1, 0, 0, 3)):
            plus, minus = base.clone(), base.clone()
            plus[b, :, r, h, p] += eps
            minus[b, :, r, h, p] -= eps
            fd = (loss(**{arg: plus}) - loss(**{arg: minus})) / (2 * eps)
            assert math.isclose(gold[name][b, h, r, p].item(), fd, rel_tol=1e-6, abs_tol=1e-8)
    for (b, t, h, p) in ((0, 3, 1, 1), (1, 6, 0, 2)):
        plus, minus = inp["z"].clone(), inp["z"].clone()
        plus[b, t, h, p] += eps
        minus[b, t, h, p] -= eps
        fd = (loss(z=plus) - loss(z=minus)) / (2 * eps)
        assert math.isclose(gold["dz"][b, t, h, p].item(), fd, rel_tol=1e-6, abs_tol=1e-8)
    for (b, t, r, h, p) in ((0, 2, 1, 1, 0), (1, 5, 0, 0, 3)):
        plus, minus = y.clone(), y.clone()
        plus[b, t, r, h, p] += eps
        minus[b, t, r, h, p] -= eps
        fd = (loss(yv=plus) - loss(yv=minus)) / (2 * eps)
        got = gold["dout_pre_rms"][b, h, t * R + r, p].item()
        assert math.isclose(got, fd, rel_tol=1e-6, abs_tol=1e-8)


def test_pairwise_grid_covers_every_pair():
    import itertools
    sizes = [3, 2, 4, 2]
    rows = M.pairwise(sizes, lambda a: not (a[0] == 2 and a[1] == 1), seed=1)
    for i, j in itertools.combinations(range(4), 2):
        for vi in range(sizes[i]):
            for vj in range(sizes[j]):
                if {i, j} == {0, 1} and (vi, vj) == ((2, 1) if i == 0 else (1, 2)):
                    continue
                assert any(r[i] == vi and r[j] == vj for r in rows), (i, vi, j, vj)
    assert not any(r[0] == 2 and r[1] == 1 for r in rows)
    cases = M.grid()
    assert {(c["S"], c["chunk_size"]) for c in cases} >= {(s, c) for s in (33, 40, 50, 100)
                                                          for c in (16, 32)}
    assert all(c["reduce_o"] for c in cases if c["norm"])


# ----------------------------------------------------------------------------- numerics

@pytest.mark.parametrize("case", M.grid()[::5], ids=lambda c: c["id"])
def test_grid_subset(case):
    inp = M.case_inputs(case, DEV, seed=7)
    M.run_and_check(mimo.mamba3_mimo_bwd_fwd, inp, case["out"])


@pytest.mark.parametrize("od", [F32, BF16], ids=str)
def test_out_api_poisoned_and_strided_outputs(od):
    inp = M.make_inputs(2, 37, 4, 2, 32, 16, 2, 16, act=BF16, z=True, d=True, norm=True, seed=5)
    outs = M.outputs_like(inp, od)
    outs["dz"] = M.relayout(outs["dz"], "T")        # through a temporary, copied back
    outs["states"] = M.relayout(outs["states"], "pad")  # written in place (row stride)
    ret = M.run_and_check(lambda *a, output_dtype, **k: mimo.mamba3_mimo_bwd_fwd_out(
        *a, **k, **outs), inp, od)
    assert all(M.as_dict(ret)[n] is o for n, o in outs.items())
    inp = M.make_inputs(1, 20, 2, 1, 16, 8, 4, 8, reduce_o=False, seed=6)
    outs = M.outputs_like(inp, od)
    ret = M.run_and_check(lambda *a, output_dtype, **k: mimo.mamba3_mimo_bwd_fwd_out(
        *a, **k, **outs), inp, od)
    assert ret[2] is None and ret[3] is None and ret[4] is None


def test_noncontiguous_inputs_equal_contiguous():
    inp = M.make_inputs(2, 30, 2, 1, 32, 16, 2, 8, act=F16, z=True, d=True, seed=8)
    a, kw = M.op_args(inp)
    ref = mimo.mamba3_mimo_bwd_fwd(*a, **kw)
    a2, kw2 = M.op_args(M.noncontiguous(inp))
    assert _equal_all(ref, mimo.mamba3_mimo_bwd_fwd(*a2, **kw2))


def test_deterministic_and_tuple_shapes():
    inp = M.make_inputs(2, 45, 2, 2, 64, 32, 4, 16, act=BF16, z=True, d=True, norm=True, seed=9)
    a, kw = M.op_args(inp)
    r1 = mimo.mamba3_mimo_bwd_fwd(*a, output_dtype=BF16, **kw)
    r2 = mimo.mamba3_mimo_bwd_fwd(*a, output_dtype=BF16, **kw)
    assert len(r1) == 7 and _equal_all(r1, r2)
    B, S, R, G, N = inp["q"].shape
    H, P = inp["v"].shape[2:]
    want = [((B, H, 3, N, P), BF16), ((B, H, S, R, R), BF16), ((B, H, R, P), F32),
            ((B, H, R, P), F32), ((B, S, H, P), BF16), ((B, H, R, P), F32),
            ((B, H, S * R, P), BF16)]
    assert [(tuple(t.shape), t.dtype) for t in r1] == want
    kw.pop("norm_weight"), kw.pop("norm_eps")
    r3 = mimo.mamba3_mimo_bwd_fwd(*a, **kw)
    assert len(r3) == 5 and r3[0].dtype == F32


def test_d_alias_and_top_level_export():
    import mamba3_kernels
    inp = M.make_inputs(1, 10, 2, 1, 16, 8, 2, 8, d=True, seed=10)
    a, kw = M.op_args(inp)
    d = kw.pop("d")
    assert _equal_all(mamba3_kernels.mamba3_mimo_bwd_fwd(*a, d=d, **kw),
                      mimo.mamba3_mimo_bwd_fwd(*a, D=d, **kw))
    with pytest.raises(TypeError):
        mimo.mamba3_mimo_bwd_fwd(*a, d=d, D=d, **kw)


def test_custom_op_matches_eager_path():
    for kw_case in (dict(z=True, d=True, norm=True), dict(reduce_o=False, z=True), dict()):
        inp = M.make_inputs(2, 21, 2, 1, 16, 8, 2, 8, seed=11, **kw_case)
        a, kw = M.op_args(inp)
        eager = mimo.mamba3_mimo_bwd_fwd(*a, output_dtype=F16, **kw)
        op = torch.ops.mamba3.mimo_bwd_fwd(*a, kw["mimo_z"], kw["d"], kw["z"],
                                           kw.get("norm_weight"), kw.get("norm_eps", 1e-5),
                                           kw["chunk_size"], kw["rotary_dim_divisor"], F16)
        assert len(op) == 7
        for e, o in zip(eager + (None,) * (7 - len(eager)), op):
            if e is None:
                assert o.numel() == 0
            else:
                assert torch.equal(e, o)


def test_torch_compile_fullgraph_cpu():
    inp = M.make_inputs(1, 19, 2, 1, 16, 8, 2, 8, z=True, d=True, norm=True, seed=12)
    a, kw = M.op_args(inp)

    def f(*args):
        o = mimo.mamba3_mimo_bwd_fwd(*args, **kw)
        kw2 = {k: v for k, v in kw.items() if k not in ("norm_weight", "norm_eps")}
        return o + mimo.mamba3_mimo_bwd_fwd(*args, **kw2, output_dtype=BF16)

    torch._dynamo.reset()
    got = torch.compile(f, fullgraph=True, backend="aot_eager")(*a)
    want = f(*a)
    assert len(got) == len(want) == 12
    assert _equal_all(got, want)


def test_fake_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode
    for kw_case in (dict(z=True, d=True, norm=True), dict(reduce_o=False, z=True)):
        inp = M.make_inputs(2, 13, 4, 2, 32, 16, 2, 8, act=BF16, seed=13, **kw_case)
        a, kw = M.op_args(inp)
        real = mimo.mamba3_mimo_bwd_fwd(*a, output_dtype=F16, **kw)
        with FakeTensorMode() as mode:
            fa = [None if t is None else mode.from_tensor(t) for t in a]
            fkw = {k: mode.from_tensor(v) if isinstance(v, torch.Tensor) else v
                   for k, v in kw.items()}
            fake = mimo.mamba3_mimo_bwd_fwd(*fa, output_dtype=F16, **fkw)
        assert len(real) == len(fake)
        for r, f in zip(real, fake):
            assert (r is None) == (f is None)
            if r is not None:
                assert r.shape == f.shape and r.dtype == f.dtype


# ----------------------------------------------------------------------------- bad input

def _small(**over):
    kw = dict(z=True, d=True)
    kw.update(over)
    return M.make_inputs(2, 12, 4, 2, 16, 8, 2, 8, seed=14, **kw)


def _call(inp, **extra):
    a, kw = M.op_args(inp)
    kw.update(extra)
    return mimo.mamba3_mimo_bwd_fwd(*a, **kw)


@pytest.mark.parametrize("name,mutate", [
    ("q", lambda i: i.update(q=i["q"].double())),
    ("q", lambda i: i.update(q=i["q"][0])),
    ("k", lambda i: i.update(k=i["k"][..., :14])),
    ("v", lambda i: i.update(v=i["v"][:, :, :, None])),
    ("H % G", lambda i: i.update(q=torch.randn(2, 12, 2, 3, 16), k=torch.randn(2, 12, 2, 3, 16))),
    ("R=9", lambda i: i.update(q=torch.randn(2, 12, 9, 2, 16), k=torch.randn(2, 12, 9, 2, 16))),
    ("angles", lambda i: i.update(angles=i["angles"][..., :3])),
    ("segsum", lambda i: i.update(segsum=i["segsum"][:, :, :1])),
    ("dout", lambda i: i.update(dout=torch.randn(2, 12, 2, 4, 8))),  # per-rank dout with mimo_o
    ("mimo_v", lambda i: i.update(mimo_v=i["mimo_v"].to(torch.int32))),
    ("da_cs_rev", lambda i: i.update(da_cs_rev=i["da_cs_rev"][:, :, :5])),
    ("z and mimo_z", lambda i: i.update(mimo_z=None)),
    ("d", lambda i: i.update(d=torch.randn(3))),
    ("trap", lambda i: i.update(trap=None)),
])
def test_bad_input(name, mutate):
    inp = _small()
    mutate(inp)
    with pytest.raises(ValueError, match=re.escape(name)):
        _call(inp)


def test_bad_options():
    inp = _small()
    with pytest.raises(ValueError, match="chunk_size"):
        _call(inp, chunk_size=12)
    with pytest.raises(ValueError, match="rotary_dim_divisor"):
        _call(inp, rotary_dim_divisor=3)
    with pytest.raises(ValueError, match="output_dtype"):
        _call(inp, output_dtype=torch.float64)
    with pytest.raises(TypeError, match="chunk_size"):
        _call(inp, chunk_size=16.0)
    with pytest.raises(ValueError, match="norm_weight"):  # the norm needs mimo_o
        a, kw = M.op_args(M.make_inputs(1, 8, 2, 1, 16, 8, 2, 8, reduce_o=False, z=True, seed=1))
        mimo.mamba3_mimo_bwd_fwd(*a, **kw, norm_weight=torch.ones(2, 8))
    with pytest.raises(ValueError, match="norm_weight"):  # ... and the gate
        a, kw = M.op_args(M.make_inputs(1, 8, 2, 1, 16, 8, 2, 8, seed=1))
        mimo.mamba3_mimo_bwd_fwd(*a, **kw, norm_weight=torch.ones(2, 8))
    with pytest.raises(ValueError, match="norm_eps"):
        _call(inp, norm_weight=torch.ones(4, 8), norm_eps=0.0)


def test_bad_outputs():
    inp = _small()
    a, kw = M.op_args(inp)
    outs = M.outputs_like(inp, F32)
    outs["dmimo_o"] = outs["dmimo_o"].to(BF16)
    with pytest.raises(ValueError, match="dmimo_o"):
        mimo.mamba3_mimo_bwd_fwd_out(*a, **kw, **outs)
    outs = M.outputs_like(inp, BF16)
    outs["qk_dot"] = outs["qk_dot"].float()  # the output dtype is that of states
    with pytest.raises(ValueError, match="qk_dot"):
        mimo.mamba3_mimo_bwd_fwd_out(*a, **kw, **outs)
    outs = M.outputs_like(inp, F32)
    del outs["dz"]
    with pytest.raises(ValueError, match="dz"):
        mimo.mamba3_mimo_bwd_fwd_out(*a, **kw, **outs)
