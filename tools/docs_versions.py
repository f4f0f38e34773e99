#!/usr/bin/env python3
"""Print the generated tables of an op's docs page, from the registry, nvcc's resource report and
the recorded sweep (docs/results/<op>_h200.json).

    python tools/docs_versions.py qk_norm          # print the tables
    python tools/docs_versions.py --write qk_norm  # rewrite them in docs/qk_norm.md (ladder layout)

An op in the ladder layout (qk_norm) gets two tables: the ladder (each rung and the tuned kernel:
its lead, registers, and its time and percent of the copy at the headline shapes) and the results
at every bench shape (the tuned kernel against `torch.compile` and the peers the sweep timed).
An op in the older layout gets its versions table:

One row per registered implementation (name, level, version, lead); CUDA C rows add the
registers and spill bytes ptxas reports for the bf16 kernels (fused rounding; for the head_dim
specialized kernels, head_dim 128; for cross_head_norm v3, every vectors-per-thread kernel)
when nvcc is on PATH.

    python tools/docs_versions.py --occupancy cross_head_norm   # the occupancy table of its page

prints, per bench row width and CUDA C version, the kernel the launcher picks, its block size,
the registers and shared memory ptxas reports, and the theoretical occupancy those allow on sm_90.
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
                                    "T=4096 Hq=24 Hk=24 D=128 rope=128 neox", "T=8192 Hq=64 Hk=8 D=128 rope=128 neox"]}
# Ops whose recorded sweep may come from another GPU where the docs' one has none (qk_norm_rope's
# ladder was first measured on an H100).
OTHER_RECORDED_GPUS = {"qk_norm_rope": ("h100",)}
# Ops whose integer template argument is 16-byte vectors per thread, not head_dim.
VECTORS_PER_THREAD_OPS = {"cross_head_norm"}


# Ops whose kernels are not named <op>_vN_kernel: version -> the bf16 fused-rounding kernels it
# launches (16-byte packs, staged in shared memory where that is a template argument).
WEIGHT_SOURCE = "(cookbook::tp_qk_norm::WeightSource)"  # how the demangler writes the enum argument
NAMED_KERNELS = {
    "tp_qk_norm": {
        # v1: the 16-byte kernels on the token-major grid (fused-qkv views); unaligned shards run the element-wise pair
        1: ("sum_sq_vec_kernel<__nv_bfloat16, true>", "apply_vec_kernel<__nv_bfloat16, false, true>",
            "sum_sq_kernel<__nv_bfloat16>", "apply_kernel<__nv_bfloat16, false>"),
        2: ("fused_kernel<__nv_bfloat16, 8, true, false, false, false>",),
        3: ("fused_v3_kernel<__nv_bfloat16, 8, true, false, false, false, false>", "fused_kernel<__nv_bfloat16, 8, true, false, false, false>"),
        4: ("fused_v3_kernel<__nv_bfloat16, 8, true, false, true, false, false>", "fused_kernel<__nv_bfloat16, 8, true, false, false, false>"),
        5: ("fused_v3_kernel<__nv_bfloat16, 8, true, false, true, true, false>", "fused_kernel<__nv_bfloat16, 8, true, false, true, false>"),
        6: ("fused_v3_kernel<__nv_bfloat16, 8, true, false, true, true, true>", "fused_kernel<__nv_bfloat16, 8, true, false, true, true>"),
        # v7: its prefill kernel at 4 vectors per thread (the MiniMax shard at TP=2); smaller calls run v6's
        7: (f"lagged_rows_kernel<__nv_bfloat16, 4, false, {WEIGHT_SOURCE}0>",),
        # v8: the same walk with the weights held in registers; v9: in shared memory
        8: (f"lagged_rows_kernel<__nv_bfloat16, 4, false, {WEIGHT_SOURCE}1>",),
        9: (f"lagged_rows_kernel<__nv_bfloat16, 4, false, {WEIGHT_SOURCE}2>",),
        # v10: its decode kernel (prefill is v9's walk)
        10: ("fused_held_kernel<__nv_bfloat16, false>", f"lagged_rows_kernel<__nv_bfloat16, 4, false, {WEIGHT_SOURCE}2>"),
        # v11: its token-row kernel at one and two vectors per thread (the MiniMax shard at TP=4 and TP=2)
        11: ("token_rows_kernel<__nv_bfloat16, 1, false>", "token_rows_kernel<__nv_bfloat16, 2, false>"),
        # v12: the kernels its table picks from (v10's held rows, v11's token rows, v9's walk, v6's tiles)
        12: ("fused_held_kernel<__nv_bfloat16, false>", "token_rows_kernel<__nv_bfloat16, 1, false>",
             f"lagged_rows_kernel<__nv_bfloat16, 4, false, {WEIGHT_SOURCE}2>",
             "fused_kernel<__nv_bfloat16, 8, true, false, true, true>"),
    },
}


# Versions whose bf16 fused-rounding kernel the name pattern below cannot tell apart: version ->
# that instantiation. qk_norm v4 to v6 are v3's kernel with a 32-bit row index (v5 streaming x,
# v6 also a programmatic launch; v7 two rows per lane group, its kernel for one to two trips named;
# v8 the fast row division; v9 its one-trip kernel at decode sizes, with 16-byte weights, named;
# v10 the persistent kernel at head_dim 96, a padded lane group, named; v12 its one-trip kernel
# with the weights warmed, named; v13 the same warming the row a wave ahead, named);
# cross_head_norm v5 is v4's dispatch with streaming kernels (v4's bulk-copy kernel named), v6 the same launched programmatically, v7 v6 with v3's kernel at
# up to eight vectors per thread where the rows fill the GPU (the eight-vector kernel named; v8's
# warp-per-token kernels come out of the pattern as one cell, per vectors per lane), v9 the same
# kernel on its (token, tensor) grid (named), v10 the same with the weights loaded with the row
# (its four-vector kernel named), v11 that kernel warming the row a wave ahead (named), v12 v9's
# token-major kernel compiled for 128 threads (named), v13 that kernel warming its row before the
# wait (named), v14 v3's two-vector kernel warming its row on the (tokens, 2) grid (named).
KERNEL_INSTANCES = {
    "qk_norm": {4: "qk_norm_v3_kernel<__nv_bfloat16, 128, false, unsigned int, false, false, 1, false>",
                5: "qk_norm_v3_kernel<__nv_bfloat16, 128, false, unsigned int, true, false, 1, false>",
                6: "qk_norm_v3_kernel<__nv_bfloat16, 128, false, unsigned int, true, true, 1, false>",
                7: "qk_norm_v3_kernel<__nv_bfloat16, 128, false, unsigned int, true, true, 2, false>",
                8: "qk_norm_v3_kernel<__nv_bfloat16, 128, false, unsigned int, true, true, 1, true>",
                9: "qk_norm_one_trip_kernel<__nv_bfloat16, 128, false, true, false, false, 1>",
                10: "qk_norm_v3_kernel<__nv_bfloat16, 96, false, unsigned int, true, true, 1, true>",
                11: "qk_norm_one_trip_kernel<__nv_bfloat16, 128, false, true, false, false, 1>",
                12: "qk_norm_one_trip_kernel<__nv_bfloat16, 128, false, true, true, false, 1>",
                13: "qk_norm_one_trip_kernel<__nv_bfloat16, 128, false, true, true, true, 1>",
                14: "qk_norm_one_trip_kernel<__nv_bfloat16, 128, false, true, true, true, 2>"},
    "cross_head_norm": {5: "cross_head_norm_v4_kernel<__nv_bfloat16, false, true, false>",
                        6: "cross_head_norm_v4_kernel<__nv_bfloat16, false, true, true>",
                        7: "cross_head_norm_v3_kernel<__nv_bfloat16, 8, false, true, true, false, false, false, 0, false>",
                        9: "cross_head_norm_v3_kernel<__nv_bfloat16, 8, false, true, true, true, false, false, 0, false>",
                        10: "cross_head_norm_v3_kernel<__nv_bfloat16, 4, false, true, true, false, true, false, 0, false>",
                        11: "cross_head_norm_v3_kernel<__nv_bfloat16, 4, false, true, true, false, true, true, 0, false>",
                        12: "cross_head_norm_v3_kernel<__nv_bfloat16, 8, false, true, true, true, false, false, 128, false>",
                        13: "cross_head_norm_v3_kernel<__nv_bfloat16, 8, false, true, true, true, false, false, 128, true>",
                        14: "cross_head_norm_v3_kernel<__nv_bfloat16, 2, false, true, true, false, false, false, 0, true>"}
}


def named_kernel_registers(op: str) -> dict[int, str]:
    by_name = {k.kernel: k for k in nvcc_report.compile_header(op)}
    found = {}
    for version, names in NAMED_KERNELS[op].items():
        cells = []
        for name in names:
            kernel = next(k for full, k in by_name.items() if f"::{name}(" in full)
            cells.append(f"{name.split('<')[0]} {kernel.registers} regs, {kernel.spill_bytes} B spill")
        found[version] = "; ".join(cells)
    return found


def cuda_registers(op: str) -> dict[int, str]:
    """{version: "R regs, S B spill"} for the bf16 fused-rounding kernels, or {} without nvcc."""
    if nvcc_report.nvcc() is None:
        return {}
    if op in NAMED_KERNELS:
        return named_kernel_registers(op)
    # Extra template arguments after the rounding flag are allowed where none is `true` (the
    # instances of later versions: streaming) and the kernel is not in KERNEL_INSTANCES, which
    # names the rest. A version of several kernels (qk_norm_rope v1: <op>_v1_norm_kernel,
    # <op>_v1_rope_kernel) gets one cell naming each.
    name = re.compile(rf"{op}_v(\d+)_(\w+_)?kernel<__nv_bfloat16, (?:(\d+), )?false((?:, [\w ]+)*)>")
    instances = KERNEL_INSTANCES.get(op, {})
    found, parts, per_vectors = {}, {}, {}
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
        elif m and op in VECTORS_PER_THREAD_OPS:
            per_vectors.setdefault(int(m.group(1)), []).append((int(m.group(3)), kernel.registers, kernel.spill_bytes))
    for version, cells in parts.items():
        found[version] = "; ".join(sorted(cells))
    for version, instance in instances.items():
        kernel = next(k for k in kernels if f"::{instance}(" in k.kernel)
        head_dim = instance.split("<")[1].split(", ")[1]  # qk_norm's and qk_norm_rope's second argument
        where = f" at head_dim {head_dim}" if op in ("qk_norm", "qk_norm_rope") and head_dim != HEAD_DIM else ""
        found[version] = f"{kernel.registers} regs, {kernel.spill_bytes} B spill ({instance.split('<')[0]}{where})"
    for version, kernels in per_vectors.items():  # one cell: every vectors-per-thread kernel
        kernels.sort()
        unit = "lane" if op == "cross_head_norm" and version == 8 else "thread"  # v8: a warp per token
        found[version] = (f"{'/'.join(str(r) for _, r, _ in kernels)} regs at {'/'.join(str(n) for n, _, _ in kernels)} "
                          f"vectors per {unit}, {max(s for _, _, s in kernels)} B spill")
    return found


def table(op: str) -> str:
    registers = cuda_registers(op)
    specialized = "vectors per thread where specialized" if op in VECTORS_PER_THREAD_OPS else f"head_dim {HEAD_DIM} where specialized"
    note = (f"registers: ptxas for {nvcc_report.DEFAULT_ARCH}, bf16, fused rounding, {specialized}"
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
def recorded_path(op: str, tag: str | None = None) -> Path:
    """docs/results/<op>_<gpu>[_<tag>].json: the recorded sweep (`tag`: a partial sweep's, e.g. `--tag peers`);
    the docs' GPU first, then the op's OTHER_RECORDED_GPUS."""
    paths = [RESULTS_DIR / f"{op}_{gpu}{'_' + tag if tag else ''}.json"
             for gpu in (RECORDED_GPU, *OTHER_RECORDED_GPUS.get(op, ()))]
    return next((path for path in paths if path.exists()), paths[0])


def recorded_rows(op: str, tag: str | None = None) -> tuple[dict, dict]:
    """({(impl, label): row}, metadata) of `recorded_path(op, tag)` ({} where there is none)."""
    path = recorded_path(op, tag)
    if not path.exists():
        return {}, {}
    data = json.loads(path.read_text())
    return {(row["impl"], row["label"]): row for row in data["rows"]}, data["metadata"]


def _time_cell(row) -> str:
    if row is None or row.get("median_us") is None:
        return "-"
    return f"{row['median_us']:.2f} us, {row['pct_of_copy']:.0f} %"


def extension_registers(op: str) -> dict[str, str]:
    """{implementation: registers of its bf16 fused-rounding kernels at head_dim 128}, or {} without nvcc."""
    if nvcc_report.nvcc() is None:
        return {}
    if op in EXTENSION_REGISTERS:
        return EXTENSION_REGISTERS[op](op)
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


def ladder_table(op: str) -> str:
    rows, meta = recorded_rows(op)
    shapes = HEADLINE_SHAPES[op]
    registers = extension_registers(op)
    moved = LADDER_BYTES[op](op) if op in LADDER_BYTES else None
    bytes_header = f" {moved[0]} |" if moved else ""
    lines = [f"| rung | what it changes, and which bottleneck it removes | registers |{bytes_header} {' | '.join(shapes)} |",
             "|---|---|---|" + ("---|" if moved else "") + "---|" * len(shapes)]
    for impl in registry.implementations(op, ("reference",) + registry.COMPILED_LEVELS):
        rung = f"v{impl.version}" if impl.level == "cuda" else impl.name.removeprefix("cuda_")
        cells = [_time_cell(rows.get((impl.name, shape))) for shape in shapes]
        bytes_cell = f" {moved[1].get(impl.name, '-')} |" if moved else ""
        lines.append(f"| {rung} | {impl.lead} | {registers.get(impl.name, '-')} |{bytes_cell} {' | '.join(cells)} |")
    when = f"{meta['gpu']}, {meta['date'][:10]}, commit {meta['commit']}" if meta else "no recorded sweep"
    note = f"; {moved[2]}" if moved else ""
    lines += ["", f"(time per call and percent of the device copy: {when}, bf16, fused rounding; registers: ptxas for "
                  f"{nvcc_report.DEFAULT_ARCH}, bf16, fused rounding, head_dim {HEAD_DIM} where specialized{note}.)"]
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


EXTENSION_REGISTERS = {"qk_norm_rope": rope_extension_registers}
LADDER_BYTES = {"qk_norm_rope": rope_ladder_bytes}


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
    for shape in contract.BENCH_SHAPES:
        answer = explainer.explain(op, shape=shape, dtype=torch.bfloat16, layout="fused_qkv", gpu="h100")
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


TP_WORLDS = (2, 4)  # the tensor-parallel pages of record the tp_qk_norm page quotes


def tp_minimax_table() -> str:
    """tp_qk_norm at MiniMax-M2's widths from the TP pages of record: the latest CUDA C version, the
    fastest one, the same shard's single-GPU cross_head_norm, and SGLang's published TP=4 figures
    beside the latest version timed both ways (the graph page's and the back-to-back page's)."""
    from cookbook.bench import tp as bench_tp

    op = "tp_qk_norm"
    latest = registry.latest(op, "cuda").name

    def load(world, timing=bench_tp.GRAPH):
        path = RESULTS_DIR / f"{bench_tp.page_stem(RECORDED_GPU, world, timing)}.json"
        return json.loads(path.read_text()) if path.exists() else {"rows": [], "metadata": {}}

    pages = {world: load(world) for world in TP_WORLDS}
    b2b = load(4, bench_tp.BACK_TO_BACK)
    header = ["tokens"]
    for world in TP_WORLDS:
        header += [f"TP={world}: {latest}", f"TP={world}: fastest version", f"TP={world}: local shard"]
    header += ["SGLang, TP=4 (published)", f"TP=4 {latest} / published",
               f"TP=4 {latest}, back to back", "back to back / published"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    tokens = sorted({r["shape"][0] for d in pages.values() for r in d["rows"]
                     if tuple(r["shape"][1:]) == bench_tp.MINIMAX_WIDTHS})
    for t in tokens:
        cells, latest_tp4 = [str(t)], None
        for world, data in pages.items():
            timed = bench_tp.timed_at(data["rows"], t)
            best = bench_tp.fastest_version(timed)
            local, mine = timed.get(bench_tp.LOCAL_SHARD), timed.get(latest)
            latest_tp4 = mine if world == 4 else latest_tp4
            cells += [f"{mine:.2f} ({mine / local:.2f}x local)" if mine and local else "-",
                      f"{best[0]} {best[1]:.2f}" if best else "-", f"{local:.2f}" if local else "-"]
        published = bench_tp.PUBLISHED_TP4_H200_US.get(t)
        back_to_back = bench_tp.timed_at(b2b["rows"], t).get(latest)
        cells += [f"{published:.1f}" if published else "-",
                  f"{latest_tp4 / published:.2f}x" if published and latest_tp4 else "-",
                  f"{back_to_back:.2f}" if back_to_back else "-",
                  f"{back_to_back / published:.2f}x" if published and back_to_back else "-"]
        lines.append("| " + " | ".join(cells) + " |")
    when = "; ".join(f"TP={w}: {d['metadata'].get('date', '-')[:10]}, commit {d['metadata'].get('commit', '-')}"
                     for w, d in pages.items())
    b2b_when = f"{b2b['metadata'].get('date', '-')[:10]}, commit {b2b['metadata'].get('commit', '-')}"
    lines += ["", f"(us per call, bf16; the slowest rank's median of CUDA-graph replays ({when}), and back to "
                  f"back as SGLang's figures are timed: rank 0's mean over {bench_tp.B2B_REPLAYS} x {bench_tp.LAYERS} calls (TP=4: "
                  f"{b2b_when}); see How the two benchmarks time a call.)"]
    return "\n".join(lines)


GENERATED = "<!-- generated by tools/docs_versions.py: {} -->"
GENERATED_END = "<!-- end of generated {} -->"


def write_generated(op: str) -> Path:
    """Rewrite the generated tables of docs/<op>.md: between their markers (ladder layout: the
    ladder and results tables), or in place of the block that starts with the same header row and
    ends with its note in parentheses (the older layout's versions and occupancy tables)."""
    page = RESULTS_DIR.parent / f"{op}.md"
    text = page.read_text()
    for name, table_text in named_tables(op):
        if name in ("ladder", "which", "results", "peers", "minimax"):
            start, end = GENERATED.format(name), GENERATED_END.format(name)
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
    tables; the older layout's versions table (and cross_head_norm's occupancy table) and, where a
    peers sweep is recorded (`--tag peers`), the comparison with the peers."""
    if any(impl.extension is not None for impl in registry.implementations(op)):
        from cookbook import explainer

        which = [("which", which_table(op))] if op in explainer.explainable() else []
        return [("ladder", ladder_table(op)), *which, ("results", results_table(op))]
    named = [("versions", table(op))] + ([("occupancy", occupancy_table(op))] if op == "cross_head_norm" else [])
    if op == "tp_qk_norm":
        named.append(("minimax", tp_minimax_table()))
    return named + ([("peers", results_table(op, "peers"))] if recorded_path(op, "peers").exists() else [])


def tables(op: str) -> list[str]:
    """The generated tables of an op's page."""
    return [text for _, text in named_tables(op)]


# --------------------------------------------------------------------------------------------
# Theoretical occupancy (cross_head_norm): registers, threads and shared memory per CTA -> CTAs per SM.
# --------------------------------------------------------------------------------------------
# sm_90 (H100, H200) limits, as CUDA's occupancy calculator (cuda_occupancy.h) uses them.
SM90_REGISTERS = 65536  # 32-bit registers per SM, in 4 sub-partitions; a warp's registers come from one
SM90_SUB_PARTITIONS = 4
SM90_REG_ALLOC_UNIT = 256  # registers are allocated per warp in units of 256
SM90_MAX_WARPS = 64
SM90_MAX_CTAS = 32
SM90_SHARED_BYTES = 233472  # 228 KiB per SM
SM90_SHARED_RESERVED = 1024  # the system's shared memory per CTA
SM90_SHARED_UNIT = 128
WARP = 32

_SMEM = re.compile(r"(\d+) bytes smem")


def ptxas_shared_bytes(op: str) -> dict[str, int]:
    """{mangled kernel: static shared bytes}, from the shared memory ptxas reports (nvcc_report's cached compile)."""
    log = nvcc_report.ptxas_log(op)
    found, current = {}, None
    for line in log.splitlines():
        if m := re.search(r"Compiling entry function '(\w+)'", line):
            current = m.group(1)
        elif current and (m := _SMEM.search(line)):
            found[current] = int(m.group(1))
    return found


def theoretical_occupancy(registers: int, threads: int, shared_bytes: int) -> tuple[int, str]:
    """(resident CTAs per SM, the limit that binds) on sm_90."""
    warps = -(-threads // WARP)
    per_warp = -(-registers * WARP // SM90_REG_ALLOC_UNIT) * SM90_REG_ALLOC_UNIT
    reg_warps = SM90_SUB_PARTITIONS * ((SM90_REGISTERS // SM90_SUB_PARTITIONS) // per_warp)
    shared = -(-(shared_bytes + SM90_SHARED_RESERVED) // SM90_SHARED_UNIT) * SM90_SHARED_UNIT
    limits = {"warps": SM90_MAX_WARPS // warps, "registers": reg_warps // warps,  # a tie names the warp cap
              "shared memory": SM90_SHARED_BYTES // shared, "CTAs": SM90_MAX_CTAS}
    binding = min(limits, key=limits.get)
    return limits[binding], binding


def _header_constant(header: str, name: str) -> int:
    return int(re.search(rf"constexpr int {name} = (\d+);", header).group(1))


def cross_head_norm_launches(widest: int, elem_bytes: int = 2) -> dict[int, tuple[int, int]]:
    """{version: (threads per CTA, v3's vectors per thread or 0)} the launchers pick for rows up to
    `widest` elements (16-byte aligned; the header's constants, launch_v3's rule; v4 on sm_90)."""
    header = (nvcc_report.KERNEL_DIR / "cross_head_norm.cuh").read_text()
    v3_threads, v3_max_vecs = _header_constant(header, "kV3MaxThreads"), _header_constant(header, "kV3MaxVecsPerThread")
    vec_elems = 16 // elem_bytes
    launches = {1: (_header_constant(header, "kV1Threads"), 0), 2: (_header_constant(header, "kV2Threads"), 0)}
    vecs = 1
    while vecs <= v3_max_vecs and widest > v3_threads * vecs * vec_elems:
        vecs *= 2
    if vecs <= v3_max_vecs:
        needed = -(-(widest // vec_elems) // vecs)
        launches[3] = (-(-needed // WARP) * WARP, vecs)
    else:
        launches[3] = launches[2]  # wider rows stream through v2
    # v4: the row in dynamic shared memory past v3's two-vector limit, v3 below it
    launches[4] = (_header_constant(header, "kV4Threads"), 0) if widest > v3_threads * 2 * vec_elems else launches[3]
    # v5: streaming kernels; the bulk copy only past v3's eight-vector limit, v3 below it
    launches[5] = (_header_constant(header, "kV4Threads"), 0) if widest > v3_threads * v3_max_vecs * vec_elems \
        else launches[3]
    # v7, where the rows fill the GPU: kV7Warps-warp CTAs, up to v3's eight vectors per thread
    if widest <= v3_threads * v3_max_vecs * vec_elems:
        v7_threads, widest_vecs = _header_constant(header, "kV7Warps") * WARP, widest // vec_elems
        vecs_needed = -(-widest_vecs // v7_threads)  # at v7_threads threads, rounded up to 1, 2, 4 or 8
        vecs = min(v3_max_vecs, 1 << max(0, (vecs_needed - 1).bit_length()))
        threads = -(-widest_vecs // vecs)
        launches[7] = (-(-threads // WARP) * WARP, vecs)
    else:
        launches[7] = launches[5]
    # v8, at narrow rows (and enough tokens): kV8Warps-warp CTAs, one warp per token, 1, 2, 4 or 8
    # vectors per lane; wider rows run v7
    if v8_takes(widest, elem_bytes):
        lane_vecs = -(-(widest // vec_elems) // WARP)
        launches[8] = (_header_constant(header, "kV8Warps") * WARP, 1 << max(0, (lane_vecs - 1).bit_length()))
    else:
        launches[8] = launches[7]
    return launches


def v8_takes(widest: int, elem_bytes: int = 2) -> bool:
    """Whether cross_head_norm v8 runs its warp-per-token kernel on rows up to `widest` elements
    (given enough tokens: kV8TokensPerVector per vector of a token)."""
    header = (nvcc_report.KERNEL_DIR / "cross_head_norm.cuh").read_text()
    return widest // (16 // elem_bytes) <= _header_constant(header, "kV8MaxVecsPerLane") * WARP


def occupancy_table(op: str = "cross_head_norm") -> str:
    """Per bench row width and version: kernel, threads, registers, shared memory, CTAs and warps per SM."""
    if op != "cross_head_norm":
        raise ValueError("the occupancy table knows cross_head_norm's launchers only")
    if nvcc_report.nvcc() is None:
        return "(nvcc not found: no occupancy table)"
    contract = registry.contract(op)
    kernels = nvcc_report.compile_header(op)
    shared = ptxas_shared_bytes(op)
    # <T, [vectors per thread,] fused rounding, [streaming, [programmatic]]>; v6's programmatic
    # instances are v5's kernels with the same resources, left out
    name = re.compile(r"cross_head_norm_v(\d+)_kernelI13__nv_bfloat16(?:Li(\d+)E)?Lb0E(?:Lb([01])E)?(?:Lb([01])E)?")
    resources = {}
    for k in kernels:
        if (m := name.search(k.mangled)) and m.group(4) != "1":
            key = (int(m.group(1)), int(m.group(2) or 0), m.group(3) == "1")
            resources[key] = (k.registers, shared.get(k.mangled, 0))
    widths = sorted({max(shape[1], shape[2]) for shape in contract.BENCH_SHAPES})  # (tokens, q_hidden, k_hidden, ...)
    lines = ["| wider row (bf16) | version | kernel | threads/CTA | registers | smem/CTA | CTAs/SM (limit) | warps/SM | theoretical occupancy |",
             "|---|---|---|---|---|---|---|---|---|"]
    for widest in widths:
        for version, (threads, vecs) in cross_head_norm_launches(widest).items():
            streaming = version >= 5
            warp_per_token = version == 8 and v8_takes(widest)
            kernel_version = 8 if warp_per_token else 2 if version == 3 and vecs == 0 else \
                3 if version >= 4 and vecs else min(version, 4)
            # v8's kernel always streams and launches programmatically: no template flags for either
            registers, smem = resources[(kernel_version, vecs, streaming and not warp_per_token)]
            if kernel_version == 4:
                smem += widest * 2  # v4 stages the wider bf16 row in dynamic shared memory
            ctas, binding = theoretical_occupancy(registers, threads, smem)
            warps = ctas * (threads // WARP)
            kernel = f"v8, {vecs} vector{'s' if vecs > 1 else ''}/lane, a warp per token" if warp_per_token else \
                f"v3, {vecs} vector{'s' if vecs > 1 else ''}/thread" if vecs else f"v{kernel_version}"
            kernel += ", streaming" if streaming else ""
            lines.append(f"| {widest} | v{version} | {kernel} | {threads} | {registers} | {smem} B | {ctas} ({binding}) "
                         f"| {warps} | {100 * warps / SM90_MAX_WARPS:.0f} % |")
    lines += ["", f"(ptxas for {nvcc_report.DEFAULT_ARCH}, bf16, fused rounding; theoretical occupancy = resident warps / "
              f"{SM90_MAX_WARPS}, from registers, threads and shared memory per CTA as CUDA's occupancy calculator counts them. "
              "v6 launches v5's kernels; v7's rows are its pick where the call's rows fill the GPU, below that it launches v6's; "
              "v8's are its warp-per-token kernel at rows of up to 2048 bf16 elements and at least 18 tokens per 16-byte vector "
              "of a token, below that it launches v7's. v9 launches v8's kernels, v3's on a (token, tensor) grid where q and k "
              "are views of one tensor: the same resources. v10 launches v9's kernels, and in calls of fewer than three waves "
              "v3's at up to 4 vectors per thread with the weights loaded with the row: 32, 48 and 64 registers at 1, 2 and 4 "
              "vectors per thread, where the rows stay resident at once (or fill one to three waves of v7's CTAs). v11 launches "
              "v10's kernels. v12 launches v9's token-major kernel compiled for 128 threads: at 8192 bf16, 58 registers "
              "against v9's 59, 8 CTAs per SM either way. v13 launches v12's kernels with its row warmed before the wait: "
              "the same registers at every vectors per thread. v14 launches v13's kernels, except on the (tokens, 2) grid at "
              "rows of 4097 to 8192 bf16 elements with q and k within 2x of each other in width, where the rows fill the GPU: "
              "there v3's two-vector kernel warming its row (32 registers; 512 threads at 8192, 4 CTAs per SM).)"]
    return "\n".join(lines)


def main(argv=None) -> int:
    args = (argv if argv is not None else sys.argv[1:]) or ["qk_norm"]
    if args[0] == "--occupancy":
        for op in args[1:] or ["cross_head_norm"]:
            print(occupancy_table(op))
        return 0
    if args[0] == "--write":
        for op in args[1:]:
            print(f"wrote {write_generated(op)}")
        return 0
    for op in args:
        print("\n\n".join(tables(op)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
