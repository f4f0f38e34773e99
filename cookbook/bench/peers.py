"""The peers of other packages in the benchmark: checked first (which rounding order, how many
ulps; not applicable, with the reason, where a peer does not take the layout), then timed like
ours, and set side by side with our tuned kernel per shape.

A peer is context, not the subject: its verdict, good or bad, is recorded (results pages, JSON
metadata) and never fails the run. Only a peer that follows one of the op's rounding orders gets a
result row (timed); the others are listed with their verdicts.
"""

from __future__ import annotations

import dataclasses

import torch

from cookbook import registry
from cookbook.bench.common import BENCH_ROUNDING, BYTES_PER_GB, EPS, WEIGHT_OFFSET, checked, error_text, positional
from cookbook.bench.tables import markdown_table
from cookbook.bench.timing import measure, summarize
from cookbook.peers import guard, orders

# Packages whose versions a results page names when peers ran (the peers, and what builds or runs them).
RECORDED_PACKAGES = ("sglang", "flashinfer-python", "liger-kernel", "apache-tvm-ffi", "triton")


# Peers that raised in this process ((op, name) -> "<shape>: <error>"): skipped at later shapes.
_FAILED: dict[tuple[str, str], str] = {}


def is_external(impl) -> bool:
    """A peer from another package (installed optionally), as opposed to torch.compile or NCCL."""
    return impl.level == "peer" and impl.package is not None


def not_installed_note(skipped) -> str | None:
    """One line for every external peer whose package is missing ([(impl, reason)]), or None."""
    missing = sorted({impl.package for impl, reason in skipped if is_external(impl) and guard.is_not_installed(reason)})
    if not missing:
        return None
    return f"peers not installed ({', '.join(missing)}): {guard.INSTALL_HINT}"


def bench_peer(case, impl, copy_gb_per_s, trace, progress) -> tuple[dict | None, dict]:
    """(result row or None, verdict record) of one external peer at one shape: its verdict on
    fresh inputs first; timed (a row) only where it follows one of the op's rounding orders."""
    record = dict(op=case.base_row["op"], label=case.base_row["label"], shape=case.base_row["shape"],
                  impl=impl.name, package=impl.package, api=None, status=None, order=None, max_ulp=None,
                  detail="")  # fmt: skip
    where = f"{record['op']} {record['label']} {impl.name}"
    earlier = _FAILED.get((impl.op, impl.name))
    if earlier is not None:  # a JIT build that failed once fails again, minutes later: not retried
        verdict = orders.failed(f"not retried after the error at {earlier}")
    else:
        try:
            kernel = impl.build()
            record.update(package=kernel.label(torch.device("cuda")), api=kernel.api)
            verdict = check(case, kernel)
        except Exception as error:  # a failed JIT build or launch: reported, the run goes on
            verdict = orders.failed(error_text(error))
            _FAILED[(impl.op, impl.name)] = f"{record['label']}: {verdict.detail}"
        if verdict.status == orders.ERROR:
            progress.write(f"!! peer {where}: {verdict.text()}")
        elif verdict.status == orders.DISAGREES:
            progress.write(f"!! peer {where}: {verdict.text()}; {verdict.detail}")
    record.update(status=verdict.status, order=verdict.order, max_ulp=verdict.max_ulp, detail=verdict.detail,
                  verdict=verdict.text())
    if not verdict.timed:
        return None, record
    row = dict(case.base_row, impl=impl.name, level=impl.level, version=impl.version, package=record["package"],
               order=verdict.order, agrees=True, max_ulp=verdict.max_ulp, agreement=verdict.text())
    try:
        for args in case.arg_sets:
            kernel.prepare(*args)
        timing = measure(kernel, case.arg_sets, trace)
    except Exception as error:
        record.update(status=orders.ERROR, detail=f"while timing: {error_text(error)}", verdict="error while timing")
        progress.write(f"!! peer {where}: timing failed: {error_text(error)}")
        return None, record
    row.update(summarize(timing.per_call_us), method=timing.method, calls_per_replay=timing.calls_per_replay)
    if timing.note:
        row["note"] = f"not capturable, timed as a launch loop: {timing.note}"
    row["gb_per_s"] = row["bytes_moved"] / (row["median_us"] * 1e-6) / BYTES_PER_GB
    row["pct_of_copy"] = 100 * row["gb_per_s"] / copy_gb_per_s
    return row, record


def check(case, kernel) -> orders.Verdict:
    """The peer's verdict on fresh inputs seeded like the agreement check's."""
    inputs = case.make_inputs()
    args = positional(checked(case.contract, inputs))
    reason = kernel.not_applicable(*args)
    if reason:
        return orders.not_applicable(reason)
    kernel.prepare(*args)
    outputs = dict(zip(case.expected, kernel(*args)))
    if any(t.is_cuda for t in outputs.values()):
        torch.cuda.synchronize()  # a launch error surfaces here, as this peer's
    return orders.judge(case.contract, outputs, case.oracles())


def oracles_of(contract, inputs) -> dict:
    """Every rounding order's reference for one shape (computed once, the first time a peer asks)."""
    return orders.oracles(contract, inputs, EPS, WEIGHT_OFFSET)


# --------------------------------------------------------------------------------------------
# Side by side: the results page's section and the console's table.
# --------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class SideBySide:
    """One op's peers against our tuned kernel (registry.fastest), from rows and verdict records."""

    op: str
    rows: list
    records: list

    @property
    def baseline(self) -> str:
        return registry.fastest(self.op).name

    def _medians(self) -> dict:
        return {(row["label"], row["impl"]): row["median_us"] for row in self.rows if row.get("median_us")}

    def table(self) -> str:
        medians = self._medians()
        headers = ["shape", "impl", "package", "verdict", "median us", "GB/s", "% of copy", f"x vs {self.baseline}"]
        body = []
        for label in dict.fromkeys(record["label"] for record in self.records):
            ours = next((row for row in self.rows if row["label"] == label and row["impl"] == self.baseline), None)
            if ours is not None and ours.get("median_us"):
                verdict = f"{BENCH_ROUNDING} order, max {ours['max_ulp']:.2g} ulp"
                body.append([label, self.baseline, "this cookbook", verdict, *_numbers(ours, ours["median_us"])])
            for record in (r for r in self.records if r["label"] == label):
                row = next((r for r in self.rows if r["label"] == label and r["impl"] == record["impl"]), None)
                tuned = medians.get((label, self.baseline))
                numbers = _numbers(row, tuned) if row is not None and row.get("median_us") else ["-"] * 4
                body.append([label, record["impl"], record["package"] or record["impl"], record["verdict"], *numbers])
        return markdown_table(headers, body)

    def faster_than_ours(self) -> list[str]:
        """One plain sentence per (shape, peer) where the peer beat our tuned kernel."""
        medians = self._medians()
        found = []
        for row in self.rows:
            tuned = medians.get((row["label"], self.baseline))
            if row.get("package") and row.get("median_us") and tuned and row["median_us"] < tuned:
                found.append(f"{row['impl']} ({row['package']}) is faster than {self.baseline} at {row['label']}: "
                             f"{row['median_us']:.2f} us against {tuned:.2f} us ({tuned / row['median_us']:.2f}x).")
        return found

    def summary(self) -> str:
        faster = self.faster_than_ours()
        if faster:
            return "\n".join(["Where a peer is faster than our tuned kernel:", "", *[f"- {line}" for line in faster]])
        timed = [row for row in self.rows if row.get("package") and row.get("median_us")]
        if not timed:
            return "No peer was timed at these shapes (see the verdicts)."
        return f"{self.baseline} is faster than every timed peer at every shape above."

    def section(self) -> str:
        return "\n".join([
            "## Side by side with the peers",
            "",
            f"`x vs {self.baseline}`: {self.baseline}'s median time over the row's (> 1: faster than ours). "
            "A peer is timed only where its output follows one of the op's rounding orders (the verdict); "
            "\"not applicable\" names what in the layout the peer does not take. How each peer is "
            "installed and loaded: [docs/peers.md](../peers.md).",
            "",
            self.table(),
            "",
            self.summary(),
        ])


def _numbers(row, tuned_us) -> list[str]:
    x = "-" if not tuned_us else f"{tuned_us / row['median_us']:.2f}x"
    return [f"{row['median_us']:.2f}", f"{row['gb_per_s']:.0f}", f"{row['pct_of_copy']:.0f} %", x]


def peer_metadata(records) -> dict:
    """What a results page records of the peers: every package's version and every verdict."""
    return {"packages": {name: guard.installed_version(name) for name in RECORDED_PACKAGES},
            "verdicts": records}
