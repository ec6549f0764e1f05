"""The PyTorch front end on CPU tensors (the library's CPU backend), and the ctypes/DLPack layer.

Needs torch (skipped without it) but no GPU. The CUDA suite is test_siso_bwd_cuda.py.
"""
import ctypes
import os
import re
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

import siso_ref as R  # noqa: E402
from mamba3_kernels import _dlpack, _lib, siso  # noqa: E402

DEV = "cpu"
F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


# ----------------------------------------------------------------------------- ctypes / DLPack

def test_dltensor_layout_matches_c():
    # The struct format used for packing agrees with ctypes' C layout of dlpack.h's DLTensor.
    T = _dlpack.DLTensor
    assert ctypes.sizeof(T) == _dlpack.DLTENSOR_SIZE == 48
    assert (T.data.offset, T.device.offset, T.ndim.offset, T.dtype.offset, T.shape.offset,
            T.strides.offset, T.byte_offset.offset) == (0, 8, 16, 20, 24, 32, 40)
    assert ctypes.sizeof(_dlpack.DLDevice) == 8 and ctypes.sizeof(_dlpack.DLDataType) == 4


@pytest.mark.parametrize("dtype,code,bits", [(F16, 2, 16), (BF16, 4, 16), (F32, 2, 32),
                                             (torch.float64, 2, 64), (torch.int32, 0, 32),
                                             (torch.int64, 0, 64), (torch.uint8, 1, 8)])
def test_pack_fields(dtype, code, bits):
    base = torch.zeros(3, 5, 7, dtype=dtype)
    views = [base, base[:, 1:4, ::2], base.transpose(0, 2), base[1], torch.zeros((), dtype=dtype)]
    buf, addrs, kept = _dlpack.pack(views, [f"t{i}" for i in range(len(views))], 0)
    for t, a in zip(views, addrs):
        r = _dlpack.read_back(a)
        assert r["data"] == t.data_ptr() and r["byte_offset"] == 0
        assert (r["device_type"], r["device_id"]) == (_dlpack.kDLCPU, 0)
        assert (r["code"], r["bits"], r["lanes"]) == (code, bits, 1)
        assert r["ndim"] == t.dim() and r["shape"] == tuple(t.shape)
        assert r["strides"] == tuple(t.stride())
    assert kept is None


def test_pack_inputs_made_unit_stride_outputs_untouched():
    x = torch.randn(4, 6).t()  # last-dim stride 4
    buf, addrs, kept = _dlpack.pack([x, x, None], ["a", "b", "c"], 1)
    ra, rb = _dlpack.read_back(addrs[0]), _dlpack.read_back(addrs[1])
    assert ra["strides"] == (4, 1) and ra["data"] == kept[0].data_ptr()
    assert torch.equal(kept[0], x)
    assert rb["strides"] == (1, 6) and rb["data"] == x.data_ptr()  # an output: passed as it is
    assert addrs[2] is None


def test_pack_compact_outputs():
    x = torch.randn(2, 3)
    y = torch.empty(5, 2, 3, dtype=BF16)
    buf, addrs, kept = _dlpack.pack([x, y], ["x", "y"], 1, compact_outputs=True)
    r = _dlpack.read_back(addrs[1])
    assert r["strides"] is None and r["shape"] == (5, 2, 3) and r["data"] == y.data_ptr()
    assert (r["code"], r["bits"], r["device_type"]) == (4, 16, _dlpack.kDLCPU)


def test_library_reads_our_structs():
    # The library's own messages echo what it read from the packed DLTensors.
    inp = R.make_dqktheta_inputs(2, 8, 1, 2, 16, 4, F32, device=DEV)
    inp["k"] = torch.randn(2, 8, 1, 18)
    with pytest.raises(ValueError, match=re.escape("k: expected shape [B=2,S=8,G=1,N=16], got "
                                                   "[2,8,1,18]")):
        siso.compute_dqktheta(*R.dqk_args(inp))
    inp = R.make_dqktheta_inputs(2, 8, 1, 2, 16, 4, F32, device=DEV)
    inp["dqk"] = inp["dqk"].to(torch.int32)
    with pytest.raises(ValueError, match=r"dqk: dtype int32 is not supported"):
        siso.compute_dqktheta(*R.dqk_args(inp))


def test_library_found_and_versions_agree():
    import mamba3_kernels
    assert os.path.isfile(mamba3_kernels.library_path())
    assert mamba3_kernels.library_version() == mamba3_kernels.__version__
    assert isinstance(mamba3_kernels.has_cuda(), bool)


def test_missing_library_is_reported():
    code = ("import mamba3_kernels as m\n"
            "try:\n    m.has_cuda()\nexcept OSError as e:\n    print('OSError', e)\n")
    env = dict(os.environ, MAMBA3_LIBRARY="/nonexistent/libmamba3.so")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    assert "OSError" in out.stdout and "MAMBA3_LIBRARY" in out.stdout, out.stdout + out.stderr


def test_status_mapping():
    # A valid request the CPU-only build cannot serve would be UNSUPPORTED -> RuntimeError; check
    # the mapping itself on the message of a real failed call.
    inp = R.make_ddt_inputs(1, 2, 4, F32, device=DEV)
    inp["dt"] = inp["dt"][..., :3]
    with pytest.raises(ValueError, match=r"^dt: "):
        siso.compute_ddt_dtrap_dinput_states(*R.ddt_args(inp))
    with pytest.raises(RuntimeError, match="MAMBA3_ERROR_CUDA"):
        _lib.raise_status(_lib.ERROR_CUDA)


# ----------------------------------------------------------------------------- numerics

DQK_CASES = [
    # B, S, G, H, N, A, chunk, nseq, dok
    (1, 1, 1, 1, 16, 8, 64, 0, False),
    (2, 17, 1, 4, 16, 4, 32, 0, True),
    (2, 64, 2, 4, 32, 16, 64, 0, True),
    (1, 100, 1, 1, 64, 16, 32, 3, True),
    (1, 100, 2, 4, 96, 48, 16, 4, False),
    (2, 33, 1, 2, 256, 128, 256, 0, True),
]


@pytest.mark.parametrize("dtype", [F32, F16, BF16], ids=str)
@pytest.mark.parametrize("case", DQK_CASES, ids=str)
def test_dqktheta(case, dtype):
    B, S, G, H, N, A, chunk, nseq, dok = case
    inp = R.make_dqktheta_inputs(B, S, G, H, N, A, dtype, nseq=nseq, dok=dok, device=DEV)
    R.run_and_check_dqktheta(siso.compute_dqktheta, inp, chunk)


DDT_CASES = [
    # B, H, S, nseq, P, N
    (1, 1, 1, 0, 0, 0),
    (2, 4, 17, 0, 0, 0),
    (2, 3, 1, 0, 8, 16),
    (2, 4, 64, 0, 16, 32),
    (1, 4, 100, 3, 64, 128),
    (1, 8, 256, 4, 0, 0),
]


@pytest.mark.parametrize("dtype", [F32, F16, BF16], ids=str)
@pytest.mark.parametrize("case", DDT_CASES, ids=str)
def test_ddt(case, dtype):
    B, H, S, nseq, P, N = case
    inp = R.make_ddt_inputs(B, H, S, dtype, nseq=nseq, P=P, N=N, device=DEV)
    R.run_and_check_ddt(siso.compute_ddt_dtrap_dinput_states, inp)


def test_out_api_poisoned_and_strided_outputs():
    inp = R.make_dqktheta_inputs(1, 40, 2, 4, 32, 8, BF16, nseq=3, dok=True, device=DEV)
    outs = R.dqktheta_outputs_like(inp)
    outs["dangles"] = R.relayout(outs["dangles"], "T")  # copied back from a temporary
    ret = R.run_and_check_dqktheta(
        lambda *a: siso.compute_dqktheta_out(*a, **outs), inp)
    assert all(r is o for r, o in zip(ret, outs.values()))
    inp = R.make_ddt_inputs(1, 4, 50, F32, nseq=2, P=8, N=16, device=DEV)
    outs = R.ddt_outputs_like(inp)
    ret = R.run_and_check_ddt(lambda *a: siso.compute_ddt_dtrap_dinput_states_out(*a, **outs),
                              inp)
    assert all(r is o for r, o in zip(ret, outs.values()))


def test_noncontiguous_inputs():
    inp = R.make_dqktheta_inputs(2, 24, 2, 4, 32, 12, F16, dok=True, device=DEV)
    R.run_and_check_dqktheta(siso.compute_dqktheta, R.noncontiguous(inp))
    inp = R.make_ddt_inputs(2, 4, 24, BF16, P=8, N=16, device=DEV)
    R.run_and_check_ddt(siso.compute_ddt_dtrap_dinput_states, R.noncontiguous(inp))


def test_deterministic():
    inp = R.make_dqktheta_inputs(1, 300, 2, 8, 64, 32, BF16, nseq=4, dok=True, device=DEV)
    a = siso.compute_dqktheta(*R.dqk_args(inp), 64, inp["cu_seqlens"])
    b = siso.compute_dqktheta(*R.dqk_args(inp), 64, inp["cu_seqlens"])
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_int64_cu_seqlens_and_upstream_alias():
    inp = R.make_dqktheta_inputs(1, 50, 1, 2, 16, 8, F32, nseq=3, dok=True, device=DEV,
                                 cu_dtype=torch.int64)
    ref = siso.compute_dqktheta(*R.dqk_args(inp), 64, inp["cu_seqlens"])
    alias = siso.compute_dqktheta(*R.dqk_args(inp), chunk_size=64, Cu_Seqlens=inp["cu_seqlens"])
    assert all(torch.equal(x, y) for x, y in zip(ref, alias))
    with pytest.raises(TypeError):
        siso.compute_dqktheta(*R.dqk_args(inp), 64, inp["cu_seqlens"],
                              Cu_Seqlens=inp["cu_seqlens"])
    R.run_and_check_dqktheta(siso.compute_dqktheta, inp)


def test_custom_ops_match_eager_path():
    inp = R.make_dqktheta_inputs(2, 20, 1, 2, 32, 16, BF16, dok=True, device=DEV)
    eager = siso.compute_dqktheta(*R.dqk_args(inp))
    op = torch.ops.mamba3.compute_dqktheta(*R.dqk_args(inp), 64, None)
    assert all(torch.equal(x, y) for x, y in zip(eager, op))
    d = R.make_ddt_inputs(2, 2, 20, F32, P=4, N=8, device=DEV)
    eager = siso.compute_ddt_dtrap_dinput_states(*R.ddt_args(d))
    op = torch.ops.mamba3.compute_ddt_dtrap_dinput_states(*R.ddt_args(d), None)
    assert all(torch.equal(x, y) for x, y in zip(eager, op))
    eager = siso.compute_ddt_dtrap_dinput_states(d["dscale"], d["dgamma"], d["dt"], d["trap"])
    op2 = torch.ops.mamba3.compute_ddt_dtrap(d["dscale"], d["dgamma"], d["dt"], d["trap"],
                                             None, None, None)
    assert eager[2:] == (None, None, None)
    assert torch.equal(op2[0], eager[0]) and torch.equal(op2[1], eager[1])


def test_torch_compile_fullgraph_cpu():
    inp = R.make_dqktheta_inputs(1, 30, 1, 2, 16, 8, F32, nseq=2, dok=True, device=DEV)
    d = R.make_ddt_inputs(1, 2, 30, F32, nseq=0, P=4, N=16, device=DEV)

    def f(q, k, scale, gamma, qb, kb, ang, dqi, dki, dqk, dok, cu, dt, trap, dis, ks, vs):
        o = siso.compute_dqktheta(q, k, scale, gamma, qb, kb, ang, dqi, dki, dqk, dok, 64, cu)
        r = siso.compute_ddt_dtrap_dinput_states(o[5], o[6], dt, trap, dis, ks, vs)
        r2 = siso.compute_ddt_dtrap_dinput_states(o[5], o[6], dt, trap)
        return o + r + r2[:2]

    args = R.dqk_args(inp) + [inp["cu_seqlens"], d["dt"], d["trap"], d["d_issm_state"],
                              d["input_k_state"], d["input_v_state"]]
    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    got, want = compiled(*args), f(*args)
    assert len(got) == len(want) == 14
    assert all(torch.equal(x, y) for x, y in zip(got, want))


def test_fake_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode
    inp = R.make_dqktheta_inputs(2, 9, 2, 4, 32, 8, BF16, dok=True, device=DEV)
    inp["scale"] = inp["scale"].to(F16)
    real = siso.compute_dqktheta(*R.dqk_args(inp))
    d = R.make_ddt_inputs(2, 4, 9, F32, P=4, N=32, state_dtype=BF16, device=DEV)
    real_d = siso.compute_ddt_dtrap_dinput_states(*R.ddt_args(d))
    with FakeTensorMode() as mode:
        fake_inp = {k: None if v is None else mode.from_tensor(v) for k, v in inp.items()}
        fake = siso.compute_dqktheta(*R.dqk_args(fake_inp))
        fake_d = siso.compute_ddt_dtrap_dinput_states(
            *[None if v is None else mode.from_tensor(v) for v in R.ddt_args(d)])
    for r, f in zip(real + real_d, fake + fake_d):
        assert r.shape == f.shape and r.dtype == f.dtype


# ----------------------------------------------------------------------------- bad input

def _dqk(**over):
    inp = R.make_dqktheta_inputs(2, 8, 2, 4, 16, 4, F32, dok=True, device=DEV)
    inp.update(over)
    return inp


@pytest.mark.parametrize("name,mutate", R.DQK_BAD_CPU)
def test_dqktheta_bad_input(name, mutate):
    inp = _dqk()
    mutate(inp)
    with pytest.raises(ValueError, match=re.escape(name)):
        siso.compute_dqktheta(*R.dqk_args(inp))


def test_dqktheta_bad_chunk_and_cu_seqlens():
    inp = _dqk()
    with pytest.raises(ValueError, match="chunk_size"):
        siso.compute_dqktheta(*R.dqk_args(inp), 48)
    with pytest.raises(ValueError, match="cu_seqlens"):  # B=2 with varlen
        siso.compute_dqktheta(*R.dqk_args(inp), 64, torch.tensor([0, 4, 8], dtype=torch.int32))
    one = R.make_dqktheta_inputs(1, 8, 1, 2, 16, 4, F32, dok=False, device=DEV)
    for cu in ([0, 5, 5, 8], [0, 6, 3, 8], [1, 4, 8], [0, 4, 7]):
        with pytest.raises(ValueError, match="cu_seqlens"):
            siso.compute_dqktheta(*R.dqk_args(one), 64, torch.tensor(cu, dtype=torch.int32))
    with pytest.raises(ValueError, match="cu_seqlens"):
        siso.compute_dqktheta(*R.dqk_args(one), 64, torch.tensor([0.0, 8.0]))


def test_ddt_bad_input():
    d = R.make_ddt_inputs(2, 4, 8, F32, P=4, N=8, device=DEV)
    with pytest.raises(ValueError, match="input_k_state"):
        siso.compute_ddt_dtrap_dinput_states(d["dscale"], d["dgamma"], d["dt"], d["trap"],
                                             d["d_issm_state"], None, d["input_v_state"])
    with pytest.raises(ValueError, match="input_k_state"):
        siso.compute_ddt_dtrap_dinput_states(d["dscale"], d["dgamma"], d["dt"], d["trap"],
                                             None, d["input_k_state"], None)
    with pytest.raises(ValueError, match="trap"):
        siso.compute_ddt_dtrap_dinput_states(d["dscale"], d["dgamma"], d["dt"],
                                             d["trap"].double())
    with pytest.raises(ValueError, match="d_issm_state"):
        siso.compute_ddt_dtrap_dinput_states(d["dscale"], d["dgamma"], d["dt"], d["trap"],
                                             d["d_issm_state"][:1], d["input_k_state"],
                                             d["input_v_state"])
    with pytest.raises(ValueError, match="dscale"):
        siso.compute_ddt_dtrap_dinput_states(d["dscale"][0], d["dgamma"], d["dt"], d["trap"])
    outs = R.ddt_outputs_like(d)
    outs["ddt"] = outs["ddt"].to(BF16)
    with pytest.raises(ValueError, match="ddt"):
        siso.compute_ddt_dtrap_dinput_states_out(*R.ddt_args(d), **outs)
