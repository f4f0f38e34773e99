"""The registry is the only list: every op has every level, and `backend=` picks the last version."""

import pytest

from cookbook import registry


@pytest.mark.parametrize("op", registry.ops())
def test_every_level_is_registered(op):
    levels = {impl.level for impl in registry.implementations(op)}
    assert {"reference", "numba", "cuda", "peer"} <= levels


@pytest.mark.parametrize("op", registry.ops())
@pytest.mark.parametrize("level", ["numba", "cuda"])
def test_backend_runs_the_last_version(op, level):
    versions = [impl.version for impl in registry.implementations(op, (level,))]
    assert sorted(versions) == list(range(1, len(versions) + 1)), "versions are numbered 1..N"
    assert registry.latest(op, level).version == max(versions)


@pytest.mark.parametrize("op", registry.ops())
def test_names_are_unique_and_contracts_exist(op):
    names = [impl.name for impl in registry.implementations(op)]
    assert len(names) == len(set(names))
    contract = registry.contract(op)
    for attr in ("check_inputs", "reference", "expected", "make_inputs", "TOLERANCES", "bytes_moved", "BENCH_SHAPES"):
        assert hasattr(contract, attr), f"{op}: the contract module lacks {attr}"


@pytest.mark.parametrize("op", registry.ops())
def test_backend_cuda_runs_the_tuned_kernel_where_there_is_one(op):
    tuned = registry.implementations(op, ("tuned",))
    assert len(tuned) <= 1
    assert registry.fastest(op) is (tuned[0] if tuned else registry.latest(op, "cuda"))


@pytest.mark.parametrize("op", ["qk_norm", "cross_head_norm"])
def test_ladder_ops_are_a_short_ladder_and_one_tuned_kernel(op):
    """Each rung and the tuned kernel is its own kernel file and its own extension."""
    rungs = registry.implementations(op, ("cuda",))
    assert 5 <= len(rungs) <= 8
    (tuned,) = registry.implementations(op, ("tuned",))
    extensions = [impl.extension.name for impl in rungs + [tuned]]
    assert len(set(extensions)) == len(extensions) and all(impl.kernel for impl in rungs + [tuned])
