"""The benchmark harness on a CPU: the simulator tour on one tiny shape, and the pure helpers the
GPU path relies on (percentiles, GPU names, rotating-set and replay sizing)."""

import json

import pytest
import torch

from cookbook import bench, registry
from cookbook.ops import qk_norm as qk_norm_contract
from cookbook.ops import tp_qk_norm as tp_contract
from cookbook.registry import Impl

cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="the tour is the CPU path")
TINY = {"qk_norm": [(1, 2, 1, 32)]}


def quiet(*_):
    pass


@cpu_only
def test_tour_runs_every_cpu_implementation_and_they_agree():
    rows = bench.tour(ops=["qk_norm"], shapes=TINY, dtypes=(torch.bfloat16,), echo=quiet)
    assert rows and all(row["agrees"] for row in rows), [row["agreement"] for row in rows if not row["agrees"]]
    ran = {row["impl"] for row in rows}
    expected = {impl.name for impl in registry.implementations("qk_norm") if impl.unavailable("cpu") is None}
    assert ran == expected and "reference" in ran
    assert {row["rounding"] for row in rows} == set(bench.ROUNDINGS)


def _forgets_the_weight(q, k, q_weight, k_weight, eps, weight_offset, rounding):
    """A deliberately wrong implementation: normalizes but never scales by the weight."""
    ones = torch.ones_like(q_weight)
    qk_norm_contract.reference(q, k, ones, ones, eps, weight_offset, rounding)


@cpu_only
def test_tour_reports_a_wrong_implementation(monkeypatch):
    monkeypatch.setattr(qk_norm_contract, "_forgets_the_weight", _forgets_the_weight, raising=False)
    wrong = Impl("qk_norm", "forgets_the_weight", "reference", 0, "cookbook.ops.qk_norm:_forgets_the_weight", "wrong")
    monkeypatch.setitem(registry.IMPLEMENTATIONS, "qk_norm", [registry.get("qk_norm", "reference"), wrong])
    rows = bench.tour(ops=["qk_norm"], shapes=TINY, dtypes=(torch.bfloat16,), echo=quiet)
    verdicts = {(row["impl"], row["rounding"]): row["agrees"] for row in rows}
    assert verdicts == {
        ("reference", "fused"): True, ("reference", "hf"): True,
        ("forgets_the_weight", "fused"): False, ("forgets_the_weight", "hf"): False,
    }  # fmt: skip
    assert all("ulp" in row["agreement"] for row in rows if not row["agrees"])


@cpu_only
def test_the_command_without_a_gpu_runs_the_tour(monkeypatch, capsys):
    from cookbook.__main__ import main

    monkeypatch.setenv("NUMBA_ENABLE_CUDASIM", "1")  # main sets it; restored after the test
    monkeypatch.setattr(qk_norm_contract, "SIM_SHAPES", TINY["qk_norm"])
    assert main(["--ops", "qk_norm"]) == 0  # no sub-command: bench, which falls back to the tour
    printed = capsys.readouterr().out
    assert "CPU tour" in printed and "runs agree with the contract." in printed and "FAILURES" not in printed
    assert "On a CUDA GPU" in printed  # what a GPU run would add


def test_percentile_interpolates_between_neighbours():
    values = [5.0, 1.0, 4.0, 2.0, 3.0]
    assert bench.percentile(values, 0) == 1.0
    assert bench.percentile(values, 50) == 3.0
    assert bench.percentile(values, 100) == 5.0
    assert bench.percentile(values, 25) == 2.0
    assert bench.percentile([0.0, 10.0], 20) == pytest.approx(2.0)
    assert bench.percentile([7.0], 80) == 7.0
    with pytest.raises(ValueError):
        bench.percentile([], 50)


def test_summarize_names_median_and_spread():
    stats = bench.summarize([float(v) for v in range(11)])
    assert stats == {"median_us": 5.0, "p20_us": 2.0, "p80_us": 8.0}


@pytest.mark.parametrize(
    "name, slug",
    [
        ("NVIDIA H100 80GB HBM3", "h100"),
        ("NVIDIA H200", "h200"),
        ("NVIDIA H100 PCIe", "h100"),
        ("NVIDIA A100-SXM4-80GB", "a100"),
        ("NVIDIA GeForce RTX 4090", "rtx4090"),
        ("Tesla T4", "t4"),
        ("", "gpu"),
    ],
)
def test_gpu_slug(name, slug):
    assert bench.gpu_slug(name) == slug


MB = 1_000_000
L2 = 50 * MB
PLENTY = 1 << 40


def test_rotating_sets_move_several_l2_per_pass():
    count = bench.rotating_set_count(37 * MB, 20 * MB, L2, PLENTY)
    assert count * 37 * MB >= bench.L2_FLUSH_FACTOR * L2
    assert (count - 1) * 37 * MB < bench.L2_FLUSH_FACTOR * L2


def test_rotating_sets_are_bounded():
    assert bench.rotating_set_count(1000 * MB, 500 * MB, L2, PLENTY) == bench.MIN_INPUT_SETS
    assert bench.rotating_set_count(10_000, 5_000, L2, PLENTY) == bench.MAX_INPUT_SETS
    assert bench.rotating_set_count(10_000, 5_000, L2, 3 * 5_000) == 3  # memory budget
    assert bench.rotating_set_count(10_000, 5_000, L2, 10) == 1  # never zero


def test_calls_per_replay_is_whole_passes_of_the_target_length():
    sets = 64
    calls = bench.calls_per_replay(sets, call_us=2.0)
    assert calls % sets == 0 and calls * 2.0 >= bench.TARGET_REPLAY_US
    assert (calls - sets) * 2.0 < bench.TARGET_REPLAY_US
    assert bench.calls_per_replay(2, call_us=150.0) == 2  # one pass is long enough
    assert bench.calls_per_replay(64, call_us=0.0) <= bench.MAX_CALLS_PER_REPLAY
    assert bench.calls_per_replay(1, call_us=0.0) == bench.MAX_CALLS_PER_REPLAY


def test_select_shapes():
    shapes = list(range(10))
    assert bench.select_shapes(shapes, "full") == shapes
    assert bench.select_shapes(shapes, "quick") == [0, 5, 9]
    assert bench.select_shapes([7], "quick") == [7]
    with pytest.raises(ValueError):
        bench.select_shapes(shapes, "medium")


def _row(impl, shape, median_us):
    return dict(dict.fromkeys(bench.ROW_FIELDS), op="qk_norm", impl=impl, shape=list(shape), median_us=median_us)


def test_speedups_are_baseline_over_row():
    rows = [_row("reference", (8, 4, 1, 64), 30.0), _row("torch_compile", (8, 4, 1, 64), 6.0),
            _row("cuda_v3", (8, 4, 1, 64), 3.0), _row("numba_v1", (8, 4, 1, 64), None)]  # fmt: skip
    bench.add_speedups(rows)
    assert rows[2]["x_vs_eager"] == pytest.approx(10.0) and rows[2]["x_vs_compile"] == pytest.approx(2.0)
    assert rows[3]["x_vs_eager"] is None  # not timed (disagreed or failed)


def test_largest_family_groups_shapes_by_everything_but_tokens():
    rows = [_row("cuda_v3", shape, 1.0) for shape in [(1, 64, 8, 128), (16, 64, 8, 128), (8192, 8, 1, 128)]]
    assert [row["shape"][0] for row in bench.largest_family(rows)] == [1, 16]


def test_recorded_sweeps_are_the_ops_own_pages(tmp_path):
    meta = {"gpu": "NVIDIA H200", "date": "2026-11-24T22:30:10+00:00", "commit": "0c1e3e2"}
    for stem, op in (("qk_norm_h200", "qk_norm"), ("qk_norm_h100", "qk_norm"), ("qk_norm_rope_h200", "qk_norm_rope"),
                     ("qk_norm_h200_experiment", "qk_norm")):
        (tmp_path / f"{stem}.json").write_text(json.dumps({"metadata": meta, "rows": [{"op": op}]}))
        (tmp_path / f"{stem}.md").write_text(stem)
    found = bench.recorded_sweeps("qk_norm", tmp_path)  # not qk_norm_rope's page, nor an experiment's
    assert [s.page.name for s in found] == ["qk_norm_h100.md", "qk_norm_h200.md"]
    assert found[0].rows == [{"op": "qk_norm"}]
    assert found[0].title == "NVIDIA H200, sweep recorded 2026-11-24 at 0c1e3e2"
    assert [s.page.name for s in bench.recorded_sweeps("qk_norm", tmp_path, "h200")] == ["qk_norm_h200.md"]
    assert bench.recorded_sweeps("qk_norm", tmp_path, "rtx4090") == []
    assert [s.page.name for s in bench.recorded_sweeps("qk_norm_rope", tmp_path)] == ["qk_norm_rope_h200.md"]


def test_markdown_table_pads_columns():
    table = bench.markdown_table(["a", "bb"], [["xyz", 1]]).splitlines()
    assert table == ["| a   | bb |", "|-----|----|", "| xyz | 1  |"]


@cpu_only
@pytest.mark.skipif(not torch.distributed.is_gloo_available(), reason="gloo is not available")
def test_the_collective_tour_runs_on_two_gloo_ranks():
    """`python -m cookbook.bench.tp --tour` (what `python -m cookbook` runs on a CPU for tp_qk_norm):
    torchrun starts two gloo ranks, every CPU implementation agrees on every rank, exit status 0."""
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-m", "cookbook.bench.tp", "--tour"], cwd=bench.REPO_ROOT,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    expected = len(tp_contract.SIM_SHAPES) * len(bench.TOUR_DTYPES) * len(bench.ROUNDINGS) * len(
        [impl for impl in registry.implementations("tp_qk_norm") if impl.unavailable("cpu") is None])
    assert f"{expected} of {expected} runs agree on every rank." in run.stdout, run.stdout[-3000:]


def test_the_collective_bench_rejects_an_unknown_row(capsys):
    from cookbook.bench import tp as bench_tp

    with pytest.raises(SystemExit) as exit_info:
        bench_tp.main(["--impls", "cuda_v1,cuda_v99"])
    assert exit_info.value.code == 2
    assert "--impls: unknown row(s) ['cuda_v99']" in capsys.readouterr().err


def test_copy_by_shape_copies_half_the_bytes_in_whole_blocks():
    from cookbook.copy_by_shape import BLOCK_BYTES, copy_bytes_for

    assert copy_bytes_for(2 * 10 * BLOCK_BYTES) == 10 * BLOCK_BYTES
    assert copy_bytes_for(2 * 10 * BLOCK_BYTES + 2 * BLOCK_BYTES - 2) == 10 * BLOCK_BYTES  # rounded down
    assert copy_bytes_for(100) == BLOCK_BYTES  # never an empty copy


def test_copy_by_shape_page_names_gpu_commit_command_and_rows():
    from cookbook.copy_by_shape import page

    meta = dict(gpu="Some GPU", sm_count=1, torch="t", cuda="c", date="d", commit="abc1234",
                command="python -m cookbook.copy_by_shape", copy_bytes=256 << 20, copy_tb_per_s=4.2, timing="graph")
    row = dict(op="qk_norm", label="T=1 Hq=8 Hk=1 D=128", bytes_moved=4_000_000, copy_us=1.5, gb_per_s=2000.0,
               pct_of_reference=47.6, exact_us=2.5)
    text = page([row], meta)
    for fragment in ("Some GPU", "abc1234", "python -m cookbook.copy_by_shape", "T=1 Hq=8 Hk=1 D=128", "48 %", "4.00"):
        assert fragment in text


def test_copy_by_shape_without_a_gpu_says_so(capsys, monkeypatch):
    from cookbook import copy_by_shape

    # As on a machine without a GPU, wherever this runs (on a GPU it would time, and write a page
    # into docs/results/).
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert copy_by_shape.main([]) == 0
    assert "needs a CUDA GPU" in capsys.readouterr().out


def test_a_partial_sweep_names_what_it_times_and_writes_beside_the_full_one():
    from cookbook.bench import sweep

    names = [impl.name for impl in sweep.select_impls("qk_norm", ["fastest", "peer"])]
    assert "cuda_tuned" in names and "torch_compile" in names and "cuda_v3" not in names
    assert [impl.name for impl in sweep.select_impls("qk_norm", ["cuda_v3"])] == ["cuda_v3"]
    meta = {"gpu_slug": "h200", "dtype": "bfloat16"}
    assert bench.results_stem("qk_norm", meta) == "qk_norm_h200"
    assert bench.results_stem("qk_norm", dict(meta, tag="peers")) == "qk_norm_h200_peers"


def test_sglang_tp_peer_says_why_it_cannot_run():
    """SGLang's fused TP kernel (a row of the TP benchmark): the calls its wrapper and template
    refuse are named, and without SGLang installed the row's reason says so."""
    import torch

    from cookbook.peers import guard, sglang_tp

    bf16 = torch.bfloat16
    assert sglang_tp.why_not(bf16, 4, 1536, 256, bf16) is None  # MiniMax-M2 at TP=4
    assert sglang_tp.why_not(bf16, 2, 3072, 512, bf16) is None
    assert "float16 and bfloat16 only" in sglang_tp.why_not(torch.float32, 2, 3072, 512, torch.float32)
    assert "weights of the activations' dtype" in sglang_tp.why_not(bf16, 2, 3072, 512, torch.float32)
    assert "power-of-two world" in sglang_tp.why_not(bf16, 3, 2048, 512, bf16)
    assert "whole warps" in sglang_tp.why_not(bf16, 2, 3072 + 8, 512, bf16)
    assert "1024 vectors" in sglang_tp.why_not(bf16, 2, 8192, 1024, bf16)
    if guard.installed_version("sglang") is None:
        assert "sglang" in sglang_tp.package().lower()


def test_the_tp_page_compares_with_sglang_timed_in_the_same_run():
    from cookbook.bench import tp as bench_tp

    def row(impl, us, error=""):
        return dict(label="T=1 q=6144 k=1024 (shard 1536/256)", impl=impl, median_us=us, error=error)

    latest = bench_tp.registry.fastest(bench_tp.OP).name  # the tuned kernel
    text = bench_tp.sglang_comparison([row(bench_tp.SGLANG_TP, 2.0), row(latest, 2.5), row("cuda_v6", 3.0)])
    assert "Against SGLang's fused TP kernel" in text and "| 2.00 " in text and "| 1.25 " in text
    missing = bench_tp.sglang_comparison([row(bench_tp.SGLANG_TP, None, "PeerUnavailable: sglang is not installed"),
                                          row(latest, 2.5)])
    assert "not timed in this run: PeerUnavailable: sglang is not installed" in missing
    assert bench_tp.sglang_comparison([row(latest, 2.5)]) == ""


def test_compare_pages_name_no_machines_folders(monkeypatch):
    """tools/compare_tuned.py writes its command into the page: the old kernels, wherever they were
    extracted, as OLD/kernels_cuda, and a path inside the checkout relative to it."""
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location("compare_tuned", bench.REPO_ROOT / "tools" / "compare_tuned.py")
    compare = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, compare)  # its dataclasses look their module up
    spec.loader.exec_module(compare)
    results = str(bench.REPO_ROOT / "docs" / "results")
    shown = compare.page_command(["--old-kernels", "/tmp/x/kernels_cuda", "--old-commit", "abc", "--results-dir", results])
    assert shown == ("python tools/compare_tuned.py --old-kernels OLD/kernels_cuda --old-commit abc "
                     "--results-dir docs/results")
    assert "/tmp" not in compare.page_command(["--old-kernels=/tmp/x/kernels_cuda", "--old-commit", "abc"])
