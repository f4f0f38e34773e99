"""The peers of other packages, on a CPU without any of them installed: the import guards and the
shim (with a fake package on disk), the layout facts, which rounding order an output follows
(fake peers built from the references), and how the benchmark labels and reports them."""

import functools
import importlib
import json
import sys
import textwrap

import pytest
import torch

from cookbook import bench, registry
from cookbook.bench import peers as bench_peers
from cookbook.bench.sweep import ShapeCase
from cookbook.ops import cross_head_norm as cross_contract
from cookbook.ops import qk_norm as qk_contract
from cookbook.ops import qk_norm_rope as rope_contract
from cookbook.peers import adapter, guard, orders, sglang_jit

EXTERNAL = [impl for op in registry.ops() for impl in registry.implementations(op, ("peer",)) if impl.package]


# --------------------------------------------------------------------------------------------
# Import guards
# --------------------------------------------------------------------------------------------
def test_every_op_but_the_collective_has_peers_of_each_package():
    for op in ("qk_norm", "cross_head_norm", "qk_norm_rope"):
        packages = {impl.package for impl in registry.implementations(op, ("peer",)) if impl.package}
        assert packages == {"sglang", "flashinfer-python", "liger-kernel"}, op


@pytest.mark.parametrize("impl", EXTERNAL, ids=lambda impl: f"{impl.op}-{impl.name}")
def test_a_peer_never_imports_its_package_for_cpu_tensors(impl):
    before = set(sys.modules)
    assert impl.unavailable("cpu") == "peer implementations run on CUDA tensors only"
    assert not any(name.split(".")[0] in ("sglang", "flashinfer", "liger_kernel") for name in set(sys.modules) - before)


@pytest.mark.parametrize("impl", EXTERNAL, ids=lambda impl: f"{impl.op}-{impl.name}")
def test_a_missing_package_is_named_not_installed(impl, monkeypatch):
    monkeypatch.setattr(guard, "installed_version", lambda distribution: None)
    _clear_guard_caches()
    try:
        reason = impl.unavailable("cuda")
    finally:
        _clear_guard_caches()
    assert reason == f"{impl.package} not installed" and guard.is_not_installed(reason)


def test_an_installed_peer_whose_import_breaks_says_why(monkeypatch):
    monkeypatch.setattr(guard, "installed_version", lambda distribution: "9.9")
    monkeypatch.setattr(guard, "first_module", _raise(ImportError("No module named 'tvm_ffi'")))
    _clear_guard_caches()
    try:
        reason = registry.get("qk_norm", "liger_rms_norm").unavailable("cuda")
    finally:
        _clear_guard_caches()
    assert reason == "import failed: ImportError: No module named 'tvm_ffi'" and not guard.is_not_installed(reason)


def _raise(error):
    def fail(*_args, **_kwargs):
        raise error

    return fail


def _clear_guard_caches():
    from cookbook.peers import flashinfer_ops, liger_triton

    for module in (sglang_jit, flashinfer_ops, liger_triton):
        module.load.cache_clear()
    for impl in EXTERNAL:
        module, attr = impl.target.split(":")
        getattr(importlib.import_module(module), attr).unavailable.cache_clear()


def test_the_bench_folds_missing_packages_into_one_line():
    skipped = [(impl, f"{impl.package} not installed") for impl in EXTERNAL]
    skipped.append((registry.get("qk_norm", "cuda_v1"), "nvcc not found"))
    note = bench_peers.not_installed_note(skipped)
    assert note.startswith("peers not installed (flashinfer-python, liger-kernel, sglang)") and "\n" not in note
    assert bench_peers.not_installed_note(skipped[-1:]) is None


# --------------------------------------------------------------------------------------------
# The shim, on a fake SGLang whose package __init__ would start the framework
# --------------------------------------------------------------------------------------------
FAKE_SGLANG = {
    "sglang/__init__.py": "raise ImportError('the framework: not in a kernel benchmark')",
    "sglang/srt/utils/__init__.py": "raise ImportError('the framework utilities')",
    "sglang/jit_kernel/__init__.py": "",
    "sglang/jit_kernel/norm.py": """
        from sglang.utils import is_in_ci
        CALLS = []
        def fused_inplace_qknorm(q, k, q_weight, k_weight, eps=1e-6, *, head_dim=0):
            CALLS.append(("qknorm", eps, is_in_ci()))
    """,
    "sglang/jit_kernel/diffusion/qknorm_rope.py": """
        from sglang.srt.utils.custom_op import register_custom_op
        @register_custom_op(mutates_args=["q", "k"])
        def fused_inplace_qknorm_rope(q, k, q_weight, k_weight, cos_sin_cache, positions, *, is_neox, eps=1e-6,
                                      head_dim=0, rope_dim=0):
            pass
    """,
    "sglang/jit_kernel/fused_qknorm_rope.py": "def fused_qk_norm_rope(*args): pass",
    "sglang-0.0.1.dist-info/METADATA": "Metadata-Version: 2.1\nName: sglang\nVersion: 0.0.1\n",
}


@pytest.fixture
def fake_sglang(tmp_path, monkeypatch):
    for path, text in FAKE_SGLANG.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(textwrap.dedent(text))
    monkeypatch.syspath_prepend(str(tmp_path))
    _forget_sglang()
    _clear_guard_caches()
    yield
    _forget_sglang()
    _clear_guard_caches()


def _forget_sglang():
    for name in [name for name in sys.modules if name == "sglang" or name.startswith("sglang.")]:
        del sys.modules[name]


def test_the_shim_reaches_the_kernel_modules_without_the_framework(fake_sglang):
    impl = registry.get("qk_norm", "sglang_qknorm")
    assert impl.unavailable("cuda") is None
    kernel = impl.build()
    assert kernel.package == "sglang 0.0.1" and not kernel.writes_new
    args = qk_contract.check_inputs(**qk_contract.make_inputs(2, 2, 1, 128), eps=1e-5, weight_offset=0.0,
                                    rounding="fused")
    assert kernel(*bench.positional(args)) == (args.q, args.k)  # in place: the inputs are the outputs
    # via the stand-in sglang.utils; eps arrives as the contract checked it: as a float32 value
    assert sys.modules["sglang.jit_kernel.norm"].CALLS == [("qknorm", float(torch.tensor(1e-5).item()), False)]
    # (the fake package's __init__ raises: it never ran, nor did sglang.srt.utils')
    assert registry.get("cross_head_norm", "sglang_qknorm_across_heads").unavailable("cuda") == (
        "sglang 0.0.1 has no fused_inplace_qknorm_across_heads in sglang.jit_kernel.norm")


def test_the_shim_leaves_an_imported_module_alone():
    assert guard.stub_module("json", loads=None) is json and guard.bare_package("json") is json


# --------------------------------------------------------------------------------------------
# Layout facts and not-applicable reasons
# --------------------------------------------------------------------------------------------
def test_packed_qkv_finds_the_fused_tensor_and_nothing_else():
    fused = qk_contract.make_inputs(3, 4, 2, 64, fused_qkv=True)
    qkv, v_heads = adapter.packed_qkv(fused["q"], fused["k"])
    assert v_heads == 2 and qkv.shape == (3, (4 + 2 + 2) * 64) and qkv.is_contiguous()
    assert qkv.data_ptr() == fused["q"].data_ptr()
    separate = qk_contract.make_inputs(3, 4, 2, 64)
    assert adapter.packed_qkv(separate["q"], separate["k"]) is None
    q_only = fused["q"][:, :2]  # not the first heads' neighbour of k
    assert adapter.packed_qkv(q_only, fused["k"]) is None


def _checked(contract, inputs):
    return bench.positional(bench.checked(contract, inputs))


def test_not_applicable_reasons_name_the_layout():
    across = object.__new__(sglang_jit.QKNormAcrossHeads)
    fused = _checked(cross_contract, cross_contract.make_inputs(4, 256, 256, fused_qkv=True))
    assert "contiguous [tokens, hidden]" in across.not_applicable(*fused)
    gqa = _checked(cross_contract, cross_contract.make_inputs(4, 256, 128))
    assert "one hidden size" in across.not_applicable(*gqa)
    assert across.not_applicable(*_checked(cross_contract, cross_contract.make_inputs(4, 256, 256))) is None

    trtllm = object.__new__(sglang_jit.TrtllmQKNormRope)
    separate = _checked(rope_contract, rope_contract.make_inputs(4, 4, 2, 128))
    assert "packed" in trtllm.not_applicable(*separate)
    packed = _checked(rope_contract, rope_contract.make_inputs(4, 4, 2, 128, fused_qkv=True))
    assert trtllm.not_applicable(*packed) is None
    head_96 = _checked(qk_contract, qk_contract.make_inputs(2, 2, 1, 96))
    assert "head_dim=96" in object.__new__(sglang_jit.QKNorm).not_applicable(*head_96)

    from cookbook.peers import liger_triton

    liger = object.__new__(liger_triton.RMSNorm)
    fused_heads = _checked(qk_contract, qk_contract.make_inputs(2, 4, 1, 64, fused_qkv=True))
    assert "x.view(-1, dim)" in liger.not_applicable(*fused_heads)
    assert liger.not_applicable(*_checked(qk_contract, qk_contract.make_inputs(2, 4, 1, 64))) is None


# --------------------------------------------------------------------------------------------
# Which rounding order: fake peers built from the references
# --------------------------------------------------------------------------------------------
def _outputs(contract, inputs, rounding):
    args = bench.checked(contract, inputs, rounding)
    contract.reference(*bench.positional(args))
    return {"q": inputs["q"], "k": inputs["k"]}


@pytest.mark.parametrize("contract, make", [
    (qk_contract, functools.partial(qk_contract.make_inputs, 8, 4, 2, 64)),
    (cross_contract, functools.partial(cross_contract.make_inputs, 8, 256, 128)),
])  # fmt: skip
@pytest.mark.parametrize("rounding", ["fused", "hf"])
def test_the_verdict_names_the_order_a_norm_follows(contract, make, rounding):
    found = orders.oracles(contract, make(), bench.EPS, bench.WEIGHT_OFFSET)
    verdict = orders.judge(contract, _outputs(contract, make(), rounding), found)
    assert verdict.status == orders.FOLLOWS and verdict.order == rounding and verdict.timed
    assert verdict.max_ulp <= contract.TOLERANCES[torch.bfloat16].hf_ulp
    assert verdict.text().startswith(f"{rounding} order, max ")


def _norm_then_rope(inputs, norm_rounding):
    """A fake split peer: the norm rounded to bf16 (as a norm kernel stores it), rope in float32."""
    args = bench.checked(rope_contract, inputs)
    cos, sin = rope_contract.cos_sin_rows(args.cos_sin_cache, args.positions, 0, torch.float32)
    out = {}
    for name, x, w in (("q", args.q, args.q_weight), ("k", args.k, args.k_weight)):
        normed = qk_contract.rms_norm_rows(x, w, bench.EPS, 0.0, norm_rounding).float()
        out[name] = rope_contract.rotate(normed, cos, sin, args.rope_dim, args.is_neox).to(x.dtype)
    return out


@pytest.mark.parametrize("norm_rounding, order", [("fused", orders.FUSED_NORM_THEN_ROPE),
                                                  ("hf", orders.HF_NORM_THEN_ROPE)])
def test_the_verdict_names_a_norm_kernel_then_a_rope_kernel(norm_rounding, order):
    make = functools.partial(rope_contract.make_inputs, 16, 4, 2, 64)
    found = orders.oracles(rope_contract, make(), bench.EPS, bench.WEIGHT_OFFSET)
    assert list(found) == [orders.FUSED, orders.HF, orders.FUSED_NORM_THEN_ROPE, orders.HF_NORM_THEN_ROPE]
    verdict = orders.judge(rope_contract, _norm_then_rope(make(), norm_rounding), found)
    assert (verdict.status, verdict.order) == (orders.FOLLOWS, order)
    fused = orders.judge(rope_contract, _outputs(rope_contract, make(), "fused"), found)
    assert (fused.status, fused.order) == (orders.FOLLOWS, orders.FUSED)


def test_a_wrong_peer_disagrees_and_is_not_timed():
    make = functools.partial(qk_contract.make_inputs, 8, 4, 2, 64)
    found = orders.oracles(qk_contract, make(), bench.EPS, bench.WEIGHT_OFFSET)
    outputs = _outputs(qk_contract, make(), "fused")
    outputs["k"] = outputs["k"] * 1.01  # one percent off: no order forgives it
    verdict = orders.judge(qk_contract, outputs, found)
    assert verdict.status == orders.DISAGREES and not verdict.timed
    assert verdict.order in (orders.FUSED, orders.HF) and verdict.max_ulp > 1
    assert "fused: max" in verdict.detail and "hf: max" in verdict.detail
    assert "not timed" in verdict.text()


# --------------------------------------------------------------------------------------------
# The benchmark's side: the check of a fake peer, the side-by-side table, the results page
# --------------------------------------------------------------------------------------------
class FakePeer(adapter.PeerKernel):
    api = "fake.rms_norm"
    writes_new = True

    def __init__(self, rounding="hf", reason=None):
        super().__init__("fake-package 1.2")
        self.rounding, self.reason, self.prepared = rounding, reason, 0

    def not_applicable(self, *args):
        return self.reason

    def prepare(self, *args):
        self.prepared += 1

    def __call__(self, q, k, q_weight, k_weight, eps, weight_offset, rounding):
        return (qk_contract.rms_norm_rows(q, q_weight, eps, weight_offset, self.rounding),
                qk_contract.rms_norm_rows(k, k_weight, eps, weight_offset, self.rounding))


def _cpu_case():
    shape = (8, 4, 2, 64)
    make = functools.partial(lambda seed: qk_contract.bench_case(shape, torch.bfloat16, "cpu", seed)[0], 10_000)
    base = dict(dict.fromkeys(bench.ROW_FIELDS), op="qk_norm", label="T=8", shape=list(shape))
    return ShapeCase(qk_contract, base, [], make, bench.expected_outputs(qk_contract, make(), "fused"))


def test_the_check_reads_a_new_tensor_and_names_its_order():
    case = _cpu_case()
    peer = FakePeer("hf")
    verdict = bench_peers.check(case, peer)
    assert (verdict.status, verdict.order) == (orders.FOLLOWS, orders.HF) and peer.prepared == 1
    reason = "q and k are strided views: the kernel takes contiguous rows"
    assert bench_peers.check(case, FakePeer(reason=reason)) == orders.not_applicable(reason)


FOLLOWS_FUSED = "fused order, max 0.5 ulp"


def _peer_rows():
    def row(label, impl, median, package=None):
        r = dict(dict.fromkeys(bench.ROW_FIELDS), op="qk_norm", label=label, impl=impl, median_us=median,
                 gb_per_s=100.0, pct_of_copy=50.0, package=package, max_ulp=0.5, agreement="ok")
        return r

    rows = [row("T=1", "cuda_tuned", 2.0), row("T=1", "sglang_qknorm", 2.5, "sglang 0.5.11"),
            row("T=8", "cuda_tuned", 4.0), row("T=8", "sglang_qknorm", 3.2, "sglang 0.5.11")]
    records = [
        dict(op="qk_norm", label="T=1", impl="sglang_qknorm", package="sglang 0.5.11", verdict=FOLLOWS_FUSED),
        dict(op="qk_norm", label="T=1", impl="liger_rms_norm", package="liger-kernel 0.8.5",
             verdict="not applicable: q and k are strided views"),
        dict(op="qk_norm", label="T=8", impl="sglang_qknorm", package="sglang 0.5.11", verdict=FOLLOWS_FUSED),
    ]
    return rows, records


def test_side_by_side_gives_x_against_our_tuned_kernel_and_says_who_is_faster():
    rows, records = _peer_rows()
    peers = bench_peers.SideBySide("qk_norm", rows, records)
    assert peers.baseline == registry.fastest("qk_norm").name == "cuda_tuned"
    table = peers.table()
    assert "| x vs cuda_tuned |" in table.splitlines()[0]
    assert "0.80x" in table and "1.25x" in table and "not applicable: q and k are strided views" in table
    faster = peers.faster_than_ours()
    assert faster == ["sglang_qknorm (sglang 0.5.11) is faster than cuda_tuned at T=8: "
                      "3.20 us against 4.00 us (1.25x)."]
    assert "faster than our tuned kernel" in peers.summary()
    slower = [dict(r, median_us=9.0) if r["package"] else r for r in rows]
    assert bench_peers.SideBySide("qk_norm", slower, records).summary() == (
        "cuda_tuned is faster than every timed peer at every shape above.")


def test_the_results_page_carries_the_peers_only_when_they_ran(tmp_path):
    rows, records = _peer_rows()
    meta = dict(gpu="NVIDIA H200", gpu_slug="h200", compute_capability="9.0", sm_count=132, l2_bytes=60 << 20,
                torch="2.11", cuda="13.0", date="2026-11-27T00:00:00+00:00", commit="abc", command="bench",
                dtype="bfloat16", copy_tb_per_s=4.3, timing="replays")
    for row in rows:
        row.update(p20_us=row["median_us"], p80_us=row["median_us"], method="graph", agrees=True, error=None)
    bench.write_results_page("qk_norm", rows, meta, {}, tmp_path)
    without = (tmp_path / "qk_norm_h200.md").read_text()
    assert "peers" not in without
    meta["peers"] = {"packages": {"sglang": "0.5.11", "flashinfer-python": None}, "verdicts": records}
    bench.write_results_page("qk_norm", rows, meta, {}, tmp_path)
    page = (tmp_path / "qk_norm_h200.md").read_text()
    assert "- peers: sglang 0.5.11\n" in page and "## Side by side with the peers" in page
    assert "is faster than cuda_tuned at T=8" in page
    assert json.loads((tmp_path / "qk_norm_h200.json").read_text())["metadata"]["peers"]["verdicts"] == records


def test_plots_name_a_peer_with_its_version():
    rows, _ = _peer_rows()
    assert bench.line_label(rows, "sglang_qknorm") == "sglang_qknorm (sglang 0.5.11)"
    assert bench.line_label(rows, "cuda_tuned") == "cuda_tuned"


def test_x_vs_tuned_is_the_tuned_median_over_the_row():
    rows, _ = _peer_rows()
    t1 = [r for r in rows if r["label"] == "T=1"]
    bench.add_speedups(t1)
    assert t1[1]["x_vs_tuned"] == pytest.approx(0.8) and t1[0]["x_vs_tuned"] == pytest.approx(1.0)


class Notes:
    def __init__(self):
        self.lines = []

    def write(self, line):
        self.lines.append(line)


def _fake_impl(name, build):
    import types

    return types.SimpleNamespace(op="qk_norm", name=name, level="peer", version=0, package="fake-package", build=build)


def test_a_peer_that_fails_is_reported_once_and_not_retried(monkeypatch):
    monkeypatch.setattr(bench_peers, "_FAILED", {})
    case, notes = _cpu_case(), Notes()
    impl = _fake_impl("broken", _raise(RuntimeError("nvcc failed: cublasLt.h not found")))
    row, record = bench_peers.bench_peer(case, impl, 1000.0, None, notes)
    assert row is None and record["status"] == orders.ERROR and "cublasLt.h" in record["verdict"]
    row, again = bench_peers.bench_peer(case, impl, 1000.0, None, notes)
    assert row is None and again["verdict"] == (
        "error: not retried after the error at T=8: RuntimeError: nvcc failed: cublasLt.h not found")
    assert len(notes.lines) == 1 and notes.lines[0].startswith("!! peer qk_norm T=8 broken: error: RuntimeError")


def test_a_disagreeing_peer_gets_no_row_and_a_record(monkeypatch):
    monkeypatch.setattr(bench_peers, "_FAILED", {})
    notes = Notes()

    class Wrong(FakePeer):
        def __call__(self, *args):
            q, k = super().__call__(*args)
            return q * 1.01, k

    row, record = bench_peers.bench_peer(_cpu_case(), _fake_impl("wrong", Wrong), 1000.0, None, notes)
    assert row is None and record["status"] == orders.DISAGREES and record["package"] == "fake-package 1.2"
    assert record["api"] == "fake.rms_norm" and "not timed" in record["verdict"] and "hf: max" in notes.lines[0]
