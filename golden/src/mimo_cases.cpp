#include "mamba3_golden/mimo_cases.hpp"

#include <cmath>
#include <limits>
#include <memory>
#include <sstream>

#include "case_support.hpp"
#include "mamba3/mamba3.h"
#include "mamba3_golden/mimo.hpp"
#include "mamba3_golden/mimo_bwd_bwd.hpp"

namespace mamba3::golden {

using namespace cases;

namespace {

Buffer make_from(IoType t, std::vector<int64_t> shape, const std::vector<double>& v, int64_t pad) {
  Buffer b = Buffer::from_double(t, std::move(shape), v);
  return pad > 0 ? b.padded(pad) : b;
}

std::vector<double> rounded(std::vector<double> v, IoType t) {
  for (double& x : v) x = round_to(x, t);
  return v;
}

// An optional operand: absent (NULL at the C API) or a Buffer with its device copy.
struct Opt {
  std::unique_ptr<Operand> op;
  Opt() = default;
  Opt(Buffer* b, bool given, Device dev) {
    if (given) op = std::make_unique<Operand>(b, dev);
  }
  DLTensor* dl() { return op ? op->dl() : nullptr; }
  void download() {
    if (op) op->download();
  }
};

}  // namespace

std::string MimoBwdFwdCase::describe() const {
  std::ostringstream os;
  os << "B" << B << " S" << S << " H" << H << " G" << G << " N" << N << " P" << P << " R" << R
     << " C" << chunk << " rdd" << rdd << ' ' << io_name(act) << '/' << io_name(param) << '/'
     << io_name(decay) << "->" << io_name(out);
  os << (reduce_o ? "" : " per-rank") << (z ? " z" : "") << (d ? " D" : "");
  if (norm) os << " norm(eps=" << norm_eps << ')';
  if (pad) os << " pad" << pad;
  return os.str();
}

MimoFwdInputs make_mimo_fwd_inputs(const MimoBwdFwdCase& c, std::mt19937_64& rng) {
  const int64_t B = c.B, S = c.S, H = c.H, G = c.G, N = c.N, P = c.P, R = c.R, C = c.chunk;
  const int64_t A = N / c.rdd, nch = (S + C - 1) / C;
  const std::vector<int64_t> dout_shape =
      c.reduce_o ? std::vector<int64_t>{B, S, H, P} : std::vector<int64_t>{B, S, R, H, P};
  MimoFwdInputs in;
  Buffer &dout = in.dout, &q = in.q, &k = in.k, &v = in.v, &qb = in.qb, &kb = in.kb, &mv = in.mv;
  Buffer &mo = in.mo, &mz = in.mz, &z = in.z, &d = in.d, &nw = in.nw, &angles = in.angles;
  Buffer &dt = in.dt, &trap = in.trap, &da_cs = in.da_cs, &da_cs_rev = in.da_cs_rev;
  Buffer &segsum = in.segsum;
  MimoInputs<double>& gi = in.gi;
  MimoInputs<float>& fi = in.fi;
  dout = make_input(rng, c.act, dout_shape, -1, 1, c.pad);
  q = make_input(rng, c.act, {B, S, R, G, N}, -1, 1, c.pad);
  k = make_input(rng, c.act, {B, S, R, G, N}, -1, 1, c.pad);
  v = make_input(rng, c.act, {B, S, H, P}, -1, 1, c.pad);
  qb = make_input(rng, c.param, {H, R, N}, -0.5, 0.5, c.pad);
  kb = make_input(rng, c.param, {H, R, N}, -0.5, 0.5, c.pad);
  mv = make_input(rng, c.param, {H, R, P}, -1, 1, c.pad);
  if (c.reduce_o) mo = make_input(rng, c.param, {H, R, P}, -1, 1, c.pad);
  if (c.z) {
    mz = make_input(rng, c.param, {H, R, P}, -1.5, 1.5, c.pad);
    z = make_input(rng, c.act, {B, S, H, P}, -2, 2, c.pad);
  }
  if (c.d) d = make_input(rng, c.param, {H}, -1, 1, c.pad);
  if (c.norm) nw = make_input(rng, c.param, {H, P}, 0.5, 1.5, c.pad);
  angles = make_input(rng, c.decay, {B, S, H, A}, -3, 3, c.pad);
  dt = make_input(rng, c.decay, {B, H, S}, 0.05, 0.6, c.pad);
  trap = make_input(rng, c.decay, {B, H, S}, -2, 2, c.pad);

  // da_cs, da_cs_rev and segsum from one adt = -a * dt <= 0 (upstream's compute_dacs_segsum),
  // then rounded to their dtype: from here on they are three independent inputs.
  MimoInputs<double> dec;
  dec.B = B, dec.H = H, dec.S = S, dec.chunk_size = C;
  {
    const std::vector<double> dtv = dt.to_double();
    const std::vector<double> a = uniform(rng, B * H * S, 0.1, 1.5, IoType::F64);
    dec.adt.resize(B * H * S);
    for (int64_t i = 0; i < B * H * S; ++i) dec.adt[i] = -a[i] * dtv[i];
    mimo_dacs_segsum(dec);
  }
  std::vector<double> da_cs_v = rounded(dec.da_cs, c.decay);
  std::vector<double> da_cs_rev_v = rounded(dec.da_cs_rev, c.decay);
  std::vector<double> segsum_v = rounded(dec.segsum, c.decay);
  if (c.nan_unread) {
    const double nan = std::numeric_limits<double>::quiet_NaN();
    const bool partial = S % C != 0;
    for (int64_t bh = 0; bh < B * H; ++bh) {
      for (int64_t ch = 0; ch < nch; ++ch)
        for (int64_t i = 0; i < C; ++i)
          for (int64_t j = 0; j < C; ++j)
            if (j >= i || (partial && ch == nch - 1))
              segsum_v[((bh * nch + ch) * C + i) * C + j] = nan;
      if (partial)
        for (int64_t t = (nch - 1) * C; t < S; ++t) da_cs_rev_v[bh * S + t] = nan;
    }
  }
  da_cs = make_from(c.decay, {B, H, S}, da_cs_v, c.pad);
  da_cs_rev = make_from(c.decay, {B, H, S}, da_cs_rev_v, c.pad);
  segsum = make_from(c.decay, {B, H, nch, C, C}, segsum_v, c.pad);

  // Golden (double) and reference (float) from exactly the rounded inputs.
  gi.B = B, gi.S = S, gi.H = H, gi.G = G, gi.N = N, gi.P = P, gi.R = R;
  gi.rotary_dim_divisor = c.rdd, gi.chunk_size = C;
  gi.dout = dout.to_double(), gi.q = q.to_double(), gi.k = k.to_double(), gi.v = v.to_double();
  gi.q_bias = qb.to_double(), gi.k_bias = kb.to_double(), gi.mimo_v = mv.to_double();
  if (c.reduce_o) gi.mimo_o = mo.to_double();
  if (c.z) gi.mimo_z = mz.to_double(), gi.z = z.to_double();
  if (c.d) gi.D = d.to_double();
  if (c.norm) gi.norm_weight = nw.to_double(), gi.norm_eps = c.norm_eps;
  gi.angles = angles.to_double(), gi.dt = dt.to_double(), gi.trap = trap.to_double();
  gi.da_cs = da_cs.to_double(), gi.da_cs_rev = da_cs_rev.to_double();
  gi.segsum = segsum.to_double();
  fi.B = B, fi.S = S, fi.H = H, fi.G = G, fi.N = N, fi.P = P, fi.R = R;
  fi.rotary_dim_divisor = c.rdd, fi.chunk_size = C;
  fi.dout = cast<float>(gi.dout), fi.q = cast<float>(gi.q), fi.k = cast<float>(gi.k);
  fi.v = cast<float>(gi.v), fi.q_bias = cast<float>(gi.q_bias),
  fi.k_bias = cast<float>(gi.k_bias);
  fi.mimo_v = cast<float>(gi.mimo_v), fi.mimo_o = cast<float>(gi.mimo_o);
  fi.mimo_z = cast<float>(gi.mimo_z), fi.z = cast<float>(gi.z), fi.D = cast<float>(gi.D);
  fi.norm_weight = cast<float>(gi.norm_weight), fi.norm_eps = static_cast<float>(c.norm_eps);
  fi.angles = cast<float>(gi.angles), fi.dt = cast<float>(gi.dt), fi.trap = cast<float>(gi.trap);
  fi.da_cs = cast<float>(gi.da_cs), fi.da_cs_rev = cast<float>(gi.da_cs_rev);
  fi.segsum = cast<float>(gi.segsum);
  return in;
}

CaseReport run_mimo_bwd_fwd_case(const MimoBwdFwdCase& c, Device dev, int repeats) {
  CaseReport rep;
  rep.op = "mimo_bwd_fwd";
  rep.case_name = c.describe();
  rep.dtype = io_name(c.act);
  rep.device = dev;
  try {
    const int64_t B = c.B, S = c.S, H = c.H, N = c.N, P = c.P, R = c.R, C = c.chunk;
    const int64_t nch = (S + C - 1) / C;
    std::mt19937_64 rng(c.seed * 0xA24BAED4963EE407ull + 4242);
    MimoFwdInputs in = make_mimo_fwd_inputs(c, rng);
    Buffer &dout = in.dout, &q = in.q, &k = in.k, &v = in.v, &qb = in.qb, &kb = in.kb;
    Buffer &mv = in.mv, &mo = in.mo, &mz = in.mz, &z = in.z, &d = in.d, &nw = in.nw;
    Buffer &angles = in.angles, &dt = in.dt, &trap = in.trap, &da_cs = in.da_cs;
    Buffer &da_cs_rev = in.da_cs_rev, &segsum = in.segsum;
    const MimoInputs<double>& gi = in.gi;
    const MimoInputs<float>& fi = in.fi;
    const MimoBwdFwdOutputs<double> gold = mimo_bwd_fwd(gi);
    const MimoBwdFwdOutputs<float> ref = mimo_bwd_fwd(fi);

    std::vector<std::vector<unsigned char>> first_run;
    for (int rr = 0; rr < std::max(1, repeats); ++rr) {
      Buffer states = make_output(c.out, {B, H, nch, N, P});
      Buffer qk_dot = make_output(c.out, {B, H, S, R, R});
      Buffer dmo, dmz, dz, dnw, dpre;
      if (c.reduce_o) dmo = make_output(IoType::F32, {B, H, R, P});
      if (c.z) dmz = make_output(IoType::F32, {B, H, R, P}), dz = make_output(c.out, {B, S, H, P});
      if (c.norm)
        dnw = make_output(IoType::F32, {B, H, R, P}), dpre = make_output(c.out, {B, H, S * R, P});

      Operand odout(&dout, dev), oq(&q, dev), ok(&k, dev), ov(&v, dev), oqb(&qb, dev),
          okb(&kb, dev), omv(&mv, dev), oang(&angles, dev), odacs(&da_cs, dev),
          orev(&da_cs_rev, dev), odt(&dt, dev), otrap(&trap, dev), oseg(&segsum, dev);
      Opt omo(&mo, c.reduce_o, dev), omz(&mz, c.z, dev), od(&d, c.d, dev), oz(&z, c.z, dev),
          onw(&nw, c.norm, dev);
      Operand Ostates(&states, dev), Oqk(&qk_dot, dev);
      Opt Odmo(&dmo, c.reduce_o, dev), Odmz(&dmz, c.z, dev), Odz(&dz, c.z, dev),
          Odnw(&dnw, c.norm, dev), Odpre(&dpre, c.norm, dev);
      Launch L(dev);
      size_t ws = 0;
      mamba3_status st = mamba3_mimo_bwd_fwd_workspace_size(
          odout.dl(), oq.dl(), ok.dl(), ov.dl(), oqb.dl(), okb.dl(), omv.dl(), omo.dl(), oang.dl(),
          odacs.dl(), orev.dl(), odt.dl(), otrap.dl(), oseg.dl(), omz.dl(), od.dl(), oz.dl(),
          onw.dl(), c.norm_eps, C, c.rdd, Ostates.dl(), Oqk.dl(), Odmo.dl(), Odmz.dl(), Odz.dl(),
          Odnw.dl(), Odpre.dl(), &ws);
      if (st != MAMBA3_OK) {
        rep.error = status_message(st);
        return rep;
      }
      L.alloc_workspace(ws);
      const double ms = L.timed([&] {
        st = mamba3_mimo_bwd_fwd(odout.dl(), oq.dl(), ok.dl(), ov.dl(), oqb.dl(), okb.dl(),
                                 omv.dl(), omo.dl(), oang.dl(), odacs.dl(), orev.dl(), odt.dl(),
                                 otrap.dl(), oseg.dl(), omz.dl(), od.dl(), oz.dl(), onw.dl(),
                                 c.norm_eps, C, c.rdd, Ostates.dl(), Oqk.dl(), Odmo.dl(),
                                 Odmz.dl(), Odz.dl(), Odnw.dl(), Odpre.dl(), L.workspace, ws,
                                 L.stream);
      });
      if (st != MAMBA3_OK) {
        rep.error = status_message(st);
        return rep;
      }
      Ostates.download();
      Oqk.download();
      for (Opt* o : {&Odmo, &Odmz, &Odz, &Odnw, &Odpre}) o->download();
      std::vector<std::vector<unsigned char>> bytes = {states.bytes, qk_dot.bytes, dmo.bytes,
                                                       dmz.bytes,    dz.bytes,     dnw.bytes,
                                                       dpre.bytes};
      if (rr == 0) {
        rep.time_ms = ms;
        first_run = bytes;
        const IoType io = loosest(loosest(c.act, c.param), loosest(c.decay, c.out));
        add_output(rep, "states", states, gold.states, ref.states, io);
        add_output(rep, "qk_dot", qk_dot, gold.qk_dot, ref.qk_dot, io, /*near_zero=*/true);
        if (c.reduce_o) add_output(rep, "dmimo_o", dmo, gold.dmimo_o, ref.dmimo_o, io);
        if (c.z) {
          add_output(rep, "dmimo_z", dmz, gold.dmimo_z, ref.dmimo_z, io, /*near_zero=*/true);
          add_output(rep, "dz", dz, gold.dz, ref.dz, io);
        }
        if (c.norm) {
          add_output(rep, "dnorm_weight", dnw, gold.dnorm_weight, ref.dnorm_weight, io);
          add_output(rep, "dout_pre_rms", dpre, gold.dout_pre_rms, ref.dout_pre_rms, io);
        }
      } else if (rr == repeats - 1) {
        add_bitwise(rep, bytes == first_run);
      } else if (bytes != first_run) {
        add_bitwise(rep, false);
        break;
      }
    }
  } catch (const std::exception& e) {
    rep.error = std::string("harness: ") + e.what();
  }
  return rep;
}

CaseReport run_mimo_bwd_combined_case(const MimoCombinedCase& c, Device dev, int repeats) {
  CaseReport rep;
  rep.op = "mimo_bwd_combined";
  rep.case_name = c.describe();
  rep.dtype = io_name(c.act);
  rep.device = dev;
  try {
    const int64_t B = c.B, S = c.S, H = c.H, G = c.G, N = c.N, P = c.P, R = c.R, C = c.chunk;
    const int64_t A = N / c.rdd;
    std::mt19937_64 rng(c.seed * 0xD1B54A32D192ED03ull + 4444);
    MimoFwdInputs in = make_mimo_fwd_inputs(c, rng);
    Buffer &dout = in.dout, &q = in.q, &k = in.k, &v = in.v, &qb = in.qb, &kb = in.kb;
    Buffer &mv = in.mv, &mo = in.mo, &mz = in.mz, &z = in.z, &d = in.d, &nw = in.nw;
    Buffer &angles = in.angles, &dt = in.dt, &trap = in.trap, &da_cs = in.da_cs;
    Buffer &da_cs_rev = in.da_cs_rev, &segsum = in.segsum;
    const MimoInputs<double>& gi = in.gi;
    const MimoInputs<float>& fi = in.fi;
    const MimoCombinedOutputs<double> gold = mimo_bwd_combined(gi);
    const MimoCombinedOutputs<float> ref = mimo_bwd_combined(fi);

    std::vector<std::vector<unsigned char>> first_run;
    for (int rr = 0; rr < std::max(1, repeats); ++rr) {
      Buffer dq = make_output(c.out, {B, S, R, G, N}), dk = make_output(c.out, {B, S, R, G, N});
      Buffer dv = make_output(c.out, {B, S, H, P});
      Buffer dadt = make_output(IoType::F32, {B, H, S}), ddt = make_output(IoType::F32, {B, H, S});
      Buffer dtrap = make_output(IoType::F32, {B, H, S});
      Buffer dqb = make_output(IoType::F32, {H, R, N}), dkb = make_output(IoType::F32, {H, R, N});
      Buffer dmv = make_output(IoType::F32, {H, R, P});
      Buffer dang = make_output(IoType::F32, {B, S, H, A});
      Buffer dmz, dmo, dd, dz, dnw;
      if (c.z) dmz = make_output(IoType::F32, {H, R, P}), dz = make_output(c.out, {B, S, H, P});
      if (c.reduce_o) dmo = make_output(IoType::F32, {H, R, P});
      if (c.d) dd = make_output(IoType::F32, {H});
      if (c.norm) dnw = make_output(IoType::F32, {H, P});

      Operand odout(&dout, dev), oq(&q, dev), ok(&k, dev), ov(&v, dev), oqb(&qb, dev),
          okb(&kb, dev), omv(&mv, dev), oang(&angles, dev), odacs(&da_cs, dev),
          orev(&da_cs_rev, dev), odt(&dt, dev), otrap(&trap, dev), oseg(&segsum, dev);
      Opt omo(&mo, c.reduce_o, dev), omz(&mz, c.z, dev), od(&d, c.d, dev), oz(&z, c.z, dev),
          onw(&nw, c.norm, dev);
      Operand Odq(&dq, dev), Odk(&dk, dev), Odv(&dv, dev), Odadt(&dadt, dev), Oddt(&ddt, dev),
          Odtrap(&dtrap, dev), Odqb(&dqb, dev), Odkb(&dkb, dev), Odmv(&dmv, dev),
          Odang(&dang, dev);
      Opt Odmz(&dmz, c.z, dev), Odmo(&dmo, c.reduce_o, dev), Odd(&dd, c.d, dev),
          Odz(&dz, c.z, dev), Odnw(&dnw, c.norm, dev);
      Launch L(dev);
      size_t ws = 0;
      mamba3_status st = mamba3_mimo_bwd_combined_workspace_size(
          odout.dl(), oq.dl(), ok.dl(), ov.dl(), oqb.dl(), okb.dl(), omv.dl(), omo.dl(), oz.dl(),
          omz.dl(), oang.dl(), odacs.dl(), orev.dl(), odt.dl(), otrap.dl(), od.dl(), oseg.dl(), C,
          c.rdd, onw.dl(), c.norm_eps, Odq.dl(), Odk.dl(), Odv.dl(), Odadt.dl(), Oddt.dl(),
          Odtrap.dl(), Odqb.dl(), Odkb.dl(), Odmv.dl(), Odmz.dl(), Odmo.dl(), Odang.dl(),
          Odd.dl(), Odz.dl(), Odnw.dl(), &ws);
      if (st != MAMBA3_OK) {
        rep.error = status_message(st);
        return rep;
      }
      L.alloc_workspace(ws);
      const double ms = L.timed([&] {
        st = mamba3_mimo_bwd_combined(
            odout.dl(), oq.dl(), ok.dl(), ov.dl(), oqb.dl(), okb.dl(), omv.dl(), omo.dl(), oz.dl(),
            omz.dl(), oang.dl(), odacs.dl(), orev.dl(), odt.dl(), otrap.dl(), od.dl(), oseg.dl(),
            C, c.rdd, onw.dl(), c.norm_eps, Odq.dl(), Odk.dl(), Odv.dl(), Odadt.dl(), Oddt.dl(),
            Odtrap.dl(), Odqb.dl(), Odkb.dl(), Odmv.dl(), Odmz.dl(), Odmo.dl(), Odang.dl(),
            Odd.dl(), Odz.dl(), Odnw.dl(), L.workspace, ws, L.stream);
      });
      if (st != MAMBA3_OK) {
        rep.error = status_message(st);
        return rep;
      }
      for (Operand* o : {&Odq, &Odk, &Odv, &Odadt, &Oddt, &Odtrap, &Odqb, &Odkb, &Odmv, &Odang})
        o->download();
      for (Opt* o : {&Odmz, &Odmo, &Odd, &Odz, &Odnw}) o->download();
      std::vector<std::vector<unsigned char>> bytes = {
          dq.bytes,  dk.bytes,  dv.bytes,   dadt.bytes, ddt.bytes, dtrap.bytes, dqb.bytes,
          dkb.bytes, dmv.bytes, dmz.bytes, dmo.bytes, dang.bytes, dd.bytes,    dz.bytes,
          dnw.bytes};
      if (rr == 0) {
        rep.time_ms = ms;
        first_run = bytes;
        const IoType io = loosest(loosest(c.act, c.param), loosest(c.decay, c.out));
        add_output(rep, "dq", dq, gold.dq, ref.dq, io);
        add_output(rep, "dk", dk, gold.dk, ref.dk, io);
        add_output(rep, "dv", dv, gold.dv, ref.dv, io);
        add_output(rep, "dadt", dadt, gold.dadt, ref.dadt, io);
        add_output(rep, "ddt", ddt, gold.ddt, ref.ddt, io);
        add_output(rep, "dtrap", dtrap, gold.dtrap, ref.dtrap, io);
        add_output(rep, "dq_bias", dqb, gold.dq_bias, ref.dq_bias, io);
        add_output(rep, "dk_bias", dkb, gold.dk_bias, ref.dk_bias, io);
        add_output(rep, "dmimo_v", dmv, gold.dmimo_v, ref.dmimo_v, io);
        if (c.z) add_output(rep, "dmimo_z", dmz, gold.dmimo_z, ref.dmimo_z, io, /*near_zero=*/true);
        if (c.reduce_o) add_output(rep, "dmimo_o", dmo, gold.dmimo_o, ref.dmimo_o, io);
        add_output(rep, "dangles", dang, gold.dangles, ref.dangles, io, /*near_zero=*/true);
        if (c.d) add_output(rep, "dd", dd, gold.dd, ref.dd, io);
        if (c.z) add_output(rep, "dz", dz, gold.dz, ref.dz, io);
        if (c.norm) add_output(rep, "dnorm_weight", dnw, gold.dnorm_weight, ref.dnorm_weight, io);
      } else if (rr == repeats - 1) {
        add_bitwise(rep, bytes == first_run);
      } else if (bytes != first_run) {
        add_bitwise(rep, false);
        break;
      }
    }
  } catch (const std::exception& e) {
    rep.error = std::string("harness: ") + e.what();
  }
  return rep;
}

std::string MimoBwdBwdCase::describe() const {
  std::ostringstream os;
  os << "B" << B << " S" << S << " H" << H << " G" << G << " N" << N << " P" << P << " R" << R
     << " C" << chunk << " rdd" << rdd << ' ' << io_name(act) << '/' << io_name(param) << '/'
     << io_name(decay) << '/' << io_name(cache) << "->" << io_name(out);
  os << (dout == MimoDoutKind::ReduceO   ? ""
         : dout == MimoDoutKind::PerRank ? " per-rank"
                                         : " packed")
     << (d ? " D" : "");
  if (pad) os << " pad" << pad;
  return os.str();
}

CaseReport run_mimo_bwd_bwd_case(const MimoBwdBwdCase& c, Device dev, int repeats) {
  CaseReport rep;
  rep.op = "mimo_bwd_bwd";
  rep.case_name = c.describe();
  rep.dtype = io_name(c.act);
  rep.device = dev;
  try {
    const int64_t B = c.B, S = c.S, H = c.H, G = c.G, N = c.N, P = c.P, R = c.R, C = c.chunk;
    const int64_t A = N / c.rdd, nch = (S + C - 1) / C;
    const bool reduce = c.dout == MimoDoutKind::ReduceO;
    std::mt19937_64 rng(c.seed * 0x9E3779B97F4A7C15ull + 4343);
    const std::vector<int64_t> dout_shape =
        reduce ? std::vector<int64_t>{B, S, H, P}
        : c.dout == MimoDoutKind::PerRank ? std::vector<int64_t>{B, S, R, H, P}
                                          : std::vector<int64_t>{B, H, S * R, P};
    Buffer dout = make_input(rng, c.act, dout_shape, -1, 1, c.pad);
    Buffer q = make_input(rng, c.act, {B, S, R, G, N}, -1, 1, c.pad);
    Buffer k = make_input(rng, c.act, {B, S, R, G, N}, -1, 1, c.pad);
    Buffer v = make_input(rng, c.act, {B, S, H, P}, -1, 1, c.pad);
    Buffer qb = make_input(rng, c.param, {H, R, N}, -0.5, 0.5, c.pad);
    Buffer kb = make_input(rng, c.param, {H, R, N}, -0.5, 0.5, c.pad);
    Buffer mv = make_input(rng, c.param, {H, R, P}, -1, 1, c.pad);
    Buffer mo, d;
    if (reduce) mo = make_input(rng, c.param, {H, R, P}, -1, 1, c.pad);
    if (c.d) d = make_input(rng, c.param, {H}, -1, 1, c.pad);
    Buffer angles = make_input(rng, c.decay, {B, S, H, A}, -3, 3, c.pad);
    Buffer dt = make_input(rng, c.decay, {B, H, S}, 0.05, 0.6, c.pad);
    Buffer trap = make_input(rng, c.decay, {B, H, S}, -2, 2, c.pad);

    // da_cs, da_cs_rev and segsum from one adt <= 0, rounded: from here on independent inputs.
    MimoInputs<double> dec;
    dec.B = B, dec.H = H, dec.S = S, dec.chunk_size = C;
    {
      const std::vector<double> dtv = dt.to_double();
      const std::vector<double> a = uniform(rng, B * H * S, 0.1, 1.5, IoType::F64);
      dec.adt.resize(B * H * S);
      for (int64_t i = 0; i < B * H * S; ++i) dec.adt[i] = -a[i] * dtv[i];
      mimo_dacs_segsum(dec);
    }
    std::vector<double> da_cs_v = rounded(dec.da_cs, c.decay);
    std::vector<double> da_cs_rev_v = rounded(dec.da_cs_rev, c.decay);
    std::vector<double> segsum_v = rounded(dec.segsum, c.decay);

    MimoInputs<double> gi;
    gi.B = B, gi.S = S, gi.H = H, gi.G = G, gi.N = N, gi.P = P, gi.R = R;
    gi.rotary_dim_divisor = c.rdd, gi.chunk_size = C;
    gi.dout = dout.to_double(), gi.q = q.to_double(), gi.k = k.to_double(), gi.v = v.to_double();
    gi.q_bias = qb.to_double(), gi.k_bias = kb.to_double(), gi.mimo_v = mv.to_double();
    if (reduce) gi.mimo_o = mo.to_double();
    if (c.d) gi.D = d.to_double();
    gi.angles = angles.to_double(), gi.dt = dt.to_double(), gi.trap = trap.to_double();
    gi.da_cs = da_cs_v, gi.da_cs_rev = da_cs_rev_v, gi.segsum = segsum_v;

    // The first pass's states and qk_dot of these inputs (its dout does not enter them), rounded
    // to the dtype the first pass would have written them in.
    std::vector<double> states_v, qk_v;
    {
      MimoInputs<double> fwd = gi;
      fwd.mimo_o.clear();
      fwd.dout.assign(B * S * R * H * P, 0.0);
      MimoBwdFwdOutputs<double> f = mimo_bwd_fwd(fwd);
      states_v = rounded(f.states, c.cache);
      qk_v = rounded(f.qk_dot, c.cache);
    }
    if (c.nan_unread) {
      const double nan = std::numeric_limits<double>::quiet_NaN();
      const bool partial = S % C != 0;
      for (int64_t bh = 0; bh < B * H; ++bh) {
        for (int64_t ch = 0; ch < nch; ++ch)
          for (int64_t i = 0; i < C; ++i)
            for (int64_t j = 0; j < C; ++j)
              if (j >= i || (partial && ch == nch - 1))
                segsum_v[((bh * nch + ch) * C + i) * C + j] = nan;
        if (partial)
          for (int64_t t = (nch - 1) * C; t < S; ++t) da_cs_rev_v[bh * S + t] = nan;
      }
      gi.segsum = segsum_v, gi.da_cs_rev = da_cs_rev_v;
    }
    Buffer da_cs = make_from(c.decay, {B, H, S}, da_cs_v, c.pad);
    Buffer da_cs_rev = make_from(c.decay, {B, H, S}, da_cs_rev_v, c.pad);
    Buffer segsum = make_from(c.decay, {B, H, nch, C, C}, segsum_v, c.pad);
    Buffer states = make_from(c.cache, {B, H, nch, N, P}, states_v, c.pad);
    Buffer qk_dot = make_from(c.cache, {B, H, S, R, R}, qk_v, c.pad);

    // Golden (double) and reference (float) from exactly the rounded inputs.
    const MimoDoutLayout layout = reduce ? MimoDoutLayout::ReduceO
                                  : c.dout == MimoDoutKind::PerRank ? MimoDoutLayout::PerRank
                                                                    : MimoDoutLayout::Packed;
    MimoInputs<float> fi;
    fi.B = B, fi.S = S, fi.H = H, fi.G = G, fi.N = N, fi.P = P, fi.R = R;
    fi.rotary_dim_divisor = c.rdd, fi.chunk_size = C;
    fi.dout = cast<float>(gi.dout), fi.q = cast<float>(gi.q), fi.k = cast<float>(gi.k);
    fi.v = cast<float>(gi.v), fi.q_bias = cast<float>(gi.q_bias);
    fi.k_bias = cast<float>(gi.k_bias), fi.mimo_v = cast<float>(gi.mimo_v);
    fi.mimo_o = cast<float>(gi.mimo_o), fi.D = cast<float>(gi.D);
    fi.angles = cast<float>(gi.angles), fi.dt = cast<float>(gi.dt), fi.trap = cast<float>(gi.trap);
    fi.da_cs = cast<float>(gi.da_cs), fi.da_cs_rev = cast<float>(gi.da_cs_rev);
    fi.segsum = cast<float>(gi.segsum);
    const MimoBwdBwdOutputs<double> gold = mimo_bwd_bwd(gi, states_v, qk_v, layout);
    const MimoBwdBwdOutputs<float> ref =
        mimo_bwd_bwd(fi, cast<float>(states_v), cast<float>(qk_v), layout);

    std::vector<std::vector<unsigned char>> first_run;
    for (int rr = 0; rr < std::max(1, repeats); ++rr) {
      Buffer dq = make_output(c.out, {B, S * R, H, N});
      Buffer dk = make_output(c.out, {B, S * R, H, N});
      Buffer dv = make_output(c.out, {B, S, H, P});
      Buffer dmv = make_output(IoType::F32, {B, H, R, P});
      Buffer dang = make_output(IoType::F32, {B, S, H, A});
      Buffer dfac = make_output(IoType::F32, {B, H, S});
      Buffer dgam = make_output(IoType::F32, {B, H, S});
      Buffer dda = make_output(IoType::F32, {B, H, S});
      Buffer dssda = make_output(IoType::F32, {B, H, nch, C, C});
      Buffer drev = make_output(IoType::F32, {B, H, S});
      Buffer dcs = make_output(IoType::F32, {B, H, S});
      Buffer dd;
      if (c.d) dd = make_output(IoType::F32, {B, H});

      Operand odout(&dout, dev), oq(&q, dev), ok(&k, dev), ov(&v, dev), oqb(&qb, dev),
          okb(&kb, dev), omv(&mv, dev), ost(&states, dev), oqk(&qk_dot, dev),
          odacs(&da_cs, dev), orev(&da_cs_rev, dev), odt(&dt, dev), otrap(&trap, dev),
          oseg(&segsum, dev), oang(&angles, dev);
      Opt omo(&mo, reduce, dev), od(&d, c.d, dev);
      Operand Odq(&dq, dev), Odk(&dk, dev), Odv(&dv, dev), Odmv(&dmv, dev), Odang(&dang, dev),
          Odfac(&dfac, dev), Odgam(&dgam, dev), Odda(&dda, dev), Odssda(&dssda, dev),
          Odrev(&drev, dev), Odcs(&dcs, dev);
      Opt Odd(&dd, c.d, dev);
      Launch L(dev);
      size_t ws = 0;
      mamba3_status st = mamba3_mimo_bwd_bwd_workspace_size(
          odout.dl(), oq.dl(), ok.dl(), ov.dl(), oqb.dl(), okb.dl(), omv.dl(), ost.dl(), oqk.dl(),
          odacs.dl(), orev.dl(), odt.dl(), otrap.dl(), oseg.dl(), oang.dl(), omo.dl(), od.dl(), C,
          c.rdd, Odq.dl(), Odk.dl(), Odv.dl(), Odmv.dl(), Odang.dl(), Odfac.dl(), Odgam.dl(),
          Odda.dl(), Odssda.dl(), Odrev.dl(), Odcs.dl(), Odd.dl(), &ws);
      if (st != MAMBA3_OK) {
        rep.error = status_message(st);
        return rep;
      }
      L.alloc_workspace(ws);
      const double ms = L.timed([&] {
        st = mamba3_mimo_bwd_bwd(
            odout.dl(), oq.dl(), ok.dl(), ov.dl(), oqb.dl(), okb.dl(), omv.dl(), ost.dl(),
            oqk.dl(), odacs.dl(), orev.dl(), odt.dl(), otrap.dl(), oseg.dl(), oang.dl(), omo.dl(),
            od.dl(), C, c.rdd, Odq.dl(), Odk.dl(), Odv.dl(), Odmv.dl(), Odang.dl(), Odfac.dl(),
            Odgam.dl(), Odda.dl(), Odssda.dl(), Odrev.dl(), Odcs.dl(), Odd.dl(), L.workspace, ws,
            L.stream);
      });
      if (st != MAMBA3_OK) {
        rep.error = status_message(st);
        return rep;
      }
      for (Operand* o : {&Odq, &Odk, &Odv, &Odmv, &Odang, &Odfac, &Odgam, &Odda, &Odssda, &Odrev,
                         &Odcs})
        o->download();
      Odd.download();
      std::vector<std::vector<unsigned char>> bytes = {
          dq.bytes,    dk.bytes,   dv.bytes,  dmv.bytes, dang.bytes, dfac.bytes,
          dgam.bytes,  dda.bytes,  dssda.bytes, drev.bytes, dcs.bytes, dd.bytes};
      if (rr == 0) {
        rep.time_ms = ms;
        first_run = bytes;
        const IoType io =
            loosest(loosest(loosest(c.act, c.param), loosest(c.decay, c.out)), c.cache);
        add_output(rep, "dq", dq, gold.dq, ref.dq, io);
        add_output(rep, "dk", dk, gold.dk, ref.dk, io);
        add_output(rep, "dv", dv, gold.dv, ref.dv, io);
        add_output(rep, "dmimo_v", dmv, gold.dmimo_v, ref.dmimo_v, io);
        add_output(rep, "dangles", dang, gold.dangles, ref.dangles, io, /*near_zero=*/true);
        add_output(rep, "dfactor", dfac, gold.dfactor, ref.dfactor, io);
        add_output(rep, "dgamma", dgam, gold.dgamma, ref.dgamma, io);
        add_output(rep, "dda", dda, gold.dda, ref.dda, io, /*near_zero=*/true);
        add_output(rep, "dssda", dssda, gold.dssda, ref.dssda, io);
        add_output(rep, "dda_cs_rev", drev, gold.dda_cs_rev, ref.dda_cs_rev, io);
        add_output(rep, "dda_cs", dcs, gold.dda_cs, ref.dda_cs, io);
        if (c.d) add_output(rep, "dd", dd, gold.dd, ref.dd, io);
      } else if (rr == repeats - 1) {
        add_bitwise(rep, bytes == first_run);
      } else if (bytes != first_run) {
        add_bitwise(rep, false);
        break;
      }
    }
  } catch (const std::exception& e) {
    rep.error = std::string("harness: ") + e.what();
  }
  return rep;
}

}  // namespace mamba3::golden
