"""One benchmark harness for every op: side-by-side profiling on a GPU, and a CPU tour.

* `cookbook.bench.sweep` (``run``, ``python -m cookbook bench``): on a GPU, every registered
  implementation of every op at every bench shape: agreement first, then CUDA-graph replay over
  rotating input sets, GB/s and percent of a device-to-device copy timed in the same run;
* `cookbook.bench.timing`: the timing core (rotating sets, graph replay, the copy ceiling);
* `cookbook.bench.tables`: markdown tables and plots of result rows;
* `cookbook.bench.pages`: metadata (GPU, date, commit, command, build seconds) and the docs'
  results pages;
* `cookbook.bench.peers`: the peers of other packages (SGLang, FlashInfer, Liger): their verdicts
  (which rounding order, or why not applicable) and the side-by-side table against our tuned kernel;
* `cookbook.bench.tour` (``tour``, ``python -m cookbook tour``): the CPU tour under Numba's
  CUDA simulator;
* `cookbook.bench.tp`: the collective op's benchmark, one process per GPU under torchrun.

Importing this package imports neither Numba nor the CUDA kernels; both load on first use, so
the simulator can still be switched on after importing it.
"""

from cookbook.bench.common import (AGREEMENT_SEED, BENCH_ROUNDING, BYTES_PER_GB, COMPILED, DEFAULT_DTYPE, DEFAULT_OUT,
                                   DEVICE, DTYPES, EAGER, EPS, GB_PER_TB, MIB, PAGES_OF_RECORD, REPO_ROOT, ROUNDINGS,
                                   SHAPE_CHOICES, TOUR_DTYPES, TOUR_SEED, US_PER_MS, WEIGHT_OFFSET, call_by_name,
                                   checked, compare, dtype_name, error_text, expected_outputs, positional,
                                   resolve_dtype, resolve_ops, resolve_results_dir, run_and_compare, select_shapes,
                                   split_available)
from cookbook.bench.pages import (ROW_FIELDS, RecordedSweep, git_commit, gpu_slug, metadata, pages_note,
                                  recorded_sweeps, results_stem, write_outputs, write_results_page)
from cookbook.bench.sweep import (Progress, ShapeCase, add_speedups, bench_impl, bench_shape, fresh_callable,
                                  prepare_shape, run)
from cookbook.bench.tables import (LEVEL_MARKERS, MAX_CELL_CHARS, PLOTS, bench_table, draw_lines, largest_family,
                                   line_label, line_style, markdown_table, plot_op, tour_table)
from cookbook.bench.timing import (COPY_BYTES, HIGH_PERCENTILE, L2_FLUSH_FACTOR, LOW_PERCENTILE, MAX_CALLS_PER_REPLAY,
                                   MAX_INPUT_SETS, MIN_INPUT_SETS, TARGET_REPLAY_US, TIMED_REPLAYS, WARMUP_REPLAYS,
                                   Timing, calls_per_replay, capture, copy_bandwidth_gb_per_s, device_copy, l2_bytes,
                                   launch_calls, measure, percentile, replayer, time_replays, warm_up,
                                   rotating_set_count, storage_bytes, summarize)
from cookbook.bench.tour import gpu_would_add, request_simulator, tour

__all__ = [name for name in dir() if not name.startswith("_")]
