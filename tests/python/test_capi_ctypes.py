"""The ctypes layer without torch: loading libmamba3, the DLTensor layout, strides, status codes.

Hand-built DLTensors over plain ctypes float buffers drive the library's CPU backend on tiny
problems whose results are computed here in pure Python from the operators' formulas (the
semantics of SPEC.md section 1 / include/mamba3/mamba3.h). Runs wherever the library is built.
"""
import ctypes
import math
import random

import pytest

from mamba3_kernels import _dltensor as D
from mamba3_kernels import _lib


@pytest.fixture(scope="module")
def F():
    return _lib.load()


class Arena:
    """Owns the float32/int32 buffers and the packed DLTensors of one call."""

    def __init__(self, slots=24):
        self.buf = (ctypes.c_char * (D.SLOT * slots))()
        self.next = 0
        self.keep = []

    def tensor(self, values, shape, strides=None, code=D.kDLFloat, bits=32):
        ctype = {32: ctypes.c_float, 64: ctypes.c_double}[bits] if code == D.kDLFloat else \
            {32: ctypes.c_int32, 64: ctypes.c_int64}[bits]
        arr = (ctype * max(1, len(values)))(*values)
        self.keep.append(arr)
        addr = D.pack_raw(self.buf, self.next * D.SLOT, ctypes.addressof(arr), D.kDLCPU, 0, code,
                          bits, shape, strides)
        self.next += 1
        return addr, arr


def test_layout_agrees_with_ctypes_structures():
    T = D.DLTensor
    assert ctypes.sizeof(T) == D.DLTENSOR_SIZE == D.STRUCTS[0].size == 48
    assert (T.data.offset, T.device.offset, T.ndim.offset, T.dtype.offset, T.shape.offset,
            T.strides.offset, T.byte_offset.offset) == (0, 8, 16, 20, 24, 32, 40)
    a = Arena()
    addr, arr = a.tensor([1.0] * 24, (2, 3, 4), (12, 1, 3))
    r = D.read_back(addr)
    assert r == dict(data=ctypes.addressof(arr), device_type=1, device_id=0, ndim=3, code=2,
                     bits=32, lanes=1, shape=(2, 3, 4), strides=(12, 1, 3), byte_offset=0)
    addr, _ = a.tensor([0.0] * 6, (6,))
    assert D.read_back(addr)["strides"] is None


def test_version_and_backends(F):
    assert F.version().decode().count(".") == 2
    assert F.has_cuda() in (0, 1)


def _rot(x0, x1, c, s):
    return x0 * c - x1 * s, x0 * s + x1 * c


def test_dqktheta_tiny_against_formulas(F):
    rng = random.Random(3)
    B, S, G, H, N, A = 1, 3, 1, 2, 4, 1
    r = lambda n: [rng.uniform(-1, 1) for _ in range(n)]  # noqa: E731
    q, k = r(B * S * G * N), r(B * S * G * N)
    scale, gamma, dqk = r(B * H * S), r(B * H * S), r(B * H * S)
    qbias, kbias = r(H * N), r(H * N)
    ang = [rng.uniform(0, 2 * math.pi) for _ in range(B * S * H * A)]
    dq_in, dk_in = r(B * S * H * N), r(B * S * H * N)
    dok = r(B * H * N)
    # round to float32 so that the formulas see exactly what the library sees
    f32 = lambda v: [ctypes.c_float(x).value for x in v]  # noqa: E731
    q, k, scale, gamma, dqk, qbias, kbias, ang, dq_in, dk_in, dok = map(
        f32, (q, k, scale, gamma, dqk, qbias, kbias, ang, dq_in, dk_in, dok))

    a = Arena()
    args = [a.tensor(q, (B, S, G, N))[0], a.tensor(k, (B, S, G, N))[0],
            a.tensor(scale, (B, H, S))[0], a.tensor(gamma, (B, H, S))[0],
            a.tensor(qbias, (H, N))[0], a.tensor(kbias, (H, N))[0],
            a.tensor(ang, (B, S, H, A))[0], a.tensor(dq_in, (B, S, H, N))[0],
            a.tensor(dk_in, (B, S, H, N))[0]]
    # dqk stored as [B,S,H] in memory, passed as a [B,H,S] view through its strides
    dqk_mem = [dqk[(b * H + h) * S + s] for b in range(B) for s in range(S) for h in range(H)]
    args.append(a.tensor(dqk_mem, (B, H, S), (S * H, 1, H))[0])
    args.append(a.tensor(dok, (B, H, N))[0])
    outs = [a.tensor([math.nan] * n, shp) for n, shp in (
        (B * S * G * N, (B, S, G, N)), (B * S * G * N, (B, S, G, N)), (H * N, (H, N)),
        (H * N, (H, N)), (B * S * H * A, (B, S, H, A)), (B * H * S, (B, H, S)),
        (B * H * S, (B, H, S)))]
    rc = F.dqktheta(*args, 64, None, *[o[0] for o in outs], None, 0, None)
    assert rc == 0, F.last_error()
    dq, dk, dqb, dkb, dang, dsc, dga = [list(o[1]) for o in outs]

    # expected, from the formulas
    e = dict(dq=[0.0] * len(dq), dk=[0.0] * len(dk), dqb=[0.0] * len(dqb),
             dkb=[0.0] * len(dkb), dang=[0.0] * len(dang), dsc=[0.0] * len(dsc),
             dga=[0.0] * len(dga))
    for b in range(B):
        for s in range(S):
            for h in range(H):
                g = h // (H // G)
                bsh = (b * H + h) * S + s
                qb = [q[((b * S + s) * G + g) * N + n] + qbias[h * N + n] for n in range(N)]
                kb = [k[((b * S + s) * G + g) * N + n] + kbias[h * N + n] for n in range(N)]
                th = [ang[((b * S + s) * H + h) * A + i] for i in range(A)]
                dqi = dq_in[((b * S + s) * H + h) * N:((b * S + s) * H + h + 1) * N]
                dki = dk_in[((b * S + s) * H + h) * N:((b * S + s) * H + h + 1) * N]
                rk = list(kb)
                for i in range(A):
                    rk[2 * i], rk[2 * i + 1] = _rot(kb[2 * i], kb[2 * i + 1], math.cos(th[i]),
                                                    math.sin(th[i]))
                e["dga"][bsh] = dqk[bsh] * sum(x * y for x, y in zip(qb, kb))
                e["dsc"][bsh] = sum(x * y for x, y in zip(dki, rk))
                dks = [x * scale[bsh] for x in dki]
                if s == S - 1:
                    dks = [x + dok[(b * H + h) * N + n] for n, x in enumerate(dks)]
                dqp, dkp = list(dqi), list(dks)
                for i in range(A):  # inverse rotation: rotate by -theta
                    c, sn = math.cos(th[i]), math.sin(th[i])
                    dqp[2 * i], dqp[2 * i + 1] = _rot(dqi[2 * i], dqi[2 * i + 1], c, -sn)
                    dkp[2 * i], dkp[2 * i + 1] = _rot(dks[2 * i], dks[2 * i + 1], c, -sn)
                    e["dang"][((b * S + s) * H + h) * A + i] = (
                        dqi[2 * i] * (-qb[2 * i] * sn - qb[2 * i + 1] * c)
                        + dqi[2 * i + 1] * (qb[2 * i] * c - qb[2 * i + 1] * sn)
                        + dks[2 * i] * (-kb[2 * i] * sn - kb[2 * i + 1] * c)
                        + dks[2 * i + 1] * (kb[2 * i] * c - kb[2 * i + 1] * sn))
                cg = dqk[bsh] * gamma[bsh]
                for n in range(N):
                    dqp[n] += cg * kb[n]
                    dkp[n] += cg * qb[n]
                    e["dq"][((b * S + s) * G + g) * N + n] += dqp[n]
                    e["dk"][((b * S + s) * G + g) * N + n] += dkp[n]
                    e["dqb"][h * N + n] += dqp[n]
                    e["dkb"][h * N + n] += dkp[n]
    for name, got in zip(("dq", "dk", "dqb", "dkb", "dang", "dsc", "dga"),
                         (dq, dk, dqb, dkb, dang, dsc, dga)):
        want = e[name]
        err = math.sqrt(sum((x - y) ** 2 for x, y in zip(got, want)))
        ref = math.sqrt(sum(y * y for y in want))
        assert err <= 1e-5 * ref, (name, got, want)


def test_ddt_tiny_against_formulas(F):
    rng = random.Random(5)
    B, H, S, P, N = 1, 1, 3, 2, 3
    f32 = lambda v: [ctypes.c_float(x).value for x in v]  # noqa: E731
    dsc, dga = f32([rng.uniform(-1, 1) for _ in range(S)]), f32([rng.uniform(-1, 1) for _ in
                                                                  range(S)])
    dt, trap = f32([rng.uniform(0.1, 0.6) for _ in range(S)]), f32([rng.uniform(-2, 2) for _ in
                                                                     range(S)])
    dis = f32([rng.uniform(-1, 1) for _ in range(P * N)])
    ks, vs = f32([rng.uniform(-1, 1) for _ in range(N)]), f32([rng.uniform(-1, 1) for _ in
                                                               range(P)])
    a = Arena()
    ins = [a.tensor(v, (B, H, S))[0] for v in (dsc, dga, dt, trap)]
    ins += [a.tensor(dis, (B, H, P, N))[0], a.tensor(ks, (B, H, N))[0],
            a.tensor(vs, (B, H, P))[0]]
    outs = [a.tensor([math.nan] * n, shp) for n, shp in (
        (S, (B, H, S)), (S, (B, H, S)), (P * N, (B, H, P, N)), (N, (B, H, N)), (P, (B, H, P)))]
    rc = F.ddt_dtrap(*ins, None, *[o[0] for o in outs], None)
    assert rc == 0, F.last_error()
    ddt, dtrap, dssm, dk, dv = [list(o[1]) for o in outs]
    lam = [1 / (1 + math.exp(-x)) for x in trap]
    want_ddt, want_dtrap = [], []
    for t in range(S):
        dsp = dsc[t - 1] if t > 0 else 0.0
        want_ddt.append((dga[t] + dsc[t]) * lam[t] + dsp * (1 - lam[t]))
        want_dtrap.append(((dga[t] + dsc[t]) * dt[t] - dsp * dt[t]) * lam[t] * (1 - lam[t]))
    scal = dt[0] * (1 - lam[0])
    dscal = sum(dis[p * N + n] * vs[p] * ks[n] for p in range(P) for n in range(N))
    want_ddt[0] += dscal * (1 - lam[0])
    want_dtrap[0] += dscal * (-dt[0]) * lam[0] * (1 - lam[0])
    want_dv = [scal * sum(dis[p * N + n] * ks[n] for n in range(N)) for p in range(P)]
    want_dk = [scal * sum(dis[p * N + n] * vs[p] for p in range(P)) for n in range(N)]
    for got, want in ((ddt, want_ddt), (dtrap, want_dtrap), (dv, want_dv), (dk, want_dk)):
        assert all(abs(x - y) <= 1e-5 * (1 + abs(y)) for x, y in zip(got, want)), (got, want)
    assert dssm == dis


def test_errors_name_the_argument(F):
    a = Arena()
    x = a.tensor([0.0] * 6, (1, 2, 3))[0]
    bad = a.tensor([0.0] * 4, (1, 2, 2))[0]
    out = [a.tensor([0.0] * 6, (1, 2, 3))[0] for _ in range(2)]
    rc = F.ddt_dtrap(x, x, bad, x, None, None, None, None, out[0], out[1], None, None, None, None)
    assert rc == _lib.ERROR_INVALID_ARGUMENT
    with pytest.raises(ValueError, match=r"^dt: expected shape \[B=1,H=2,S=3\], got \[1,2,2\]"):
        _lib.raise_status(rc)
    i32 = a.tensor([0] * 6, (1, 2, 3), code=D.kDLInt, bits=32)[0]
    rc = F.ddt_dtrap(x, i32, x, x, None, None, None, None, out[0], out[1], None, None, None, None)
    with pytest.raises(ValueError, match=r"^dgamma: dtype int32 is not supported"):
        _lib.raise_status(rc)
    with pytest.raises(RuntimeError, match="MAMBA3_ERROR_INTERNAL"):
        _lib.raise_status(_lib.ERROR_INTERNAL)
