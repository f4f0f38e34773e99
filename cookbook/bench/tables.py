"""Tables and plots of result rows (pure formatting: no GPU)."""

from __future__ import annotations

from pathlib import Path

PLOTS = {  # plot name -> (row column, y-axis label)
    "latency": ("median_us", "median time per call (us)"),
    "pct_of_copy": ("pct_of_copy", "% of device-to-device copy bandwidth"),
}

MAX_CELL_CHARS = 60  # error messages in a table cell are cut to this
PLOT_SIZE_INCHES = (7.0, 4.5)

# One line per implementation, told apart by colour (a qualitative map of 20 distinct colours, so
# that a sweep of every version does not repeat the default cycle's 10) and by a marker per level.
PLOT_COLORS = "tab20"
LEVEL_MARKERS = {"reference": "s", "numba": "^", "cuda": "o", "tuned": "*"}  # peers (torch_compile, ...): "D"
PLOT_DPI = 120


def markdown_table(headers, body) -> str:
    """A markdown table with padded columns (readable in a terminal too)."""
    cells = [[str(c) for c in headers]] + [[str(c) for c in line] for line in body]
    widths = [max(len(line[i]) for line in cells) for i in range(len(headers))]
    fmt = lambda line: "| " + " | ".join(c.ljust(w) for c, w in zip(line, widths)) + " |"  # noqa: E731
    rule = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([fmt(cells[0]), rule] + [fmt(line) for line in cells[1:]])


def _x(value) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _agreement_cell(row) -> str:
    """Short: the full agreement report and error are in results.json and printed when they occur."""
    if row["error"]:
        error = row["error"]
        return "ERROR: " + (error if len(error) <= MAX_CELL_CHARS else error[: MAX_CELL_CHARS - 3] + "...")
    if not row["agrees"]:
        return f"FAIL (max {row['max_ulp']:.3g} ulp), not timed"
    return f"ok ({row['max_ulp']:.2g} ulp)"


def bench_table(rows) -> str:
    headers = ["shape", "impl", "median us", "p20-p80 us", "GB/s", "% of copy", "x vs eager",
               "x vs compile", "timed by", "agreement"]  # fmt: skip
    body = []
    for r in rows:
        if r["median_us"] is None:
            timing = ["-"] * 7
        else:
            timing = [f"{r['median_us']:.2f}", f"{r['p20_us']:.2f}-{r['p80_us']:.2f}", f"{r['gb_per_s']:.0f}",
                      f"{r['pct_of_copy']:.0f} %", _x(r["x_vs_eager"]), _x(r["x_vs_compile"]), r["method"]]  # fmt: skip
        body.append([r["label"], r["impl"], *timing, _agreement_cell(r)])
    return markdown_table(headers, body)


def tour_table(rows) -> str:
    headers = ["shape", "dtype", "rounding", "impl", "agreement", "wall ms (simulated)"]
    body = [
        [r["label"], r["dtype"], r["rounding"], r["impl"],
         r["agreement"] if r["agrees"] else "FAIL (below)",
         "-" if r["wall_ms"] is None else f"{r['wall_ms']:.1f}"]
        for r in rows
    ]  # fmt: skip
    return markdown_table(headers, body)


def _tokens(row) -> int:
    return row["shape"][0]  # BENCH_SHAPES entries start with the token count


def largest_family(rows) -> list[dict]:
    """The rows whose shapes differ only in the token count, from the biggest such family."""
    families = {}
    for row in rows:
        families.setdefault(tuple(row["shape"][1:]), []).append(row)
    return max(families.values(), key=lambda family: len({_tokens(r) for r in family}), default=[])


def line_style(index: int, impl: str) -> dict:
    """Matplotlib keywords for the index-th implementation of a plot: its own colour (PLOT_COLORS;
    past its 20, dashed lines), a marker for its level."""
    from matplotlib import colormaps

    colors = colormaps[PLOT_COLORS]
    return dict(color=colors(index % colors.N), linestyle="-" if index < colors.N else "--",
                marker=LEVEL_MARKERS.get("tuned" if impl.endswith("_tuned") else impl.split("_")[0], "D"))


def line_label(rows, impl: str) -> str:
    """A plot's name for an implementation: peers of other packages carry their package version."""
    package = next((row.get("package") for row in rows if row["impl"] == impl and row.get("package")), None)
    return f"{impl} ({package})" if package else impl


def draw_lines(ax, family, column: str, ylabel: str) -> None:
    """On `ax`, `column` of a shape family against tokens, one line per implementation (plot_op and
    the notebooks draw with it)."""
    for i, impl in enumerate(dict.fromkeys(row["impl"] for row in family)):
        points = sorted((_tokens(r), r[column]) for r in family if r["impl"] == impl)
        ax.plot(*zip(*points), label=line_label(family, impl), **line_style(i, impl))
    if column == "pct_of_copy":
        ax.axhline(100, color="gray", linestyle="--", linewidth=1, label="device copy")
    else:
        ax.set_yscale("log")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens")
    ax.set_ylabel(ylabel)
    ax.grid(True, which="both", alpha=0.3)


def plot_op(rows, meta, out: Path) -> dict[str, Path]:
    """Latency and %-of-copy against tokens, one line per implementation: {plot name: png}."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        print("matplotlib is not installed: no plots")
        return {}
    family = largest_family([row for row in rows if row["median_us"] is not None])
    if not family:
        return {}
    op, shape_tail = family[0]["op"], ", ".join(map(str, family[0]["shape"][1:]))
    paths = {}
    for plot, (column, ylabel) in PLOTS.items():
        fig = Figure(figsize=PLOT_SIZE_INCHES)
        FigureCanvasAgg(fig)  # render with Agg, whatever backend a notebook chose
        ax = fig.subplots()
        draw_lines(ax, family, column, ylabel)
        ax.set_title(f"{op}, shape (tokens, {shape_tail}), {meta['dtype']}, {meta['gpu']}", fontsize="medium")
        ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the lines
        paths[plot] = out / f"{op}_{meta['dtype']}_{plot}.png"
        fig.savefig(paths[plot], dpi=PLOT_DPI, bbox_inches="tight")
    return paths
