"""The command line as a newcomer meets it, on any machine (the GPU is faked where a path needs
one): usage named as invoked, the GPU benchmark's options refused by name where the CPU tour runs
instead, the collective benchmark saying what it needs, and results pages kept out of the
checkout's pages of record unless asked."""

from __future__ import annotations

import inspect
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cookbook import __main__ as cli
from cookbook import bench
from cookbook.bench import tp as bench_tp
from cookbook.bench.sweep import run as sweep_run

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def no_gpu(monkeypatch):
    """A machine without a CUDA GPU; the simulator flag main sets is restored after the test."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setenv("NUMBA_ENABLE_CUDASIM", "1")


@pytest.fixture
def one_gpu(monkeypatch):
    """A machine with one CUDA GPU, whose benchmark records what it was asked instead of timing."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    calls = []
    monkeypatch.setattr(bench, "run", lambda **kwargs: calls.append(kwargs) or [])
    return calls


# ---- usage: named as invoked ------------------------------------------------------------------
@pytest.mark.parametrize("argv0, prog", [
    ("/venv/bin/fused-norm-cookbook", "fused-norm-cookbook"),
    ("/venv/Scripts/fused-norm-cookbook.exe", "fused-norm-cookbook"),
    (str(ROOT / "cookbook" / "__main__.py"), "python -m cookbook"),
])
@pytest.mark.parametrize("argv, usage", [(["--help"], "usage: {prog} "), (["bench", "--help"], "usage: {prog} bench ")])
def test_usage_names_the_command_as_invoked(monkeypatch, capsys, argv0, prog, argv, usage):
    monkeypatch.setattr(sys, "argv", [argv0])
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    assert exit_.value.code == 0
    assert capsys.readouterr().out.startswith(usage.format(prog=prog))


@pytest.mark.skipif(shutil.which("fused-norm-cookbook") is None, reason="the console script is not installed")
def test_the_console_script_says_its_own_name():
    run = subprocess.run(["fused-norm-cookbook", "--help"], capture_output=True, text=True, cwd=ROOT,
                         env={"PATH": str(Path(sys.executable).parent), "PYTHONPATH": str(ROOT)})
    assert run.returncode == 0 and run.stdout.startswith("usage: fused-norm-cookbook "), run.stdout + run.stderr


# ---- bench without a GPU: the tour, with the options it can honour -------------------------------
@pytest.mark.parametrize("option", [["--shapes", "quick"], ["--out", "somewhere"], ["--profile"],
                                    ["--results-dir", "docs/results"], ["--no-results"], ["--impls", "tuned"],
                                    ["--tag", "peers"]], ids=lambda o: o[0])
def test_gpu_options_are_refused_by_name_without_a_gpu(no_gpu, capsys, option):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["bench", "--ops", "qk_norm", *option])
    assert exit_.value.code == 2
    said = capsys.readouterr().err
    assert f"{option[0]}: the GPU benchmark's option" in said and "runs the CPU tour instead" in said, said
    assert "--ops, --dtype, --nproc" in said, said


def test_dtype_and_nproc_are_honoured_by_the_tour(no_gpu, monkeypatch, capsys):
    asked = {}
    monkeypatch.setattr(bench, "tour", lambda ops, dtypes: asked.update(ops=ops, dtypes=dtypes) or [])
    monkeypatch.setattr(bench_tp, "launch_tour", lambda nproc, dtype: asked.update(nproc=nproc, tp_dtype=dtype) or 0)
    assert cli.main(["bench", "--ops", "qk_norm", "tp_qk_norm", "--dtype", "float16", "--nproc", "3"]) == 0
    assert asked == dict(ops=["qk_norm"], dtypes=(torch.float16,), nproc=3, tp_dtype="float16")
    assert "running the CPU tour" in capsys.readouterr().out
    asked.clear()
    assert cli.main(["tour", "--ops", "qk_norm"]) == 0  # without them: the tour's own dtypes
    assert asked == dict(ops=["qk_norm"], dtypes=bench.TOUR_DTYPES)


# ---- the collective benchmark: what it needs, and a status that says it did not run --------------
def test_the_tp_benchmark_without_gpus_says_what_it_needs_and_fails(no_gpu, capsys):
    status = bench_tp.main([])  # python -m cookbook.bench.tp, on a CPU
    said = capsys.readouterr()
    assert status == bench_tp.CANNOT_RUN_HERE != 0
    for needed in ("2 or more CUDA GPUs", "torchrun", "--nproc N", "no CUDA GPU is visible",
                   "python -m cookbook.bench.tp --tour"):
        assert needed in said.err, said.err
    assert "skipped" not in said.out + said.err


def test_the_tp_benchmark_asked_for_on_one_gpu_fails_and_is_skipped_in_a_full_sweep(one_gpu, capsys):
    assert cli.main(["bench", "--ops", "tp_qk_norm"]) == bench_tp.CANNOT_RUN_HERE
    assert "1 CUDA GPU visible" in capsys.readouterr().err
    assert cli.main(["bench", "--nproc", "4"]) == bench_tp.CANNOT_RUN_HERE  # its ranks asked for
    assert "--nproc 4 asked for" in capsys.readouterr().err
    assert cli.main(["bench"]) == 0  # every op: tp_qk_norm is skipped, the others run
    said = capsys.readouterr().out
    assert "tp_qk_norm: skipped" in said and "2 or more CUDA GPUs" in said
    assert one_gpu and "tp_qk_norm" not in one_gpu[-1]["ops"]


# ---- results pages: out of docs/results unless asked ---------------------------------------------
def test_results_pages_go_under_the_output_directory_by_default(one_gpu):
    assert cli.parser().parse_args(["bench"]).results_dir is None
    assert bench_tp.arguments().parse_args([]).results_dir is None
    assert inspect.signature(sweep_run).parameters["results_dir"].default is None
    assert bench.resolve_results_dir(bench.DEFAULT_OUT) == Path("bench_out", "pages")
    assert bench.resolve_results_dir("o", "docs/results") == Path("docs/results")
    assert cli.main(["bench", "--ops", "qk_norm"]) == 0
    run = one_gpu[-1]
    pages = bench.resolve_results_dir(run["out"], run["results_dir"]).resolve()
    assert not pages.is_relative_to((ROOT / bench.PAGES_OF_RECORD).resolve()), pages
    assert cli.main(["bench", "--ops", "qk_norm", "--results-dir", "docs/results"]) == 0
    assert one_gpu[-1]["results_dir"] == "docs/results"


def test_the_end_of_a_run_says_where_the_pages_went(tmp_path):
    assert "unchanged: write those with --results-dir docs/results" in bench.pages_note(tmp_path)
    assert "are the pages of record" in bench.pages_note(ROOT / bench.PAGES_OF_RECORD)


def test_the_gpu_scripts_write_pages_of_record_where_they_did():
    """Each benchmark run in tools/*.sh names its results directory: the default moved out of
    docs/results, so a script that relied on it would stop updating the pages of record."""
    lines = [line for script in sorted((ROOT / "tools").glob("*.sh"))
             for line in script.read_text().replace("\\\n", " ").splitlines()]  # continued lines joined
    runs = [line for line in lines if re.search(r"-m cookbook(\.bench\.tp)?(\s|$)", line)
            and not re.search(r"--propose-dispatch|--tour|-m cookbook tour", line)]
    assert runs, "no benchmark run found in tools/*.sh"
    for line in runs:
        assert "--results-dir" in line, f"names no --results-dir: {line.strip()}"
    assert any("--results-dir docs/results" in line for line in runs)
