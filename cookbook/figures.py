"""The lesson's pictures, drawn by code: where one beats a paragraph.

* `lane_group`: which lanes hold which 16-byte vectors of a row (qk_norm's LaneGroup, lanes.h);
* `programmatic_launch`: two kernels back to back, with and without a programmatic dependent
  launch (after_prior_grids and warm_l2, include/common.cuh);
* `warm_ahead`: waves of blocks, each lane group warming the row one wave ahead (the tuned kernel);
* `grid_orders`: which rows of a fused qkv tensor cross_head_norm's CTAs take, and in which order:
  one CTA per token (rung 1), q and k on grid.y (rung 2 on), the token-major grid (its tuned kernel).

The timelines are schematics (not to scale, nothing measured); the lane layout is computed from
the same arithmetic the kernels use. ``python -m cookbook.figures [DIR]`` writes them as PNG files
(default: docs/figures/) for the docs pages; the notebooks draw them inline.
"""

from __future__ import annotations

import sys
from pathlib import Path

VEC_BYTES = 16
WARP = 32


def _plt():
    import matplotlib.pyplot as plt  # matplotlib: the [test], [bench] and [notebooks] extras

    return plt


def lane_shape(head_dim: int, element_bytes: int, min_vecs_per_lane: int) -> tuple[int, int]:
    """(lanes, vectors per lane) of a row: kernels_cuda/qk_norm/lanes.h's lane_shape."""
    vecs = head_dim * element_bytes // VEC_BYTES
    wanted = (1 << max(vecs - 1, 0).bit_length()) // min_vecs_per_lane
    lanes = max(1, min(WARP, wanted))
    return lanes, -(-vecs // lanes)


def lane_group(head_dim: int = 128, element_bytes: int = 2):
    """A row of `head_dim` elements as 16-byte vectors, coloured by the lane that holds each, for
    one and two vectors per lane: slot i of lane l is vector i * lanes + l, so one load instruction
    of the group reads contiguous memory."""
    plt = _plt()
    vecs = head_dim * element_bytes // VEC_BYTES
    per_vec = VEC_BYTES // element_bytes
    fig, axes = plt.subplots(2, 1, figsize=(10, 2.8))
    cmap = plt.get_cmap("tab20")
    for ax, min_vecs in zip(axes, (1, 2)):
        lanes, held = lane_shape(head_dim, element_bytes, min_vecs)
        for v in range(vecs):
            lane, slot = v % lanes, v // lanes
            ax.add_patch(plt.Rectangle((v, 0), 0.95, 1, color=cmap(lane % 20), alpha=0.55 + 0.45 * (slot == 0)))
            ax.text(v + 0.47, 0.5, f"L{lane}" + (f"\ns{slot}" if held > 1 else ""), ha="center", va="center", fontsize=7)
        ax.set_xlim(0, vecs)
        ax.set_ylim(0, 1)
        ax.set_yticks([])
        ax.set_xticks(range(0, vecs + 1, 2), [str(v * per_vec) for v in range(0, vecs + 1, 2)], fontsize=7)
        ax.set_title(f"{lanes} lanes x {held} vector{'s' if held > 1 else ''} of 16 bytes "
                     f"({per_vec} elements); a warp holds {WARP // lanes} rows", fontsize=9, loc="left")
    axes[1].set_xlabel(f"element of a row of head_dim {head_dim} ({element_bytes}-byte elements); "
                       "Lk = lane k, sj = its j-th vector", fontsize=8)
    fig.tight_layout()
    return fig


def _bar(ax, y, start, length, label, color, hatch=None):
    ax.barh(y, length, left=start, height=0.6, color=color, edgecolor="black", hatch=hatch)
    ax.text(start + length / 2, y, label, ha="center", va="center", fontsize=7)


def programmatic_launch():
    """Kernel A then kernel B in one stream: a plain launch (B's blocks start once A has finished
    and the launch gap has passed) against a programmatic one (B's blocks become resident while A
    drains, warm the weights into L2, then wait in hardware for A's writes)."""
    plt = _plt()
    fig, axes = plt.subplots(2, 1, figsize=(10, 3.2), sharex=True)
    a_end, gap = 6.0, 1.5
    for ax, programmatic in zip(axes, (False, True)):
        _bar(ax, 2, 0, a_end - 1, "kernel A: blocks", "#9ecae1")
        _bar(ax, 2, a_end - 1, 1, "A's tail", "#c6dbef")
        if programmatic:
            _bar(ax, 1, a_end - 1, 0.6, "warm w", "#fdae6b")
            _bar(ax, 1, a_end - 0.4, 0.4, "wait", "#eeeeee", hatch="//")
            _bar(ax, 1, a_end, 3, "B: load rows, sum, write", "#a1d99b")
            ax.set_title("programmatic: B resident during A's tail; griddepcontrol.wait until A's writes are "
                         "visible; weights already in L2", fontsize=9, loc="left")
        else:
            _bar(ax, 1, a_end, gap, "launch gap", "#eeeeee", hatch="..")
            _bar(ax, 1, a_end + gap, 0.8, "load w", "#fdae6b")
            _bar(ax, 1, a_end + gap + 0.8, 3, "B: load rows, sum, write", "#a1d99b")
            ax.set_title("plain launch: B starts after A has finished, then waits a DRAM round trip for its "
                         "weights", fontsize=9, loc="left")
        ax.set_yticks([1, 2], ["B", "A"])
        ax.set_ylim(0.4, 2.6)
    axes[1].set_xlabel("time (schematic, not to scale)", fontsize=8)
    axes[1].set_xticks([])
    fig.tight_layout()
    return fig


def warm_ahead(waves: int = 3):
    """Waves of blocks over time: without warming, every block of a later wave starts with a DRAM
    round trip for its row; with it, each lane group of wave w, once its own loads are issued,
    warms into L2 the row one wave ahead, which the block of wave w + 1 then finds there."""
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(10, 2.8), sharey=True)
    dram, l2, work = 1.0, 0.35, 1.2
    for ax, warm in zip(axes, (False, True)):
        start = 0.0
        for w in range(waves):
            first = w == 0 or not warm
            wait = dram if first else l2
            _bar(ax, waves - w, start, wait, "DRAM" if first else "L2", "#fdae6b" if first else "#fee6ce")
            _bar(ax, waves - w, start + wait, work, "sum, write", "#a1d99b")
            if warm and w + 1 < waves:
                ax.annotate("", xy=(start + wait + work + 0.05, waves - w - 1), xytext=(start + wait + 0.1, waves - w - 0.3),
                            arrowprops=dict(arrowstyle="->", color="#e6550d"))
            start += wait + work
        ax.set_title(("warm the next wave: each group prefetches the row one wave ahead" if warm else
                      "no warming: every wave waits on DRAM"), fontsize=9, loc="left")
        ax.set_yticks(range(1, waves + 1), [f"wave {waves - i + 1}" for i in range(1, waves + 1)])
        ax.set_xlabel("time (schematic)", fontsize=8)
        ax.set_xticks([])
    fig.tight_layout()
    return fig


def grid_orders(tokens: int = 6, wave: int = 4):
    """A fused qkv tensor's token rows (q wide, k and v narrow) and the order in which the CTAs of
    three cross_head_norm grids take them, the first `wave` CTAs (those resident at once) shaded:
    one CTA per token, q row and k row together (rung 1); q and k on grid.y, every q row before the
    first k row (rungs 2-6); the token-major grid, a token's q CTA and k CTA side by side (the tuned
    kernel at many waves), so the rows in flight together are neighbours in memory."""
    plt = _plt()
    q_w, k_w = 4.0, 1.0  # widths, schematic (GQA: k and v narrower than q)
    fig, axes = plt.subplots(3, 1, figsize=(10, 4.2), sharex=True)
    titles = ("rung 1: grid.x = token; a CTA takes the token's q row and k row",
              "rungs 2-7: grid (tokens, 2); CTAs in grid order: every q row, then every k row",
              "tuned, many waves: grid.x = 2 x token + tensor; a token's two CTAs side by side")
    for ax, title, grid in zip(axes, titles, ("token", "by_tensor", "token_major")):
        for t in range(tokens):
            x0 = t * (q_w + 2 * k_w)
            for tensor, (start, width, name) in enumerate(((0, q_w, "q"), (q_w, k_w, "k"), (q_w + k_w, k_w, "v"))):
                if name == "v":
                    ax.add_patch(plt.Rectangle((x0 + start, 0), width * 0.97, 1, color="#eeeeee"))
                    ax.text(x0 + start + width / 2, 0.5, "v", ha="center", va="center", fontsize=7, color="#888888")
                    continue
                cta = {"token": t, "by_tensor": tensor * tokens + t, "token_major": 2 * t + tensor}[grid]
                color = "#9ecae1" if name == "q" else "#a1d99b"
                ax.add_patch(plt.Rectangle((x0 + start, 0), width * 0.97, 1, color=color, alpha=1.0 if cta < wave else 0.35))
                ax.text(x0 + start + width / 2, 0.5, f"{name}{t}\nCTA {cta}", ha="center", va="center", fontsize=7)
        ax.set_xlim(0, tokens * (q_w + 2 * k_w))
        ax.set_ylim(0, 1)
        ax.set_yticks([])
        ax.set_title(title + f" (dark: the first {wave} CTAs)", fontsize=9, loc="left")
    axes[-1].set_xticks([])
    axes[-1].set_xlabel("memory of the fused qkv tensor, token after token (schematic widths)", fontsize=8)
    fig.tight_layout()
    return fig


FIGURES = {"lane_group": lane_group, "programmatic_launch": programmatic_launch, "warm_ahead": warm_ahead,
           "grid_orders": grid_orders}


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    out = Path(args[0]) if args else Path(__file__).resolve().parents[1] / "docs" / "figures"
    out.mkdir(parents=True, exist_ok=True)
    import matplotlib

    matplotlib.use("Agg")  # files only
    plt = _plt()
    for name, draw in FIGURES.items():
        fig = draw()
        fig.savefig(out / f"{name}.png", dpi=110)
        plt.close(fig)
        print(out / f"{name}.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
