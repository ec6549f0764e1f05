"""Reference and comparison helpers for the SISO backward tests (not a test module).

The references are written from SPEC.md section 1 as explicit forward relations of exactly the
operators' inputs; torch.autograd.grad gives the gradients the operators must return. They run in
float64 (the golden) and in float32 (the "fp32 reference" of the dual rule: its results are cast
to the operators' output dtypes, as a float32 implementation with the same I/O would round them).
Inputs are created already rounded to their test dtype; the references up-cast those values.

Comparison (SPEC.md section 3), per output: rel_l2 = ||cand - gold|| / ||gold|| must be
<= TOL[io dtype] AND (<= 2x the fp32 reference's rel_l2 OR <= TOL / 100). NaN/Inf never pass.
MAX_REL (max|cand-gold| / max|gold|) is the metric for outputs that are nearly zero by
construction; none of these two operators' outputs is (they are compared with rel_l2).
"""
from __future__ import annotations

import math

import torch

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}

DQK_OUTPUTS = ("dq", "dk", "dq_bias", "dk_bias", "dangles", "dscale", "dgamma")
DDT_OUTPUTS = ("ddt", "dtrap", "d_input_ssm_state", "d_input_k_state", "d_input_v_state")


def io_tol(*tensors) -> float:
    """Tolerance of a call: that of its least precise floating-point input."""
    return max(TOL[t.dtype] for t in tensors if t is not None and t.dtype in TOL)


# ------------------------------------------------------------------------------ inputs

def make_cu_seqlens(S: int, nseq: int, gen: torch.Generator, dtype=torch.int32, device="cpu"):
    """[nseq+1] strictly increasing from 0 to S (every sequence non-empty); requires S >= nseq."""
    assert 1 <= nseq <= S
    cuts = torch.randperm(S - 1, generator=gen)[: nseq - 1] + 1 if nseq > 1 else torch.empty(0)
    cuts = sorted(int(c) for c in cuts)
    return torch.tensor([0] + cuts + [S], dtype=dtype, device=device)


def _rand(shape, dtype, device, gen, scale=1.0, shift=0.0, uniform=False):
    if uniform:
        x = torch.rand(shape, generator=gen, dtype=torch.float32) * scale + shift
    else:
        x = torch.randn(shape, generator=gen, dtype=torch.float32) * scale + shift
    return x.to(dtype).to(device)


def make_dqktheta_inputs(B, S, G, H, N, A, io_dtype, param_dtype=torch.float32, *, nseq=0,
                         dok=False, device="cuda", seed=0, cu_dtype=torch.int32):
    """Inputs of compute_dqktheta as a dict. nseq > 0: varlen with that many sequences (B must
    be 1). io_dtype: q, k, dq_in, dk_in, d_ok_state; param_dtype: scale, gamma, biases, angles,
    dqk."""
    gen = torch.Generator().manual_seed(seed)
    cu = None
    if nseq:
        assert B == 1
        cu = make_cu_seqlens(S, nseq, gen, cu_dtype, device)
    n_states = nseq if nseq else B
    return dict(
        q=_rand((B, S, G, N), io_dtype, device, gen),
        k=_rand((B, S, G, N), io_dtype, device, gen),
        scale=_rand((B, H, S), param_dtype, device, gen, 0.5, 0.05, uniform=True),
        gamma=_rand((B, H, S), param_dtype, device, gen, 0.5, 0.05, uniform=True),
        q_bias=_rand((H, N), param_dtype, device, gen, 0.5),
        k_bias=_rand((H, N), param_dtype, device, gen, 0.5),
        angles=_rand((B, S, H, A), param_dtype, device, gen, 2 * math.pi, uniform=True),
        dq_in=_rand((B, S, H, N), io_dtype, device, gen),
        dk_in=_rand((B, S, H, N), io_dtype, device, gen),
        dqk=_rand((B, H, S), param_dtype, device, gen),
        d_ok_state=_rand((n_states, H, N), io_dtype, device, gen) if dok else None,
        cu_seqlens=cu,
    )


def make_ddt_inputs(B, H, S, dtype, *, nseq=0, P=0, N=0, state_dtype=None, device="cuda",
                    seed=0, cu_dtype=torch.int32):
    """Inputs of compute_ddt_dtrap_dinput_states as a dict; P, N > 0 adds the input states."""
    gen = torch.Generator().manual_seed(seed)
    cu = None
    if nseq:
        assert B == 1
        cu = make_cu_seqlens(S, nseq, gen, cu_dtype, device)
    n_states = nseq if nseq else B
    sd = state_dtype or dtype
    d = dict(
        dscale=_rand((B, H, S), dtype, device, gen),
        dgamma=_rand((B, H, S), dtype, device, gen),
        dt=_rand((B, H, S), dtype, device, gen, 0.5, 0.01, uniform=True),
        trap=_rand((B, H, S), dtype, device, gen, 2.0),
        d_issm_state=None, input_k_state=None, input_v_state=None,
        cu_seqlens=cu,
    )
    if P:
        d["d_issm_state"] = _rand((n_states, H, P, N), sd, device, gen)
        d["input_k_state"] = _rand((n_states, H, N), sd, device, gen)
        d["input_v_state"] = _rand((n_states, H, P), sd, device, gen)
    return d


# ------------------------------------------------------------------------------ references

def _rot(x, ang):
    """Interleaved rotation of pairs (2i, 2i+1), i < A, by ang[..., i]; other dims unchanged."""
    A = ang.shape[-1]
    xr = x[..., : 2 * A].unflatten(-1, (A, 2))
    x0, x1 = xr[..., 0], xr[..., 1]
    c, s = torch.cos(ang), torch.sin(ang)
    y = torch.stack((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1).flatten(-2)
    return torch.cat((y, x[..., 2 * A:]), dim=-1)


def _seq_ends(B, S, cu):
    """(batch index, last position) of every sequence."""
    if cu is None:
        return torch.arange(B), torch.full((B,), S - 1, dtype=torch.long)
    cu = cu.to("cpu", torch.long)
    return torch.zeros(cu.numel() - 1, dtype=torch.long), cu[1:] - 1


def _seq_starts(B, cu):
    if cu is None:
        return torch.arange(B), torch.zeros(B, dtype=torch.long)
    cu = cu.to("cpu", torch.long)
    return torch.zeros(cu.numel() - 1, dtype=torch.long), cu[:-1].clone()


def dqktheta_reference(inp, dtype=torch.float64, round_outputs=False):
    """Gradients (dq, dk, dq_bias, dk_bias, dangles, dscale, dgamma) of
        F = sum dq_in . rot(qb) + sum dk_in . scale * rot(kb) + sum dqk * gamma * (qb . kb)
          + sum_seq d_ok_state . rot(kb at the sequence's last position),
    qb = q[g(h)] + q_bias[h], kb = k[g(h)] + k_bias[h], computed in `dtype`. With
    round_outputs, each gradient is cast to the operator's output dtype (fp32 reference)."""
    def leaf(t):
        return t.detach().to(dtype).requires_grad_(True)

    def const(t):
        return None if t is None else t.detach().to(dtype)

    q, k = leaf(inp["q"]), leaf(inp["k"])
    scale, gamma = leaf(inp["scale"]), leaf(inp["gamma"])
    q_bias, k_bias = leaf(inp["q_bias"]), leaf(inp["k_bias"])
    angles = leaf(inp["angles"])
    dq_in, dk_in, dqk = const(inp["dq_in"]), const(inp["dk_in"]), const(inp["dqk"])
    d_ok = const(inp["d_ok_state"])
    B, S, G, N = q.shape
    H = scale.shape[1]
    r = H // G
    with torch.enable_grad():
        qb = q.repeat_interleave(r, dim=2) + q_bias
        kb = k.repeat_interleave(r, dim=2) + k_bias
        rq, rk = _rot(qb, angles), _rot(kb, angles)
        sc = scale.transpose(1, 2).unsqueeze(-1)
        f = (dq_in * rq).sum() + (dk_in * sc * rk).sum()
        f = f + (dqk.transpose(1, 2) * gamma.transpose(1, 2) * (qb * kb).sum(-1)).sum()
        if d_ok is not None:
            bi, ti = _seq_ends(B, S, inp["cu_seqlens"])
            dev = rk.device
            f = f + (d_ok * rk[bi.to(dev), ti.to(dev)]).sum()
        grads = torch.autograd.grad(f, (q, k, q_bias, k_bias, angles, scale, gamma))
    if round_outputs:
        io = inp["dq_in"].dtype
        dts = (io, io, torch.float32, torch.float32, inp["angles"].dtype, inp["scale"].dtype,
               inp["gamma"].dtype)
        grads = tuple(g.to(d) for g, d in zip(grads, dts))
    return dict(zip(DQK_OUTPUTS, grads))


def ddt_reference(inp, dtype=torch.float64, round_outputs=False):
    """Gradients (ddt, dtrap, d_input_ssm_state, d_input_k_state, d_input_v_state) of
        F = sum dgamma * gamma + sum dscale * scale + sum_seq d_issm . issm_mid,
    lam = sigmoid(trap), gamma_t = dt_t lam_t, scale_t = gamma_t + dt_{t+1} (1 - lam_{t+1})
    (no second term at a sequence's last position), issm_mid = issm + dt_0 (1 - lam_0)
    outer(v_state, k_state) at each sequence's first position; dtrap is w.r.t. pre-sigmoid trap."""
    def leaf(t):
        return None if t is None else t.detach().to(dtype).requires_grad_(True)

    def const(t):
        return None if t is None else t.detach().to(dtype)

    dscale, dgamma = const(inp["dscale"]), const(inp["dgamma"])
    dt, trap = leaf(inp["dt"]), leaf(inp["trap"])
    d_issm = const(inp["d_issm_state"])
    cu = inp["cu_seqlens"]
    B, H, S = dscale.shape
    dev = dscale.device
    not_last = torch.ones(B, 1, S, dtype=dtype, device=dev)
    bi, ti = _seq_ends(B, S, cu)
    not_last[bi.to(dev), 0, ti.to(dev)] = 0
    with torch.enable_grad():
        lam = torch.sigmoid(trap)
        gamma = dt * lam
        nxt = dt * (1 - lam)
        shifted = torch.cat((nxt[..., 1:], torch.zeros_like(nxt[..., :1])), dim=-1) * not_last
        scale = gamma + shifted
        f = (dgamma * gamma).sum() + (dscale * scale).sum()
        wrt = [dt, trap]
        if d_issm is not None:
            issm = torch.zeros_like(d_issm).requires_grad_(True)
            ks, vs = leaf(inp["input_k_state"]), leaf(inp["input_v_state"])
            b0, t0 = _seq_starts(B, cu)
            b0, t0 = b0.to(dev), t0.to(dev)
            coef = dt[b0, :, t0] * (1 - lam[b0, :, t0])  # [nseq, H]
            mid = issm + coef[..., None, None] * vs[..., :, None] * ks[..., None, :]
            f = f + (d_issm * mid).sum()
            wrt += [issm, ks, vs]
        grads = list(torch.autograd.grad(f, wrt))
    grads += [None] * (5 - len(grads))
    if round_outputs and grads[2] is not None:
        grads[0], grads[1] = grads[0].float(), grads[1].float()
        grads[2] = grads[2].to(inp["d_issm_state"].dtype)
        grads[3], grads[4] = grads[3].float(), grads[4].float()
    elif round_outputs:
        grads[0], grads[1] = grads[0].float(), grads[1].float()
    return dict(zip(DDT_OUTPUTS, grads))


# ------------------------------------------------------------------------------ comparison

def rel_l2(cand, gold) -> float:
    c = cand.detach().to(torch.float64)
    g = gold.detach().to(device=c.device, dtype=torch.float64)
    if not torch.isfinite(c).all():
        return math.inf
    num = torch.linalg.vector_norm(c - g).item()
    den = torch.linalg.vector_norm(g).item()
    if den == 0.0:
        return 0.0 if num == 0.0 else math.inf
    return num / den


def max_rel(cand, gold) -> float:
    c = cand.detach().to(torch.float64)
    g = gold.detach().to(device=c.device, dtype=torch.float64)
    if not torch.isfinite(c).all():
        return math.inf
    num = (c - g).abs().max().item() if c.numel() else 0.0
    den = g.abs().max().item() if g.numel() else 0.0
    if den == 0.0:
        return 0.0 if num == 0.0 else math.inf
    return num / den


def noise_floor(tol):
    """Errors at or below this are rounding noise (same definition as golden/src/host.cpp):
    1% of the tolerance, never less than 4 float32 ulps (4 * 2**-23 = 4.8e-7)."""
    return max(tol / 100, 4 * 2.0 ** -23)


def check_outputs(names, cand, gold, ref32, tol, near_zero=()):
    """Compares every output; returns a list of failure lines (empty when all pass)."""
    failures = []
    for i, name in enumerate(names):
        c, g, r = cand[i], gold[name], ref32[name]
        if g is None:
            if c is not None:
                failures.append(f"{name}: expected None, got a tensor")
            continue
        if c is None:
            failures.append(f"{name}: missing output")
            continue
        if tuple(c.shape) != tuple(g.shape) or c.dtype != r.dtype:
            failures.append(f"{name}: shape/dtype {tuple(c.shape)}/{c.dtype}, expected "
                            f"{tuple(g.shape)}/{r.dtype}")
            continue
        metric = max_rel if name in near_zero else rel_l2
        err, err32 = metric(c, g), metric(r, g)
        ok = err <= tol and (err <= 2 * err32 or err <= noise_floor(tol))
        if not ok:
            failures.append(f"{name}: {metric.__name__}={err:.3e} (fp32 reference {err32:.3e}, "
                            f"tol {tol:.0e})")
    return failures


def run_and_check_dqktheta(fn, inp, chunk_size=64):
    """Runs fn(**inputs) and checks all seven outputs against the golden; returns the outputs."""
    out = fn(inp["q"], inp["k"], inp["scale"], inp["gamma"], inp["q_bias"], inp["k_bias"],
             inp["angles"], inp["dq_in"], inp["dk_in"], inp["dqk"], inp["d_ok_state"],
             chunk_size, inp["cu_seqlens"])
    assert isinstance(out, tuple) and len(out) == 7
    gold = dqktheta_reference(inp, torch.float64)
    ref32 = dqktheta_reference(inp, torch.float32, round_outputs=True)
    tol = io_tol(*(v for k, v in inp.items() if k != "cu_seqlens"))
    failures = check_outputs(DQK_OUTPUTS, out, gold, ref32, tol)
    assert not failures, "\n".join(failures)
    return out


def run_and_check_ddt(fn, inp):
    out = fn(inp["dscale"], inp["dgamma"], inp["dt"], inp["trap"], inp["d_issm_state"],
             inp["input_k_state"], inp["input_v_state"], inp["cu_seqlens"])
    assert isinstance(out, tuple) and len(out) == 5
    gold = ddt_reference(inp, torch.float64)
    ref32 = ddt_reference(inp, torch.float32, round_outputs=True)
    tol = io_tol(*(v for k, v in inp.items() if k != "cu_seqlens"))
    failures = check_outputs(DDT_OUTPUTS, out, gold, ref32, tol)
    assert not failures, "\n".join(failures)
    return out


# ------------------------------------------------------------------------------ call helpers

# Bad inputs of compute_dqktheta on CPU tensors, as (the name the error must carry, a mutation of
# make_dqktheta_inputs(2, 8, 2, 4, 16, 4, float32, dok=True)'s dict): the CPU front-end tests and
# the compiled-binding tests share them.
DQK_BAD_CPU = [
    ("q", lambda i: i.update(q=i["q"].double())),
    ("k", lambda i: i.update(k=i["k"][:, :, :, :14])),
    ("H % G", lambda i: i.update(q=torch.randn(2, 8, 3, 16), k=torch.randn(2, 8, 3, 16))),
    ("N=15", lambda i: i.update(q=torch.randn(2, 8, 2, 15), k=torch.randn(2, 8, 2, 15))),
    ("angles", lambda i: i.update(angles=torch.randn(2, 8, 4, 9))),
    ("d_ok_state", lambda i: i.update(d_ok_state=torch.randn(3, 4, 16))),
    ("dq_in", lambda i: i.update(dq_in=i["dq_in"].to(torch.int32))),
    ("q", lambda i: i.update(q=i["q"][0])),
    ("scale", lambda i: i.update(scale=i["scale"][0])),
    ("q_bias", lambda i: i.update(q_bias=i["q_bias"][:3])),
    ("gamma", lambda i: i.update(gamma=None)),
    ("k", lambda i: i.update(k=None)),
]

DQK_ARGS = ("q", "k", "scale", "gamma", "q_bias", "k_bias", "angles", "dq_in", "dk_in", "dqk",
            "d_ok_state")
DDT_ARGS = ("dscale", "dgamma", "dt", "trap", "d_issm_state", "input_k_state", "input_v_state")


def dqk_args(inp):
    return [inp[k] for k in DQK_ARGS]


def ddt_args(inp):
    return [inp[k] for k in DDT_ARGS]


def dqktheta_outputs_like(inp, fill=float("nan")):
    """Output tensors for the *_out API, filled with `fill` (NaN: unwritten elements fail)."""
    q, scale, angles, dq_in = inp["q"], inp["scale"], inp["angles"], inp["dq_in"]
    B, S, G, N = q.shape
    H, A = scale.shape[1], angles.shape[3]
    dev = q.device

    def full(shape, dtype):
        return torch.full(shape, fill, dtype=dtype, device=dev)
    return dict(dq=full((B, S, G, N), dq_in.dtype), dk=full((B, S, G, N), dq_in.dtype),
                dq_bias=full((H, N), torch.float32), dk_bias=full((H, N), torch.float32),
                dangles=full((B, S, H, A), angles.dtype), dscale=full((B, H, S), scale.dtype),
                dgamma=full((B, H, S), inp["gamma"].dtype))


def ddt_outputs_like(inp, fill=float("nan")):
    dscale, d_issm = inp["dscale"], inp["d_issm_state"]
    dev = dscale.device
    out = dict(ddt=torch.full(dscale.shape, fill, device=dev),
               dtrap=torch.full(dscale.shape, fill, device=dev))
    if d_issm is not None:
        nseq, H, P, N = d_issm.shape
        out["d_input_ssm_state"] = torch.full(d_issm.shape, fill, dtype=d_issm.dtype, device=dev)
        out["d_input_k_state"] = torch.full((nseq, H, N), fill, device=dev)
        out["d_input_v_state"] = torch.full((nseq, H, P), fill, device=dev)
    return out


def relayout(t, kind):
    """A view holding the same values as `t` in another memory layout:
    'T'      last two dimensions stored transposed (last-dim stride != 1),
    'pad'    rows padded by 3 elements and offset by 1 (unit stride, odd row stride, pointer
             offset by one element),
    'step'   every other element of a twice as long last dimension (last-dim stride 2),
    'outer'  the first two dimensions stored swapped (unit last stride, permuted outer strides)."""
    if t is None:
        return None
    if kind == "T" and t.dim() >= 2:
        return t.transpose(-1, -2).contiguous().transpose(-1, -2)
    if kind == "pad":
        base = torch.zeros(*t.shape[:-1], t.shape[-1] + 3, dtype=t.dtype, device=t.device)
        v = base[..., 1: 1 + t.shape[-1]]
        v.copy_(t)
        return v
    if kind == "step":
        base = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype, device=t.device)
        v = base[..., ::2]
        v.copy_(t)
        return v
    if kind == "outer" and t.dim() >= 3:
        return t.transpose(0, 1).contiguous().transpose(0, 1)
    return t.clone()


_DQK_LAYOUTS = dict(q="pad", k="outer", scale="T", gamma="pad", q_bias="T", k_bias="pad",
                    angles="pad", dq_in="outer", dk_in="step", dqk="T", d_ok_state="T")
_DDT_LAYOUTS = dict(dscale="T", dgamma="pad", dt="step", trap="outer", d_issm_state="T",
                    input_k_state="pad", input_v_state="step")


def noncontiguous(inp):
    """The same inputs as strided views (see relayout); values unchanged."""
    layouts = _DQK_LAYOUTS if "q" in inp else _DDT_LAYOUTS
    out = dict(inp)
    for name, kind in layouts.items():
        out[name] = relayout(inp[name], kind)
    return out
