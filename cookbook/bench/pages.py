"""Results: the run's metadata (GPU, date, commit, command, build seconds), the files written to
the output directory, and the docs' results pages `docs/results/<op>_<gpu>.{md,json}`."""

from __future__ import annotations

import csv
import datetime
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import dataclasses
from pathlib import Path

import torch

from cookbook.bench.common import DEFAULT_DTYPE, GB_PER_TB, MIB, PAGES_OF_RECORD, REPO_ROOT, dtype_name
from cookbook.bench.peers import SideBySide
from cookbook.bench.tables import bench_table, plot_op
from cookbook.bench.timing import (COPY_BYTES, HIGH_PERCENTILE, L2_FLUSH_FACTOR, LOW_PERCENTILE, MAX_INPUT_SETS,
                                   TIMED_REPLAYS, WARMUP_REPLAYS, l2_bytes)

# Every bench row has these keys (the CSV columns), in this order.
ROW_FIELDS = (
    "op", "dtype", "label", "shape", "impl", "level", "version", "package", "order",
    "agrees", "max_ulp", "agreement", "error",
    "method", "input_sets", "calls_per_replay", "median_us", "p20_us", "p80_us",
    "bytes_moved", "gb_per_s", "pct_of_copy", "x_vs_eager", "x_vs_compile", "x_vs_tuned", "note",
)  # fmt: skip
# package, order: peers of other packages only ("<distribution> <version>", the rounding order
# their output follows); x_vs_tuned: over registry.fastest(op), what backend="cuda" runs.

_VENDOR_WORDS = {"nvidia", "geforce", "tesla", "quadro"}


def gpu_slug(device_name: str) -> str:
    """A short file-name tag for a GPU: the words up to the first model number, vendor dropped.

    "NVIDIA H100 80GB HBM3" -> "h100", "NVIDIA H200" -> "h200", "NVIDIA GeForce RTX 4090" -> "rtx4090".
    """
    words = [w for w in re.split(r"[^a-z0-9]+", device_name.lower()) if w and w not in _VENDOR_WORDS]
    for i, word in enumerate(words):
        if any(c.isdigit() for c in word):
            return "".join(words[: i + 1])
    return "".join(words) or "gpu"


def git_commit() -> str:
    """Short HEAD commit, "-dirty" when tracked files changed; "unknown" outside a git checkout.
    COOKBOOK_COMMIT, when set, names it instead (a copy of the tree on a remote GPU machine)."""
    if os.environ.get("COOKBOOK_COMMIT"):
        return os.environ["COOKBOOK_COMMIT"]

    def git(*args):
        return subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, check=True).stdout.strip()

    try:
        head = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.CalledProcessError):
        # A copy of the tree without .git (a remote GPU machine): the caller may name the commit.
        return os.environ.get("COOKBOOK_COMMIT", "unknown")
    return head + ("-dirty" if dirty else "")


def _installed_version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _build_seconds() -> dict:
    """{extension: {"seconds": wall time, "cached": loaded from an earlier build}} of this process."""
    import sys

    cuda = sys.modules.get("cookbook.cuda")  # only what this process built or loaded
    if cuda is None:
        return {}
    return {name: {"seconds": round(r.seconds, 2), "cached": r.cached} for name, r in cuda.BUILDS.items()}


def metadata(command: str, copy_gb_per_s: float, dtype) -> dict:
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return {
        "gpu": props.name,
        "gpu_slug": gpu_slug(props.name),
        "compute_capability": f"{props.major}.{props.minor}",
        "sm_count": props.multi_processor_count,
        "l2_bytes": l2_bytes(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "numba_cuda": _installed_version("numba-cuda"),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": git_commit(),
        "command": command,
        "dtype": dtype_name(dtype),
        "copy_bytes": COPY_BYTES,
        "copy_tb_per_s": copy_gb_per_s / GB_PER_TB,
        "builds": _build_seconds(),
        "timing": f"median and p{LOW_PERCENTILE}-p{HIGH_PERCENTILE} of {TIMED_REPLAYS} CUDA-graph replays "
        f"(after {WARMUP_REPLAYS} warm-up replays), per call = replay / calls per replay; rotating input "
        f"sets moving >= {L2_FLUSH_FACTOR}x L2 per pass (at most {MAX_INPUT_SETS})",
    }


def write_outputs(rows, meta, out: Path, results_dir: Path | None) -> None:
    """Tables to the console; results.csv, results.json and plots to `out`; docs pages."""
    with open(out / "results.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=ROW_FIELDS)
        writer.writeheader()
        writer.writerows(dict(row, shape="x".join(map(str, row["shape"]))) for row in rows)
    (out / "results.json").write_text(json.dumps({"metadata": meta, "rows": rows}, indent=1))
    for op in dict.fromkeys(row["op"] for row in rows):
        op_rows = [row for row in rows if row["op"] == op]
        print(f"\n{op} ({meta['dtype']}) on {meta['gpu']}, copy {meta['copy_tb_per_s']:.2f} TB/s\n{bench_table(op_rows)}")
        peers = side_by_side(op, op_rows, meta)
        if peers is not None:
            print(f"\n{op}: side by side with the peers\n{peers.table()}\n{peers.summary()}")
        plots = plot_op(op_rows, meta, out)
        if results_dir is not None:
            write_results_page(op, op_rows, meta, plots, results_dir)
    print(f"\nwrote {out / 'results.csv'}, {out / 'results.json'} and the plots in {out}/")
    if results_dir is not None:
        print(pages_note(results_dir))


def pages_note(results_dir: Path) -> str:
    """Where the results pages went, and how to write the pages of record instead."""
    if Path(results_dir).resolve() == (REPO_ROOT / PAGES_OF_RECORD).resolve():
        return (f"the results pages in {results_dir}/ are the pages of record: review them with "
                f"`git diff {PAGES_OF_RECORD}`")
    return (f"the results pages are in {results_dir}/; the checkout's pages of record ({PAGES_OF_RECORD}/, what the "
            f"docs link to) are unchanged: write those with --results-dir {PAGES_OF_RECORD}")


def results_stem(op: str, meta: dict) -> str:
    """`<op>_<gpu>` for the default dtype (the names the docs link to), `<op>_<gpu>_<dtype>` else;
    a partial sweep's tag last (`<op>_<gpu>_peers`)."""
    stem = f"{op}_{meta['gpu_slug']}"
    if meta["dtype"] != dtype_name(DEFAULT_DTYPE):
        stem += f"_{meta['dtype']}"
    return f"{stem}_{meta['tag']}" if meta.get("tag") else stem


@dataclasses.dataclass(frozen=True)
class RecordedSweep:
    """A sweep the benchmark recorded in the docs: the page `{op}_{gpu}.md` and its rows, from the
    JSON written beside it (`write_results_page`)."""

    page: Path
    rows: list
    metadata: dict

    @property
    def title(self) -> str:
        m = self.metadata
        return f"{m['gpu']}, sweep recorded {m['date'][:10]} at {m['commit']}"


def recorded_sweeps(op, results_dir, gpu_slug=None) -> list[RecordedSweep]:
    """The sweeps of `op` recorded in `results_dir`, one per GPU (only `gpu_slug`'s when given):
    what a notebook draws where it cannot time (no GPU) or timed too few points for a line (a
    quick run). Only `{op}_{gpu}` pages count: not another op's whose name extends this one's
    (`qk_norm_rope_h200` for `qk_norm`), nor the Nsight Compute and experiment pages."""
    found = []
    for path in sorted(Path(results_dir).glob(f"{op}_*.json")):
        slug = path.stem[len(op) + 1:]
        if not re.fullmatch(r"[a-z0-9]+", slug) or (gpu_slug is not None and slug != gpu_slug):
            continue
        data = json.loads(path.read_text())
        found.append(RecordedSweep(path.with_suffix(".md"), data["rows"], data["metadata"]))
    return found


def side_by_side(op, rows, meta) -> SideBySide | None:
    """The op's peers against our tuned kernel, where peers of other packages ran (else None)."""
    records = [record for record in meta.get("peers", {}).get("verdicts", []) if record["op"] == op]
    return SideBySide(op, rows, records) if records else None


def _peer_versions(meta) -> str:
    packages = meta["peers"]["packages"]
    return ", ".join(f"{name} {version}" for name, version in packages.items() if version) or "none installed"


def write_results_page(op, rows, meta, plots: dict, results_dir: Path) -> None:
    """docs/results/<stem>.md (header and table), <stem>_<plot>.png and <stem>.json."""
    results_dir.mkdir(parents=True, exist_ok=True)
    stem = results_stem(op, meta)
    images = []
    for plot, path in plots.items():
        target = results_dir / f"{stem}_{plot}.png"
        shutil.copyfile(path, target)
        images.append(f"![{op} {plot}]({target.name})")
    page = [
        f"# {op} on {meta['gpu']} ({meta['dtype']})",
        "",
        "Written by the benchmark: do not edit by hand, run the command again.",
        "",
        f"- GPU: {meta['gpu']} (sm {meta['compute_capability']}, {meta['sm_count']} SMs, "
        f"L2 {meta['l2_bytes'] // MIB} MiB); torch {meta['torch']}, CUDA {meta['cuda']}",
        f"- date: {meta['date']}; commit: {meta['commit']}",
        f"- command: `{meta['command']}`",
        f"- device-to-device copy ({COPY_BYTES // MIB} MiB, bytes read + written): {meta['copy_tb_per_s']:.2f} TB/s",
        f"- timing: {meta['timing']}",
        *([f"- peers: {_peer_versions(meta)}"] if "peers" in meta else []),
        "",
        bench_table(rows),
        "",
        *images,
        "",
    ]
    peers = side_by_side(op, rows, meta)
    if peers is not None:
        page += [peers.section(), ""]
    (results_dir / f"{stem}.md").write_text("\n".join(page))
    (results_dir / f"{stem}.json").write_text(json.dumps({"metadata": meta, "rows": rows}, indent=1))
    print(f"wrote {results_dir / (stem + '.md')}")
