"""The CUDA C sources on a machine without a GPU: the kernel files agree with the registry, every
kernel compiles with nvcc alone, without spills, and the torch bindings compile too."""

from __future__ import annotations

import re
import sys

import pytest

import nvcc_jobs
from cookbook import nvcc_report, registry
from kernels_cuda import KERNEL_DIR

EXTENSIONS = list(nvcc_report.extensions())  # the ladder layout: one per rung and tuned kernel
LADDER_OPS = sorted({ext.op for ext in nvcc_report.extensions().values()})
# The older layout: every version in kernels_cuda/<op>.cuh, built as one extension.
CUDA_OPS = [op for op in registry.ops() if registry.implementations(op, ("cuda",)) and op not in LADDER_OPS]
needs_nvcc = pytest.mark.skipif(nvcc_report.nvcc() is None, reason="nvcc not on PATH")
_VERSION_LINE = re.compile(r"^// v(\d+): (.+)$", re.MULTILINE)


def header(op):
    return (nvcc_report.KERNEL_DIR / f"{op}.cuh").read_text()


@pytest.mark.parametrize("op", CUDA_OPS)
def test_header_versions_match_registry(op):
    """Each `// vN: lead` line (in the header list and above each kernel) is the registry's lead."""
    registered = {impl.version: impl.lead for impl in registry.implementations(op, ("cuda",))}
    found = _VERSION_LINE.findall(header(op))
    assert {int(v) for v, _ in found} == set(registered), "header and registry list different versions"
    for version, lead in found:
        assert lead == registered[int(version)], f"v{version}: header says {lead!r}, registry says {registered[int(version)]!r}"
    assert len(found) == 2 * len(registered), "each version appears in the header list and above its kernel"
    assert f"kNumVersions = {len(registered)};" in header(op)


@pytest.mark.parametrize("op", LADDER_OPS)
def test_every_kernel_file_is_registered_and_opens_with_its_lead(op):
    """The ladder layout: each rung file `vN_<what>.cuh` and `tuned.cuh` is registered, and its
    first line is `// vN: <lead>` (`// tuned: <lead>`), the registry's lead."""
    registered = {impl.kernel: impl for impl in registry.implementations(op) if impl.kernel is not None}
    on_disk = {f"{op}/{path.name}" for path in (KERNEL_DIR / op).glob("*.cuh") if re.match(r"(v\d+_\w+|tuned)\.cuh$", path.name)}
    assert on_disk == set(registered), f"kernel files and registry differ: {on_disk ^ set(registered)}"
    for kernel, impl in registered.items():
        first_line = (KERNEL_DIR / kernel).read_text().splitlines()[0]
        label = f"v{impl.version}" if impl.level == "cuda" else "tuned"
        assert first_line == f"// {label}: {impl.lead}", f"{kernel}: {first_line!r} is not the registry's lead"
        assert kernel.split("/")[1].startswith(f"{label}_" if impl.level == "cuda" else "tuned"), kernel


@pytest.mark.parametrize("op", LADDER_OPS)
def test_leads_are_one_line(op):
    """A lead says what changed and what it removes in about 25 words; numbers live in docs/results."""
    for impl in registry.implementations(op):
        assert len(impl.lead.split()) <= 26, f"{impl.name}: {len(impl.lead.split())} words"
        assert not re.search(r"\d+(\.\d+)? ?(us|%|x\b)", impl.lead), f"{impl.name}: a measurement in the lead"


@needs_nvcc
@pytest.mark.nvcc("compile_header")
@pytest.mark.parametrize("op", CUDA_OPS)
def test_kernels_compile_without_spills(op):
    kernels = nvcc_jobs.result(nvcc_report.compile_header, op)
    assert kernels, "nvcc reported no kernels"
    spilling = [k for k in kernels if k.spill_bytes]
    assert not spilling, f"register spills: {spilling}"


@needs_nvcc
@pytest.mark.nvcc("compile_extension")
@pytest.mark.parametrize("name", EXTENSIONS)
def test_extension_compiles_without_spills(name):
    kernels = nvcc_jobs.result(nvcc_report.compile_extension, name)
    assert kernels, "nvcc reported no kernels"
    spilling = [k for k in kernels if k.spill_bytes]
    assert not spilling, f"register spills: {spilling}"


@needs_nvcc
@pytest.mark.nvcc("compile_extension_binding")
@pytest.mark.parametrize("name", EXTENSIONS)
def test_extension_binding_compiles(name):
    nvcc_jobs.result(nvcc_report.compile_extension_binding, name)  # raises with the compiler's output


@needs_nvcc
@pytest.mark.nvcc("compile_extension", "cross_head_norm_tuned", "sm_80")
def test_hopper_only_kernels_still_compile_for_ampere():
    """cross_head_norm's staged-row kernel uses sm_90 bulk copies behind an architecture guard: the
    tuned extension built for an sm_80 GPU must still compile (its policy never launches the kernel
    there: no bulk copies, no room for a staged row)."""
    kernels = nvcc_jobs.result(nvcc_report.compile_extension, "cross_head_norm_tuned", "sm_80")
    assert any("cross_head_norm_staged_kernel" in k.kernel for k in kernels)


@needs_nvcc
@pytest.mark.nvcc("compile_binding")
@pytest.mark.parametrize("op", CUDA_OPS)
def test_binding_compiles(op):
    nvcc_jobs.result(nvcc_report.compile_binding, op)  # raises with nvcc's output


@needs_nvcc
@pytest.mark.nvcc("compile_extension", "tp_qk_norm_tuned", nvcc_report.DEFAULT_ARCH)
def test_tp_tuned_extension_compiles_only_what_its_policy_launches():
    """tp_qk_norm's tuned extension (what backend="cuda" builds): rung 1's kernels (the NCCL path),
    rungs 7 and 8's lean kernels, rung 5's walk, rung 4's tiles (and rung 2's for the absent launch); no
    other rung's kernel."""
    kernels = nvcc_jobs.result(nvcc_report.compile_extension, "tp_qk_norm_tuned", nvcc_report.DEFAULT_ARCH)
    names = " ".join(k.kernel for k in kernels)
    for wanted in ("lean_rows_kernel", "paired_rows_kernel", "lagged_rows_kernel", "fused_v3_kernel", "fused_kernel", "sum_sq_vec_kernel",
                   "apply_vec_kernel"):
        assert wanted in names, wanted
    assert "token_rows_kernel" not in names, "rung 6's kernel, which the policy never launches, was compiled"


def _docs_versions():
    import importlib.util

    spec = importlib.util.spec_from_file_location("docs_versions", nvcc_report.KERNEL_DIR.parent / "tools" / "docs_versions.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@needs_nvcc
@pytest.mark.nvcc
@pytest.mark.parametrize("op", CUDA_OPS + LADDER_OPS)
def test_docs_tables_match_the_generator(op):
    """Each op page's generated tables (the ladder and results tables of an op in the ladder layout,
    the versions table of the older layout, cross_head_norm's occupancy table) are exactly what
    tools/docs_versions.py prints now: leads, registers and recorded times cannot drift."""
    tools = _docs_versions()
    page = (nvcc_report.KERNEL_DIR.parent / "docs" / f"{op}.md").read_text()
    stale = [line for text in tools.tables(op) for line in text.splitlines() if line.strip() and line not in page]
    assert not stale, f"docs/{op}.md: rerun `python tools/docs_versions.py {op}` (`--write` for the ladder layout) and paste; stale: {stale[:3]}"


def test_ptxas_report_cache_key_follows_every_header(tmp_path, monkeypatch):
    """compile_header reuses a report only for the same unit, flags, arch, nvcc and headers: an
    edit to any header under kernels_cuda/ (an include too) must give a new cache file. (The
    kernel folder is passed, not patched: background compiles read the module's while this runs.)"""
    (tmp_path / "include").mkdir()
    (tmp_path / "op.cuh").write_text("// op\n")
    (tmp_path / "include" / "common.cuh").write_text("// common\n")
    monkeypatch.setenv("COOKBOOK_BUILD_DIR", str(tmp_path / "cache"))
    key = lambda arch="sm_90": nvcc_report._report_cache("op", arch, "unit", sys.executable, tmp_path)  # noqa: E731
    first = key()
    assert key() == first and first.parent == tmp_path / "cache" / "ptxas_reports"
    assert key("sm_80") != first
    (tmp_path / "include" / "common.cuh").write_text("// common, edited\n")
    assert key() != first


@pytest.mark.nvcc  # runs with the nvcc tests, last: its calls queue behind the real compiles
def test_background_nvcc_jobs_give_their_result_or_raise():
    def fake_compile(op):
        if op == "bad":
            raise RuntimeError("nvcc failed on bad.cuh")
        return [op]

    nvcc_jobs.start([(fake_compile, ("a",)), (fake_compile, ("bad",))])
    assert nvcc_jobs.result(fake_compile, "a") == ["a"]
    with pytest.raises(RuntimeError, match="nvcc failed on bad.cuh"):
        nvcc_jobs.result(fake_compile, "bad")
    assert nvcc_jobs.result(fake_compile, "c") == ["c"]  # never started: made by the caller


def test_tools_start_while_another_thread_changes_the_environment():
    """The compiles run on a worker thread while tests set and unset environment variables. A
    child that inherits the live C environment can be exec'd while putenv rewrites it and fail
    with EFAULT (it did in CI); `_run_tool` hands the child a copy taken at import instead.
    Without that copy this loop fails within a second on a 2-core machine (about half the starts)."""
    import os
    import shutil
    import threading
    import time

    true = shutil.which("true")
    if true is None:
        pytest.skip("no `true` program on PATH")
    errors, starts, done = [], [0], threading.Event()

    def start_tools():
        while not done.is_set():
            try:
                nvcc_report._run_tool([true], check=True)
            except Exception as error:  # noqa: BLE001 (any failure to start is the bug)
                errors.append(repr(error))
            starts[0] += 1

    names = [f"COOKBOOK_ENV_RACE_{i}" for i in range(16)]
    worker = threading.Thread(target=start_tools)
    worker.start()
    try:
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:
            os.environ.update({name: "x" * 64 for name in names})
            for name in names:
                os.environ.pop(name)
    finally:
        done.set()
        worker.join()
        for name in names:
            os.environ.pop(name, None)
    assert starts[0] > 0 and not errors, f"{len(errors)} of {starts[0]} starts failed: {errors[:3]}"
