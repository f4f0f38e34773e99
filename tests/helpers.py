"""What the op tests share: the device under test, runnable implementations, run-and-compare."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from cookbook import registry
from cookbook.testing import agreement

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ON_GPU = DEVICE.type == "cuda"
KERNEL_LEVELS = ("reference", "numba", "cuda", "tuned")


def kernel_impls(op):
    """Every registered implementation except peers, as pytest params named after them."""
    return [pytest.param(impl, id=impl.name) for impl in registry.implementations(op, KERNEL_LEVELS)]


def require(impl, device=DEVICE):
    reason = impl.unavailable(device)
    if reason:
        pytest.skip(f"{impl.name}: {reason}")


def fields(args):
    """A checked-args dataclass as the positional arguments of an implementation (no copies)."""
    return [getattr(args, f.name) for f in dataclasses.fields(args)]


def clone_inputs(inputs):
    """Copies of the inputs, taken before an in-place run (the expected values read them)."""
    return {name: t.clone() for name, t in inputs.items()}


def run_and_compare(op, impl, inputs, *, eps, weight_offset, rounding):
    """Run `impl` in place on `inputs` and assert every output agrees with the contract."""
    contract = registry.contract(op)
    expected = contract.expected(clone_inputs(inputs), eps, weight_offset, rounding)
    args = contract.check_inputs(**inputs, eps=eps, weight_offset=weight_offset, rounding=rounding)
    impl.fn(*fields(args))
    for out, (exact, rounded) in expected.items():
        actual = inputs[out]
        result = agreement(f"{impl.name}:{out}", actual, exact, rounded, rounding, contract.TOLERANCES[actual.dtype])
        assert result.ok, result.message


BACKENDS = ["auto", "reference", "numba", "cuda"]


def assert_rejected_untouched(op_fn, args, error, fragment, **kwargs):
    """`op_fn(**args, **kwargs)` raises `error` whose message holds `fragment` (and describes the
    tensor when it names a shape), and no tensor argument changed."""
    tensors = {name: v for name, v in args.items() if isinstance(v, torch.Tensor)}
    snapshot = {name: v.clone() for name, v in tensors.items()}
    with pytest.raises(error) as info:
        op_fn(**args, **kwargs)
    message = str(info.value)
    assert fragment in message, message
    if "got shape" in message:
        assert "stride" in message and "dtype" in message, f"the error should describe the tensor: {message}"
    for name, t in tensors.items():
        assert torch.equal(t, snapshot[name]), f"{name} was modified before the error"


def bad_case(good, **changes):
    """A zero-argument maker of the op's keyword arguments: `good()`'s inputs with the contract's
    defaults (eps=1e-6, weight_offset=0.0, rounding="fused"), then `changes` applied in order; a
    callable change gets the arguments so far and returns the new value (e.g. a broken view)."""
    def make():
        args = dict(good(), eps=1e-6, weight_offset=0.0, rounding="fused")
        for key, value in changes.items():
            args[key] = value(args) if callable(value) else value
        return args

    return make


def launched_kernels(fn):
    """Names of the CUDA kernels `fn()` launches, read from the profiler: lets a GPU test assert
    which kernel a version's dispatch picked, not only that the result is right."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return {event.name for event in prof.events() if event.device_type == torch.autograd.DeviceType.CUDA}


def check_dispatch(op, version, make, picked):
    """For both rounding orders (the fused one with float32 weights, Hugging Face's with weights in
    the activation dtype): the kernels that `version` (a CUDA C version number, or an
    implementation's name such as "cuda_tuned") launches on `make(seed, weight_dtype)` (q and k of
    the op's contract, zero rows included) satisfy `picked(kernel names)`, and it agrees with the
    reference on fresh inputs, at eps=0 and weight_offset=0.5."""
    from cookbook import cuda

    impl = registry.get(op, version if isinstance(version, str) else f"cuda_v{version}")
    if impl.extension is not None:
        cuda.load_extension(impl.extension)
    else:
        cuda.load(op)
    for seed, (rounding, weight_dtype) in enumerate((("fused", torch.float32), ("hf", None))):
        x = make(2 * seed, weight_dtype)
        names = launched_kernels(lambda: impl.fn(x["q"], x["k"], x["q_weight"], x["k_weight"], 0.0, 0.5, rounding))
        assert picked(names), names
        run_and_compare(op, impl, make(2 * seed + 1, weight_dtype), eps=0.0, weight_offset=0.5, rounding=rounding)
