"""The in-place and numerics edge cases of every op (docs/edge_cases.md), shared by the CPU tests
(test_edge_cases.py: the references, and the Numba kernels under the simulator) and the GPU tests
(test_gpu_edge_cases.py: every implementation, each CUDA C rung and tuned kernel included).

* `rejections(op)`: arguments the contract refuses before anything is written: q and k sharing
  memory, a read-only input inside q or k, a broadcast or self-overlapping q, tensors that
  require grad, inference tensors outside inference mode, eps or weight_offset infinite in
  float32.
* `edge_rows(dtype)`: rows whose result the contract defines exactly: a NaN or an Inf anywhere
  makes the whole row NaN, a sum of squares past float32's range too, squares that underflow
  float32 with eps = 0 give zeros; the rows on the right side of each edge match the float64
  value. `check_edge_rows` runs one implementation on all of them at once.
"""

from __future__ import annotations

import math

import torch

import cookbook
from cookbook import registry
from cookbook.testing import agreement
from helpers import fields

OPS = ("qk_norm", "cross_head_norm", "qk_norm_rope", "tp_qk_norm")
PER_HEAD_OPS = ("qk_norm", "qk_norm_rope")
API = {"qk_norm": cookbook.qk_norm, "cross_head_norm": cookbook.cross_head_norm, "qk_norm_rope": cookbook.qk_norm_rope,
       "tp_qk_norm": cookbook.tp_qk_norm}
# Each op's names for q, k and their weights (tp_qk_norm takes shards).
NAMES = {op: dict(q="q", k="k", q_weight="q_weight", k_weight="k_weight") for op in OPS}
NAMES["tp_qk_norm"] = dict(q="q_shard", k="k_shard", q_weight="q_weight_shard", k_weight="k_weight_shard")

TOKENS = 2  # per-head ops: rows = tokens * heads
Q_HEADS, K_HEADS, HEAD_DIM = 3, 2, 64
CROSS_TOKENS, Q_HIDDEN, K_HIDDEN = 5, 64, 32  # cross-head ops: a row per token, 5 in q and 5 in k
EDGE_DTYPES = (torch.float32, torch.bfloat16)  # float32's exponent range: squares can leave float32
FLOAT32_MAX = torch.finfo(torch.float32).max
SQUARE_UNDERFLOW = 2.0**-75  # |x| at most this: x * x rounds to 0 in float32


def make_inputs(op, dtype, device, *, seed=0, heads=(Q_HEADS, K_HEADS)):
    """Small seeded arguments of `op` (q, k, weights; the cache, positions and rope for qk_norm_rope)."""
    contract = registry.contract(op)
    if op == "qk_norm":
        return contract.make_inputs(TOKENS, *heads, HEAD_DIM, dtype, device, seed=seed)
    if op == "qk_norm_rope":
        return contract.make_inputs(TOKENS, *heads, HEAD_DIM, dtype=dtype, device=device, seed=seed)
    return contract.make_inputs(CROSS_TOKENS, Q_HIDDEN, K_HIDDEN, dtype, device, seed=seed)


def api_arguments(inputs):
    """make_inputs' dict as the public op's keyword arguments (qk_norm_rope's `rope` unpacked)."""
    inputs = dict(inputs)
    rope = inputs.pop("rope", None)
    if rope is not None:
        inputs.update(is_neox=rope.is_neox, rope_dim=rope.rope_dim, position_offset=rope.position_offset)
    return inputs


def call_api(op, inputs, backend, **kwargs):
    """The public op on `inputs` (make_inputs' dict, possibly altered)."""
    return API[op](**api_arguments(inputs), **kwargs, backend=backend)


def run_impl(op, impl, inputs, eps, weight_offset=0.0, rounding="fused"):
    """`impl` on the checked arguments, in place (tp_qk_norm at one rank: group None)."""
    args = registry.contract(op).check_inputs(**inputs, eps=eps, weight_offset=weight_offset, rounding=rounding)
    impl.fn(*fields(args))


def exact(op, inputs, eps, weight_offset=0.0):
    """{written name: the float64 value} of unmodified `inputs`."""
    contract = registry.contract(op)
    copies = {name: v.clone() for name, v in inputs.items()}
    if op == "tp_qk_norm":
        full = {plain: copies[name] for plain, name in NAMES[op].items()}
        out = contract.expected(full, 0, 1, eps, weight_offset, "fused")
    else:
        out = contract.expected(copies, eps, weight_offset, "fused")
    return {name: value[0] for name, value in out.items()}


def rows(t):
    """A written tensor as its rows (the last dim): [T*H, D] per head, [T, hidden] across heads."""
    return t.reshape(-1, t.shape[-1])


# --------------------------------------------------------------------------------------------
# Rows with a defined result
# --------------------------------------------------------------------------------------------
NAN, ZEROS, EXACT = "nan", "zeros", "exact"  # what a row must come out as


def _scaled_to_sum_sq(x, sum_sq):
    """`x` scaled (in float64) so that its sum of squares is `sum_sq`."""
    return x * math.sqrt(sum_sq / x.square().sum().item())


def edge_rows(dtype):
    """[(label, make(x) -> the row's values from a float64 randn row x, what it must come out as)],
    to run at eps = 0. Rows at float32's range edges only for dtypes with that range."""
    def with_value(index, value):
        return lambda x: x.index_fill(0, torch.tensor([index]), value)

    cases = [
        ("normal", lambda x: x, EXACT),
        ("a zero row (eps = 0)", lambda x: x * 0, ZEROS),
        ("one NaN", with_value(3, math.nan), NAN),
        ("one +Inf", with_value(5, math.inf), NAN),
        ("one -Inf", with_value(0, -math.inf), NAN),
    ]
    if dtype in EDGE_DTYPES:
        cases += [
            ("sum of squares a quarter of float32's max", lambda x: _scaled_to_sum_sq(x, FLOAT32_MAX / 4), EXACT),
            ("sum of squares 4x float32's max", lambda x: _scaled_to_sum_sq(x, FLOAT32_MAX * 4), NAN),
            ("|x| ~ 1e-18: squares still normal (eps = 0)", lambda x: x * 1e-18, EXACT),
            ("|x| < 2^-75: squares underflow to 0 (eps = 0)",
             lambda x: x / x.abs().max() * SQUARE_UNDERFLOW * 0.9, ZEROS),
        ]
    return cases


def fill_edge_rows(op, inputs, dtype):
    """Writes `edge_rows(dtype)` into the rows of q, then of k (the rest stay as drawn); returns
    {(written name, row index): (label, what it must come out as)}."""
    gen = torch.Generator().manual_seed(1)
    slots = [(name, i) for name in (NAMES[op]["q"], NAMES[op]["k"]) for i in range(rows(inputs[name]).shape[0])]
    cases = edge_rows(dtype)
    assert len(slots) >= len(cases), f"{op}: {len(slots)} rows for {len(cases)} edge cases"
    for (name, i), (_, make, _) in zip(slots, cases):
        x = torch.randn(inputs[name].shape[-1], generator=gen, dtype=torch.float64)
        rows(inputs[name])[i] = make(x).to(dtype)
    return {slot: (label, result) for slot, (label, _, result) in zip(slots, cases)}


def check_edge_rows(op, impl, dtype, device):
    """`impl` on every edge row at once (eps = 0): NaN rows all NaN, zero rows all zero, the rest
    within the contract's tolerance of the float64 value."""
    inputs = make_inputs(op, dtype, device, seed=3)
    want = fill_edge_rows(op, inputs, dtype)
    expected = exact(op, inputs, 0.0)
    run_impl(op, impl, inputs, 0.0)
    tolerance = registry.contract(op).TOLERANCES[dtype]
    for name in (NAMES[op]["q"], NAMES[op]["k"]):
        out, ref = rows(inputs[name]).cpu(), rows(expected[name])
        for i in range(out.shape[0]):
            label, result = want.get((name, i), ("normal", EXACT))
            where = f"{impl.name} {dtype} {name} row {i} ({label})"
            if result == NAN:
                assert out[i].isnan().all(), f"{where}: expected all NaN, got {out[i].tolist()[:8]}..."
            elif result == ZEROS:
                assert (out[i] == 0).all(), f"{where}: expected zeros, got {out[i].tolist()[:8]}..."
            else:
                check = agreement(where, out[i], ref[i], None, "fused", tolerance)
                assert check.ok, check.message


def check_zero_heads(op, impl, heads, device, dtype=torch.bfloat16):
    """A per-head op with no q heads or no kv heads: the other tensor normalized, nothing else."""
    inputs = make_inputs(op, dtype, device, seed=4, heads=heads)
    expected = exact(op, inputs, 1e-6)
    run_impl(op, impl, inputs, 1e-6)
    for name in ("q", "k"):
        check = agreement(f"{impl.name} {name}", inputs[name], expected[name], None, "fused",
                          registry.contract(op).TOLERANCES[dtype])
        assert check.ok, check.message


# --------------------------------------------------------------------------------------------
# Arguments the contract refuses, before anything is written
# --------------------------------------------------------------------------------------------
def _shared_buffer_views(op, inputs, dtype, device, overlap):
    """q and k as views of one buffer: side by side (overlap=False), or k starting inside q."""
    q_name, k_name = NAMES[op]["q"], NAMES[op]["k"]
    q, k = inputs[q_name], inputs[k_name]
    if op in PER_HEAD_OPS:  # [T, heads, D]: k's heads start at q's last head (overlap) or after it
        first_k = q.shape[1] - 1 if overlap else q.shape[1]
        buffer = torch.zeros(q.shape[0], first_k + k.shape[1], q.shape[2], dtype=dtype, device=device)
        views = buffer[:, : q.shape[1]], buffer[:, first_k:]
    else:  # [T, width]: k's columns start half way into q's (overlap) or after them
        first_k = q.shape[1] // 2 if overlap else q.shape[1]
        buffer = torch.zeros(q.shape[0], first_k + k.shape[1], dtype=dtype, device=device)
        views = buffer[:, : q.shape[1]], buffer[:, first_k:]
    views[0].copy_(q)
    views[1].copy_(k)
    return views


def rejections(op, dtype=torch.float32, device="cpu"):
    """[(label, make() -> the op's keyword arguments, fragment of the ValueError)]."""
    n = NAMES[op]
    q_name, k_name, qw_name, kw_name = n["q"], n["k"], n["q_weight"], n["k_weight"]

    def case(label, change, fragment):
        def make():
            args = dict(make_inputs(op, dtype, device, seed=5), eps=1e-6, weight_offset=0.0)
            change(args)
            return args

        return label, make, fragment

    def k_is_q(a):
        a[k_name], a[kw_name] = a[q_name], a[qw_name].clone()

    def k_overlaps_q(a):
        a[q_name], a[k_name] = _shared_buffer_views(op, a, dtype, device, overlap=True)

    def weight_in(weight_name, tensor_name):
        def change(a):
            a[weight_name] = rows(a[tensor_name])[0][: a[weight_name].shape[0]]
        return change

    def broadcast_tokens(a):
        a[q_name] = a[q_name][:1].expand(a[q_name].shape)

    def overlapping_rows(a):  # each row starts half a row after the previous one
        q = a[q_name]
        buffer = torch.randn(q.numel(), device=device).to(dtype)
        if op in PER_HEAD_OPS:
            a[q_name] = buffer.as_strided(q.shape, (q.shape[1] * q.shape[2] // 2, q.shape[2] // 2, 1))
        else:
            a[q_name] = buffer.as_strided(q.shape, (q.shape[1] // 2, 1))

    def requires_grad(name):
        def change(a):
            a[name] = a[name].clone().requires_grad_()
        return change

    def inference_tensor(a):
        with torch.inference_mode():
            a[q_name] = a[q_name].clone()

    def setting(name, value):
        def change(a):
            a[name] = value
        return change

    mine = f"{k_name}: expected memory disjoint from {q_name} (both are written in place)"
    cases = [
        case(f"{k_name} is {q_name}", k_is_q, mine),
        case(f"{k_name} overlaps {q_name}", k_overlaps_q, mine),
        case(f"{qw_name} inside {q_name}", weight_in(qw_name, q_name),
             f"{qw_name}: expected memory disjoint from {q_name} ({q_name} is written in place)"),
        case(f"{kw_name} inside {k_name}", weight_in(kw_name, k_name),
             f"{kw_name}: expected memory disjoint from {k_name} ({k_name} is written in place)"),
        case(f"{q_name} broadcast over tokens", broadcast_tokens,
             f"{q_name}: expected every element at its own memory location"),
        case(f"{q_name} rows overlapping", overlapping_rows, f"{q_name}: expected every element at its own memory location"),
        case(f"{k_name} requires grad", requires_grad(k_name), f"{k_name}: expected a tensor that does not require grad"),
        case(f"{q_name} an inference tensor", inference_tensor,
             f"{q_name}: expected a tensor writable here, got an inference tensor"),
        case("eps infinite in float32", setting("eps", 1e300), "eps: expected a finite float >= 0"),
        case("eps just past float32's max", setting("eps", 2.0**128 - 2.0**103), "eps: expected a finite float >= 0"),
        case("weight_offset infinite in float32", setting("weight_offset", -1e39), "weight_offset: expected a finite float"),
    ]
    if op == "qk_norm_rope":
        def cache_in_k(a):
            k, width = a["k"], a["cos_sin_cache"].shape[1]
            a["cos_sin_cache"] = k.reshape(-1)[: (k.numel() // width) * width].view(-1, width)

        def positions_in_q(a):
            a["positions"] = a["q"].reshape(-1).view(torch.int32)[: a["positions"].shape[0]]

        cases += [
            case("cos_sin_cache inside k", cache_in_k, "cos_sin_cache: expected memory disjoint from k (k is written in place)"),
            case("positions inside q", positions_in_q, "positions: expected memory disjoint from q (q is written in place)"),
        ]
    return cases


def acceptances(op, dtype=torch.float32, device="cpu"):
    """[(label, make() -> the op's keyword arguments, new_to_kernels)] that share memory safely
    (or carry grad on a read-only input): each must give what separate, plain tensors give.
    `new_to_kernels`: a layout or input the kernels' own tests do not already cover (the others
    test the checks, so the CPU tests run them on the reference alone)."""
    n = NAMES[op]

    def case(label, change, new_to_kernels=False):
        def make():
            args = make_inputs(op, dtype, device, seed=6)
            change(args)
            return args

        return label, make, new_to_kernels

    def one_weight(a):
        if a[n["q_weight"]].shape == a[n["k_weight"]].shape:
            a[n["k_weight"]] = a[n["q_weight"]]

    def side_by_side(a):
        a[n["q"]], a[n["k"]] = _shared_buffer_views(op, a, dtype, device, overlap=False)

    def parameters(a):
        for name in (n["q_weight"], n["k_weight"]):
            a[name] = torch.nn.Parameter(a[name].clone())

    cases = [case("one weight for q and k", one_weight), case("q and k side by side in one buffer", side_by_side),
             case("weights that are parameters (require grad)", parameters, new_to_kernels=True)]
    if op in PER_HEAD_OPS:
        def interleaved(a):  # [T, H, 3, D]: each head's q, k and v rows next to each other (GPT-NeoX's layout)
            q, k = a["q"], a["k"]
            qkv = torch.zeros(q.shape[0], q.shape[1], 3, q.shape[2], dtype=dtype, device=device)
            qkv[:, :, 0].copy_(q)
            qkv[:, : k.shape[1], 1].copy_(k)
            a["q"], a["k"] = qkv[:, :, 0], qkv[:, : k.shape[1], 1]

        cases.append(case("q and k heads interleaved in one buffer", interleaved, new_to_kernels=True))
    return cases
