#include "mamba3_golden/siso_cases.hpp"

#include <chrono>
#include <cmath>
#include <cstring>
#include <memory>
#include <sstream>
#include <stdexcept>

#include "mamba3/mamba3.h"
#include "mamba3_golden/siso_bwd.hpp"
#include "case_support.hpp"

#ifdef MAMBA3_GOLDEN_CUDA
#include <cuda_runtime.h>
#endif

namespace mamba3::golden {

const char* device_name(Device d) { return d == Device::CUDA ? "cuda" : "cpu"; }

bool cuda_available() {
#ifdef MAMBA3_GOLDEN_CUDA
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no device" error
    return false;
  }
  return n > 0;
#else
  return false;
#endif
}

namespace {

using namespace cases;

std::string io_list(IoType a, IoType b, IoType c) {
  std::ostringstream os;
  os << io_name(a) << '/' << io_name(b) << '/' << io_name(c);
  return os.str();
}

std::string seq_str(const std::vector<int64_t>& v) {
  std::ostringstream os;
  os << " varlen[";
  for (size_t i = 0; i < v.size(); ++i) os << (i ? "," : "") << v[i];
  os << ']';
  return os.str();
}

std::vector<int64_t> cu_from_lengths(const std::vector<int64_t>& lens) {
  std::vector<int64_t> cu{0};
  for (int64_t l : lens) cu.push_back(cu.back() + l);
  return cu;
}

}  // namespace

std::string DqkthetaCase::describe() const {
  std::ostringstream os;
  os << "B" << B << " S" << S << " G" << G << " H" << H << " N" << N << " A" << A << " C" << chunk
     << ' ' << io_list(qk, grad, small);
  if (dok) os << " dok";
  if (!seqlens.empty()) os << seq_str(seqlens);
  if (pad) os << " pad" << pad;
  return os.str();
}

std::string DdtCase::describe() const {
  std::ostringstream os;
  os << "B" << B << " H" << H << " S" << S << ' ' << io_name(io);
  if (states) os << " states(N" << N << " P" << P << ' ' << io_name(state_io) << ')';
  if (!seqlens.empty()) os << seq_str(seqlens);
  if (pad) os << " pad" << pad;
  return os.str();
}

bool CaseReport::pass() const {
  if (!error.empty()) return false;
  for (const auto& o : outputs)
    if (!o.acc.pass) return false;
  return !outputs.empty();
}

std::string CaseReport::first_failure() const {
  if (!error.empty()) return op + " [" + case_name + "] on " + device_name(device) + ": " + error;
  for (const auto& o : outputs) {
    if (o.acc.pass) continue;
    std::ostringstream os;
    os << op << " [" << case_name << "] on " << device_name(device) << ": output " << o.name << " ("
       << o.dtype << ") " << o.acc.metric << '=' << o.acc.value() << " ref=" << o.acc.ref_value()
       << (o.acc.finite ? "" : " NON-FINITE");
    return os.str();
  }
  return "";
}

CaseReport run_dqktheta_case(const DqkthetaCase& c, Device dev, int repeats) {
  CaseReport rep;
  rep.op = "compute_dqktheta";
  rep.case_name = c.describe();
  rep.dtype = io_name(c.grad);
  rep.device = dev;
  try {
    const int64_t B = c.B, S = c.S, G = c.G, H = c.H, N = c.N, A = c.A;
    const int64_t nseq = c.seqlens.empty() ? B : static_cast<int64_t>(c.seqlens.size());
    std::mt19937_64 rng(c.seed * 0x9E3779B97F4A7C15ull + 12345);
    Buffer q = make_input(rng, c.qk, {B, S, G, N}, -1, 1, c.pad);
    Buffer k = make_input(rng, c.qk, {B, S, G, N}, -1, 1, c.pad);
    Buffer scale = make_input(rng, c.small, {B, H, S}, 0.5, 1.5, c.pad);
    Buffer gamma = make_input(rng, c.small, {B, H, S}, 0.0, 0.5, c.pad);
    Buffer qb = make_input(rng, c.qk, {H, N}, -0.5, 0.5, c.pad);
    Buffer kb = make_input(rng, c.qk, {H, N}, -0.5, 0.5, c.pad);
    Buffer angles = make_input(rng, c.small, {B, S, H, A}, 0.0, 6.283185307179586, c.pad);
    Buffer dq_in = make_input(rng, c.grad, {B, S, H, N}, -1, 1, c.pad);
    Buffer dk_in = make_input(rng, c.grad, {B, S, H, N}, -1, 1, c.pad);
    Buffer dqk = make_input(rng, c.small, {B, H, S}, -1, 1, c.pad);
    Buffer dok;
    if (c.dok) dok = make_input(rng, c.small, {nseq, H, N}, -1, 1, c.pad);
    Buffer cu;
    std::vector<int64_t> cuv;
    if (!c.seqlens.empty()) {
      cuv = cu_from_lengths(c.seqlens);
      std::vector<double> cud(cuv.begin(), cuv.end());
      cu = Buffer::from_double(IoType::I32, {nseq + 1}, cud);
    }

    // Golden (double) and reference (float) from exactly the rounded inputs.
    DqkthetaInputs<double> gi;
    gi.B = B, gi.S = S, gi.G = G, gi.H = H, gi.N = N, gi.A = A;
    gi.q = q.to_double(), gi.k = k.to_double(), gi.scale = scale.to_double();
    gi.gamma = gamma.to_double(), gi.q_bias = qb.to_double(), gi.k_bias = kb.to_double();
    gi.angles = angles.to_double(), gi.dq_in = dq_in.to_double(), gi.dk_in = dk_in.to_double();
    gi.dqk = dqk.to_double();
    if (c.dok) gi.d_ok_state = dok.to_double();
    gi.cu_seqlens = cuv;
    DqkthetaInputs<float> fi;
    fi.B = B, fi.S = S, fi.G = G, fi.H = H, fi.N = N, fi.A = A;
    fi.q = cast<float>(gi.q), fi.k = cast<float>(gi.k), fi.scale = cast<float>(gi.scale);
    fi.gamma = cast<float>(gi.gamma), fi.q_bias = cast<float>(gi.q_bias);
    fi.k_bias = cast<float>(gi.k_bias), fi.angles = cast<float>(gi.angles);
    fi.dq_in = cast<float>(gi.dq_in), fi.dk_in = cast<float>(gi.dk_in), fi.dqk = cast<float>(gi.dqk);
    fi.d_ok_state = cast<float>(gi.d_ok_state);
    fi.cu_seqlens = cuv;
    const DqkthetaGrads<double> gold = dqktheta(gi);
    const DqkthetaGrads<float> ref = dqktheta(fi);

    std::vector<std::vector<unsigned char>> first_run;
    for (int r = 0; r < std::max(1, repeats); ++r) {
      Buffer dq = make_output(c.grad, {B, S, G, N}), dk = make_output(c.grad, {B, S, G, N});
      Buffer dqb = make_output(IoType::F32, {H, N}), dkb = make_output(IoType::F32, {H, N});
      Buffer dang = make_output(c.small, {B, S, H, A});
      Buffer dsc = make_output(c.small, {B, H, S}), dga = make_output(c.small, {B, H, S});
      Operand oq(&q, dev), ok(&k, dev), osc(&scale, dev), oga(&gamma, dev), oqb(&qb, dev),
          okb(&kb, dev), oang(&angles, dev), odqi(&dq_in, dev), odki(&dk_in, dev), odqk(&dqk, dev);
      std::unique_ptr<Operand> odok, ocu;
      if (c.dok) odok = std::make_unique<Operand>(&dok, dev);
      if (!c.seqlens.empty()) ocu = std::make_unique<Operand>(&cu, dev);
      Operand Odq(&dq, dev), Odk(&dk, dev), Odqb(&dqb, dev), Odkb(&dkb, dev), Odang(&dang, dev),
          Odsc(&dsc, dev), Odga(&dga, dev);
      Launch L(dev);
      size_t ws = 0;
      mamba3_status st = mamba3_compute_dqktheta_workspace_size(
          oq.dl(), osc.dl(), c.chunk, ocu ? ocu->dl() : nullptr, &ws);
      if (st != MAMBA3_OK) {
        rep.error = status_message(st);
        return rep;
      }
      L.alloc_workspace(ws);
      const double ms = L.timed([&] {
        st = mamba3_compute_dqktheta(
            oq.dl(), ok.dl(), osc.dl(), oga.dl(), oqb.dl(), okb.dl(), oang.dl(), odqi.dl(),
            odki.dl(), odqk.dl(), odok ? odok->dl() : nullptr, c.chunk, ocu ? ocu->dl() : nullptr,
            Odq.dl(), Odk.dl(), Odqb.dl(), Odkb.dl(), Odang.dl(), Odsc.dl(), Odga.dl(), L.workspace,
            ws, L.stream);
      });
      if (st != MAMBA3_OK) {
        rep.error = status_message(st);
        return rep;
      }
      for (Operand* o : {&Odq, &Odk, &Odqb, &Odkb, &Odang, &Odsc, &Odga}) o->download();
      std::vector<std::vector<unsigned char>> bytes = {dq.bytes, dk.bytes, dqb.bytes, dkb.bytes,
                                                       dang.bytes, dsc.bytes, dga.bytes};
      if (r == 0) {
        rep.time_ms = ms;
        first_run = bytes;
        const IoType io_qk = loosest(c.qk, c.grad), io_all = loosest(io_qk, c.small);
        add_output(rep, "dq", dq, gold.dq, ref.dq, io_all);
        add_output(rep, "dk", dk, gold.dk, ref.dk, io_all);
        add_output(rep, "dq_bias", dqb, gold.dq_bias, ref.dq_bias, io_all);
        add_output(rep, "dk_bias", dkb, gold.dk_bias, ref.dk_bias, io_all);
        add_output(rep, "dangles", dang, gold.dangles, ref.dangles, io_all);
        add_output(rep, "dscale", dsc, gold.dscale, ref.dscale, io_all);
        add_output(rep, "dgamma", dga, gold.dgamma, ref.dgamma, io_all);
      } else if (r == repeats - 1) {
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

CaseReport run_ddt_case(const DdtCase& c, Device dev, int repeats) {
  CaseReport rep;
  rep.op = "compute_ddt_dtrap_dinput_states";
  rep.case_name = c.describe();
  rep.dtype = io_name(c.io);
  rep.device = dev;
  try {
    const int64_t B = c.B, H = c.H, S = c.S, N = c.N, P = c.P;
    const int64_t nseq = c.seqlens.empty() ? B : static_cast<int64_t>(c.seqlens.size());
    std::mt19937_64 rng(c.seed * 0xD1B54A32D192ED03ull + 777);
    Buffer dscale = make_input(rng, c.io, {B, H, S}, -1, 1, c.pad);
    Buffer dgamma = make_input(rng, c.io, {B, H, S}, -1, 1, c.pad);
    Buffer dt = make_input(rng, c.io, {B, H, S}, 0.01, 0.5, c.pad);
    Buffer trap = make_input(rng, c.io, {B, H, S}, -3, 3, c.pad);
    Buffer dissm, kst, vst, cu;
    if (c.states) {
      dissm = make_input(rng, c.state_io, {nseq, H, P, N}, -1, 1, c.pad);
      kst = make_input(rng, c.state_io, {nseq, H, N}, -1, 1, c.pad);
      vst = make_input(rng, c.state_io, {nseq, H, P}, -1, 1, c.pad);
    }
    std::vector<int64_t> cuv;
    if (!c.seqlens.empty()) {
      cuv = cu_from_lengths(c.seqlens);
      std::vector<double> cud(cuv.begin(), cuv.end());
      cu = Buffer::from_double(IoType::I64, {nseq + 1}, cud);
    }
    DdtDtrapInputs<double> gi;
    gi.B = B, gi.H = H, gi.S = S, gi.N = N, gi.P = P;
    gi.dscale = dscale.to_double(), gi.dgamma = dgamma.to_double();
    gi.dt = dt.to_double(), gi.trap = trap.to_double();
    if (c.states) {
      gi.d_issm_state = dissm.to_double();
      gi.input_k_state = kst.to_double();
      gi.input_v_state = vst.to_double();
    }
    gi.cu_seqlens = cuv;
    DdtDtrapInputs<float> fi;
    fi.B = B, fi.H = H, fi.S = S, fi.N = N, fi.P = P;
    fi.dscale = cast<float>(gi.dscale), fi.dgamma = cast<float>(gi.dgamma);
    fi.dt = cast<float>(gi.dt), fi.trap = cast<float>(gi.trap);
    fi.d_issm_state = cast<float>(gi.d_issm_state);
    fi.input_k_state = cast<float>(gi.input_k_state);
    fi.input_v_state = cast<float>(gi.input_v_state);
    fi.cu_seqlens = cuv;
    const DdtDtrapGrads<double> gold = ddt_dtrap(gi);
    const DdtDtrapGrads<float> ref = ddt_dtrap(fi);

    std::vector<std::vector<unsigned char>> first_run;
    for (int r = 0; r < std::max(1, repeats); ++r) {
      Buffer ddt = make_output(IoType::F32, {B, H, S}), dtrap = make_output(IoType::F32, {B, H, S});
      Buffer dis, dks, dvs;
      if (c.states) {
        dis = make_output(c.state_io, {nseq, H, P, N});
        dks = make_output(IoType::F32, {nseq, H, N});
        dvs = make_output(IoType::F32, {nseq, H, P});
      }
      Operand ods(&dscale, dev), odg(&dgamma, dev), odt(&dt, dev), otr(&trap, dev);
      std::unique_ptr<Operand> oissm, ok, ov, ocu, Odis, Odks, Odvs;
      if (c.states) {
        oissm = std::make_unique<Operand>(&dissm, dev);
        ok = std::make_unique<Operand>(&kst, dev);
        ov = std::make_unique<Operand>(&vst, dev);
        Odis = std::make_unique<Operand>(&dis, dev);
        Odks = std::make_unique<Operand>(&dks, dev);
        Odvs = std::make_unique<Operand>(&dvs, dev);
      }
      if (!c.seqlens.empty()) ocu = std::make_unique<Operand>(&cu, dev);
      Operand Oddt(&ddt, dev), Odtrap(&dtrap, dev);
      Launch L(dev);
      mamba3_status st = MAMBA3_OK;
      auto dl = [](std::unique_ptr<Operand>& o) { return o ? o->dl() : nullptr; };
      const double ms = L.timed([&] {
        st = mamba3_compute_ddt_dtrap_dinput_states(
            ods.dl(), odg.dl(), odt.dl(), otr.dl(), dl(oissm), dl(ok), dl(ov), dl(ocu), Oddt.dl(),
            Odtrap.dl(), dl(Odis), dl(Odks), dl(Odvs), L.stream);
      });
      if (st != MAMBA3_OK) {
        rep.error = status_message(st);
        return rep;
      }
      Oddt.download();
      Odtrap.download();
      std::vector<std::vector<unsigned char>> bytes = {ddt.bytes, dtrap.bytes};
      if (c.states) {
        Odis->download();
        Odks->download();
        Odvs->download();
        bytes.push_back(dis.bytes);
        bytes.push_back(dks.bytes);
        bytes.push_back(dvs.bytes);
      }
      if (r == 0) {
        rep.time_ms = ms;
        first_run = bytes;
        const IoType io_all = c.states ? loosest(c.io, c.state_io) : c.io;
        add_output(rep, "ddt", ddt, gold.ddt, ref.ddt, io_all);
        add_output(rep, "dtrap", dtrap, gold.dtrap, ref.dtrap, io_all);
        if (c.states) {
          add_output(rep, "d_input_ssm_state", dis, gold.d_input_ssm_state, ref.d_input_ssm_state,
                     c.state_io);
          add_output(rep, "d_input_k_state", dks, gold.d_input_k_state, ref.d_input_k_state,
                     c.state_io);
          add_output(rep, "d_input_v_state", dvs, gold.d_input_v_state, ref.d_input_v_state,
                     c.state_io);
        }
      } else if (r == repeats - 1) {
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
