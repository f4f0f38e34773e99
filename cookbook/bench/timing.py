"""Timing on a GPU: rotating input sets, CUDA-graph replay, the copy ceiling.

1. **Rotating input sets.** N copies of the inputs that together move at least
   ``L2_FLUSH_FACTOR`` times the L2 cache per pass, so no call finds its inputs still in L2 from
   the previous call on the same set.
2. **CUDA-graph replay.** K calls cycling through the N sets are captured once in a CUDA graph
   and replayed; each replay is timed with CUDA events and per-call time = replay time / K
   (median, p20, p80). Python launch overhead vanishes, as in an engine that replays graphs. An
   implementation that cannot be captured is timed as a plain loop of K launches instead
   (``method: "loop"``): that time includes its launch overhead.
3. **The copy ceiling, in the same run.** A device-to-device copy of ``COPY_BYTES``, timed the
   same way: every row reports GB/s from the contract's bytes model and percent of that copy.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import statistics

import torch

from cookbook.bench.common import BYTES_PER_GB, DEVICE, MIB, US_PER_MS, error_text

# Rotating input sets: one pass over them moves L2_FLUSH_FACTOR x the L2 cache, so by the time a
# set comes round again its lines have been evicted. At least MIN_INPUT_SETS (a set is never
# reused back to back), at most MAX_INPUT_SETS (tiny shapes would want thousands, and a graph per
# set pass that large only slows capture), and never more than MEMORY_FRACTION of free memory.
L2_FLUSH_FACTOR = 4

MIN_INPUT_SETS = 2
MAX_INPUT_SETS = 64
MEMORY_FRACTION = 0.25

FALLBACK_L2_BYTES = 64 << 20  # larger than any current GPU's L2, if torch cannot tell us

# Timing. Warm-up calls run on a side stream before capture (lazy initialization and compiles
# must not happen inside a graph). One replay runs at least TARGET_REPLAY_US where the calls
# allow it (event resolution is about 0.5 us; launch gaps between replays amortize), capped at
# MAX_CALLS_PER_REPLAY calls per graph.
WARMUP_CALLS = 3
ESTIMATE_REPLAYS = 3
WARMUP_REPLAYS = 10
TIMED_REPLAYS = 30
TARGET_REPLAY_US = 200.0
MAX_CALLS_PER_REPLAY = 1024

LOW_PERCENTILE, HIGH_PERCENTILE = 20, 80

# The copy ceiling: COPY_BYTES read and COPY_BYTES written per call, far beyond any L2.
COPY_BYTES = 256 * MIB


def percentile(values, q: float) -> float:
    """The q-th percentile (0..100) of `values`, interpolating linearly between neighbours."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    below = math.floor(position)
    above = min(below + 1, len(ordered) - 1)
    return ordered[below] + (ordered[above] - ordered[below]) * (position - below)


def summarize(per_call_us) -> dict:
    """Median and the p20..p80 spread of per-call times (microseconds)."""
    return {
        "median_us": percentile(per_call_us, 50),
        "p20_us": percentile(per_call_us, LOW_PERCENTILE),
        "p80_us": percentile(per_call_us, HIGH_PERCENTILE),
    }


def rotating_set_count(bytes_per_call: int, bytes_per_set: int, l2_bytes: int, memory_budget: int) -> int:
    """How many input sets to rotate through (see the constants above); at least 1."""
    wanted = math.ceil(L2_FLUSH_FACTOR * l2_bytes / max(bytes_per_call, 1))
    count = min(max(wanted, MIN_INPUT_SETS), MAX_INPUT_SETS)
    fits = memory_budget // max(bytes_per_set, 1)
    return max(1, min(count, fits))


def calls_per_replay(input_sets: int, call_us: float) -> int:
    """K: whole passes over the input sets, enough for one replay to run TARGET_REPLAY_US."""
    most_passes = max(1, MAX_CALLS_PER_REPLAY // input_sets)
    pass_us = call_us * input_sets
    passes = most_passes if pass_us <= 0 else min(math.ceil(TARGET_REPLAY_US / pass_us), most_passes)
    return input_sets * max(passes, 1)


@dataclasses.dataclass
class Timing:
    method: str  # "graph": CUDA-graph replay; "loop": launched from Python (capture failed)
    calls_per_replay: int
    per_call_us: list[float]
    note: str = ""  # why the graph was not used


def launch_calls(fn, arg_sets, calls: int) -> None:
    """`calls` calls of `fn`, cycling through the input sets."""
    for i in range(calls):
        fn(*arg_sets[i % len(arg_sets)])


def warm_up(fn, arg_sets) -> None:
    """Run a few calls on a side stream before capture, as torch's CUDA-graph docs prescribe:
    first-call work (compiles, module loads, workspace allocations) must not land in a graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        launch_calls(fn, arg_sets, WARMUP_CALLS)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()


def capture(fn, arg_sets, calls: int):
    """(a CUDA graph of `calls` calls, "") or (None, why capture failed)."""
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):  # captures on torch's own side stream
            launch_calls(fn, arg_sets, calls)
    except Exception as error:  # e.g. a launch path that is not capture-safe
        torch.cuda.synchronize()  # raises if the failed capture broke the context: not recoverable
        return None, error_text(error)
    return graph, ""


def replayer(fn, arg_sets, calls: int, why_not_graph: str = ""):
    """(a zero-argument replay of `calls` calls, why it is a launch loop: "" for a graph)."""
    if not why_not_graph:
        graph, why_not_graph = capture(fn, arg_sets, calls)
        if graph is not None:
            return graph.replay, ""
    return functools.partial(launch_calls, fn, arg_sets, calls), why_not_graph


def time_replays(replay, count: int) -> list[float]:
    """Microseconds of GPU time of each of `count` back-to-back replays (CUDA events)."""
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(count)]
    for start, end in events:
        start.record()
        replay()
        end.record()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) * US_PER_MS for start, end in events]


def measure(fn, arg_sets, trace_path=None) -> Timing:
    """Per-call times of `fn` over the rotating `arg_sets` (see the module docstring)."""
    warm_up(fn, arg_sets)
    sets = len(arg_sets)
    replay, why_loop = replayer(fn, arg_sets, sets)  # one pass over the sets: an estimate
    call_us = statistics.median(time_replays(replay, ESTIMATE_REPLAYS)) / sets
    calls = calls_per_replay(sets, call_us)
    if calls != sets:
        del replay  # free the estimate's graph before capturing the longer one
        replay, why_loop = replayer(fn, arg_sets, calls, why_loop)
    time_replays(replay, WARMUP_REPLAYS)
    per_replay_us = time_replays(replay, TIMED_REPLAYS)
    if trace_path is not None:
        write_trace(replay, trace_path)
    return Timing("loop" if why_loop else "graph", calls, [us / calls for us in per_replay_us], why_loop)


def write_trace(replay, path) -> None:
    """A chrome trace (chrome://tracing, ui.perfetto.dev) of one replay."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        replay()
        torch.cuda.synchronize()
    prof.export_chrome_trace(str(path))


def device_copy(dst, src) -> None:
    dst.copy_(src)


def copy_bandwidth_gb_per_s() -> float:
    """GB/s of a COPY_BYTES device-to-device copy (bytes read plus written), timed like a kernel."""
    src = torch.ones(COPY_BYTES, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    timing = measure(device_copy, [(dst, src)])
    median_us = summarize(timing.per_call_us)["median_us"]
    return 2 * COPY_BYTES / (median_us * 1e-6) / BYTES_PER_GB


def l2_bytes() -> int:
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return getattr(props, "L2_cache_size", 0) or FALLBACK_L2_BYTES


def storage_bytes(inputs: dict) -> int:
    """Device memory one input set holds (views into one fused qkv tensor count it once)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in inputs.values() if isinstance(t, torch.Tensor)}  # fmt: skip
    return sum(storages.values())
