"""The notebooks' shared helpers (cookbook/walkthrough.py): excerpts, rung diffs, recorded rows,
agreement tables and setup, on the CPU in seconds."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from cookbook import registry, walkthrough

ROOT = Path(__file__).resolve().parents[1]
TUNED = "kernels_cuda/qk_norm/tuned.cuh"


# ---- excerpts ----------------------------------------------------------------------------------
def test_an_excerpt_runs_from_its_start_marker_to_before_its_end_marker():
    text = walkthrough.excerpt_text(TUNED, "// ---- the launcher (host)", "// Calls launch.template").splitlines()
    assert text[0].startswith(f"{TUNED}, lines ")
    assert text[1].startswith("// ---- the launcher (host)")
    assert any("inline Call call_of" in line for line in text)
    assert not any("// Calls launch.template" in line for line in text)


def test_an_excerpt_is_cut_to_max_lines_and_says_what_it_left_out():
    text = walkthrough.excerpt_text(TUNED, "#pragma once", max_lines=10).splitlines()  # the file goes on
    assert len(text) <= 10 and len(text) >= 8  # a blank line at the cut is dropped
    assert text[-1].startswith("... (") and "more lines to line" in text[-1]


def test_an_excerpt_can_start_at_the_last_occurrence():
    policy, mark = "kernels_cuda/tp_qk_norm/policy.h", "case KernelName::kLean:"
    lines = (ROOT / policy).read_text().splitlines()
    marks = [i + 1 for i, line in enumerate(lines) if mark in line]
    assert len(marks) >= 2, "each of the policy's name tables has a case for the lean kernel"
    text = walkthrough.excerpt_text(policy, mark, occurrence=-1, max_lines=5)
    assert f"lines {marks[-1]}-" in text.splitlines()[0]


def test_a_missing_marker_is_an_error_naming_the_file_and_the_marker():
    with pytest.raises(ValueError, match=r"tuned\.cuh.*no such marker"):
        walkthrough.excerpt_text(TUNED, "no such marker")
    with pytest.raises(ValueError, match="no such end"):
        walkthrough.excerpt_text(TUNED, "#pragma once", "no such end")


@pytest.mark.parametrize("op, name", [("qk_norm", "cuda_v1"), ("qk_norm", "cuda_tuned"), ("cross_head_norm", "cuda_v2")])
def test_show_kernel_prints_one_kernel_function(op, name):
    text = walkthrough.kernel_text(op, name, max_lines=1000).splitlines()
    body = text[1:]
    assert body[0].startswith("template") and any("__global__" in line for line in body[:3])
    assert body[-1] == "}"
    code = "\n".join(line.split("//")[0] for line in body)
    assert code.count("{") == code.count("}")


def test_a_version_without_its_own_kernel_is_an_error():
    with pytest.raises(ValueError, match="tp_qk_norm_v3_kernel"):
        walkthrough.kernel_text("tp_qk_norm", "cuda_v3")  # rung 3 switches on features of tiles.cuh's kernels


# ---- the ladder's diffs ------------------------------------------------------------------------
RUNGS = [impl.version for impl in registry.implementations("qk_norm", ("cuda",))][1:]


@pytest.mark.parametrize("n", RUNGS)
def test_a_rung_diff_opens_with_the_two_leads(n):
    diff = walkthrough.rung_diff("qk_norm", n)
    before, after = (registry.get("qk_norm", f"cuda_v{v}").lead for v in (n - 1, n))
    assert diff[0] == f"--- {walkthrough.rung_files('qk_norm', n)[0].as_posix()}"
    assert f"-// v{n - 1}: {before}" in diff and f"+// v{n}: {after}" in diff


@pytest.mark.parametrize("n", RUNGS)
def test_diff_pages_hold_the_whole_diff_in_short_pages(n):
    diff = walkthrough.rung_diff("qk_norm", n)
    pages = walkthrough.diff_pages(diff)
    assert all(len(page) <= walkthrough.DIFF_PAGE_LINES for page in pages)
    assert all(page[:2] == diff[:2] for page in pages)
    assert [line for page in pages for line in page[2:] if line != walkthrough.CONTINUED] == diff[2:]


def test_a_hunk_longer_than_a_page_is_split():
    diff = ["--- a", "+++ b", "@@ -1 +1 @@", *[f"+{i}" for i in range(30)], "@@ -9 +9 @@", "-x"]
    pages = walkthrough.diff_pages(diff, max_lines=12)
    assert all(len(page) <= 12 for page in pages) and len(pages) == 4
    assert all(page[2] == walkthrough.CONTINUED for page in pages[1:])
    assert [line for page in pages for line in page[2:] if line != walkthrough.CONTINUED] == diff[2:]


def test_rung_1_has_no_diff():
    with pytest.raises(ValueError, match="no rungs 0 and 1"):
        walkthrough.rung_diff("qk_norm", 1)


# ---- recorded rows and effects -----------------------------------------------------------------
def _row(impl, level, shape=(1, 64, 8, 128), median_us=2.0, pct=10.0):
    return dict(impl=impl, level=level, shape=list(shape), label="x".join(map(str, shape)), dtype="bfloat16",
                median_us=median_us, pct_of_copy=pct, error=None, agreement="ok")


def test_a_sweep_with_names_the_registry_no_longer_lists_loses_its_compiled_rows():
    rows = [_row("reference", "reference"), _row("cuda_v1", "cuda"), _row("cuda_v14", "cuda")]
    kept, left_out = walkthrough.current_rows("qk_norm", rows)
    assert [r["impl"] for r in kept] == ["reference"]
    assert left_out == ["cuda_v1", "cuda_v14"]


def test_a_sweep_of_todays_names_keeps_every_row():
    rows = [_row("reference", "reference"), _row("cuda_v1", "cuda"), _row("cuda_tuned", "tuned")]
    kept, left_out = walkthrough.current_rows("qk_norm", rows)
    assert kept == rows and left_out == []


def test_names_are_shortened_to_runs():
    names = ["cuda_v1", "cuda_v2", "cuda_v3", "cuda_v10", "numba_v2", "reference"]
    assert walkthrough.names_text(names) == "cuda_v1..cuda_v3, cuda_v10, numba_v2, reference"


def test_an_effect_gives_the_speedup_or_says_what_is_missing():
    shapes = [[1, 64, 8, 128], [8, 64, 8, 128]]
    rows = [_row("cuda_v1", "cuda", shapes[0], 4.0, 5.0), _row("cuda_v2", "cuda", shapes[0], 2.0, 10.0),
            _row("cuda_v1", "cuda", shapes[1])]
    measured = walkthrough.Measured("qk_norm", ["cuda_v1", "cuda_v2"], shapes, rows, "test", "not in the recorded sweep")
    first, second = walkthrough.effect_text(measured, "cuda_v1", "cuda_v2").splitlines()
    assert first.endswith("cuda_v1 4.00 us (5 % of copy) -> cuda_v2 2.00 us (10 % of copy): 2.00x")
    assert second.endswith("cuda_v2: not in the recorded sweep")
    table = walkthrough.timing_text(measured)
    assert "| cuda_v2" in table and " - " in table


def test_the_recorded_sweep_is_read_by_name():
    if walkthrough.recorded_sweep("qk_norm") is None:
        pytest.skip("no qk_norm sweep recorded in docs/results")
    rows, source = walkthrough.recall("qk_norm", ["reference"], [(1, 64, 8, 128)])
    assert source.startswith("recorded in docs/results/qk_norm_")
    assert rows and all(r["impl"] == "reference" and r["shape"] == [1, 64, 8, 128] for r in rows)


def test_results_pages_belong_to_their_op_and_link_from_the_notebooks():
    pages = walkthrough.results_pages("qk_norm") + walkthrough.results_pages("qk_norm", "ncu")
    assert all(p.name.startswith("qk_norm_") and not p.name.startswith("qk_norm_rope_") for p in pages)
    link = walkthrough.link_text("docs/results/qk_norm_h200.md")
    assert link == "[docs/results/qk_norm_h200.md](../docs/results/qk_norm_h200.md)"


# ---- registers ---------------------------------------------------------------------------------
def test_warps_allowed_by_registers_on_sm_90():
    assert [walkthrough.warps_allowed(r) for r in (32, 40, 64, 255)] == [64, 51, 32, 8]


def test_kernel_names_are_shortened():
    name = ("void cookbook::qk_norm::tuned::qk_norm_tuned_kernel<__nv_bfloat16, (cookbook::Rounding)0, 128, 2, "
            "(cookbook::qk_norm::tuned::Warm)1>(cookbook::qk_norm::Params, unsigned int)")
    assert walkthrough.short_kernel_name(name) == "qk_norm_tuned_kernel<__nv_bfloat16, (Rounding)0, 128, 2, (Warm)1>"
    assert walkthrough._mangled_namespace("cookbook::qk_norm::v3") == "N8cookbook7qk_norm2v3"


# ---- agreement ---------------------------------------------------------------------------------
class _Scaled:
    """The reference, then q scaled by 1 % : an implementation that must fail the check."""

    name, level = "scaled_reference", "reference"

    def unavailable(self, device):
        return None

    def fn(self, q, k, *rest):
        registry.get("qk_norm", "reference").fn(q, k, *rest)
        q.mul_(1.01)


def test_the_agreement_table_passes_the_reference_and_fails_a_wrong_implementation():
    shapes = [(2, 2, 1, 64)]
    impls = [registry.get("qk_norm", "reference"), _Scaled(),
             SimpleNamespace(name="gpu_only", unavailable=lambda device: "needs a GPU")]
    report = walkthrough.check_all("qk_norm", shapes, walkthrough.CASES[:4], device="cpu", impls=impls)
    assert all(ok for ok, _, _ in report.results["reference"].values())
    assert not any(ok for ok, _, _ in report.results["scaled_reference"].values())
    text = walkthrough.agreement_text(report)
    assert "| reference" in text and "FAIL scaled_reference, bf16 fused" in text
    assert "not run here: gpu_only (needs a GPU)" in text and "FAILURES above" in text


def test_a_case_label_names_what_differs():
    assert walkthrough.case_label(dict(dtype=torch.bfloat16, rounding="hf", weight_offset=1.0)) == "bf16 hf w+1"
    assert walkthrough.case_label(dict(dtype=torch.float32, rounding="fused", position_offset=5)) == "fp32 fused position_offset=5"


# ---- setup -------------------------------------------------------------------------------------
SETUP = textwrap.dedent("""
    import os, sys
    from cookbook import walkthrough
    session = walkthrough.setup()
    print("RESULT", os.environ.get("NUMBA_ENABLE_CUDASIM"), session.simulator, "numba.core.config" in sys.modules)
""")


@pytest.mark.parametrize("chosen, expected", [(None, "1 True False"), ("0", "0 False False")])
def test_setup_switches_the_simulator_on_before_numba_unless_chosen_otherwise(chosen, expected):
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env.update(CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(ROOT))
    if chosen is not None:
        env["NUMBA_ENABLE_CUDASIM"] = chosen
    run = subprocess.run([sys.executable, "-c", SETUP], capture_output=True, text=True, cwd=ROOT, env=env)
    assert run.returncode == 0, run.stderr[-2000:]
    result = next(line for line in run.stdout.splitlines() if line.startswith("RESULT"))
    assert result == f"RESULT {expected}"
    assert "device: no CUDA GPU" in run.stdout
