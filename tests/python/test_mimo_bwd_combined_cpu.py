"""mamba3_mimo_bwd_combined through the PyTorch front end on CPU tensors, against torch.autograd
of the chunked forward as a function of the raw inputs (mimo_ref.combined_reference), which is
itself checked against the sequential recurrence's autograd here. Needs torch, no GPU.
"""
import pytest

torch = pytest.importorskip("torch")

import mimo_ref as M  # noqa: E402
from mamba3_kernels import mimo  # noqa: E402

F32, F16, BF16, F64 = torch.float32, torch.float16, torch.bfloat16, torch.float64


def test_reference_equals_autograd_of_the_recurrence():
    # The chunked reference's gradients equal those of the sequential recurrence (from adt).
    inp = M.make_inputs(1, 11, 4, 2, 8, 4, 2, 4, z=True, d=True, norm=True, act=F64, param=F64,
                        decay=F64, seed=4, nan_unread=False)
    gold = M.combined_reference(inp)
    leaves = {}
    x = dict(inp)
    with torch.enable_grad():
        for out, name in M._RAW.items():
            t = inp[name].detach().clone().requires_grad_(True)
            leaves[out] = x[name] = t
        y, _ = M.sequential_readout(x, leaves["dadt"])
        loss = (inp["dout"] * M.project(x, y)).sum()
        got = torch.autograd.grad(loss, list(leaves.values()))
    for (n, _), g in zip(leaves.items(), got):
        assert torch.allclose(gold[n], g, rtol=1e-9, atol=1e-12), n


CASES = [
    # B, S, H, G, N, P, R, C, options, dtypes, out
    (2, 33, 4, 2, 16, 16, 2, 16, dict(z=True, d=True), dict(act=BF16), None),
    (1, 40, 2, 1, 32, 16, 4, 8, dict(z=True, norm=True), dict(), F32),
    (1, 50, 2, 2, 16, 32, 1, 32, dict(reduce_o=False, z=True, d=True), dict(act=F16), F16),
    (2, 20, 2, 1, 16, 8, 2, 8, dict(d=True), dict(act=BF16, param=BF16, decay=BF16), BF16),
    (1, 5, 2, 1, 16, 8, 8, 8, dict(reduce_o=False), dict(), None),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"S{c[1]}R{c[6]}C{c[7]}-" + "-".join(
    k for k, v in c[8].items() if v))
def test_matches_reference(case):
    B, S, H, G, N, P, R, C, opts, dts, out = case
    inp = M.make_inputs(B, S, H, G, N, P, R, C, seed=S + R, **opts, **dts)
    a, kw = M.combined_args(inp)
    res = mimo.mamba3_mimo_bwd_combined(*a, **kw, output_dtype=out)
    assert len(res) == 15
    failures = M.check_combined(res, inp, out)
    assert not failures, "\n".join(failures)


def test_absent_outputs_and_dtypes():
    inp = M.make_inputs(1, 12, 2, 1, 16, 8, 2, 8, reduce_o=False, act=BF16, seed=3)
    a, kw = M.combined_args(inp)
    res = dict(zip(M.COMBINED_OUTPUTS, mimo.mamba3_mimo_bwd_combined(*a, **kw)))
    for n in ("dmimo_z", "dmimo_o", "dd", "dz", "dnorm_weight"):
        assert res[n] is None, n
    assert res["dq"].dtype == BF16 and res["dq"].shape == inp["q"].shape
    assert res["dadt"].dtype == F32 and res["dq_bias"].shape == inp["q_bias"].shape


def test_custom_op_compile_and_fake():
    inp = M.make_inputs(1, 13, 2, 1, 16, 8, 2, 8, z=True, d=True, norm=True, seed=5)
    a, kw = M.combined_args(inp)
    eager = mimo.mamba3_mimo_bwd_combined(*a, **kw)

    def f(*args):
        return mimo.mamba3_mimo_bwd_combined(*args, **kw)

    torch._dynamo.reset()
    got = torch.compile(f, fullgraph=True, backend="aot_eager")(*a)
    assert all((e is None and g is None) or torch.equal(e, g) for e, g in zip(eager, got))
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode() as mode:
        fa = [mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in a]
        fkw = {k: mode.from_tensor(v) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
        fake = mimo.mamba3_mimo_bwd_combined(*fa, **fkw)
    for e, f_ in zip(eager, fake):
        assert (e is None) == (f_ is None)
        if e is not None:
            assert e.shape == f_.shape and e.dtype == f_.dtype


def test_bad_input_is_named():
    inp = M.make_inputs(1, 12, 2, 1, 16, 8, 2, 8, z=True, seed=6)
    a, kw = M.combined_args(inp)
    a[9] = None  # mimo_z without z
    with pytest.raises(ValueError, match="z and mimo_z"):
        mimo.mamba3_mimo_bwd_combined(*a, **kw)
