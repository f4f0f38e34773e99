#!/usr/bin/env python3
"""Old against new without a GPU: does the tuned kernel compile to the code it replaced?

    git archive 0c0c9f5 kernels_cuda | tar -x -C /tmp/old
    python tools/compare_registers.py --op cross_head_norm --old-kernels /tmp/old/kernels_cuda --old-commit 0c0c9f5

Compiles every kernel of this checkout's tuned extension and of the earlier commit's single header
with nvcc for sm_90 (ptxas's report: registers and spills; and the PTX), pairs each new kernel
variant with the former kernel it replaces, and compares their registers and their PTX instruction
sequences (opcodes in order; the loads of the kernel parameters left out, since the parameters'
layout changed). Writes docs/results/<op>_sm90_tuned_vs_<commit>_registers.{md,json}. A
reorganization that keeps every register count and instruction sequence keeps the timing too;
`tools/compare_tuned.py` measures that on a GPU.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cookbook import bench, nvcc_report, registry  # noqa: E402

ARCH = nvcc_report.DEFAULT_ARCH
_ENTRY = re.compile(r"\.visible \.entry (\w+)\((.*?)\)([^{]*)\{(.*?)\n\}", re.S)


def old_name_of_cross_head_norm(new: str) -> str | None:
    """The former kernel (its demangled name, up to the parameter list) a new one replaces: the tuned
    kernel's variants are the former v3 kernel with the switches v14 set; rung 7's warp per token is
    the former v8 kernel, the staged row the former v4 kernel streaming and programmatic, rung 2's
    kernel the former v2."""
    inner = new.split(">(")[0]
    args = [a.strip() for a in inner.removesuffix(">").split("<", 1)[1].split(",")]
    value = lambda arg: int(re.sub(r"^\([^()]*\)", "", arg))  # noqa: E731
    storage, hf = args[0], "true" if value(args[1]) else "false"
    on = lambda flag: "true" if flag else "false"  # noqa: E731
    if "cross_head_norm_tuned_kernel" in new:
        vecs, order, weights, warm, block = (value(a) for a in args[2:7])
        return (f"cross_head_norm_v3_kernel<{storage}, {vecs}, {hf}, true, true, {on(order == 1)}, {on(weights == 1)}, "
                f"{on(warm == 2)}, {block}, {on(warm >= 1)}>")
    if "cross_head_norm_v7_kernel" in new:
        return f"cross_head_norm_v8_kernel<{storage}, {value(args[2])}, {hf}>"
    if "cross_head_norm_staged_kernel" in new:
        return f"cross_head_norm_v4_kernel<{storage}, {hf}, true, true>"
    if "cross_head_norm_v2_kernel" in new:
        return f"cross_head_norm_v2_kernel<{storage}, {hf}>"
    return None


OLD_NAME_OF = {"cross_head_norm": old_name_of_cross_head_norm}


def compile_unit(source: str, include: Path, ptx: bool) -> str:
    """ptxas's report (or, with `ptx`, the PTX) of one unit compiled with nvcc."""
    with tempfile.TemporaryDirectory() as tmp:
        unit = Path(tmp) / "unit.cu"
        unit.write_text(source)
        out = Path(tmp) / ("unit.ptx" if ptx else "unit.o")
        flags = ["-ptx"] if ptx else ["-Xptxas", "-v", "-c"]
        run = subprocess.run([nvcc_report.nvcc(), *nvcc_report.NVCC_FLAGS, f"-arch={ARCH}", f"-I{include}", *flags,
                              str(unit), "-o", str(out)], capture_output=True, text=True)
        if run.returncode != 0:
            raise RuntimeError(f"nvcc failed:\n{run.stderr[-3000:]}")
        return out.read_text() if ptx else run.stderr


def demangle(names: list[str]) -> list[str]:
    return nvcc_report._demangle(names)


def kernels(report: str, ptx: str) -> dict[str, dict]:
    """{demangled name up to its parameters: {registers, spills, opcodes}} of one compile."""
    resources = {k.mangled: k for k in nvcc_report.parse_ptxas(report)}
    bodies = {m.group(1): m.group(4) for m in _ENTRY.finditer(ptx)}
    names = demangle(list(bodies))
    found = {}
    for (mangled, body), name in zip(bodies.items(), names):
        lines = [line.strip() for line in body.replace(mangled, "K").splitlines()]
        opcodes = [line.split()[0] if not line.endswith(":") else "LABEL" for line in lines
                   if line and not line.startswith(("//", ".loc", ".file", ".reg", "ld.param"))]
        function, _, arguments = name.removeprefix("void ").split(">(")[0].partition("<")
        key = f"{function.split('::')[-1]}<{arguments}>"
        found[key] = dict(registers=resources[mangled].registers, spills=resources[mangled].spill_bytes, opcodes=opcodes)
    return found


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--op", default="cross_head_norm", choices=sorted(OLD_NAME_OF))
    parser.add_argument("--old-kernels", type=Path, required=True, help="the earlier commit's kernels_cuda/")
    parser.add_argument("--old-commit", required=True)
    parser.add_argument("--results-dir", type=Path, default=bench.REPO_ROOT / "docs" / "results")
    args = parser.parse_args(argv)
    command = shlex.join(["python", "tools/compare_registers.py", *(argv if argv is not None else sys.argv[1:])])
    if nvcc_report.nvcc() is None:
        print("nvcc is not on PATH", file=sys.stderr)
        return 2

    ext = registry.get(args.op, "cuda_tuned").extension
    new_unit = "".join(ext.kernel_units().values())
    old_unit = f'#include "{args.op}.cuh"\nauto const keep_launch = &cookbook::{args.op}::launch;\n'
    new = kernels(compile_unit(new_unit, nvcc_report.KERNEL_DIR, False), compile_unit(new_unit, nvcc_report.KERNEL_DIR, True))
    old_dir = args.old_kernels.resolve()
    old = kernels(compile_unit(old_unit, old_dir, False), compile_unit(old_unit, old_dir, True))

    rows = []
    for name, k in sorted(new.items()):
        former = OLD_NAME_OF[args.op](name)
        o = old.get(former)
        rows.append(dict(kernel=name, former=former, registers=k["registers"], spills=k["spills"],
                         former_registers=o["registers"] if o else None,
                         same_instructions=bool(o) and o["opcodes"] == k["opcodes"],
                         instructions=len(k["opcodes"]), former_instructions=len(o["opcodes"]) if o else None))
    same_registers = sum(r["registers"] == r["former_registers"] for r in rows)
    same_code = sum(r["same_instructions"] for r in rows)
    version = subprocess.run([nvcc_report.nvcc(), "--version"], capture_output=True, text=True).stdout.strip()
    meta = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), commit=bench.git_commit(),
                old_commit=args.old_commit, command=command, arch=ARCH, nvcc=version.splitlines()[-1])
    body = [[f"`{r['kernel']}`", f"`{r['former']}`", str(r["registers"]), str(r["former_registers"]),
             "yes" if r["same_instructions"] else f"no ({r['instructions']} against {r['former_instructions']})"]
            for r in rows]
    table = bench.markdown_table(["kernel", f"former kernel ({args.old_commit})", "registers", "former registers",
                                  "same PTX instructions"], body)
    stem = f"{args.op}_{ARCH.replace('_', '')}_tuned_vs_{args.old_commit}_registers"
    page = [f"# {args.op}: the tuned extension's kernels against the former kernels they replace ({ARCH}, no GPU)", "",
            "Written by `tools/compare_registers.py`: do not edit by hand, run the command again.", "",
            f"- date: {meta['date']}; commit: {meta['commit']}; old: {args.old_commit}; {meta['nvcc']}",
            f"- command: `{command}`",
            f"- {same_registers} of {len(rows)} kernels: the same registers; {same_code} of {len(rows)}: the same PTX "
            "instruction sequence (opcodes in order, the kernel parameters' loads left out)", "", table, ""]
    args.results_dir.mkdir(parents=True, exist_ok=True)
    (args.results_dir / f"{stem}.md").write_text("\n".join(page))
    (args.results_dir / f"{stem}.json").write_text(json.dumps({"metadata": meta, "rows": rows}, indent=1))
    print(page[6])
    print(f"wrote {args.results_dir / (stem + '.md')}")
    return 0 if same_registers == same_code == len(rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
