"""The shared Numba device helpers: warp and lane-group sums, the storage codecs and the bf16 word
codec against torch, contiguous_row.

Tiny launches: under the simulator (tests/conftest.py turns it on without a GPU) every CUDA
thread is a Python thread. The same tests run as real kernels on a GPU.
"""

import sys

import numpy as np
import pytest
import torch
from numba import cuda

from kernels_numba import SIMULATOR
from kernels_numba.helpers import (BF16, FP16, WARP_SIZE, bf16_round_to, bf16x2_decode, bf16x2_encode,
                                   bf16x2_encode_int, contiguous_row, lane_group_sum, rsqrt, warp_sum)

WARPS = 2
THREADS = WARPS * WARP_SIZE


@cuda.jit
def _warp_sum_kernel(v, out):
    tid = cuda.threadIdx.x
    out[tid] = warp_sum(v[tid])


def test_warp_sum_gives_every_lane_its_warps_sum():
    v = np.arange(THREADS, dtype=np.float32) ** 2  # small integers: every order sums exactly
    v[WARP_SIZE:] *= -1
    out = np.zeros_like(v)
    _warp_sum_kernel[1, THREADS](v, out)
    want = np.repeat(v.reshape(WARPS, WARP_SIZE).sum(axis=1), WARP_SIZE)
    np.testing.assert_array_equal(out, want)


def _make_round_kernel(round_to):
    @cuda.jit
    def kernel(v, out):
        for i in range(cuda.threadIdx.x, v.shape[0], cuda.blockDim.x):
            out[i] = round_to(v[i])

    return kernel


_ROUND_BF16 = _make_round_kernel(BF16.round_to)
_ROUND_FP16 = _make_round_kernel(FP16.round_to)


def _bits(x):
    return np.asarray(x, np.float32).view(np.uint32)


def _special_values(dtype):
    """Ties both ways, overflow, subnormals, signed zeros, infinities, NaN."""
    f32 = lambda bits: np.uint32(bits).view(np.float32)  # noqa: E731
    if dtype == torch.bfloat16:
        tie_to_even_down, tie_to_even_up = f32(0x3F808000), f32(0x3F818000)  # kept lsb 0 / 1
        above_max = f32(0x7F7FFFFF)  # float32 max rounds up to inf in bf16
        tiny = [f32(0x00000001), f32(0x00008000), f32(0x00018000), f32(0x80400000), 1e-40]
    else:
        tie_to_even_down, tie_to_even_up = 1 + 2.0**-11, 1 + 3 * 2.0**-11
        above_max = 65520.0  # halfway past float16 max: rounds to inf
        tiny = [2.0**-25, 3 * 2.0**-26, 2.0**-24, -(2.0**-26), 1e-9]
    values = [tie_to_even_down, tie_to_even_up, above_max, 65519.0, 3.0e38, -3.4e38]
    values += tiny + [0.0, -0.0, np.inf, -np.inf, np.nan, -1.5, 1.0 / 3.0]
    return np.array(values, dtype=np.float32)


def _test_values(dtype, seed=0):
    rng = np.random.default_rng(seed)
    random_bits = rng.integers(0, 2**32, size=512, dtype=np.uint64).astype(np.uint32).view(np.float32)
    scaled = (rng.standard_normal(256) * 10.0 ** rng.integers(-40, 38, size=256)).astype(np.float32)
    return np.concatenate([_special_values(dtype), random_bits, scaled])


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")  # -> inf, on purpose
@pytest.mark.parametrize(
    "dtype, kernel", [(torch.bfloat16, _ROUND_BF16), (torch.float16, _ROUND_FP16)], ids=["bf16", "fp16"]
)
def test_round_to_matches_torch(dtype, kernel):
    v = _test_values(dtype)
    out = np.zeros_like(v)
    kernel[1, WARP_SIZE](v, out)
    want = torch.from_numpy(v).to(dtype).float().numpy()
    nan = np.isnan(want)
    np.testing.assert_array_equal(np.isnan(out), nan)
    bad = np.nonzero(_bits(out[~nan]) != _bits(want[~nan]))[0]
    assert bad.size == 0, "round_to differs from torch at " + ", ".join(
        f"{v[~nan][i]!r}: got {out[~nan][i]!r} want {want[~nan][i]!r}" for i in bad[:5]
    )


@cuda.jit
def _bf16_encode_decode_kernel(v, encoded, decoded):
    for i in range(cuda.threadIdx.x, v.shape[0], cuda.blockDim.x):
        encoded[i] = BF16.encode(v[i])
        decoded[i] = BF16.decode(encoded[i])


def test_bf16_encode_decode_match_torch():
    """GPU: bf16 travels as int16 bits, so encode gives torch's bits. Simulator: bf16 travels as
    a float32 copy, so encode gives the rounded float32."""
    v = _test_values(torch.bfloat16, seed=1)
    want = torch.from_numpy(v).to(torch.bfloat16)
    if SIMULATOR:
        encoded, want_encoded = np.zeros_like(v), want.float().numpy()
    else:
        encoded, want_encoded = np.zeros(v.shape, np.int16), want.view(torch.int16).numpy()
    decoded = np.zeros_like(v)
    _bf16_encode_decode_kernel[1, WARP_SIZE](v, encoded, decoded)
    nan = torch.isnan(want).numpy()  # any NaN will do: torch itself writes 0x7FC0 or 0xFFFF
    np.testing.assert_array_equal(np.isnan(decoded), nan)
    np.testing.assert_array_equal(_bits(decoded[~nan]), _bits(want.float().numpy()[~nan]))
    if SIMULATOR:
        np.testing.assert_array_equal(_bits(encoded[~nan]), _bits(want_encoded[~nan]))
    else:
        np.testing.assert_array_equal(encoded[~nan], want_encoded[~nan])


@cuda.jit
def _rsqrt_kernel(v, out):
    for i in range(cuda.threadIdx.x, v.shape[0], cuda.blockDim.x):
        out[i] = rsqrt(v[i])


def test_rsqrt_matches_torch_on_the_same_device():
    """rounding="hf" needs rstd as the reference computes it: bit-identical to torch.rsqrt."""
    rng = np.random.default_rng(2)
    special = [1.0, 4.0, 2.0, 1e-38, 1e-30, 3e38, np.inf]
    v = np.concatenate([special, rng.random(128) * 10.0 ** rng.integers(-30, 30, 128)]).astype(np.float32)
    out = np.zeros_like(v)
    _rsqrt_kernel[1, WARP_SIZE](v, out)
    device = "cpu" if SIMULATOR else "cuda"
    want = torch.rsqrt(torch.from_numpy(v).to(device)).cpu().numpy()
    np.testing.assert_array_equal(_bits(out), _bits(want))


# ------------------------------------------------------------------------------------------
# bfloat16 pairs as 32-bit words (bf16x2_decode / bf16x2_encode): word = lo | hi << 16, as a bf16
# tensor viewed as int32 holds columns 2u and 2u + 1.
# ------------------------------------------------------------------------------------------
ALL_BF16 = np.arange(1 << 16, dtype=np.uint32)  # every bfloat16 bit pattern
PER_THREAD = 16  # elements per thread in the grid-stride kernels below


def _over(n):
    """Launch configuration for `n` elements: one-warp blocks, PER_THREAD elements a thread. The
    simulator runs a block's threads as Python threads whose locking grows superlinearly with
    long per-thread loops; it runs blocks one after another, so many short blocks stay fast."""
    return max(1, n // (WARP_SIZE * PER_THREAD)), WARP_SIZE


def _words(lo_bits, hi_bits):
    return (lo_bits.astype(np.uint32) | (hi_bits.astype(np.uint32) << 16)).view(np.int32)


def _bf16_bits_of(v):
    """torch's bfloat16 of float32 `v`, as bits (np.uint32)."""
    bits = torch.from_numpy(np.ascontiguousarray(v)).to(torch.bfloat16).view(torch.int16).numpy()
    return bits.view(np.uint16).astype(np.uint32)


@cuda.jit
def _decode_kernel(words, lo, hi):
    for i in range(cuda.grid(1), words.shape[0], cuda.gridsize(1)):
        lo[i], hi[i] = bf16x2_decode(words[i])


def test_bf16x2_decode_every_pattern_exactly():
    """Every bf16 value in both halves (hi runs through them in another order): decoded as torch
    widens bf16, bit for bit (NaN payloads included: widening is exact)."""
    hi_bits = ALL_BF16[::-1] ^ 0x5A5A
    words = _words(ALL_BF16, hi_bits)
    lo, hi = np.zeros(words.shape, np.float32), np.zeros(words.shape, np.float32)
    _decode_kernel[_over(words.size)](words, lo, hi)
    for got, bits in ((lo, ALL_BF16), (hi, hi_bits)):
        want = torch.from_numpy(bits.astype(np.uint16).view(np.int16)).view(torch.bfloat16).float().numpy()
        np.testing.assert_array_equal(_bits(got), _bits(want))


def _make_encode_kernel(encode):
    @cuda.jit
    def kernel(lo, hi, words):
        for i in range(cuda.grid(1), lo.shape[0], cuda.gridsize(1)):
            words[i] = encode(lo[i], hi[i])

    return kernel


# On a GPU bf16x2_encode is the conversion instruction (sm_80 on) and bf16x2_encode_int what
# older GPUs get; the simulator has only the integer one.
ENCODERS = {"bf16x2_encode": _make_encode_kernel(bf16x2_encode)}
if bf16x2_encode is not bf16x2_encode_int:
    ENCODERS["bf16x2_encode_int"] = _make_encode_kernel(bf16x2_encode_int)


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")  # -> inf, on purpose
@pytest.mark.parametrize("encoder", ENCODERS)
def test_bf16x2_encode_matches_torch(encoder):
    """Ties both ways, overflow to inf, subnormals, signed zeros, infinities, NaN and random
    float32 in both halves: each half as torch rounds to bfloat16 (NaN: any NaN)."""
    lo = _test_values(torch.bfloat16, seed=3)
    hi = np.roll(lo, 7)
    words = np.zeros(lo.shape, np.int32)
    ENCODERS[encoder][_over(lo.size)](lo, hi, words)
    bits = words.view(np.uint32)
    for got, v in ((bits & 0xFFFF, lo), (bits >> 16, hi)):
        want = _bf16_bits_of(v)
        nan = np.isnan(v)
        got_nan = ((got & 0x7F80) == 0x7F80) & ((got & 0x7F) != 0)
        np.testing.assert_array_equal(got_nan, nan)
        np.testing.assert_array_equal(got[~nan], want[~nan])


@pytest.mark.parametrize("encoder", ENCODERS)
def test_bf16x2_round_trip_every_pattern(encoder):
    """decode then encode gives every non-NaN word back (bf16 values are exact in float32)."""
    hi_bits = (ALL_BF16 * 40503) & 0xFFFF  # an odd multiplier: another order of every pattern
    words = _words(ALL_BF16, hi_bits)
    lo, hi = np.zeros(words.shape, np.float32), np.zeros(words.shape, np.float32)
    _decode_kernel[_over(words.size)](words, lo, hi)
    again = np.zeros_like(words)
    ENCODERS[encoder][_over(words.size)](lo, hi, again)
    keep = ~(np.isnan(lo) | np.isnan(hi))
    np.testing.assert_array_equal(again[keep], words[keep])


_ROUND_BF16_VIA_PAIR = _make_round_kernel(bf16_round_to)


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
def test_bf16_round_to_through_the_pair_matches_torch():
    v = _test_values(torch.bfloat16, seed=4)
    out = np.zeros_like(v)
    _ROUND_BF16_VIA_PAIR[1, WARP_SIZE](v, out)
    want = torch.from_numpy(v).to(torch.bfloat16).float().numpy()
    nan = np.isnan(want)
    np.testing.assert_array_equal(np.isnan(out), nan)
    np.testing.assert_array_equal(_bits(out[~nan]), _bits(want[~nan]))


# ------------------------------------------------------------------------------------------
# lane_group_sum and contiguous_row
# ------------------------------------------------------------------------------------------
@cuda.jit
def _lane_group_sum_kernels(v, out1, out2, out4, out8, out16, out32):
    tid = cuda.threadIdx.x
    out1[tid] = lane_group_sum(v[tid], 1)
    out2[tid] = lane_group_sum(v[tid], 2)
    out4[tid] = lane_group_sum(v[tid], 4)
    out8[tid] = lane_group_sum(v[tid], 8)
    out16[tid] = lane_group_sum(v[tid], 16)
    out32[tid] = lane_group_sum(v[tid], 32)


def test_lane_group_sum_gives_every_lane_its_groups_sum():
    v = np.arange(THREADS, dtype=np.float32) ** 2  # small integers: every order sums exactly
    outs = [np.zeros_like(v) for _ in range(6)]
    _lane_group_sum_kernels[1, THREADS](v, *outs)
    for width, out in zip((1, 2, 4, 8, 16, 32), outs):
        np.testing.assert_array_equal(out, np.repeat(v.reshape(-1, width).sum(axis=1), width), err_msg=f"{width=}")


@cuda.jit
def _contiguous_row_kernel(a, out):
    """Copies rows of a strided view of `a` (heads 1.., as a fused-qkv slice) through contiguous_row."""
    view = a[:, 1:, :]
    t, h = cuda.blockIdx.x, cuda.threadIdx.x
    if h < view.shape[1]:
        row = contiguous_row(view, t, h)
        for c in range(row.shape[0]):
            out[t, h, c] = row[c]
        row[0] = -row[0]  # writes land in `a`


def test_contiguous_row_reads_and_writes_a_strided_view():
    a = np.arange(3 * 5 * 6, dtype=np.int32).reshape(3, 5, 6)
    before = a.copy()
    out = np.zeros((3, 4, 6), np.int32)
    _contiguous_row_kernel[3, WARP_SIZE](a, out)
    np.testing.assert_array_equal(out, before[:, 1:, :])
    before[:, 1:, 0] *= -1
    np.testing.assert_array_equal(a, before)


def test_simulated_shared_arrays_are_one_array_per_line_in_every_thread():
    """The simulator keys `cuda.shared.array` by source line; its first allocation is made under
    a lock (kernels_numba/_compat.py), so threads of one block reaching the line together all get
    the same array (without it, a block sum could drop threads' values)."""
    import threading

    import numpy as np
    from numba.cuda.simulator import kernelapi

    from kernels_numba import _compat

    _compat._serialize_simulated_shared_arrays()
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads switch often: unlocked, about 1 round in 25 gave two arrays
    try:
        _each_thread_gets_one_array(kernelapi, np, threading)
    finally:
        sys.setswitchinterval(interval)


def _each_thread_gets_one_array(kernelapi, np, threading):
    for _ in range(200):
        shared = kernelapi.FakeCUDAShared(0)
        start = threading.Barrier(32)
        got = []

        def thread():
            start.wait()
            got.append(shared.array(32, np.float32))

        threads = [threading.Thread(target=thread) for _ in range(32)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len({id(a) for a in got}) == 1
        assert got[0].shape == (32,) and got[0].dtype == np.float32
