#!/usr/bin/env python3
"""Print the generated tables of an op's docs page, from the registry, nvcc's resource report and
the recorded sweep (docs/results/<op>_<gpu>.json: the latest sweep that timed the op's tuned kernel).

    python tools/docs_versions.py qk_norm          # print the tables
    python tools/docs_versions.py --write qk_norm  # rewrite them in docs/qk_norm.md (ladder layout)

An op in the ladder layout (qk_norm, cross_head_norm) gets its ladder table (each rung and the
tuned kernel: its lead, registers, for cross_head_norm the achieved occupancy Nsight Compute
measured (`python -m cookbook.ncu ... --tag ladder`), and its time and percent of the copy at the
headline shapes), the "which kernel runs" table and the results at every bench shape (the tuned
kernel against `torch.compile` and the peers the sweep timed). tp_qk_norm's come from its TP=2
pages of record instead (`python -m cookbook.bench.tp`): the ladder by both timings, which kernel
runs at TP=2 and TP=4, and the tuned kernel against SGLang's fused TP kernel and the local shard.
An op in the older layout gets its versions table:

One row per registered implementation (name, level, version, lead); CUDA C rows add the
registers and spill bytes ptxas reports for the bf16 kernels (fused rounding; for the head_dim
specialized kernels, head_dim 128) when nvcc is on PATH.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cookbook import nvcc_report, registry  # noqa: E402

HEAD_DIM = "128"
RESULTS_DIR = Path(__file__).resolve().parents[1] / "docs" / "results"
RECORDED_GPU = "h200"  # the sweep the docs quote
# The ladder table's columns: the shapes (bench labels) that show each rung's effect.
HEADLINE_SHAPES = {"qk_norm": ["T=1 Hq=64 Hk=8 D=128", "T=1024 Hq=64 Hk=8 D=128", "T=8192 Hq=64 Hk=8 D=128",
                               "T=8192 Hq=8 Hk=1 D=128"],
                   "qk_norm_rope": ["T=1 Hq=32 Hk=8 D=128 rope=128 neox", "T=64 Hq=32 Hk=8 D=128 rope=128 neox",
                                    "T=4096 Hq=24 Hk=24 D=128 rope=128 neox", "T=8192 Hq=64 Hk=8 D=128 rope=128 neox"],
                   "qk_norm_rope_cache": ["T=1 Hq=32 Hk=8 D=128 cache=bfloat16", "T=256 Hq=32 Hk=8 D=128 cache=bfloat16",
                                          "T=8192 Hq=32 Hk=8 D=128 cache=bfloat16", "T=1 Hq=32 Hk=8 D=128 cache=fp8",
                                          "T=8192 Hq=32 Hk=8 D=128 cache=fp8"],
                   "cross_head_norm": ["T=1 q_hidden=8192 k_hidden=8192", "T=1024 q_hidden=4096 k_hidden=4096",
                                       "T=2048 q_hidden=8192 k_hidden=8192", "T=16384 q_hidden=768 k_hidden=128"]}
# Ops whose kernels' integer template argument is 16-byte vectors per thread, not head_dim.
VECTORS_PER_THREAD_OPS = {"cross_head_norm"}
# Ops whose ladder table carries each rung's achieved occupancy, from the Nsight Compute page
# `python -m cookbook.ncu --op <op> --shape N --impls <rungs and tuned> --tag ladder` writes.
OCCUPANCY_TAG = {"cross_head_norm": "ncu_ladder"}


# Versions of an op in the single-header layout whose bf16 fused-rounding kernel the name pattern
# below cannot tell apart: version -> that instantiation (none left).
KERNEL_INSTANCES: dict[str, dict[int, str]] = {}


def cuda_registers(op: str) -> dict[int, str]:
    """{version: "R regs, S B spill"} for the bf16 fused-rounding kernels, or {} without nvcc."""
    if nvcc_report.nvcc() is None:
        return {}
    # Extra template arguments after the rounding flag are allowed where none is `true` (the
    # instances of later versions: streaming) and the kernel is not in KERNEL_INSTANCES, which
    # names the rest. A version of several kernels (qk_norm_rope v1: <op>_v1_norm_kernel,
    # <op>_v1_rope_kernel) gets one cell naming each.
    name = re.compile(rf"{op}_v(\d+)_(\w+_)?kernel<__nv_bfloat16, (?:(\d+), )?false((?:, [\w ]+)*)>")
    instances = KERNEL_INSTANCES.get(op, {})
    found, parts = {}, {}
    kernels = nvcc_report.compile_header(op)
    for kernel in kernels:
        if any(f"::{instance}(" in kernel.kernel for instance in instances.values()):
            continue
        m = name.search(kernel.kernel)
        if m and "true" in m.group(4):
            continue
        if m and m.group(2) and m.group(3) in (None, HEAD_DIM):
            parts.setdefault(int(m.group(1)), []).append(
                f"{m.group(2)}kernel {kernel.registers} regs, {kernel.spill_bytes} B spill")
        elif m and m.group(3) in (None, HEAD_DIM):
            found[int(m.group(1))] = f"{kernel.registers} regs, {kernel.spill_bytes} B spill"
    for version, cells in parts.items():
        found[version] = "; ".join(sorted(cells))
    for version, instance in instances.items():
        kernel = next(k for k in kernels if f"::{instance}(" in k.kernel)
        head_dim = instance.split("<")[1].split(", ")[1]  # qk_norm's and qk_norm_rope's second argument
        where = f" at head_dim {head_dim}" if op in ("qk_norm", "qk_norm_rope") and head_dim != HEAD_DIM else ""
        found[version] = f"{kernel.registers} regs, {kernel.spill_bytes} B spill ({instance.split('<')[0]}{where})"
    return found


def table(op: str) -> str:
    registers = cuda_registers(op)
    note = (f"registers: ptxas for {nvcc_report.DEFAULT_ARCH}, bf16, fused rounding, head_dim {HEAD_DIM} where specialized"
            if registers else "registers: nvcc not found, not reported")
    lines = [f"| implementation | level | version | what changed, and which bottleneck it removes | registers ({nvcc_report.DEFAULT_ARCH}) |",
             "|---|---|---|---|---|"]
    for impl in registry.implementations(op):
        regs = registers.get(impl.version, "see the notebook's register table") if impl.level == "cuda" and registers else "-"
        lines.append(f"| `{impl.name}` | {impl.level} | {impl.version or '-'} | {impl.lead} | {regs} |")
    lines += ["", f"({note}; `backend=\"cuda\"` runs `{registry.latest(op, 'cuda').name}`.)"]
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# The ladder layout: the ladder table and the results table, from the recorded sweep.
# --------------------------------------------------------------------------------------------
def recorded_gpu(op: str) -> str:
    """The GPU of the op's sweep of record: the latest recorded sweep (an H100's or an H200's) that
    timed the op's tuned kernel, else RECORDED_GPU's."""
    from cookbook import bench

    tuned = registry.fastest(op).name
    timed = [s for s in bench.recorded_sweeps(op, RESULTS_DIR) if any(r.get("impl") == tuned for r in s.rows)]
    latest = max(timed, key=lambda s: s.metadata.get("date", ""), default=None)
    return latest.page.stem[len(op) + 1:] if latest is not None else RECORDED_GPU


def recorded_path(op: str, tag: str | None = None) -> Path:
    """docs/results/<op>_<gpu>[_<tag>].json: the recorded sweep (`tag`: a partial sweep's, e.g. `--tag peers`)."""
    return RESULTS_DIR / f"{op}_{recorded_gpu(op)}{'_' + tag if tag else ''}.json"


def recorded_rows(op: str, tag: str | None = None) -> tuple[dict, dict]:
    """({(impl, label): row}, metadata) of `recorded_path(op, tag)` ({} where there is none). A page
    that names CUDA C implementations the registry no longer lists was recorded before the kernels
    were renumbered: its CUDA C rows are left out (the names it shares with today's may be other
    kernels)."""
    path = recorded_path(op, tag)
    if not path.exists():
        return {}, {}
    data = json.loads(path.read_text())
    known = {impl.name for impl in registry.implementations(op)}
    compiled = {row["impl"] for row in data["rows"] if row.get("level") in registry.COMPILED_LEVELS}
    renumbered = bool(compiled - known)
    return {(row["impl"], row["label"]): row for row in data["rows"]
            if not (renumbered and row.get("level") in registry.COMPILED_LEVELS)}, data["metadata"]


def _time_cell(row) -> str:
    if row is None or row.get("median_us") is None:
        return "-"
    return f"{row['median_us']:.2f} us, {row['pct_of_copy']:.0f} %"


def vector_registers(op: str) -> dict[str, str]:
    """{implementation: registers of its own bf16 fused-rounding kernels}: one count for a kernel of
    no vectors, one per vectors-per-thread count (1/2/4/8) for a rung, the range over the tuned
    kernel's variants (VECTORS_PER_THREAD_OPS)."""
    found = {}
    for impl in registry.implementations(op, registry.COMPILED_LEVELS):
        own = f"{op}_{impl.extension.stem}_kernel<__nv_bfloat16, (cookbook::Rounding)0"  # not a fallback's
        picked = [k for k in nvcc_report.compile_extension(impl.extension.name) if own in k.kernel]
        by_vectors = {}
        for k in picked:
            args = k.kernel.split(">(")[0].split(own, 1)[1]
            count = re.sub(r"^\([^()]*\)", "", args.split(",")[1].strip()) if args.startswith(",") else ""  # "(int)8": 8
            by_vectors.setdefault(count, set()).add(k.registers)
        if impl.level == "tuned":
            registers = set().union(*by_vectors.values())
            found[impl.name] = f"{min(registers)}-{max(registers)} ({len(picked)} variants)"
        elif list(by_vectors) == [""]:
            found[impl.name] = ", ".join(str(r) for r in sorted(by_vectors[""]))
        else:
            counts = sorted(by_vectors, key=int)
            unit = "lane" if "warp per token" in impl.lead else "thread"
            found[impl.name] = (f"{'/'.join(str(max(by_vectors[v])) for v in counts)} at {'/'.join(counts)} vectors "
                                f"per {unit}")
    return found


def extension_registers(op: str) -> dict[str, str]:
    """{implementation: registers of its bf16 fused-rounding kernels at head_dim 128}, or {} without nvcc."""
    if nvcc_report.nvcc() is None:
        return {}
    if op in EXTENSION_REGISTERS:
        return EXTENSION_REGISTERS[op](op)
    if op in VECTORS_PER_THREAD_OPS:
        return vector_registers(op)
    found = {}
    for impl in registry.implementations(op, registry.COMPILED_LEVELS):
        own = f"{op}_{impl.extension.stem}_kernel<__nv_bfloat16, (cookbook::Rounding)0"  # not a fallback's
        picked = [k for k in nvcc_report.compile_extension(impl.extension.name) if own in k.kernel
                  and (f", {HEAD_DIM}" in k.kernel or impl.version in (1, 2))]
        if impl.level == "tuned":  # one cell per vectors per lane, over its other choices
            by_vectors = {}
            for k in picked:
                vectors = k.kernel.split(f", {HEAD_DIM}, ")[1].split(",")[0]
                by_vectors.setdefault(vectors, set()).add(k.registers)
            found[impl.name] = "; ".join(f"{min(r)}-{max(r)} ({v} vector{'s' if v != '1' else ''} per lane)"
                                         for v, r in sorted(by_vectors.items()))
        else:
            found[impl.name] = ", ".join(sorted({str(k.registers) for k in picked}))
    return found


def occupancy_page(op: str) -> tuple[dict, dict]:
    """({implementation: achieved occupancy %}, metadata) of the op's Nsight Compute ladder page (the
    first kernel each implementation launched), or ({}, {}) where none is recorded."""
    path = RESULTS_DIR / f"{op}_{recorded_gpu(op)}_{OCCUPANCY_TAG[op]}.json"
    if not path.exists():
        return {}, {}
    data = json.loads(path.read_text())
    found = {}
    for row in data["rows"]:
        found.setdefault(row["impl"], row.get("achieved occupancy %"))
    return found, data["metadata"]


def ladder_table(op: str) -> str:
    rows, meta = recorded_rows(op)
    shapes = HEADLINE_SHAPES[op]
    registers = extension_registers(op)
    moved = LADDER_BYTES[op](op) if op in LADDER_BYTES else None
    occupancy, ncu_meta = occupancy_page(op) if op in OCCUPANCY_TAG else ({}, {})
    measured = ["achieved occupancy"] if op in OCCUPANCY_TAG else []
    bytes_header = f" {moved[0]} |" if moved else ""
    lines = [f"| rung | what it changes, and which bottleneck it removes | registers |{bytes_header} {' | '.join(measured + shapes)} |",
             "|---|---|---|" + ("---|" if moved else "") + "---|" * (len(measured) + len(shapes))]
    for impl in registry.implementations(op, ("reference",) + registry.COMPILED_LEVELS):
        rung = f"v{impl.version}" if impl.level == "cuda" else impl.name.removeprefix("cuda_")
        cells = [_time_cell(rows.get((impl.name, shape))) for shape in shapes]
        if measured:
            achieved = occupancy.get(impl.name)
            cells.insert(0, f"{achieved:.0f} %" if isinstance(achieved, (int, float)) else "-")
        bytes_cell = f" {moved[1].get(impl.name, '-')} |" if moved else ""
        lines.append(f"| {rung} | {impl.lead} | {registers.get(impl.name, '-')} |{bytes_cell} {' | '.join(cells)} |")
    when = f"{meta['gpu']}, {meta['date'][:10]}, commit {meta['commit']}" if meta else "no recorded sweep"
    specialized = "per vectors-per-thread kernel" if op in VECTORS_PER_THREAD_OPS else f"head_dim {HEAD_DIM} where specialized"
    note = (f"(time per call and percent of the device copy: {when}, bf16, fused rounding; registers: ptxas for "
            f"{nvcc_report.DEFAULT_ARCH}, bf16, fused rounding, {specialized}")
    if moved:
        note += f"; {moved[2]}"
    if measured:
        ncu_when = (f"{ncu_meta['gpu']}, {ncu_meta['date'][:10]}, commit {ncu_meta['commit']}, {ncu_meta['shape']}"
                    if ncu_meta else "not measured yet")
        note += f"; achieved occupancy: Nsight Compute, one call ({ncu_when})"
    lines += ["", note + ".)"]
    return "\n".join(lines)


# ---- qk_norm_rope's ladder: its registers per kernel and the bytes each rung moves ---------------
ROPE_BYTES_SHAPE = 3  # BENCH_SHAPES index: flux_1024 with NeoX pairs, the ladder's bytes column


def rope_extension_registers(op: str) -> dict[str, str]:
    """{implementation: its bf16 fused-rounding kernels' registers at head_dim 128}: v1's two
    kernels; v5 on, the kernels of the benchmark's tables (bf16 weights, a float32 cache) per rope
    layout; the tuned kernel's per walk."""
    found = {}
    for impl in registry.implementations(op, registry.COMPILED_LEVELS):
        stem = impl.extension.stem
        own = f"{op}_{stem}_"
        kernels = [k for k in nvcc_report.compile_extension(impl.extension.name)
                   if own in k.kernel and "__nv_bfloat16, (cookbook::Rounding)0" in k.kernel
                   and (f", {HEAD_DIM}" in k.kernel or impl.version in (1, 2))]
        if impl.version == 1:  # the norm kernel, then the rope kernel
            found[impl.name] = ", ".join(f"{k.kernel.split(own)[1].split('_kernel')[0]} {k.registers}"
                                         for k in sorted(kernels, key=lambda k: "_v1_rope_kernel" in k.kernel))
        elif impl.level == "tuned":
            bench = [k for k in kernels if "TableDtype)0, (cookbook::qk_norm_rope::tuned::TableDtype)1" in k.kernel]
            cells = []
            for walk, name in ((0, "one row"), (2, "whole tokens"), (1, "steps")):
                regs = {layout: k.registers for k in bench for layout in (0, 1)
                        if k.kernel.split("(cookbook::qk_norm_rope::tuned::Layout)")[1].startswith(str(layout))
                        and k.kernel.split("(cookbook::qk_norm_rope::tuned::Walk)")[1].startswith(str(walk))}
                cells.append(f"{name} {regs.get(1, '-')}/{regs.get(0, '-')}")
            found[impl.name] = "; ".join(cells) + " (NeoX/interleaved)"
        elif impl.version >= 5:
            regs = {layout: k.registers for k in kernels for layout in ("true", "false")
                    if f", {HEAD_DIM}, {layout}, __nv_bfloat16, float>" in k.kernel}
            found[impl.name] = f"{regs.get('true', '-')}/{regs.get('false', '-')} (NeoX/interleaved)"
        else:
            found[impl.name] = ", ".join(sorted({str(k.registers) for k in kernels}))
    return found


def rope_ladder_bytes(op: str) -> tuple[str, dict[str, str], str]:
    """(column header, {implementation: MB}, note): the bytes each rung moves through memory at
    flux_1024, from the contract's model: q and k read and written once, the tables once; the split
    path's float32 rows written and read back on top."""
    import torch

    contract = registry.contract(op)
    shape = contract.BENCH_SHAPES[ROPE_BYTES_SHAPE]
    inputs, label = contract.bench_case(shape, torch.bfloat16, "meta")
    rope = inputs.pop("rope")
    a = contract.check_inputs(**inputs, eps=1e-6, weight_offset=0.0, rounding="fused", rope=rope)
    fused = contract.bytes_moved(a.q, a.k, a.q_weight, a.k_weight, a.cos_sin_cache, a.positions)
    split = fused + contract.split_scratch_bytes(a.q, a.k)
    moved = {impl.name: f"{(split if impl.version == 1 else fused) / 1e6:.0f}"
             for impl in registry.implementations(op, registry.COMPILED_LEVELS)}
    return "MB moved", moved, f"MB moved: at {label}, the contract's bytes model, the split path's float32 rows on top"


# ---- qk_norm_rope_cache's ladder: registers per cache dtype, and the bytes each rung moves ----------
CACHE_BYTES_SHAPE = (8192, 32, 8, 128, 0)  # Qwen3-8B prefill, bf16 cache: the ladder's bytes column
CACHE_DTYPE_ARG = "(cookbook::qk_norm_rope_cache::CacheDtype)"  # how the demangler writes the enum argument


def cache_extension_registers(op: str) -> dict[str, str]:
    """{implementation: registers of its bf16 fused-rounding kernels at the benchmark's call, for a
    bf16 / an FP8 cache}: rung 1's copy kernel (after qk_norm_rope's tuned kernel); from rung 2 on
    the one-pass kernel at head_dim 128, NeoX, bf16 weights, a float32 cos/sin table."""
    found = {}
    for impl in registry.implementations(op, registry.COMPILED_LEVELS):
        stem = impl.extension.stem
        if impl.version == 1:
            wanted = f"{op}_copy_kernel<__nv_bfloat16, {CACHE_DTYPE_ARG}"
        elif impl.level == "tuned":
            tuned = "(cookbook::qk_norm_rope::tuned::"  # its layout and table choices are qk_norm_rope's
            wanted = (f"{op}_tuned_kernel<__nv_bfloat16, (cookbook::Rounding)0, {HEAD_DIM}, {tuned}Layout)1, "
                      f"{tuned}TableDtype)0, {tuned}TableDtype)1, {CACHE_DTYPE_ARG}")
        else:
            wanted = f"{op}_{stem}_kernel<__nv_bfloat16, (cookbook::Rounding)0, {HEAD_DIM}, true, __nv_bfloat16, float, {CACHE_DTYPE_ARG}"
        regs = {k.kernel.split(wanted)[1][0]: k.registers for k in nvcc_report.compile_extension(impl.extension.name)
                if wanted in k.kernel}
        found[impl.name] = f"{regs.get('0', '-')}/{regs.get('1', '-')}" + (" (copy kernel)" if impl.version == 1 else "")
    return found


def cache_ladder_bytes(op: str) -> tuple[str, dict[str, str], str]:
    """(column header, {implementation: MB}, note): the bytes each rung moves at Qwen3-8B's prefill,
    from the contract's model; the split path reads k again on top."""
    import torch

    contract = registry.contract(op)
    inputs, label = contract.bench_case(CACHE_BYTES_SHAPE, torch.bfloat16, "meta")
    a = contract.check_inputs(**inputs, eps=1e-6, weight_offset=0.0, rounding="fused")
    fused = contract.bytes_moved(a.q, a.k, a.v, a.q_weight, a.k_weight, a.cos_sin_cache, a.positions, a.k_cache,
                                 a.slot_mapping)
    split = fused + contract.split_extra_bytes(a.k)
    moved = {impl.name: f"{(split if impl.version == 1 else fused) / 1e6:.0f}"
             for impl in registry.implementations(op, registry.COMPILED_LEVELS)}
    return "MB moved", moved, (f"MB moved: at {label}, the contract's bytes model, the split path's second read of k on "
                               f"top; registers: bf16 cache / FP8 cache")


EXTENSION_REGISTERS = {"qk_norm_rope": rope_extension_registers, "qk_norm_rope_cache": cache_extension_registers}
LADDER_BYTES = {"qk_norm_rope": rope_ladder_bytes, "qk_norm_rope_cache": cache_ladder_bytes}


def results_table(op: str, tag: str | None = None) -> str:
    """Our fastest path against each peer, per shape, from the recorded sweep (`tag`: a partial
    sweep's pages, e.g. `--tag peers`)."""
    rows, meta = recorded_rows(op, tag)
    ours = registry.fastest(op).name
    others = [impl.name for impl in registry.implementations(op, ("peer",))]
    labels = list(dict.fromkeys(label for _, label in rows))
    header = ["shape", f"{ours}", *others]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for label in labels:
        mine = rows.get((ours, label))
        cells = [_time_cell(mine)]
        for other in others:
            row = rows.get((other, label))
            if row is None or row.get("median_us") is None or mine is None or mine.get("median_us") is None:
                cells.append("-")
            else:
                cells.append(f"{row['median_us']:.2f} us ({row['median_us'] / mine['median_us']:.2f}x ours)")
        lines.append(f"| {label} | {' | '.join(cells)} |")
    when = f"{meta['gpu']}, {meta['date'][:10]}, commit {meta['commit']}" if meta else "no recorded sweep"
    layout = "q and k as views of one fused qkv tensor" if tag is None else "the layouts the results page names"
    lines += ["", f"({when}; bf16, fused rounding; {layout}; -: not timed, the results page says why.)"]
    return "\n".join(lines)


def which_table(op: str) -> str:
    """Which kernel the tuned path runs at every bench shape, and the policy's numbers: what
    `python -m cookbook explain` answers (the policy compiled for the host, nvcc's registers) for
    the benchmark's calls (bf16, fused rounding, q and k as views of one fused qkv tensor)."""
    import torch

    from cookbook import explainer

    contract = registry.contract(op)
    columns = explainer.EXPLAINERS[op].SUMMARY
    lines = [f"| shape | kernel | grid x block | registers | {' | '.join(columns)} |",
             "|---|---|---|---|" + "---|" * len(columns)]
    dims = len(explainer.EXPLAINERS[op].shape_names)
    for shape in contract.BENCH_SHAPES:
        layout = "separate" if tuple(shape[dims:]) == ("separate",) else "fused_qkv"
        answer = explainer.explain(op, shape=tuple(shape[:dims]), dtype=torch.bfloat16, layout=layout, gpu="h100")
        p = answer.plan
        name = p["kernel"].rsplit("::", 1)[1]
        args = ", ".join(arg.split("=", 1)[1].split("::")[-1] for arg in p["template_arguments"].split(", ")[2:])
        kernel = f"`{name}<{args}>`" if args else f"`{name}`"
        label = contract.bench_case(shape, torch.bfloat16, "meta")[1]
        lines.append(f"| {label} | {kernel} | {int(p['grid']):,} x {p['block']} | {p.get('registers', '-')} | "
                     f"{' | '.join(answer.summary)} |")
    lines += ["", "(an H100 or H200: 132 SMs, compute capability 9.0, the same answer for both; bf16, fused rounding, "
                  "q and k as views of one fused qkv tensor, as the benchmark calls it; from `python -m cookbook explain "
                  f"{op} --shape ... --gpu h100`, registers from ptxas for {nvcc_report.DEFAULT_ARCH}.)"]
    return "\n".join(lines)


# ---- tp_qk_norm: its ladder, which kernel runs and the results, from the TP=2 pages -------------
TP_WORLD = 2  # the pages of record of the ladder: MiniMax-M2's widths on two GPUs, both timings
TP_WHICH_WORLDS = (2, 4)
TP_LADDER_TOKENS = (1, 128, 2048, 16384)  # the token counts both timings measured
# Each rung's own bf16 fused-rounding kernels at MiniMax-M2's TP=2 shards (3072/512: 448 vectors,
# 16-byte packs staged in the tiles), as nvcc's report names them in the rung's extension.
TP_RUNG_KERNELS = {
    "cuda_v1": ("v1::sum_sq_vec_kernel<__nv_bfloat16, true>", "v1::apply_vec_kernel<__nv_bfloat16, false, true>"),
    "cuda_v2": ("fused_kernel<__nv_bfloat16, 8, true, false, false, false>",),
    "cuda_v3": ("fused_v3_kernel<__nv_bfloat16, 8, true, false, true, true, false>",
                "fused_kernel<__nv_bfloat16, 8, true, false, true, false>"),
    "cuda_v4": ("fused_v3_kernel<__nv_bfloat16, 8, true, false, true, true, true>",
                "fused_kernel<__nv_bfloat16, 8, true, false, true, true>"),
    "cuda_v5": ("v5::lagged_rows_kernel<__nv_bfloat16, 4, false>",),
    "cuda_v6": ("v6::token_rows_kernel<__nv_bfloat16, 2, false>",),
    "cuda_v7": ("v7::lean_rows_kernel<__nv_bfloat16, false>",),
    "cuda_v8": ("v8::paired_rows_kernel<__nv_bfloat16, false>",),
    "cuda_tuned": ("v7::lean_rows_kernel<__nv_bfloat16, false>", "v8::paired_rows_kernel<__nv_bfloat16, false>",
                   "v5::lagged_rows_kernel<__nv_bfloat16, 4, false>",
                   "fused_v3_kernel<__nv_bfloat16, 8, true, false, true, true, true>"),
}


def tp_registers() -> dict[str, str]:
    """{implementation: "kernel R" per kernel of TP_RUNG_KERNELS}, or {} without nvcc."""
    if nvcc_report.nvcc() is None:
        return {}
    found = {}
    for impl in registry.implementations("tp_qk_norm", registry.COMPILED_LEVELS):
        kernels = nvcc_report.compile_extension(impl.extension.name)
        cells = []
        for name in TP_RUNG_KERNELS[impl.name]:
            kernel = next(k for k in kernels if f"::{name}(" in k.kernel)
            cells.append(f"{name.split('<')[0].split('::')[-1].removesuffix('_kernel')} {kernel.registers}")
        found[impl.name] = ", ".join(cells)
    return found


def tp_pages(world: int = TP_WORLD) -> dict[str, dict]:
    """{timing: the page's json} of the TP pages of record at `world` ({"rows": []} where none)."""
    from cookbook.bench import tp as bench_tp

    pages = {}
    for timing in (bench_tp.GRAPH, bench_tp.BACK_TO_BACK):
        path = RESULTS_DIR / f"{bench_tp.page_stem(RECORDED_GPU, world, timing)}.json"
        pages[timing] = json.loads(path.read_text()) if path.exists() else {"rows": [], "metadata": {}}
    return pages


def _tp_when(pages: dict[str, dict], world: int = TP_WORLD) -> str:
    from cookbook.bench import tp as bench_tp

    links = []
    for timing, data in pages.items():
        meta = data["metadata"]
        stem = bench_tp.page_stem(RECORDED_GPU, world, timing)
        name = "graph" if timing == bench_tp.GRAPH else "back to back"
        links.append(f"[{name}](results/{stem}.md): {meta.get('date', '-')[:10]}, commit {meta.get('commit', '-')}")
    gpu = next((d["metadata"]["gpu"] for d in pages.values() if d["metadata"]), "-")
    return f"{world} x {gpu}, bf16, fused rounding; {'; '.join(links)}"


def tp_ladder_table() -> str:
    """Each rung and the tuned kernel: its lead, its kernels' registers, its time at MiniMax-M2's
    widths at TP=2 by both timings, and the local shard's (the same shard on one GPU) as the floor."""
    from cookbook.bench import tp as bench_tp

    pages = tp_pages()
    registers = tp_registers()
    timed = {timing: {t: bench_tp.timed_at(d["rows"], t) for t in TP_LADDER_TOKENS} for timing, d in pages.items()}
    lines = ["| rung | what it changes, and which bottleneck it removes | registers | "
             + " | ".join(f"T={t}" for t in TP_LADDER_TOKENS) + " |", "|---|---|---|" + "---|" * len(TP_LADDER_TOKENS)]

    def cells(name):
        out = []
        for t in TP_LADDER_TOKENS:
            graph, b2b = (timed[timing][t].get(name) for timing in (bench_tp.GRAPH, bench_tp.BACK_TO_BACK))
            out.append(" / ".join(f"{us:.2f}" if us is not None else "-" for us in (graph, b2b)))
        return " | ".join(out)

    for impl in registry.implementations("tp_qk_norm", registry.COMPILED_LEVELS):
        rung = f"v{impl.version}" if impl.level == "cuda" else "tuned"
        lines.append(f"| {rung} | {impl.lead} | {registers.get(impl.name, '-')} | {cells(impl.name)} |")
    lines.append(f"| local shard | the same shard's `cross_head_norm` on one GPU, no communication: the floor | - | "
                 f"{cells(bench_tp.LOCAL_SHARD)} |")
    lines += ["", f"(us per call at MiniMax-M2's widths, graph / back to back ({_tp_when(pages)}); registers: ptxas for "
                  f"{nvcc_report.DEFAULT_ARCH}, bf16, fused rounding, each rung's kernels at the TP=2 shard.)"]
    return "\n".join(lines)


def tp_which_table() -> str:
    """Which kernel the tuned kernel runs at MiniMax-M2's widths at TP=2 and TP=4, with its launch
    and registers: what `python -m cookbook explain tp_qk_norm` answers."""
    import torch

    from cookbook import explainer
    from cookbook.bench import tp as bench_tp

    contract = registry.contract("tp_qk_norm")
    lines = ["| tokens | " + " | ".join(f"TP={world}: kernel, grid x block, registers" for world in TP_WHICH_WORLDS) + " |",
             "|---|" + "---|" * len(TP_WHICH_WORLDS)]
    for shape in contract.BENCH_SHAPES:
        if tuple(shape[1:]) != bench_tp.MINIMAX_WIDTHS:
            continue
        cells = []
        for world in TP_WHICH_WORLDS:
            p = explainer.explain("tp_qk_norm", shape=tuple(shape), dtype=torch.bfloat16, world=world, gpu="h100").plan
            name = p["kernel"].rsplit("::", 1)[1]
            vecs = next((arg.split("=")[1] for arg in p["template_arguments"].split(", ")
                         if arg.startswith("kVecsPerThread")), None)
            cells.append(f"`{name}{f'<{vecs}>' if vecs else ''}` {int(p['grid']):,} x {p['block']}, {p['registers']}")
        lines.append(f"| {shape[0]} | {' | '.join(cells)} |")
    lines += ["", "(an H100 or H200: 132 SMs; bf16, fused rounding, each rank's shards as views of one fused qkv shard; "
                  "`python -m cookbook explain tp_qk_norm --shape T,6144,1024 --world TP --gpu h100`; registers from "
                  f"ptxas for {nvcc_report.DEFAULT_ARCH}.)"]
    return "\n".join(lines)


def tp_minimax_table(world: int = TP_WORLD) -> str:
    """The tuned kernel against SGLang's fused TP kernel and the local shard at MiniMax-M2's widths
    at TP=`world`, timed in one run on the same GPUs, by both methods (at another world size than
    TP_WORLD without the local shard, its caption pointing at the first table's)."""
    from cookbook.bench import tp as bench_tp

    pages = tp_pages(world)
    tuned = registry.fastest("tp_qk_norm").name
    header = ["tokens"]
    for timing in pages:
        name = "graph" if timing == bench_tp.GRAPH else "back to back"
        header += [f"{name}: {tuned}", "SGLang", "ours / SGLang"] + (["local shard"] if world == TP_WORLD else [])
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    tokens = sorted({r["shape"][0] for d in pages.values() for r in d["rows"]
                     if tuple(r["shape"][1:]) == bench_tp.MINIMAX_WIDTHS})
    for t in tokens:
        cells = [str(t)]
        for data in pages.values():
            timed = bench_tp.timed_at(data["rows"], t)
            ours, sglang, local = timed.get(tuned), timed.get(bench_tp.SGLANG_TP), timed.get(bench_tp.LOCAL_SHARD)
            cells += [f"{ours:.2f}" if ours else "-", f"{sglang:.2f}" if sglang else "-",
                      f"**{ours / sglang:.2f}**" if ours and sglang else "-"]
            cells += [f"{local:.2f}" if local else "-"] if world == TP_WORLD else []
        lines.append("| " + " | ".join(cells) + " |")
    if world != TP_WORLD:
        return "\n".join(lines + ["", f"(us per call, timed as above; {_tp_when(pages, world)}.)"])
    lines += ["", f"(us per call ({_tp_when(pages, world)}); graph: the slowest rank's median of CUDA-graph replays after a "
                  f"barrier; back to back: rank 0's mean over {bench_tp.B2B_REPLAYS} x {bench_tp.LAYERS} calls; -: not "
                  f"timed by that method.)"]
    return "\n".join(lines)


GENERATED = "<!-- generated by tools/docs_versions.py: {} -->"
GENERATED_END = "<!-- end of generated {} -->"


def write_generated(op: str) -> Path:
    """Rewrite the generated tables of docs/<op>.md: between their markers (ladder layout: the
    ladder and results tables), or in place of the block that starts with the same header row and
    ends with its note in parentheses (the older layout's versions table)."""
    page = RESULTS_DIR.parent / f"{op}.md"
    text = page.read_text()
    for name, table_text in named_tables(op):
        start, end = GENERATED.format(name), GENERATED_END.format(name)
        if start in text:  # between its markers
            before, rest = text.split(start, 1)
            _, after = rest.split(end, 1)
            text = f"{before}{start}\n{table_text}\n{end}{after}"
            continue
        lines = text.split("\n")
        first = lines.index(table_text.split("\n")[0])
        last = next(i for i in range(first, len(lines)) if lines[i].startswith("("))
        text = "\n".join(lines[:first] + table_text.split("\n") + lines[last + 1:])
    page.write_text(text)
    return page


def named_tables(op: str) -> list[tuple[str, str]]:
    """(name, text) of each generated table of an op's page: the ladder layout's ladder and results
    tables; the older layout's versions table and, where a
    peers sweep is recorded (`--tag peers`), the comparison with the peers."""
    if op == "tp_qk_norm":
        return [("ladder", tp_ladder_table()), ("which", tp_which_table()), ("minimax", tp_minimax_table()),
                ("minimax4", tp_minimax_table(4))]
    if any(impl.extension is not None for impl in registry.implementations(op)):
        from cookbook import explainer

        which = [("which", which_table(op))] if op in explainer.explainable() else []
        return [("ladder", ladder_table(op)), *which, ("results", results_table(op))]
    named = [("versions", table(op))]
    return named + ([("peers", results_table(op, "peers"))] if recorded_path(op, "peers").exists() else [])


def tables(op: str) -> list[str]:
    """The generated tables of an op's page."""
    return [text for _, text in named_tables(op)]


def main(argv=None) -> int:
    args = (argv if argv is not None else sys.argv[1:]) or ["qk_norm"]
    if args[0] == "--write":
        for op in args[1:]:
            print(f"wrote {write_generated(op)}")
        return 0
    for op in args:
        print("\n\n".join(tables(op)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
