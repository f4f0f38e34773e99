"""cookbook.ncu: the Nsight Compute details-page parser and the command's error paths (CPU)."""

from __future__ import annotations

import pytest

from cookbook import ncu

KERNEL = "void cookbook::qk_norm_rope::qk_norm_rope_v4_kernel<__nv_bfloat16, 128, false>(cookbook::qk_norm_rope::Params, long)"
HEADER = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size",'
          '"Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"')


def _row(launch, kernel, section, name, unit, value):
    return f'"{launch}","1","python3","h","{kernel}","1","7","(256, 1, 1)","(528, 1, 1)","0","9.0","{section}","{name}","{unit}","{value}"'


CSV = "\n".join([
    "==PROF== Connected to process 1",  # ncu's preamble comes before the table
    HEADER,
    _row(0, KERNEL, "Launch Statistics", "Registers Per Thread", "register/thread", "64"),
    _row(0, KERNEL, "Occupancy", "Theoretical Occupancy", "%", "50"),
    _row(0, KERNEL, "Occupancy", "Achieved Occupancy", "%", "43.97"),
    _row(0, KERNEL, "GPU Speed Of Light Throughput", "DRAM Throughput", "%", "45.17"),
    _row(0, KERNEL, "GPU Speed Of Light Throughput", "Duration", "usecond", "50.66"),
    _row(0, KERNEL, "Memory Workload Analysis", "L2 Hit Rate", "%", "61.20"),
    _row(0, KERNEL, "Command line profiler metrics", "smsp__inst_executed.sum", "inst", "7,372,800"),
    _row(0, KERNEL, "Command line profiler metrics", "lts__t_sector_op_read_hit_rate.pct", "%", "22.50"),
    _row(0, KERNEL, "Command line profiler metrics", ncu.STALL_METRIC.format("long_scoreboard"), "", "4.8"),
    _row(0, KERNEL, "Command line profiler metrics", ncu.STALL_METRIC.format("wait"), "", "1.5"),
    _row(0, KERNEL, "Command line profiler metrics", ncu.STALL_METRIC.format("selected"), "", "1.0"),
    _row(1, "void k2(P)", "GPU Speed Of Light Throughput", "Duration", "nsecond", "2,500"),
    _row(1, "void k2(P)", "Launch Statistics", "Registers Per Thread", "register/thread", "1,024"),
])


def test_parse_details_one_dict_per_launch_in_order():
    first, second = ncu.parse_details(CSV)
    assert first["kernel"] == KERNEL and second["kernel"] == "void k2(P)"
    assert first["registers"] == 64 and first["achieved occupancy %"] == pytest.approx(43.97)
    assert first["theoretical occupancy %"] == 50 and first["DRAM throughput %"] == pytest.approx(45.17)
    assert first["duration us"] == pytest.approx(50.66)
    assert second["duration us"] == pytest.approx(2.5)  # nanoseconds, thousands separator
    assert second["registers"] == 1024
    assert first["L2 hit rate %"] == pytest.approx(61.2) and first["L2 read hit rate %"] == pytest.approx(22.5)
    assert first["warp instructions"] == 7372800
    # "selected" is the issuing warp, not a stall: it is left out of the stall reasons
    assert first["stalls"] == {"long_scoreboard": 4.8, "wait": 1.5}


def test_table_names_the_kernel_and_the_top_stalls():
    text = ncu.table(ncu.parse_details(CSV), ["cuda_v4", "cuda_v1"])
    lines = text.splitlines()
    assert lines[0].startswith("| impl") and len(lines) == 4
    assert "qk_norm_rope_v4_kernel<__nv_bfloat16, 128, false>" in lines[2]
    assert "long_scoreboard 4.8, wait 1.5" in lines[2]
    assert "| 64 " in lines[2] and "| 43.97 " in lines[2]
    assert "| - " in lines[3]  # a metric ncu did not report shows as "-"


def test_short_kernel_name():
    assert ncu.short_kernel_name(KERNEL) == "qk_norm_rope_v4_kernel<__nv_bfloat16, 128, false>"
    assert ncu.short_kernel_name("void cookbook::op::plain_kernel(cookbook::op::Params)") == "plain_kernel"


def test_unknown_implementation_is_rejected(capsys):
    with pytest.raises(SystemExit):
        ncu.main(["--op", "qk_norm_rope", "--impls", "cuda_v99"])
    assert "cuda_v99" in capsys.readouterr().err


def test_without_ncu_it_says_so(monkeypatch, capsys):
    # (not shutil.which itself: the process's background nvcc jobs look for nvcc with it meanwhile)
    monkeypatch.setattr(ncu, "ncu_path", lambda: None)
    assert ncu.main(["--op", "qk_norm", "--impls", "cuda_v4"]) == 2
    assert "ncu" in capsys.readouterr().err


@pytest.mark.parametrize("argv, fragment", [
    (["--op", "qk_norm", "--shape", "99"], "--shape"),
    (["--op", "qk_norm", "--shape", "-99"], "--shape"),
    (["--op", "no_such_op"], "--op"),
])
def test_bad_op_or_shape_is_rejected(argv, fragment, capsys):
    with pytest.raises(SystemExit):
        ncu.main(argv)
    assert fragment in capsys.readouterr().err


def test_known_metrics_keeps_what_this_ncu_lists(monkeypatch):
    listing = "Device GH100\nlts__t_sector_op_read_hit_rate   Counter   ...\nsmsp__issue_active   Counter\n"

    monkeypatch.setattr(ncu, "metric_listing", lambda path: listing)  # (subprocess.run itself: nvcc jobs use it)
    names = ["lts__t_sector_op_read_hit_rate.pct", "no_such__metric.sum"]
    assert ncu.known_metrics("ncu", names) == ["lts__t_sector_op_read_hit_rate.pct"]
