"""mamba3_mimo_bwd_bwd through the PyTorch front end on CPU tensors (the library's CPU backend),
against the float64 autograd reference of mimo_ref.py (bwd_bwd_reference), and checks of that
reference itself against finite differences of the chunked forward.

Needs torch (skipped without it) but no GPU. Small: the CPU backend's full case grid is in the
C++ suite (tests/cpp/test_mimo_bwd_bwd_cpu.cpp).
"""
import math
import re

import pytest

torch = pytest.importorskip("torch")

import mimo_ref as M  # noqa: E402
from mamba3_kernels import mimo  # noqa: E402

F32, F16, BF16, F64 = torch.float32, torch.float16, torch.bfloat16, torch.float64


def _call(inp, **extra):
    a, kw = M.bb_args(inp)
    kw.update(extra)
    return mimo.mamba3_mimo_bwd_bwd(*a, **kw)


def _equal_all(a, b):
    return a.keys() == b.keys() and all(
        (a[n] is None and b[n] is None) or torch.equal(a[n], b[n]) for n in a)


# ----------------------------------------------------------------------------- the reference

@pytest.mark.parametrize("layout,S", [("reduce", 8), ("rank", 8), ("packed", 7)])
def test_reference_matches_finite_differences(layout, S):
    # The reference's gradients against central differences of L = sum dL/dy . y, with y from
    # chunked_readout (independent code that recomputes the states), on a tiny float64 problem.
    B, H, G, N, P, R, C = 1, 4, 2, 8, 4, 2, 4
    inp = M.make_bwd_bwd_inputs(B, S, H, G, N, P, R, C, layout=layout, cache=F64, d=True,
                                act=F64, param=F64, decay=F64, seed=21, nan_unread=False)
    gold = M.bwd_bwd_reference(inp)
    eps = 1e-6

    def loss(**over):
        x = dict(inp, **over)
        y, _, _ = M.chunked_readout(x)  # [B,S,R,H,P]
        d = x["dout"]
        if layout == "reduce":
            g = d[:, :, None] * x["mimo_o"].permute(1, 0, 2)
        elif layout == "rank":
            g = d
        else:
            g = d.view(B, H, S, R, P).permute(0, 2, 3, 1, 4)
        return (g * y).sum().item()

    def fd(name, idx):
        plus, minus = inp[name].clone(), inp[name].clone()
        plus[idx] += eps
        minus[idx] -= eps
        return (loss(**{name: plus}) - loss(**{name: minus})) / (2 * eps)

    def close(got, want):
        assert math.isclose(got, want, rel_tol=1e-6, abs_tol=1e-8), (got, want)

    # q / k of group g: the per-head gradients summed over the heads of the group.
    for (b, t, r, g, n) in ((0, 1, 1, 1, 3), (0, S - 1, 0, 0, 6)):
        for name, out in (("q", "DQ"), ("k", "DK")):
            per = gold[out].view(B, S, R, H, N)[b, t, r, g * 2:(g + 1) * 2, n].sum().item()
            close(per, fd(name, (b, t, r, g, n)))
    close(gold["DV"][0, 2, 1, 3].item(), fd("v", (0, 2, 1, 3)))
    close(gold["DMIMO_V"][0, 3, 1, 2].item(), fd("mimo_v", (3, 1, 2)))
    close(gold["DANGLES"][0, 5, 2, 1].item(), fd("angles", (0, 5, 2, 1)))
    close(gold["DD"][0, 1].item(), fd("d", (1,)))
    # The decay factors: d/dda_cs = E DDA_CS (+ DDA at a chunk's last step), d/dda_cs_rev =
    # F DDA_CS_REV, d/dsegsum[c,i,j] = exp(segsum) DSSDA[c,j,i] (whole chunks only: a partial
    # chunk rebuilds its decays from da_cs).
    for t in (1, 3):
        want = math.exp(inp["da_cs"][0, 1, t]) * gold["DDA_CS"][0, 1, t].item()
        if t == 3:
            want += gold["DDA"][0, 1, t].item()
        close(want, fd("da_cs", (0, 1, t)))
    close(math.exp(inp["da_cs_rev"][0, 2, 2]) * gold["DDA_CS_REV"][0, 2, 2].item(),
          fd("da_cs_rev", (0, 2, 2)))
    close(math.exp(inp["segsum"][0, 3, 0, 3, 1]) * gold["DSSDA"][0, 3, 0, 1, 3].item(),
          fd("segsum", (0, 3, 0, 3, 1)))
    # DFACTOR and DGAMMA through dt: lam (DGAMMA + DFACTOR)_t + (1 - lam_t) DFACTOR_{t-1}.
    t = 2
    lam = torch.sigmoid(inp["trap"][0, 0, t]).item()
    want = lam * (gold["DGAMMA"][0, 0, t] + gold["DFACTOR"][0, 0, t]).item() \
        + (1 - lam) * gold["DFACTOR"][0, 0, t - 1].item()
    close(want, fd("dt", (0, 0, t)))


def test_reference_partial_chunk_zeroes_dssda_outside():
    inp = M.make_bwd_bwd_inputs(1, 6, 2, 1, 8, 4, 2, 4, seed=3)
    g = M.bwd_bwd_reference(inp)["DSSDA"]
    L = 6 - 4
    assert torch.all(g[:, :, -1, L:, :] == 0) and torch.all(g[:, :, -1, :, L:] == 0)
    assert g[:, :, -1, :L, :L].abs().max() > 0
    assert g[:, :, 0].triu(1).abs().max() > 0  # unmasked above the diagonal (upstream's layout)


# ----------------------------------------------------------------------------- numerics

CASES = [
    # B, S, H, G, N, P, R, C, layout, dtypes, cache, out, d, rdd
    (2, 33, 4, 2, 16, 16, 2, 16, "reduce", dict(act=BF16), F32, None, True, 4),
    (1, 50, 2, 1, 32, 32, 4, 8, "rank", dict(act=F16, param=F16, decay=F16), BF16, F32, False, 2),
    (1, 40, 2, 2, 16, 32, 1, 32, "packed", dict(), F32, None, True, 4),
    (2, 64, 2, 1, 64, 16, 8, 16, "reduce", dict(act=BF16, param=BF16, decay=BF16), BF16, BF16,
     False, 4),
    (1, 5, 2, 1, 16, 8, 2, 8, "packed", dict(act=F16), F16, F16, True, 2),
    (1, 100, 2, 1, 32, 16, 2, 32, "rank", dict(act=BF16, trap=BF16), F32, None, True, 4),
    (2, 17, 4, 4, 16, 8, 4, 64, "reduce", dict(), F32, F32, False, 4),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"S{c[1]}R{c[6]}C{c[7]}-{c[8]}")
def test_matches_reference(case):
    B, S, H, G, N, P, R, C, layout, dts, cache, out, d, rdd = case
    inp = M.make_bwd_bwd_inputs(B, S, H, G, N, P, R, C, layout=layout, cache=cache, d=d, rdd=rdd,
                                seed=S + R, **dts)
    res = _call(inp, output_dtype=out)
    failures = M.check_bwd_bwd(res, inp, out)
    assert not failures, "\n".join(failures)


def test_noncontiguous_inputs_equal_contiguous():
    inp = M.make_bwd_bwd_inputs(2, 30, 2, 1, 32, 16, 2, 8, layout="rank", act=F16, d=True, seed=8)
    ref = _call(inp)
    strided = dict(M.noncontiguous(inp))
    for i, n in enumerate(("states", "qk_dot")):
        strided[n] = M.relayout(inp[n], ("T", "outer")[i])
    assert _equal_all(ref, _call(strided))


def test_deterministic_keys_shapes_and_dtypes():
    inp = M.make_bwd_bwd_inputs(2, 45, 4, 2, 32, 16, 4, 16, act=BF16, d=True, seed=9)
    r1, r2 = _call(inp), _call(inp)
    assert tuple(r1) == M.BB_OUTPUTS and _equal_all(r1, r2)
    B, S, R, G, N = inp["q"].shape
    H, P = inp["v"].shape[2:]
    want = dict(DQ=((B, S * R, H, N), BF16), DK=((B, S * R, H, N), BF16), DV=((B, S, H, P), BF16),
                DMIMO_V=((B, H, R, P), F32), DANGLES=((B, S, H, N // 4), F32),
                DFACTOR=((B, H, S), F32), DGAMMA=((B, H, S), F32), DDA=((B, H, S), F32),
                DSSDA=((B, H, 3, 16, 16), F32), DDA_CS_REV=((B, H, S), F32),
                DDA_CS=((B, H, S), F32), DD=((B, H), F32))
    assert {n: (tuple(t.shape), t.dtype) for n, t in r1.items()} == want
    r3 = _call(inp, output_dtype=F32, d=None)
    assert r3["DD"] is None and r3["DQ"].dtype == r3["DV"].dtype == F32


def test_d_alias_and_top_level_export():
    import mamba3_kernels
    inp = M.make_bwd_bwd_inputs(1, 10, 2, 1, 16, 8, 2, 8, d=True, seed=10)
    a, kw = M.bb_args(inp)
    d = kw.pop("d")
    assert _equal_all(mamba3_kernels.mamba3_mimo_bwd_bwd(*a, d=d, **kw),
                      mimo.mamba3_mimo_bwd_bwd(*a, D=d, **kw))
    with pytest.raises(TypeError):
        mimo.mamba3_mimo_bwd_bwd(*a, d=d, D=d, **kw)


def test_custom_op_matches_eager_path():
    for layout, d in (("reduce", True), ("rank", False), ("packed", True)):
        inp = M.make_bwd_bwd_inputs(2, 21, 2, 1, 16, 8, 2, 8, layout=layout, d=d, seed=11)
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


def test_torch_compile_fullgraph_cpu():
    inp = M.make_bwd_bwd_inputs(1, 19, 2, 1, 16, 8, 2, 8, d=True, seed=12)
    a, kw = M.bb_args(inp)

    def f(*args):
        o = mimo.mamba3_mimo_bwd_bwd(*args, **kw)
        return o["DQ"].float().sum() + o["DSSDA"].sum() + o["DD"].sum(), o["DV"]

    torch._dynamo.reset()
    got = torch.compile(f, fullgraph=True, backend="aot_eager")(*a)
    want = f(*a)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_fake_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode
    for layout, d in (("reduce", True), ("packed", False)):
        inp = M.make_bwd_bwd_inputs(2, 13, 4, 2, 32, 16, 2, 8, layout=layout, d=d, act=BF16,
                                    seed=13)
        a, kw = M.bb_args(inp)
        real = mimo.mamba3_mimo_bwd_bwd(*a, **kw)
        with FakeTensorMode() as mode:
            fa = [mode.from_tensor(t) for t in a]
            fkw = {k: mode.from_tensor(v) if isinstance(v, torch.Tensor) else v
                   for k, v in kw.items()}
            fake = mimo.mamba3_mimo_bwd_bwd(*fa, **fkw)
        for n in M.BB_OUTPUTS:
            assert (real[n] is None) == (fake[n] is None), n
            if real[n] is not None:
                assert real[n].shape == fake[n].shape and real[n].dtype == fake[n].dtype, n


# ----------------------------------------------------------------------------- bad input

def _small(**over):
    kw = dict(d=True)
    kw.update(over)
    return M.make_bwd_bwd_inputs(2, 12, 4, 2, 16, 8, 2, 8, seed=14, **kw)


@pytest.mark.parametrize("name,mutate", [
    ("q", lambda i: i.update(q=i["q"].double())),
    ("k", lambda i: i.update(k=i["k"][..., :14])),
    ("H % G", lambda i: i.update(q=torch.randn(2, 12, 2, 3, 16), k=torch.randn(2, 12, 2, 3, 16))),
    ("states", lambda i: i.update(states=i["states"][:, :, :1])),
    ("qk_dot", lambda i: i.update(qk_dot=i["qk_dot"].to(torch.int32))),
    ("dout", lambda i: i.update(dout=torch.randn(2, 12, 2, 4, 8))),  # per-rank dout with mimo_o
    ("segsum", lambda i: i.update(segsum=i["segsum"][:, :, :, :4])),
    ("angles", lambda i: i.update(angles=i["angles"][..., :3])),
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
