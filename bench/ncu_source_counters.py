#!/usr/bin/env python3
"""Extract per-SASS-instruction metrics ("source counters") from an Nsight Compute
report (.ncu-rep) without Nsight Compute.  Standard library only; needs nvdisasm
(or cuobjdump) for the SASS text.

Why: the development machine has no Nsight Compute (and none installs from PyPI or Debian), and
exporting source pages on the device (`ncu --import X --page source --csv`) costs device time.
With this reader a device call only brings the .ncu-rep files back; stall samples, executed
instructions and bank-conflict wavefronts per SASS instruction (per source line with
bench/ncu_by_line.py) are read here. nvdisasm: NVDISASM=..., PATH, or the pip wheel
nvidia-cuda-nvdisasm (unzip; the binary is nvidia/cu13/bin/nvdisasm).

From Python: extract(report) returns the same table (and each instruction's source line).

Usage:
  python3 bench/ncu_source_counters.py REPORT.ncu-rep OUT.csv [--result N] [--ncu-columns]
                         [--nvdisasm PATH] [--dump-cubin FILE] [--list]

Checked (session 23) on two reports of the planes K3 (the device's ncu, CUDA 13, sm_90a):
every per-instruction column sums to the report's own kernel total (62 of 62 columns), the
stall reasons of each row add up to its sample count, executed LDL / STL match ncu's spill
counters, and the SASS text of 3904 instructions matches ncu's source page.

File layout (decoded by hand, field numbers match the NV.Profiler protobuf
schema seen in public ncu readers):
  "NVR\\0"  u32 len  FileHeader{1: version}
  repeat:   u32 len  BlockHeader{1: NumSources, 2: NumResults, 3: SessionDetails,
                                 4: StringTable{1: repeated string}, 5: PayloadSize,
                                 6: Process}
            payload (PayloadSize bytes) = NumSources x (u32 len, ProfilerSource)
                                        + NumResults x (u32 len, ProfilerResult)
  ProfilerSource (= SourceData): 1: module id, 4: cubin ELF bytes, 5: sm version?,
                 9: {repeated 1: Function{1: mangled name, 2: load address, 3: ELF symbol index}}
  ProfilerResult: 1: process id, 5: mangled kernel name, 6: short name, 7: demangled,
                 13: repeated MetricResult{1: name id (into the block's StringTable),
                                           2: aggregate MetricValue,
                                           3: repeated {1: CorrelationId MetricValue,
                                                        2: ElementValue MetricValue}}
                 15: {1: module id of the source}
  MetricValue: 1 string | 2 float | 3 double | 4 uint32 | 5 uint64.
Per-instruction ("source") metrics are the MetricResults whose list correlation ids
are PCs inside the kernel's code (function load address .. + size).

Output CSV: Address (absolute PC, as ncu prints it), Source (SASS, formatted like ncu's
source page: 6-char predicate field, branch labels replaced by absolute addresses,
".reuse" dropped -- verified identical to ncu on 3904 instructions), one column per
per-PC metric under its report name, and a final "Offset" column (PC - function start).
PCs without an entry get 0 (enum-like metrics: empty).  With --ncu-columns the
columns are renamed/derived like `ncu --page source --csv --print-source sass`
(stall_*, "Warp Stall Sampling (All Samples)" = sum of stall reasons, ...).
Enum metrics: memory_type 4=Global 8=Local 16=Shared; memory_access_type 2=Load
4=Store; memory_access_size_type = bits (U16 accesses show 8 -- unverified).
"""

import argparse
import bz2
import csv
import lzma
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import zlib

# ----------------------------------------------------------------------------
# generic protobuf wire-format decoding
# ----------------------------------------------------------------------------


def _varint(b, i):
    r = 0
    s = 0
    while True:
        c = b[i]
        i += 1
        r |= (c & 0x7F) << s
        s += 7
        if c < 0x80:
            return r, i


def pb_parse(b):
    """Decode one message into a list of (field, wiretype, value). Raises on error."""
    out = []
    i = 0
    n = len(b)
    while i < n:
        k, i = _varint(b, i)
        f, wt = k >> 3, k & 7
        if f == 0:
            raise ValueError("field 0")
        if wt == 0:
            v, i = _varint(b, i)
        elif wt == 1:
            v = b[i : i + 8]
            i += 8
        elif wt == 5:
            v = b[i : i + 4]
            i += 4
        elif wt == 2:
            ln, i = _varint(b, i)
            v = b[i : i + ln]
            i += ln
        else:
            raise ValueError("wiretype %d" % wt)
        if i > n:
            raise ValueError("truncated")
        out.append((f, wt, v))
    return out


def pb_fields(b, field):
    return [v for f, _, v in pb_parse(b) if f == field]


def pb_first(b, field, default=None):
    for f, _, v in pb_parse(b):
        if f == field:
            return v
    return default


def metric_value(b):
    """MetricValue message -> python value (str / float / int)."""
    for f, wt, v in pb_parse(b):
        if f == 1:
            return v.decode("utf-8", "replace")
        if f == 2:
            return struct.unpack("<f", v)[0] if wt == 5 else v
        if f == 3:
            return struct.unpack("<d", v)[0] if wt == 1 else v
        if f in (4, 5):
            return v
    return None


# ----------------------------------------------------------------------------
# report container
# ----------------------------------------------------------------------------


def maybe_decompress(b):
    if b[:4] == b"\x7fELF":
        return b
    for fn in (zlib.decompress, lzma.decompress, bz2.decompress):
        try:
            return fn(b)
        except Exception:
            pass
    if b[:4] == b"\x28\xb5\x2f\xfd":
        try:
            import zstandard  # optional

            return zstandard.ZstdDecompressor().decompress(b, max_output_size=1 << 31)
        except Exception:
            pass
    return b


def read_report(path):
    b = open(path, "rb").read()
    if b[:4] != b"NVR\0":
        raise SystemExit("%s: not an .ncu-rep file (magic %r)" % (path, b[:4]))
    i = 4
    hl = struct.unpack_from("<I", b, i)[0]
    i += 4 + hl
    sources = []  # (module_id, raw message)
    results = []  # (string table, raw message)
    strings = []
    while i + 4 <= len(b):
        hl = struct.unpack_from("<I", b, i)[0]
        i += 4
        hdr = pb_parse(b[i : i + hl])
        i += hl
        h = {}
        for f, wt, v in hdr:
            h.setdefault(f, v)
        nsrc, nres, psize = h.get(1, 0), h.get(2, 0), h.get(5, 0)
        # A block without a string table uses the last one given (ncu writes the table once
        # when several kernels' results share it: session 43's two-kernel reports).
        if 4 in h and h[4]:
            strings = [v.decode("utf-8", "replace") for v in pb_fields(h[4], 1)]
        j = i
        for k in range(nsrc + nres):
            ln = struct.unpack_from("<I", b, j)[0]
            msg = b[j + 4 : j + 4 + ln]
            j += 4 + ln
            if k < nsrc:
                sources.append(msg)
            else:
                results.append((strings, msg))
        i += psize
    return sources, results


# ----------------------------------------------------------------------------
# ELF helpers (symbols of the cubin)
# ----------------------------------------------------------------------------


def elf_symbols(elf):
    """Return list of (index, name, value, size, shndx, type) and section list."""
    assert elf[:4] == b"\x7fELF" and elf[4] == 2, "expect ELF64"
    (e_shoff,) = struct.unpack_from("<Q", elf, 0x28)
    e_shentsize, e_shnum, e_shstrndx = struct.unpack_from("<HHH", elf, 0x3A)
    secs = []
    for k in range(e_shnum):
        o = e_shoff + k * e_shentsize
        name, typ, flags, addr, off, size, link, info, align, entsize = struct.unpack_from(
            "<IIQQQQIIQQ", elf, o
        )
        secs.append(dict(name=name, type=typ, off=off, size=size, link=link, entsize=entsize))
    shstr = secs[e_shstrndx]

    def cstr(sec, o):
        s = sec["off"] + o
        e = elf.index(b"\0", s)
        return elf[s:e].decode("utf-8", "replace")

    for s in secs:
        s["sname"] = cstr(shstr, s["name"])
    syms = []
    for s in secs:
        if s["type"] != 2:  # SHT_SYMTAB
            continue
        strsec = secs[s["link"]]
        n = s["size"] // 24
        for k in range(n):
            st_name, st_info, st_other, st_shndx, st_value, st_size = struct.unpack_from(
                "<IBBHQQ", elf, s["off"] + k * 24
            )
            syms.append((k, cstr(strsec, st_name), st_value, st_size, st_shndx, st_info & 0xF))
    return syms, secs


# ----------------------------------------------------------------------------
# disassembly
# ----------------------------------------------------------------------------

HERE = os.path.dirname(os.path.abspath(__file__))


def find_tool(name, explicit=None):
    cands = []
    if explicit:
        cands.append(explicit)
    if os.environ.get(name.upper()):
        cands.append(os.environ[name.upper()])
    cands += [os.path.join(HERE, "tools", name), "/usr/local/cuda/bin/" + name]
    w = shutil.which(name)
    if w:
        cands.append(w)
    for c in cands:
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    return None


_FILE_RE = re.compile(r'//## File "([^"]+)", line (\d+)')
_INS_RE = re.compile(r"^\s*/\*([0-9a-fA-F]+)\*/\s+(.*?)\s*;?\s*(?:/\*.*\*/)?\s*$")
_LBL_RE = re.compile(r"^\s*([.$A-Za-z_][^\s:]*):\s*$")


def disassemble(cubin_path, sym_index, sym_name, nvdisasm=None):
    """Return ({offset: text}, {label: offset}, {offset: (file, line)}) for one function (the
    line table only with nvdisasm, whose -g prints it; the library is built with -lineinfo)."""
    tool = find_tool("nvdisasm", nvdisasm)
    lines = None
    if tool:
        p = subprocess.run(
            [tool, "-g", "-c", "-fun", str(sym_index), cubin_path],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        if p.returncode == 0:
            lines = p.stdout.splitlines()
        else:
            sys.stderr.write("nvdisasm failed: %s\n" % p.stderr[:500])
    if lines is None:
        tool = find_tool("cuobjdump")
        if not tool:
            raise SystemExit("neither nvdisasm nor cuobjdump found (set NVDISASM=...)")
        p = subprocess.run(
            [tool, "-sass", "-fun", sym_name, cubin_path],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        lines = p.stdout.splitlines()
    ins = {}
    labels = {}
    where = {}
    cur = ("?", 0)
    pending = []
    for ln in lines:
        m = _FILE_RE.search(ln)
        if m:
            cur = (os.path.basename(m.group(1)), int(m.group(2)))
            continue
        m = _INS_RE.match(ln)
        if m:
            off = int(m.group(1), 16)
            txt = m.group(2).strip()
            if txt.endswith(";"):
                txt = txt[:-1].rstrip()
            # cuobjdump prints encoding comment lines "/* 0x... */" only -> skip
            if txt.startswith("/*") or not txt:
                continue
            ins[off] = txt
            where[off] = cur
            for l in pending:
                labels[l] = off
            pending = []
            continue
        m = _LBL_RE.match(ln)
        if m:
            pending.append(m.group(1))
    return ins, labels, where


_PRED_RE = re.compile(r"^(@!?U?P[T0-9]+)\s+(.*)$")
_TGT_RE = re.compile(r"`\(([^)]+)\)")


def ncu_style(txt, labels, base, fun_name):
    """Format like ncu's source page: predicate column of width 6, label -> abs addr."""

    def rep(m):
        l = m.group(1)
        if l in labels:
            return "0x%x" % (base + labels[l])
        if l == fun_name:
            return "0x%x" % base
        return m.group(0)

    txt = _TGT_RE.sub(rep, txt)
    txt = txt.replace(".reuse", "")  # ncu's source view omits operand-reuse flags
    m = _PRED_RE.match(txt)
    if m:
        return "%-6s%s" % (m.group(1), m.group(2))
    return "      " + txt


# ----------------------------------------------------------------------------
# ncu source-page style column names (from ncu --page source --csv)
# ----------------------------------------------------------------------------

STALL_SHORT = [
    ("barrier", "stall_barrier"),
    ("branch_resolving", "stall_branch_resolving"),
    ("dispatch_stall", "stall_dispatch"),
    ("drain", "stall_drain"),
    ("imc_miss", "stall_imc"),
    ("lg_throttle", "stall_lg"),
    ("long_scoreboard", "stall_long_sb"),
    ("math_pipe_throttle", "stall_math"),
    ("membar", "stall_membar"),
    ("mio_throttle", "stall_mio"),
    ("misc", "stall_misc"),
    ("no_instructions", "stall_no_inst"),
    ("not_selected", "stall_not_selected"),
    ("selected", "stall_selected"),
    ("short_scoreboard", "stall_short_sb"),
    ("sleeping", "stall_sleep"),
    ("tex_throttle", "stall_tex"),
    ("wait", "stall_wait"),
    ("warpgroup_arrive", "stall_warpgroup_arrive"),
]

NCU_COLS = [  # (ncu column, report metric)
    ("Instructions Executed", "inst_executed"),
    ("Thread Instructions Executed", "thread_inst_executed"),
    ("Predicated-On Thread Instructions Executed", "thread_inst_executed_true"),
    ("Avg. Threads Executed", "derived__avg_thread_executed"),
    ("Avg. Predicated-On Threads Executed", "derived__avg_thread_executed_true"),
    (
        "Derivative Avg. Predicated-On Threads Executed",
        "derived__derivative_avg_thread_executed_true",
    ),
    ("Avg. Predicated-On Threads Unexecuted", "derived__avg_thread_unexecuted_true"),
    ("Divergent Branches", "smsp__branch_targets_threads_divergent"),
    ("Address Space", "memory_type"),
    ("Access Operation", "memory_access_type"),
    ("Access Size", "memory_access_size_type"),
    ("L1 Tag Requests Global", "memory_l1_tag_requests_global"),
    ("L1 Conflicts Shared N-Way", "derived__memory_l1_conflicts_shared_nway"),
    ("L1 Wavefronts Shared Excessive", "derived__memory_l1_wavefronts_shared_excessive"),
    ("L1 Wavefronts Shared", "memory_l1_wavefronts_shared"),
    ("L1 Wavefronts Shared Ideal", "memory_l1_wavefronts_shared_ideal"),
    (
        "L2 Theoretical Sectors Global Excessive",
        "derived__memory_l2_theoretical_sectors_global_excessive",
    ),
    ("L2 Theoretical Sectors Global", "memory_l2_theoretical_sectors_global"),
    ("L2 Theoretical Sectors Global Ideal", "memory_l2_theoretical_sectors_global_ideal"),
    ("L2 Theoretical Sectors Local", "memory_l2_theoretical_sectors_local"),
    ("L2 Explicit Evict Policies", "smsp__sass_inst_executed_memdesc_explicit_evict_type"),
    (
        "L2 Explicit Hit Policy Evict First",
        "smsp__sass_inst_executed_memdesc_explicit_hitprop_evict_first",
    ),
    (
        "L2 Explicit Hit Policy Evict Last",
        "smsp__sass_inst_executed_memdesc_explicit_hitprop_evict_last",
    ),
    (
        "L2 Explicit Hit Policy Evict Normal",
        "smsp__sass_inst_executed_memdesc_explicit_hitprop_evict_normal",
    ),
    (
        "L2 Explicit Hit Policy Evict Normal Demote",
        "smsp__sass_inst_executed_memdesc_explicit_hitprop_evict_normal_demote",
    ),
    (
        "L2 Explicit Miss Policy Evict First",
        "smsp__sass_inst_executed_memdesc_explicit_missprop_evict_first",
    ),
    (
        "L2 Explicit Miss Policy Evict Normal",
        "smsp__sass_inst_executed_memdesc_explicit_missprop_evict_normal",
    ),
]

# Enum decodings inferred from this report vs. SASS opcodes and ncu's source page
# (UNSURE for values that did not occur in the inspected reports).
# memory_type / memory_access_type are bit flags: seen 4=Global (LDG/STG), 8=Local (LDL/STL),
# 16=Shared (LDS/STS/LDSM); 2=Load, 4=Store.  Other values are printed as numbers.
# A value of 0 (instruction has a memory record but was never executed) prints as '' like ncu.
MEMORY_TYPE = {4: "Global", 8: "Local", 16: "Shared"}
MEMORY_ACCESS_TYPE = {2: "Load", 4: "Store"}


ENUM_METRICS = {
    "memory_type",
    "memory_access_type",
    "memory_access_size_type",
    "smsp__sass_inst_executed_memdesc_explicit_evict_type",
}


def _enum(v, table):
    if v is None:
        return ""
    return table.get(v, str(v))


# ----------------------------------------------------------------------------


def extract(report, result=0, nvdisasm=None, dump_cubin=None):
    """The per-instruction counters of profiled launch `result` of `report`: a dict with the
    rows (pc, SASS as ncu prints it, function start, function name), line_of (pc -> (file,
    line) from the cubin's line table), src_metrics (the per-instruction metric names, in
    report order), per (metric -> {pc: value}), metrics (name -> (kernel total, list)),
    used_funs and the demangled kernel name."""
    sources, results = read_report(report)
    if not results:
        raise SystemExit("no profile results in report")
    strings, res = results[result]
    mangled = pb_first(res, 5, b"").decode()
    demangled = pb_first(res, 7, b"").decode()
    mod = pb_first(res, 15)
    mod_id = pb_first(mod, 1) if mod else None

    # --- source module (cubin) -----------------------------------------------
    src = None
    for s in sources:
        if mod_id is None or pb_first(s, 1) == mod_id:
            src = s
            break
    if src is None:
        raise SystemExit("no source/cubin for module %r" % mod_id)
    cubin = maybe_decompress(pb_first(src, 4))
    funcs = []  # (name, load address, symbol index)
    for fm in [x for f9 in pb_fields(src, 9) for x in pb_fields(f9, 1)]:
        funcs.append((pb_first(fm, 1, b"").decode(), pb_first(fm, 2, 0), pb_first(fm, 3, 0)))
    syms, secs = elf_symbols(cubin)
    symbyidx = {s[0]: s for s in syms}
    symbyname = {s[1]: s for s in syms if s[5] == 2}

    # --- metrics ----------------------------------------------------------------
    metrics = {}  # name -> (aggregate, [(corr, value)])
    order = []
    for mr in pb_fields(res, 13):
        nid = pb_first(mr, 1, 0)
        name = strings[nid] if nid < len(strings) else "metric_%d" % nid
        agg = pb_first(mr, 2)
        agg = metric_value(agg) if agg is not None else None
        lst = []
        for el in pb_fields(mr, 3):
            c = pb_first(el, 1)
            v = pb_first(el, 2)
            lst.append(
                (
                    metric_value(c) if c is not None else None,
                    metric_value(v) if v is not None else None,
                )
            )
        metrics[name] = (agg, lst)
        order.append(name)

    # kernel functions: those from the module's function table whose code range
    # contains the per-PC correlation ids.
    ranges = []
    for fname, addr, sidx in funcs:
        s = symbyidx.get(sidx)
        if s is None or s[1] != fname:
            s = symbyname.get(fname)
        if s is None:
            continue
        ranges.append((addr, addr + s[3], fname, s[0], s[3]))
    base_pc = None
    if "launch__function_pcs" in metrics:
        lst = metrics["launch__function_pcs"][1]
        if lst and isinstance(lst[0][1], int):
            base_pc = lst[0][1]

    def fun_of(pc):
        for lo, hi, fname, sidx, size in ranges:
            if lo <= pc < hi:
                return (lo, hi, fname, sidx, size)
        return None

    src_metrics = []
    used_funs = {}
    for name in order:
        lst = metrics[name][1]
        if not lst or not all(isinstance(c, int) for c, _ in lst):
            continue
        fs = [fun_of(c) for c, _ in lst]
        if all(f is not None for f in fs) and len(lst) > 0:
            # guard against small-int ids that happen to be in range (none expected: PCs are huge)
            if min(c for c, _ in lst) < 1 << 20:
                continue
            src_metrics.append(name)
            for f in fs:
                used_funs[f[0]] = f
    if not used_funs:
        # fall back to the kernel entry itself
        for r in ranges:
            if r[2] == mangled or r[0] == base_pc:
                used_funs[r[0]] = r
    if not used_funs:
        raise SystemExit("could not locate the kernel function in the embedded cubin")

    # --- disassemble -----------------------------------------------------------
    tmpdir = tempfile.mkdtemp(prefix="ncurep_")
    cubin_path = dump_cubin or os.path.join(tmpdir, "module.cubin")
    with open(cubin_path, "wb") as fh:
        fh.write(cubin)
    rows = []  # (pc, text, function start, function name)
    line_of = {}  # pc -> (file, line)
    for lo in sorted(used_funs):
        lo, hi, fname, sidx, size = used_funs[lo]
        ins, labels, where = disassemble(cubin_path, sidx, fname, nvdisasm)
        for off, w in where.items():
            line_of[lo + off] = w
        for off in range(0, size, 16):
            txt = ins.get(off)
            rows.append(
                (
                    lo + off,
                    ncu_style(txt, labels, lo, fname) if txt is not None else "      ?",
                    lo,
                    fname,
                )
            )
    if not dump_cubin:
        shutil.rmtree(tmpdir, ignore_errors=True)

    # --- per-pc table ------------------------------------------------------------
    per = {}
    for name in src_metrics:
        d = {}
        for c, v in metrics[name][1]:
            d[c] = v
        per[name] = d
    pcs_with_data = set()
    for d in per.values():
        pcs_with_data.update(d)
    missing = pcs_with_data - set(r[0] for r in rows)
    if missing:
        sys.stderr.write(
            "warning: %d PCs with data have no disassembled instruction\n" % len(missing)
        )

    return dict(
        rows=rows,
        line_of=line_of,
        src_metrics=src_metrics,
        per=per,
        metrics=metrics,
        order=order,
        used_funs=used_funs,
        demangled=demangled,
    )


def main():
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("report")
    ap.add_argument("out_csv")
    ap.add_argument(
        "--result", type=int, default=0, help="index of the profiled launch (default 0)"
    )
    ap.add_argument(
        "--ncu-columns",
        action="store_true",
        help="columns named / derived as `ncu --page source --csv` has them (stall_*, ...)",
    )
    ap.add_argument("--nvdisasm", help="path to nvdisasm")
    ap.add_argument("--dump-cubin", help="also write the embedded cubin to this file")
    ap.add_argument("--list", action="store_true", help="list results/functions and exit")
    a = ap.parse_args()

    if a.list:
        for k, (st, r) in enumerate(read_report(a.report)[1]):
            print("result %d: %s" % (k, pb_first(r, 7, b"").decode()))
        return
    x = extract(a.report, a.result, a.nvdisasm, a.dump_cubin)
    rows, src_metrics, per, metrics = x["rows"], x["src_metrics"], x["per"], x["metrics"]
    order, used_funs, demangled = x["order"], x["used_funs"], x["demangled"]
    print("kernel: %s" % demangled)
    for lo in sorted(used_funs):
        f = used_funs[lo]
        print(
            "function %s  load address 0x%x  size 0x%x (%d instructions)  ELF symbol %d"
            % (f[2], f[0], f[4], f[4] // 16, f[3])
        )

    # --- output ----------------------------------------------------------------------
    def num(v):
        if v is None:
            return ""
        if isinstance(v, float):
            return ("%d" % v) if v == int(v) else repr(v)
        return str(v)

    if not a.ncu_columns:
        header = ["Address", "Source"] + src_metrics + ["Offset"]
        with open(a.out_csv, "w", newline="") as fh:
            w = csv.writer(fh, quoting=csv.QUOTE_ALL)
            w.writerow(header)
            for pc, txt, lo, fname in rows:
                w.writerow(
                    ["0x%x" % pc, txt]
                    + [num(per[m].get(pc, None if m in ENUM_METRICS else 0)) for m in src_metrics]
                    + ["0x%x" % (pc - lo)]
                )
    else:
        samp = "smsp__pcsamp_warps_issue_stalled_"
        stall_all = [(short, samp + long) for long, short in STALL_SHORT if samp + long in per]
        stall_ni = [
            (
                ("stall_sleeping" if long == "sleeping" else short) + " (Not Issued)",
                samp + long + "_not_issued",
            )
            for long, short in STALL_SHORT
            if samp + long + "_not_issued" in per
        ]
        header = [
            "Address",
            "Source",
            "Warp Stall Sampling (All Samples)",
            "Warp Stall Sampling (Not-issued Samples)",
            "# Samples",
        ]
        mapped = [(c, m) for c, m in NCU_COLS if m in per]
        header += [c for c, _ in mapped] + [c for c, _ in stall_all] + [c for c, _ in stall_ni]
        extra = [
            m
            for m in src_metrics
            if m not in set(m for _, m in mapped)
            and m not in set(m for _, m in stall_all + stall_ni)
            and m != "smsp__pcsamp_sample_count"
        ]
        header += extra + ["Offset"]
        with open(a.out_csv, "w", newline="") as fh:
            w = csv.writer(fh, quoting=csv.QUOTE_ALL)
            w.writerow(header)
            for pc, txt, lo, fname in rows:
                r = ["0x%x" % pc, txt]
                s_all = sum(per[m].get(pc, 0) for _, m in stall_all)
                s_ni = sum(per[m].get(pc, 0) for _, m in stall_ni)
                r += [
                    num(s_all),
                    num(s_ni),
                    num(per.get("smsp__pcsamp_sample_count", {}).get(pc, 0)),
                ]
                for c, m in mapped:
                    v = per[m].get(pc)
                    if m in ENUM_METRICS:
                        if v is None:
                            r.append("-")
                        elif v == 0:
                            r.append("")
                        elif m == "memory_type":
                            r.append(_enum(v, MEMORY_TYPE))
                        elif m == "memory_access_type":
                            r.append(_enum(v, MEMORY_ACCESS_TYPE))
                        else:
                            r.append(num(v))
                    else:
                        r.append(num(v if v is not None else 0))
                r += [num(per[m].get(pc, 0)) for c, m in stall_all]
                r += [num(per[m].get(pc, 0)) for c, m in stall_ni]
                r += [num(per[m].get(pc, 0)) for m in extra]
                r.append("0x%x" % (pc - lo))
                w.writerow(r)

    # --- summary -------------------------------------------------------------------
    print("\n%d rows written to %s" % (len(rows), a.out_csv))
    print(
        "\n%-66s %8s %18s %18s %s"
        % ("per-instruction metric", "#pcs", "column sum", "report aggregate", "")
    )
    for m in src_metrics:
        vals = [v for v in per[m].values() if isinstance(v, (int, float))]
        tot = sum(vals)
        agg = metrics[m][0]
        enumlike = m in ENUM_METRICS
        flag = ""
        if not enumlike and isinstance(agg, (int, float)):
            flag = "OK" if abs(tot - agg) <= 1e-6 * max(1, abs(agg)) else "DIFF"
        print(
            "%-66s %8d %18s %18s %s"
            % (m, len(per[m]), num(tot), num(agg), "(enum)" if enumlike else flag)
        )
    other = [m for m in order if m not in src_metrics and metrics[m][1]]
    print(
        "\nother (non-per-PC) list metrics in the result: %d (e.g. %s)"
        % (len(other), ", ".join(other[:6]))
    )


if __name__ == "__main__":
    main()
