"""Reference and comparison helpers for the mamba3_mimo_bwd_fwd tests (not a test module).

The reference is the chunked forward of golden/include/mamba3_golden/mimo.hpp written in torch,
as a function of exactly the operator's inputs (da_cs, da_cs_rev and segsum are independent
inputs; in a partial last chunk they are rebuilt from da_cs alone, the tail contract). It returns
the entering states, qk_dot and the per-rank readout y; the gradients dmimo_o, dmimo_z, dz,
dnorm_weight and dout_pre_rms come from torch.autograd.grad of sum(dout * out), with mimo_o,
mimo_z and norm_weight expanded per batch (and norm_weight per rank) so that autograd returns
the per-batch tensors the operator writes. It runs in float64 (the golden) and in float32 (the
"fp32 reference" of the dual rule, its results cast to the operator's output dtypes).

A sequential form of the model (SPEC.md section 1: the recurrence, one step at a time, from adt)
is also here: the agreement of the two forms on tiny shapes checks the reference itself.

Comparison: siso_ref's rule (SPEC.md section 3); qk_dot and dmimo_z are compared with max_rel
(the seeds' "nearly zero by construction" outputs), the others with rel_l2. The tolerance of a
call is that of the least precise dtype among its inputs and its output dtype (a bf16 output is
judged at the bf16 tolerance whatever the inputs).
"""
from __future__ import annotations

import math

import torch

from siso_ref import TOL, check_outputs, max_rel, rel_l2, relayout  # noqa: F401 (re-exported)

F32, F16, BF16, F64 = torch.float32, torch.float16, torch.bfloat16, torch.float64

OUTPUTS = ("states", "qk_dot", "dmimo_o", "dmimo_z", "dz", "dnorm_weight", "dout_pre_rms")
NEAR_ZERO = ("qk_dot", "dmimo_z")
INPUTS = ("dout", "q", "k", "v", "q_bias", "k_bias", "mimo_v", "mimo_o", "angles", "da_cs",
          "da_cs_rev", "dt", "trap", "segsum", "mimo_z", "d", "z", "norm_weight")
# What each dtype role covers (the C++ harness's act / param / decay split).
ACT = ("dout", "q", "k", "v", "z")
PARAM = ("q_bias", "k_bias", "mimo_v", "mimo_o", "mimo_z", "d", "norm_weight")
DECAY = ("angles", "da_cs", "da_cs_rev", "dt", "trap", "segsum")


# ------------------------------------------------------------------------------ inputs

def _uniform(shape, lo, hi, gen, dtype, device):
    x = torch.rand(shape, generator=gen, dtype=F64) * (hi - lo) + lo
    return x.to(dtype).to(device)


def make_inputs(B, S, H, G, N, P, R, chunk_size=16, *, rdd=4, act=F32, param=F32, decay=F32,
                trap=None, reduce_o=True, z=False, d=False, norm=False, norm_eps=1e-5,
                device="cpu", seed=0, nan_unread=True):
    """Operator inputs as a dict (keys INPUTS + norm_eps, chunk_size, rotary_dim_divisor), each
    tensor already rounded to its dtype (act: dout, q, k, v, z; param: biases, mimo_*, d,
    norm_weight; decay: angles, dt, trap, da_cs, da_cs_rev, segsum; `trap` overrides trap's
    dtype); absent optional inputs are None. "_adt" (float64, CPU)
    is the adt = -a * dt the decay inputs were derived from (the sequential form needs it).

    da_cs, da_cs_rev and segsum are upstream's compute_dacs_segsum of adt, computed in float64
    and then rounded: from there on they are independent inputs. With nan_unread, what the
    operator must not read is NaN: segsum on and above the diagonal, and in a partial last chunk
    that chunk's whole segsum and its da_cs_rev entries."""
    assert not norm or (reduce_o and z), "the pre-gate norm needs mimo_o and z"
    gen = torch.Generator().manual_seed(seed)
    A = N // rdd
    C = chunk_size
    nch = -(-S // C)

    def u(shape, lo, hi, dtype):
        return _uniform(shape, lo, hi, gen, dtype, device)

    inp = dict(
        dout=u((B, S, H, P) if reduce_o else (B, S, R, H, P), -1, 1, act),
        q=u((B, S, R, G, N), -1, 1, act),
        k=u((B, S, R, G, N), -1, 1, act),
        v=u((B, S, H, P), -1, 1, act),
        q_bias=u((H, R, N), -0.5, 0.5, param),
        k_bias=u((H, R, N), -0.5, 0.5, param),
        mimo_v=u((H, R, P), -1, 1, param),
        mimo_o=u((H, R, P), -1, 1, param) if reduce_o else None,
        mimo_z=u((H, R, P), -1.5, 1.5, param) if z else None,
        z=u((B, S, H, P), -2, 2, act) if z else None,
        d=u((H,), -1, 1, param) if d else None,
        norm_weight=u((H, P), 0.5, 1.5, param) if norm else None,
        angles=u((B, S, H, A), -3, 3, decay),
        dt=u((B, H, S), 0.05, 0.6, decay),
        trap=u((B, H, S), -2, 2, trap or decay),
    )
    a = torch.rand((B, H, S), generator=gen, dtype=F64) * 1.4 + 0.1
    adt = -a * inp["dt"].cpu().to(F64)
    da_cs, da_cs_rev, segsum = dacs_segsum(adt, C)
    if nan_unread:
        tri = torch.ones(C, C, dtype=torch.bool).tril(-1)
        segsum = segsum.masked_fill(~tri, math.nan)
        if S % C:
            segsum[:, :, -1] = math.nan
            da_cs_rev[:, :, (nch - 1) * C:] = math.nan
    inp.update(da_cs=da_cs.to(decay).to(device), da_cs_rev=da_cs_rev.to(decay).to(device),
               segsum=segsum.to(decay).to(device), norm_eps=norm_eps, chunk_size=C,
               rotary_dim_divisor=rdd, _adt=adt)
    return inp


def dacs_segsum(adt, C):
    """Per-chunk decays of adt [B,H,S] (upstream's compute_dacs_segsum, dense, in adt's dtype):
    da_cs = inclusive cumsum inside each chunk, da_cs_rev_t = da_cs_{last of chunk} - da_cs_t,
    segsum[c,i,j] = da_cs_i - da_cs_j for i > j and 0 elsewhere (rows/columns past S are 0)."""
    B, H, S = adt.shape
    nch = -(-S // C)
    pad = torch.zeros(B, H, nch * C - S, dtype=adt.dtype, device=adt.device)
    cs = torch.cat((adt, pad), -1).view(B, H, nch, C).cumsum(-1)
    # The padded positions repeat the last valid cumsum, so the last chunk's "last" is S-1's.
    rev = (cs[..., -1:] - cs).reshape(B, H, nch * C)[..., :S]
    tri = torch.ones(C, C, dtype=torch.bool, device=adt.device).tril(-1)
    seg = (cs[..., :, None] - cs[..., None, :]) * tri
    if S % C:
        L = S - (nch - 1) * C
        seg[:, :, -1, L:, :] = 0
        seg[:, :, -1, :, L:] = 0
    return cs.reshape(B, H, nch * C)[..., :S].clone(), rev.clone(), seg


def op_args(inp):
    """Positional arguments of mamba3_mimo_bwd_fwd (up to segsum) and its keyword arguments."""
    args = [inp[k] for k in INPUTS[:14]]
    kw = dict(mimo_z=inp["mimo_z"], d=inp["d"], z=inp["z"], chunk_size=inp["chunk_size"],
              rotary_dim_divisor=inp["rotary_dim_divisor"])
    if inp["norm_weight"] is not None:
        kw.update(norm_weight=inp["norm_weight"], norm_eps=inp["norm_eps"])
    return args, kw


def io_tol(inp, output_dtype):
    """Tolerance of a call: that of its least precise dtype, inputs and output dtype alike."""
    dts = [inp[k].dtype for k in INPUTS if inp[k] is not None] + [output_dtype]
    return max(TOL[t] for t in dts if t in TOL)


# ------------------------------------------------------------------------------ reference

def _rot_half(x, ang):
    """Rotates the pairs (i, N/2 + i), i < A = ang.shape[-1], of x [..., N] by ang [..., A]:
    (a, b) -> (a cos - b sin, a sin + b cos); other dims unchanged."""
    N, A = x.shape[-1], ang.shape[-1]
    h = N // 2
    a, b = x[..., :A], x[..., h:h + A]
    c, s = torch.cos(ang), torch.sin(ang)
    out = x.clone()
    out[..., :A] = a * c - b * s
    out[..., h:h + A] = a * s + b * c
    return out


def _heads(inp, dtype):
    """Biased q/k (unrotated and rotated) and x^r = v * mimo_v^r, all [B,H,S,R,*]."""
    q, k, v = (inp[n].to(dtype) for n in ("q", "k", "v"))
    B, S, R, G, N = q.shape
    H = v.shape[2]
    rep = H // G
    q = q.repeat_interleave(rep, dim=3).permute(0, 3, 1, 2, 4)  # [B,H,S,R,N]
    k = k.repeat_interleave(rep, dim=3).permute(0, 3, 1, 2, 4)
    qb = q + inp["q_bias"].to(dtype)[None, :, None]
    kb = k + inp["k_bias"].to(dtype)[None, :, None]
    ang = inp["angles"].to(dtype).permute(0, 2, 1, 3)[:, :, :, None]  # [B,H,S,1,A]
    x = v.permute(0, 2, 1, 3)[:, :, :, None] * inp["mimo_v"].to(dtype)[None, :, None]
    return qb, kb, _rot_half(qb, ang), _rot_half(kb, ang), x


def chunked_readout(inp, dtype=F64):
    """The chunked form: (y [B,S,R,H,P], states [B,H,nchunks,N,P], qk_dot [B,H,S,R,R]) in dtype.

    Every sequence input is zero-padded to nchunks*C, da_cs padded with its last value; in a
    partial last chunk segsum and da_cs_rev are rebuilt from the padded da_cs (the caller's values
    there are never read, nor segsum on and above the diagonal)."""
    C = inp["chunk_size"]
    qb, kb, qh, kh, x = _heads(inp, dtype)
    B, H, S, R, N = qh.shape
    P = x.shape[-1]
    nch = -(-S // C)
    Sp = nch * C
    dev = qh.device
    qk_dot = torch.einsum("bhsrn,bhsqn->bhsrq", qb, kb)

    dt, trap, da_cs = (inp[n].to(dtype) for n in ("dt", "trap", "da_cs"))
    lam = torch.sigmoid(trap)
    gamma = dt * lam
    nxt = dt * (1 - lam)
    tscale = gamma + torch.cat((nxt[..., 1:], torch.zeros_like(nxt[..., :1])), -1)

    def pad_seq(t, dim, value=None):  # zero (or `value`) padding of the sequence axis
        n = Sp - S
        if n == 0:
            return t
        shape = list(t.shape)
        shape[dim] = n
        fill = torch.zeros(shape, dtype=t.dtype, device=dev)
        if value is not None:
            fill += value
        return torch.cat((t, fill), dim)

    qc = pad_seq(qh, 2).view(B, H, nch, C, R, N)
    kc = pad_seq(kh, 2).view(B, H, nch, C, R, N)
    xc = pad_seq(x, 2).view(B, H, nch, C, R, P)
    qkc = pad_seq(qk_dot, 2).view(B, H, nch, C, R, R)
    gc = pad_seq(gamma, 2).view(B, H, nch, C)
    tc = pad_seq(tscale, 2).view(B, H, nch, C)
    dcs = pad_seq(da_cs, 2, da_cs[..., -1:]).view(B, H, nch, C)
    seg = inp["segsum"].to(dtype, copy=True)
    rev = pad_seq(inp["da_cs_rev"].to(dtype, copy=True), 2).view(B, H, nch, C)
    if S % C:
        last = dcs[:, :, -1]
        seg[:, :, -1] = last[..., :, None] - last[..., None, :]
        rev[:, :, -1] = last[..., -1:] - last
    tri = torch.ones(C, C, dtype=torch.bool, device=dev).tril(-1)
    # where() before exp(): the entries not read may be NaN.
    w = torch.where(tri, torch.exp(torch.where(tri, seg, torch.zeros((), dtype=dtype, device=dev))),
                    torch.zeros((), dtype=dtype, device=dev)) * tc[:, :, :, None, :]
    scores = torch.einsum("bhctrn,bhcsqn->bhctrsq", qc, kc)
    y = torch.einsum("bhctrsq,bhcts,bhcsqp->bhctrp", scores, w, xc)
    y = y + gc[..., None, None] * torch.einsum("bhctrq,bhctqp->bhctrp", qkc, xc)
    if inp["d"] is not None:
        y = y + inp["d"].to(dtype)[None, :, None, None, None, None] * xc

    contrib = torch.einsum("bhcsrn,bhcs,bhcsrp->bhcnp", kc, tc * torch.exp(rev), xc)
    decay = torch.exp(dcs[..., -1])
    st = torch.zeros(B, H, N, P, dtype=dtype, device=dev)
    states = []
    for c in range(nch):
        states.append(st)
        st = decay[:, :, c, None, None] * st + contrib[:, :, c]
    states = torch.stack(states, 2)
    y = y + torch.exp(dcs)[..., None, None] * torch.einsum("bhctrn,bhcnp->bhctrp", qc, states)
    y = y.reshape(B, H, Sp, R, P)[:, :, :S].permute(0, 2, 3, 1, 4)  # [B,S,R,H,P]
    return y, states, qk_dot


def sequential_readout(inp, adt, dtype=F64):
    """The recurrence of SPEC.md section 1, one step at a time, from adt [B,H,S]:
    H_t = alpha H_{t-1} + beta sum_r kh_{t-1} (x) x_{t-1} + gamma sum_r kh_t (x) x_t,
    y_t^r = qh_t^r . H_t + D x_t^r. Returns (y [B,S,R,H,P], the chunk-entry states [B,H,nch,N,P]
    expressed from it: St_c = H_{cC-1} + dt_{cC} (1 - lam_{cC}) sum_r kh_{cC-1} (x) x_{cC-1})."""
    C = inp["chunk_size"]
    _, _, qh, kh, x = _heads(inp, dtype)
    B, H, S, R, N = qh.shape
    P = x.shape[-1]
    dev = qh.device
    dt, trap = inp["dt"].to(dtype), inp["trap"].to(dtype)
    adt = adt.to(dtype=dtype, device=dev)
    lam = torch.sigmoid(trap)
    alpha = torch.exp(adt)
    gamma = lam * dt
    beta = (1 - lam) * dt * alpha
    Dh = inp["d"].to(dtype) if inp["d"] is not None else torch.zeros(H, dtype=dtype, device=dev)
    Hs = torch.zeros(B, H, N, P, dtype=dtype, device=dev)
    prev = torch.zeros_like(Hs)  # sum_r kh_{t-1} (x) x_{t-1}
    ys, states = [], []
    for t in range(S):
        cur = torch.einsum("bhrn,bhrp->bhnp", kh[:, :, t], x[:, :, t])
        if t % C == 0:
            states.append(Hs + (dt[:, :, t] * (1 - lam[:, :, t]))[..., None, None] * prev)
        Hs = alpha[:, :, t, None, None] * Hs + beta[:, :, t, None, None] * prev \
            + gamma[:, :, t, None, None] * cur
        ys.append(torch.einsum("bhrn,bhnp->bhrp", qh[:, :, t], Hs)
                  + Dh[None, :, None, None] * x[:, :, t])
        prev = cur
    y = torch.stack(ys, 2).permute(0, 2, 3, 1, 4)
    return y, torch.stack(states, 2)


def project(inp, y, dtype=F64, mimo_o=None, mimo_z=None, z=None, norm_weight=None):
    """out of the readout y [B,S,R,H,P] (pre-gate norm, SiLU gate, down projection). mimo_o,
    mimo_z and norm_weight may be given per step, [B,S,R,H,P] (default: the inputs')."""
    if mimo_o is None and inp["mimo_o"] is not None:
        mimo_o = inp["mimo_o"].to(dtype).permute(1, 0, 2)  # [R,H,P] broadcasts over B, S
    if mimo_z is None and inp["mimo_z"] is not None:
        mimo_z = inp["mimo_z"].to(dtype).permute(1, 0, 2)
    if z is None and inp["z"] is not None:
        z = inp["z"].to(dtype)
    if norm_weight is None and inp["norm_weight"] is not None:
        norm_weight = inp["norm_weight"].to(dtype)
    if norm_weight is not None:
        rstd = torch.rsqrt((y * y).mean(-1, keepdim=True) + inp["norm_eps"])
        y = y * rstd * norm_weight
    if z is not None:
        u = z[:, :, None] * mimo_z
        y = y * (u * torch.sigmoid(u))
    if mimo_o is not None:
        return (mimo_o * y).sum(2)
    return y


def _dot_in_order(a, b):
    """sum_n a[..., n] * b[..., n] accumulated one n after the other in a's dtype, as the
    float32 golden's loops do (a BLAS dot would be more accurate than that golden)."""
    acc = torch.zeros(a.shape[:-1], dtype=a.dtype, device=a.device)
    for n in range(a.shape[-1]):
        acc = acc + a[..., n] * b[..., n]
    return acc


def reference(inp, dtype=F64, output_dtype=None, golden_order=True):
    """Every output of mamba3_mimo_bwd_fwd as a dict (None where the operator returns none),
    computed in dtype. With output_dtype (the fp32 reference), each output is cast to the dtype
    the operator writes it in: states / qk_dot / dz / dout_pre_rms in output_dtype, the rest f32.

    The per-batch parameter gradients come from per-step copies of the parameters (autograd
    gives each step's contribution), summed over the steps here. In float32 with golden_order,
    those sums over t and the qk_dot dots over N are accumulated sequentially, in the order of
    the float32 golden (golden/src/mimo.cpp), which is the float32 reference of the C++
    harness; golden_order=False uses torch's reductions (faster, for timing)."""
    y, states, qk_dot = chunked_readout(inp, dtype)
    B, S, R, H, P = y.shape
    in_order = golden_order and dtype == F32
    if in_order:
        qb, kb, _, _, _ = _heads(inp, dtype)
        qk_dot = _dot_in_order(qb[..., :, None, :], kb[..., None, :, :])
    leaves = {}

    def leaf(name, t):
        if t is None:
            return None
        t = t.detach().to(dtype).clone().requires_grad_(True)
        leaves[name] = t
        return t

    def per_step(w):  # [H,R,P] -> a leaf [B,S,R,H,P]
        return None if w is None else w.permute(1, 0, 2).expand(B, S, R, H, P)
    with torch.enable_grad():
        yl = leaf("dout_pre_rms", y) if inp["norm_weight"] is not None else y
        mo = leaf("dmimo_o", per_step(inp["mimo_o"]))
        mz = leaf("dmimo_z", per_step(inp["mimo_z"]))
        z = leaf("dz", inp["z"])
        nw = leaf("dnorm_weight", None if inp["norm_weight"] is None
                  else inp["norm_weight"].expand(B, S, R, H, P))
        out = project(inp, yl, dtype, mo, mz, z, nw)
        loss = (inp["dout"].to(dtype) * out).sum()
        names = list(leaves)
        grads = torch.autograd.grad(loss, [leaves[n] for n in names]) if names else ()
    res = dict.fromkeys(OUTPUTS)
    res.update(states=states, qk_dot=qk_dot)
    res.update(zip(names, grads))
    for n in ("dmimo_o", "dmimo_z", "dnorm_weight"):  # per step [B,S,R,H,P] -> [B,H,R,P]
        g = res[n]
        if g is not None:
            g = g.permute(0, 1, 3, 2, 4)
            if in_order:
                acc = torch.zeros_like(g[:, 0])
                for t in range(S):
                    acc = acc + g[:, t]
                res[n] = acc
            else:
                res[n] = g.sum(1)
    if res["dout_pre_rms"] is not None:  # [B,S,R,H,P] -> [B,H,S*R,P], row t*R + r
        res["dout_pre_rms"] = res["dout_pre_rms"].permute(0, 3, 1, 2, 4).reshape(B, H, S * R, P)
    if output_dtype is not None:
        for n in ("states", "qk_dot", "dz", "dout_pre_rms"):
            if res[n] is not None:
                res[n] = res[n].to(output_dtype)
        for n in ("dmimo_o", "dmimo_z", "dnorm_weight"):
            if res[n] is not None:
                res[n] = res[n].to(F32)
    return {k: None if v is None else v.detach() for k, v in res.items()}


# ------------------------------------------------------------------------------ checks

def as_dict(out):
    """The operator's tuple (5 outputs, or 7 with the norm) as a dict over OUTPUTS."""
    out = tuple(out)
    assert len(out) in (5, 7), f"expected 5 or 7 outputs, got {len(out)}"
    return dict(zip(OUTPUTS, out + (None,) * (7 - len(out))))


def check(out, inp, output_dtype, gold=None, ref32=None):
    """Compares every output with the float64 golden under the dual rule; returns failure lines."""
    gold = gold or reference(inp, F64)
    ref32 = ref32 or reference(inp, F32, output_dtype)
    cand = as_dict(out)
    return check_outputs(OUTPUTS, [cand[n] for n in OUTPUTS], gold, ref32,
                         io_tol(inp, output_dtype), near_zero=NEAR_ZERO)


def run_and_check(fn, inp, output_dtype=F32, **extra):
    """fn(*args, output_dtype=..., **kwargs) -> outputs; checks every output, returns them."""
    args, kw = op_args(inp)
    out = fn(*args, output_dtype=output_dtype, **kw, **extra)
    has_norm = inp["norm_weight"] is not None
    assert isinstance(out, tuple) and len(out) == (7 if has_norm else 5)
    failures = check(out, inp, output_dtype)
    assert not failures, "\n".join(failures)
    return out


def outputs_like(inp, output_dtype=F32, fill=math.nan):
    """Output tensors for mamba3_mimo_bwd_fwd_out (present exactly where the operator writes
    them), filled with `fill` (NaN: an unwritten element fails the comparison)."""
    q, v = inp["q"], inp["v"]
    B, S, R, G, N = q.shape
    H, P = v.shape[2:]
    nch = -(-S // inp["chunk_size"])
    dev = q.device

    def full(shape, dtype):
        return torch.full(shape, fill, dtype=dtype, device=dev)
    o = dict(states=full((B, H, nch, N, P), output_dtype), qk_dot=full((B, H, S, R, R), output_dtype))
    if inp["mimo_o"] is not None:
        o["dmimo_o"] = full((B, H, R, P), F32)
    if inp["z"] is not None:
        o["dmimo_z"] = full((B, H, R, P), F32)
        o["dz"] = full((B, S, H, P), output_dtype)
    if inp["norm_weight"] is not None:
        o["dnorm_weight"] = full((B, H, R, P), F32)
        o["dout_pre_rms"] = full((B, H, S * R, P), output_dtype)
    return o


# ------------------------------------------------------------------------------ case grids

def pairwise(sizes, ok=lambda a: True, seed=0, candidates=40):
    """A covering array of strength 2: assignments (one value index per axis) such that every
    pair of values of two axes that some valid assignment holds appears in at least one of them.
    ok(a) says whether a partial assignment (None = unset) may still be completed validly; it
    must reject every invalid full assignment. Greedy (best of `candidates` random completions
    per row) and deterministic for a given seed."""
    import itertools
    import random
    rng = random.Random(seed)
    n = len(sizes)
    uncovered = set()
    for i, j in itertools.combinations(range(n), 2):
        for vi in range(sizes[i]):
            for vj in range(sizes[j]):
                a = [None] * n
                a[i], a[j] = vi, vj
                if ok(a):
                    uncovered.add((i, vi, j, vj))

    def key(ax, v, other, w):
        return (ax, v, other, w) if ax < other else (other, w, ax, v)

    def new_pairs(a, ax, v):  # uncovered pairs that value v of axis ax adds to a
        return sum(1 for o in range(n) if o != ax and a[o] is not None
                   and key(ax, v, o, a[o]) in uncovered)

    result = []
    while uncovered:
        pool = sorted(uncovered)
        best, best_gain = None, 0
        for _ in range(candidates):
            i, vi, j, vj = pool[rng.randrange(len(pool))]
            a = [None] * n
            a[i], a[j] = vi, vj
            order = [x for x in range(n) if x not in (i, j)]
            rng.shuffle(order)
            for ax in order:
                scored = []
                for v in range(sizes[ax]):
                    a[ax] = v
                    if ok(a):
                        scored.append((new_pairs(a, ax, v), rng.random(), v))
                a[ax] = max(scored)[2] if scored else None
                if a[ax] is None:
                    break
            if any(x is None for x in a):
                continue
            gain = sum(1 for p, q in itertools.combinations(range(n), 2)
                       if (p, a[p], q, a[q]) in uncovered)
            if gain > best_gain:
                best, best_gain = list(a), gain
        if best is None:
            raise RuntimeError("pairwise: no valid assignment covers the remaining pairs")
        result.append(best)
        uncovered -= {(p, best[p], q, best[q]) for p, q in itertools.combinations(range(n), 2)}
    return result


# Dtype sets (act / param / decay, and trap when it differs): the C++ harness's five plus
# upstream's own mix (bf16 activations and trap, f32 parameters and decays).
DTYPE_SETS = (
    ("f32", dict(act=F32, param=F32, decay=F32)),
    ("f16/f32/f32", dict(act=F16, param=F32, decay=F32)),
    ("bf16/f32/f32", dict(act=BF16, param=F32, decay=F32)),
    ("f16", dict(act=F16, param=F16, decay=F16)),
    ("bf16", dict(act=BF16, param=BF16, decay=BF16)),
    ("upstream", dict(act=BF16, param=F32, decay=F32, trap=BF16)),
)
OUT_DTYPES = (F32, F16, BF16)


def grid(*, R=(1, 2, 4, 8), N=(16, 32, 64, 128, 256), P=(32, 64, 128), C=(8, 16, 32, 64),
         S=(5, 33, 40, 50, 64, 100), GH=((1, 1), (1, 2), (2, 4)), B=(1, 2), seed=20240603):
    """Pairwise cases over every axis (dtype set, output dtype, R, N, P, C, S, gate: none / z /
    z + norm, reduce-O or per rank, D, GQA (G, H), B, rotary divisor, strided inputs). Each case
    is a dict of make_inputs arguments plus "out" (output dtype), "strided" and "id"."""
    axes = [DTYPE_SETS, OUT_DTYPES, R, N, P, C, S, ("none", "z", "norm"), (True, False),
            (False, True), GH, B, (4, 2), (False, True)]

    def ok(a):
        gate, reduce_o = a[7], a[8]
        # The pre-gate norm sits before the down projection: it needs mimo_o.
        return not (gate == 2 and reduce_o == 1)
    cases = []
    for a in pairwise([len(x) for x in axes], ok, seed):
        v = [axes[i][a[i]] for i in range(len(axes))]
        (dname, dts), out, r, n, p, c, s, gate, reduce_o, d, (g, h), b, rdd, strided = v
        case = dict(B=b, S=s, H=h, G=g, N=n, P=p, R=r, chunk_size=c, rdd=rdd, reduce_o=reduce_o,
                    z=gate != "none", norm=gate == "norm", d=d, out=out, strided=strided, **dts)
        case["id"] = (f"B{b}S{s}H{h}G{g}N{n}P{p}R{r}C{c}rdd{rdd}-{dname}->"
                      f"{str(out).replace('torch.', '')}"
                      + ("" if reduce_o else "-rank") + ("" if gate == "none" else "-" + gate)
                      + ("-D" if d else "") + ("-strided" if strided else ""))
        cases.append(case)
    return cases


def case_inputs(case, device, seed=0):
    """make_inputs for a grid case (strided: every input as a non-contiguous view)."""
    kw = {k: v for k, v in case.items() if k not in ("out", "strided", "id")}
    inp = make_inputs(device=device, seed=seed, **kw)
    return noncontiguous(inp) if case.get("strided") else inp


_LAYOUTS = ("pad", "outer", "T", "step")


def noncontiguous(inp):
    """The same inputs as strided views (siso_ref.relayout, cycling through the layouts)."""
    out = dict(inp)
    for i, name in enumerate(INPUTS):
        if inp[name] is not None:
            out[name] = relayout(inp[name], _LAYOUTS[i % len(_LAYOUTS)])
    return out


# ------------------------------------------------------------------------------ second pass

BB_OUTPUTS = ("DQ", "DK", "DV", "DMIMO_V", "DANGLES", "DFACTOR", "DGAMMA", "DDA", "DSSDA",
              "DDA_CS_REV", "DDA_CS", "DD")
BB_NEAR_ZERO = ("DANGLES", "DDA")  # the seed's nearly-zero outputs (compared with max_rel)
BB_INPUTS = ("dout", "q", "k", "v", "q_bias", "k_bias", "mimo_v", "states", "qk_dot", "da_cs",
             "da_cs_rev", "dt", "trap", "segsum", "angles", "mimo_o", "d")


def make_bwd_bwd_inputs(B, S, H, G, N, P, R, chunk_size=16, *, layout="reduce", cache=F32,
                        seed=0, **kw):
    """Inputs of mamba3_mimo_bwd_bwd as a dict (keys BB_INPUTS + chunk_size, rotary_dim_divisor,
    layout): make_inputs' (no gate, no norm) with dout in `layout` ("reduce" [B,S,H,P] with
    mimo_o, "rank" [B,S,R,H,P], "packed" [B,H,S*R,P]) and states / qk_dot the float64 first pass
    of these inputs rounded to `cache` (as the first pass hands them over)."""
    inp = make_inputs(B, S, H, G, N, P, R, chunk_size, reduce_o=layout == "reduce", seed=seed,
                      **kw)
    if layout == "packed":
        d = inp["dout"]  # [B,S,R,H,P] -> [B,H,S*R,P]
        inp["dout"] = d.permute(0, 3, 1, 2, 4).reshape(B, H, S * R, P).contiguous()
    _, states, qk_dot = chunked_readout(inp, F64)
    dev = inp["q"].device
    inp.update(states=states.to(cache).to(dev), qk_dot=qk_dot.to(cache).to(dev), layout=layout)
    return inp


def bb_args(inp):
    """Positional arguments of mamba3_mimo_bwd_bwd (through angles) and its keyword arguments."""
    return ([inp[k] for k in BB_INPUTS[:15]],
            dict(mimo_o=inp["mimo_o"], d=inp["d"], chunk_size=inp["chunk_size"],
                 rotary_dim_divisor=inp["rotary_dim_divisor"]))


def bwd_bwd_reference(inp, dtype=F64, output_dtype=None):
    """Every output of mamba3_mimo_bwd_bwd as a dict over BB_OUTPUTS, from torch.autograd of the
    chunked forward written with the factors the outputs are gradients of as leaves:
    E = exp(da_cs) (DDA_CS), F = exp(da_cs_rev) (DDA_CS_REV), W = exp(segsum) masked to the
    strictly lower triangle *before* it becomes the leaf (so its gradient is the unmasked
    product upstream's DSSDA holds), the chunk decay exp(da_cs_last) (DDA = decay * its
    gradient, repeated over the chunk), trap_scale (DFACTOR) and the diagonal's gamma (DGAMMA)
    as two leaves, q / k per head (DQ / DK before the group sum), mimo_v and D per batch.

    The given states and qk_dot enter by value where the first pass's would (the readout and
    the decay's product, the diagonal term) while gradients flow through the recomputed ones
    (x_given + (x - x.detach())), which is the golden's definition. The partial-chunk contract
    is chunked_readout's (padding, rebuilt decays). With output_dtype (the fp32 reference), DQ /
    DK / DV are cast to it (None: the dtypes of q, k, v)."""
    C = inp["chunk_size"]
    rdd = inp["rotary_dim_divisor"]
    q, k, v = (inp[n].to(dtype) for n in ("q", "k", "v"))
    B, S, R, G, N = q.shape
    H, P = v.shape[2], v.shape[3]
    A = N // rdd
    nch = -(-S // C)
    Sp = nch * C
    dev = q.device
    layout = inp["layout"]
    leaves = {}

    def leaf(name, t):
        t = t.detach().to(dtype).clone().requires_grad_(True)
        leaves[name] = t
        return t

    def pad_seq(t, dim, value=None):
        n = Sp - S
        if n == 0:
            return t
        shape = list(t.shape)
        shape[dim] = n
        fill = torch.zeros(shape, dtype=t.dtype, device=dev)
        if value is not None:
            fill = fill + value
        return torch.cat((t, fill), dim)

    with torch.enable_grad():
        rep = H // G
        qh_in = leaf("DQ", q.repeat_interleave(rep, dim=3))  # [B,S,R,H,N] per head
        kh_in = leaf("DK", k.repeat_interleave(rep, dim=3))
        v_l = leaf("DV", v)
        mv = leaf("DMIMO_V", inp["mimo_v"].to(dtype).expand(B, H, R, P))
        ang = leaf("DANGLES", inp["angles"].to(dtype))
        qb = qh_in.permute(0, 3, 1, 2, 4) + inp["q_bias"].to(dtype)[None, :, None]  # [B,H,S,R,N]
        kb = kh_in.permute(0, 3, 1, 2, 4) + inp["k_bias"].to(dtype)[None, :, None]
        a = ang.permute(0, 2, 1, 3)[:, :, :, None]
        qr, kr = _rot_half(qb, a), _rot_half(kb, a)
        x = v_l.permute(0, 2, 1, 3)[:, :, :, None] * mv[:, :, None]  # [B,H,S,R,P]

        dt, trap, da_cs = (inp[n].to(dtype) for n in ("dt", "trap", "da_cs"))
        lam = torch.sigmoid(trap)
        gamma = dt * lam
        nxt = dt * (1 - lam)
        shifted = torch.cat((nxt[..., 1:], torch.zeros_like(nxt[..., :1])), -1)
        ts_l = leaf("DFACTOR", gamma + shifted)
        gd_l = leaf("DGAMMA", gamma)

        dcs = pad_seq(da_cs, 2, da_cs[..., -1:]).view(B, H, nch, C)
        seg = inp["segsum"].to(dtype, copy=True)
        rev = pad_seq(inp["da_cs_rev"].to(dtype, copy=True), 2).view(B, H, nch, C)
        if S % C:
            last = dcs[:, :, -1]
            seg[:, :, -1] = last[..., :, None] - last[..., None, :]
            rev[:, :, -1] = last[..., -1:] - last
        tri = torch.ones(C, C, dtype=torch.bool, device=dev).tril(-1)
        zero = torch.zeros((), dtype=dtype, device=dev)
        W = leaf("DSSDA", torch.where(tri, torch.exp(torch.where(tri, seg, zero)), zero))
        E = leaf("DDA_CS", torch.exp(dcs))
        Fv = leaf("DDA_CS_REV", torch.exp(rev))
        decay = leaf("DDA", torch.exp(dcs[..., -1]))  # [B,H,nch]

        qc = pad_seq(qr, 2).view(B, H, nch, C, R, N)
        kc = pad_seq(kr, 2).view(B, H, nch, C, R, N)
        xc = pad_seq(x, 2).view(B, H, nch, C, R, P)
        tc = pad_seq(ts_l, 2).view(B, H, nch, C)
        gc = pad_seq(gd_l, 2).view(B, H, nch, C)
        qk = torch.einsum("bhsrn,bhsqn->bhsrq", qb, kb)
        qk_used = inp["qk_dot"].to(dtype) + (qk - qk.detach())
        qkc = pad_seq(qk_used, 2).view(B, H, nch, C, R, R)

        scores = torch.einsum("bhctrn,bhcsqn->bhctrsq", qc, kc)
        y = torch.einsum("bhctrsq,bhcts,bhcs,bhcsqp->bhctrp", scores, W, tc, xc)
        y = y + gc[..., None, None] * torch.einsum("bhctrq,bhctqp->bhctrp", qkc, xc)
        if inp["d"] is not None:
            Dl = leaf("DD", inp["d"].to(dtype).expand(B, H))
            y = y + Dl[:, :, None, None, None, None] * xc
        contrib = torch.einsum("bhcsrn,bhcs,bhcsrp->bhcnp", kc, tc * Fv, xc)
        given = inp["states"].to(dtype)
        st = torch.zeros(B, H, N, P, dtype=dtype, device=dev)
        used = []
        for c in range(nch):
            st = given[:, :, c] + (st - st.detach())
            used.append(st)
            st = decay[:, :, c, None, None] * st + contrib[:, :, c]
        states = torch.stack(used, 2)
        y = y + E[..., None, None] * torch.einsum("bhctrn,bhcnp->bhctrp", qc, states)
        y = y.reshape(B, H, Sp, R, P)[:, :, :S]  # [B,H,S,R,P]

        dout = inp["dout"].to(dtype)
        if layout == "reduce":
            g = dout.permute(0, 2, 1, 3)[:, :, :, None] * inp["mimo_o"].to(dtype)[None, :, None]
        elif layout == "rank":
            g = dout.permute(0, 3, 1, 2, 4)
        else:
            g = dout.view(B, H, S, R, P)
        loss = (g * y).sum()
        names = list(leaves)
        # With one chunk nothing reads the decay or F (no later chunk): zero gradients.
        got = torch.autograd.grad(loss, [leaves[n] for n in names], allow_unused=True)
        grads = {n: torch.zeros_like(leaves[n]) if g is None else g for n, g in zip(names, got)}

    res = dict.fromkeys(BB_OUTPUTS)
    res["DQ"] = grads["DQ"].reshape(B, S * R, H, N)
    res["DK"] = grads["DK"].reshape(B, S * R, H, N)
    res["DV"] = grads["DV"]
    res["DMIMO_V"] = grads["DMIMO_V"]
    res["DANGLES"] = grads["DANGLES"]
    res["DFACTOR"] = grads["DFACTOR"]
    res["DGAMMA"] = grads["DGAMMA"]
    dda = (decay * grads["DDA"]).detach()[..., None].expand(B, H, nch, C)
    res["DDA"] = dda.reshape(B, H, Sp)[..., :S]
    res["DSSDA"] = grads["DSSDA"].transpose(-1, -2)  # stored [c, key s, query t]
    res["DDA_CS_REV"] = grads["DDA_CS_REV"].reshape(B, H, Sp)[..., :S]
    res["DDA_CS"] = grads["DDA_CS"].reshape(B, H, Sp)[..., :S]
    if inp["d"] is not None:
        res["DD"] = grads["DD"]
    out = {}
    for n, t in res.items():
        if t is None:
            out[n] = None
            continue
        t = t.detach().contiguous()
        if output_dtype is not None or dtype != F64:
            if n in ("DQ", "DK", "DV"):
                src = {"DQ": inp["q"], "DK": inp["k"], "DV": inp["v"]}[n]
                t = t.to(output_dtype or src.dtype)
            else:
                t = t.to(F32)
        out[n] = t
    return out


def bb_tol(inp, output_dtype):
    dts = [inp[k].dtype for k in BB_INPUTS if inp[k] is not None]
    dts += [output_dtype] if output_dtype is not None else [inp[k].dtype for k in ("q", "k", "v")]
    return max(TOL[t] for t in dts if t in TOL)


def check_bwd_bwd(out, inp, output_dtype=None):
    """Compares every output of mamba3_mimo_bwd_bwd (a dict) with the float64 golden under the
    dual rule; returns failure lines."""
    gold = bwd_bwd_reference(inp, F64)
    ref32 = bwd_bwd_reference(inp, F32, output_dtype)
    assert tuple(out) == BB_OUTPUTS, tuple(out)
    return check_outputs(BB_OUTPUTS, [out[n] for n in BB_OUTPUTS], gold, ref32,
                         bb_tol(inp, output_dtype), near_zero=BB_NEAR_ZERO)


# ------------------------------------------------------------------------------ combined

COMBINED_OUTPUTS = ("dq", "dk", "dv", "dadt", "ddt", "dtrap", "dq_bias", "dk_bias", "dmimo_v",
                    "dmimo_z", "dmimo_o", "dangles", "dd", "dz", "dnorm_weight")
COMBINED_NEAR_ZERO = ("dangles", "dmimo_z")
_RAW = {"dq": "q", "dk": "k", "dv": "v", "dadt": "_adt", "ddt": "dt", "dtrap": "trap",
        "dq_bias": "q_bias", "dk_bias": "k_bias", "dmimo_v": "mimo_v", "dmimo_z": "mimo_z",
        "dmimo_o": "mimo_o", "dangles": "angles", "dd": "d", "dz": "z",
        "dnorm_weight": "norm_weight"}


def combined_args(inp):
    """Positional arguments of mamba3_mimo_bwd_combined (upstream's order) and its keywords."""
    names = ("dout", "q", "k", "v", "q_bias", "k_bias", "mimo_v", "mimo_o", "z", "mimo_z",
             "angles", "da_cs", "da_cs_rev", "dt", "trap", "d", "segsum")
    return ([inp[n] for n in names] + [inp["chunk_size"], inp["rotary_dim_divisor"]],
            dict(norm_weight=inp["norm_weight"], norm_eps=inp["norm_eps"]))


def combined_reference(inp, dtype=F64, output_dtype=None):
    """The 15 gradients of mamba3_mimo_bwd_combined from torch.autograd of sum(dout * out), out
    the chunked forward (chunked_readout + project) as a function of the raw inputs, with
    da_cs / da_cs_rev / segsum computed from adt by dacs_segsum inside the graph (so dadt is
    the gradient w.r.t. adt) but holding the values the operator is given (rounded to their
    dtype: x_given + (x - x.detach())). With output_dtype (or dtype != float64) dq / dk / dv / dz
    are cast to it (default the dtypes of q, k, v, v) and the rest to float32."""
    C = inp["chunk_size"]
    x = dict(inp)
    leaves = {}
    with torch.enable_grad():
        for out, name in _RAW.items():
            t = inp[name]
            if t is None:
                continue
            # (_adt lives on the CPU: the leaf moves to the operator's device)
            t = t.detach().to(device=inp["q"].device, dtype=dtype).clone().requires_grad_(True)
            leaves[out] = t
            x[name] = t
        # Values: the (rounded) decay inputs the operator is given; gradients: through adt.
        derived = dacs_segsum(leaves["dadt"], C)
        for name, t in zip(("da_cs", "da_cs_rev", "segsum"), derived):
            x[name] = inp[name].to(dtype) + (t - t.detach())
        y, _, _ = chunked_readout(x, dtype)
        loss = (inp["dout"].to(dtype) * project(x, y, dtype)).sum()
        names = list(leaves)
        got = torch.autograd.grad(loss, [leaves[n] for n in names], allow_unused=True)
    res = dict.fromkeys(COMBINED_OUTPUTS)
    for n, g in zip(names, got):
        res[n] = torch.zeros_like(leaves[n]) if g is None else g.detach()
    if dtype != F64 or output_dtype is not None:
        for n, t in res.items():
            if t is None:
                continue
            if n in ("dq", "dk", "dv", "dz"):
                src = inp[{"dq": "q", "dk": "k", "dv": "v", "dz": "v"}[n]]
                res[n] = t.to(output_dtype or src.dtype)
            else:
                res[n] = t.to(F32)
    return {n: None if t is None else t.contiguous() for n, t in res.items()}


def check_combined(out, inp, output_dtype=None):
    gold = combined_reference(inp, F64)
    ref32 = combined_reference(inp, F32, output_dtype)
    dts = [inp[k].dtype for k in INPUTS if inp.get(k) is not None and k != "dout"]
    dts += [inp["dout"].dtype] + ([output_dtype] if output_dtype is not None else [])
    tol = max(TOL[t] for t in dts if t in TOL)
    return check_outputs(COMBINED_OUTPUTS, list(out), gold, ref32, tol,
                         near_zero=COMBINED_NEAR_ZERO)
