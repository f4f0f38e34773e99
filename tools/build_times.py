#!/usr/bin/env python3
"""How long a new user waits for an op's CUDA C kernels, from an empty build cache (GPU machine).

    python tools/build_times.py qk_norm
    python tools/build_times.py cross_head_norm --cache /tmp/cookbook-build   # keep the whole op's build
    python tools/build_times.py qk_norm_rope --first-forward qwen3              # and a patched model's first forward

Two fresh processes, each with its own empty cache: (1) the first `backend="auto"` call, timed
from before `import cookbook` to the synchronized result (it builds the tuned kernel only);
(2) the whole op, every rung and the tuned kernel, built in parallel (what the benchmark does
first), in `--cache` where given (an empty or new folder, kept for the runs that follow: point
COOKBOOK_BUILD_DIR at it), else in a temporary one. With `--first-forward FAMILY`, a third fresh
process with its own empty cache: a model of that family (`cookbook.integrations.bench`'s widths,
random weights) is made on the GPU, then `cookbook.integrations.transformers.patch(model)` and its
first forward are timed to the synchronized logits (what a user waits for between `patch` and the
first token). For tp_qk_norm (1) is what its first call builds, the tuned extension, timed from
before `import cookbook` to the extension loaded (the call itself needs two ranks). Writes
docs/results/<op>_<gpu>_builds.{md,json}: wall seconds, each extension's seconds, the machine's cores.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

FIRST_CALL = """
import json, time
start = time.perf_counter()
import torch, cookbook
from cookbook import cuda, registry
x = registry.contract({op!r}).bench_case(registry.contract({op!r}).BENCH_SHAPES[0], torch.bfloat16, "cuda")[0]
rope = x.pop("rope", None)  # qk_norm_rope's rotary settings, as the public function takes them
settings = {{}} if rope is None else dict(is_neox=rope.is_neox, rope_dim=rope.rope_dim)
if rope is not None and rope.position_offset:  # (qk_norm_rope_cache takes none)
    settings["position_offset"] = rope.position_offset
getattr(cookbook, {op!r})(**x, **settings, backend="auto")
torch.cuda.synchronize()
print(json.dumps({{"seconds": time.perf_counter() - start,
                  "builds": {{n: r.seconds for n, r in cuda.BUILDS.items()}}}}))
"""

# tp_qk_norm's first call needs a group of at least two ranks (a group of one runs cross_head_norm):
# what that call builds, timed the same way (the group's setup is not a build).
TP_FIRST_CALL = """
import json, time
start = time.perf_counter()
import torch, cookbook
from cookbook import cuda
cuda.TpOps(cuda.tp_tuned())
print(json.dumps({{"seconds": time.perf_counter() - start,
                  "builds": {{n: r.seconds for n, r in cuda.BUILDS.items()}}}}))
"""

WHOLE_OP = """
import json, time
import torch
from cookbook import cuda, registry
extensions = [impl.extension for impl in registry.implementations({op!r}) if impl.extension is not None]
start = time.perf_counter()
results = cuda.build(extensions)
failed = {{n: str(r) for n, r in results.items() if isinstance(r, Exception)}}
print(json.dumps({{"seconds": time.perf_counter() - start, "failed": failed,
                  "builds": {{n: r.seconds for n, r in cuda.BUILDS.items()}}}}))
"""


FIRST_FORWARD = """
import json, time
import torch
from cookbook.integrations import bench, transformers as integration
model = bench.causal_lm({family!r}, device="cuda")
ids = torch.randint(1, model.config.vocab_size, (1, 16), device="cuda")
torch.cuda.synchronize()
start = time.perf_counter()
report = integration.patch(model)
with torch.no_grad():
    model(input_ids=ids).logits.float().sum().item()
torch.cuda.synchronize()
from cookbook import cuda
print(json.dumps({{"seconds": time.perf_counter() - start, "patched": "; ".join(str(report).splitlines()),
                  "builds": {{n: r.seconds for n, r in cuda.BUILDS.items()}}}}))
"""


def fresh_run(script: str, cache: Path | None = None) -> dict:
    """The JSON line `script` prints last, run in a fresh process whose build cache is `cache` (which
    must be empty: the build starts from nothing) or a temporary folder."""
    if cache is None:
        with tempfile.TemporaryDirectory() as temporary:
            return fresh_run(script, Path(temporary))
    if cache.exists() and any(cache.iterdir()):
        raise SystemExit(f"--cache: {cache} is not empty; the build must start from an empty cache")
    cache.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "COOKBOOK_BUILD_DIR": str(cache), "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=ROOT)
    if run.returncode != 0:
        raise RuntimeError(run.stderr[-3000:])
    return json.loads(run.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    import torch

    from cookbook import bench

    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("op", nargs="?", default="qk_norm")
    parser.add_argument("--cache", type=Path, help="build the whole op here and keep it (an empty or new folder)")
    parser.add_argument("--first-forward", metavar="FAMILY",
                        help="also time patch(model) to its first forward for a model of this family (e.g. qwen3)")
    args = parser.parse_args(argv)
    op = args.op
    first = fresh_run((TP_FIRST_CALL if op == "tp_qk_norm" else FIRST_CALL).format(op=op))
    print(f"first auto call: {first['seconds']:.1f} s", flush=True)  # each run as it ends: a run cut short keeps these
    whole = fresh_run(WHOLE_OP.format(op=op), args.cache)
    print(f"the whole op: {whole['seconds']:.1f} s", flush=True)
    forward = fresh_run(FIRST_FORWARD.format(family=args.first_forward)) if args.first_forward else None
    if forward is not None:
        print(f"patch to the first forward's logits: {forward['seconds']:.1f} s", flush=True)
    meta = bench.metadata(shlex.join(["python", "tools/build_times.py", *argv]), 0.0, torch.bfloat16)
    meta.update(cpu_cores=os.cpu_count())
    first_label = ("first `backend=\"auto\"` call's build (import to the tuned extension loaded; no group needed)"
                   if op == "tp_qk_norm" else "first `backend=\"auto\"` call (import to result)")
    rows = [[first_label, f"{first['seconds']:.1f}",
             ", ".join(f"{n} {s:.1f} s" for n, s in first["builds"].items())],
            ["the whole op, every extension in parallel", f"{whole['seconds']:.1f}",
             ", ".join(f"{n} {s:.1f} s" for n, s in whole["builds"].items())]]
    if forward is not None:
        rows.append([f"`patch(model)` to its first forward's logits ({args.first_forward}, {forward['patched']})",
                     f"{forward['seconds']:.1f}", ", ".join(f"{n} {s:.1f} s" for n, s in forward["builds"].items())])
    table = bench.markdown_table(["empty build cache", "wall seconds", "each extension (wall, in parallel)"], rows)
    stem = f"{op}_{meta['gpu_slug']}_builds"
    page = [f"# {op}: build times from an empty cache, {meta['gpu']} host ({meta['cpu_cores']} cores)", "",
            "Written by `tools/build_times.py`: do not edit by hand, run the command again.", "",
            f"- date: {meta['date']}; commit: {meta['commit']}; torch {meta['torch']}, CUDA {meta['cuda']}",
            f"- command: `{meta['command']}`", "", table, ""]
    if whole["failed"]:
        page += ["Failed builds:", "", *[f"- {n}: {e[:300]}" for n, e in whole["failed"].items()], ""]
    results = ROOT / "docs" / "results"
    (results / f"{stem}.md").write_text("\n".join(page))
    (results / f"{stem}.json").write_text(json.dumps({"metadata": meta, "first_call": first, "whole_op": whole,
                                                         **({"first_forward": forward} if forward else {})}, indent=1))
    print(table)
    return 1 if whole["failed"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
