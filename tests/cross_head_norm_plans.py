"""What the tuned cross_head_norm kernel's policy must choose, shared by the CPU test (the policy
compiled for the host, tests/test_cross_head_norm.py) and the GPU test (the kernels a call launches,
tests/test_gpu_cross_head_norm.py). A choice is (path, vectors per thread or lane, grid order,
weights, warm, block compiled in), as `describe(plan)`'s template arguments and the profiler's
kernel names give them."""

from __future__ import annotations

import re

import torch

from cookbook.ops import cross_head_norm as contract

BELOW, FROM = "cta_per_row_below_a_wave", "cta_per_row_from_a_wave"
NONE = ("-", "-", "-", "-")

# The former fastest version's choices (0c0c9f5's v14), which the tuned kernel makes at the bench shapes.
BENCH_PLANS = {
    (1, 8192, 8192): (BELOW, "2", "kTokensByTensor", "kWithTheRow", "kNothing", "0"),
    (16, 8192, 8192): (BELOW, "2", "kTokensByTensor", "kWithTheRow", "kNothing", "0"),
    (256, 8192, 8192): (BELOW, "2", "kTokensByTensor", "kAfterTheSum", "kNothing", "0"),
    (1024, 4096, 4096): (FROM, "4", "kTokensByTensor", "kWithTheRow", "kFirstRowsAndNextWave", "0"),
    (1536, 8192, 8192): (FROM, "2", "kTokensByTensor", "kAfterTheSum", "kFirstRows", "0"),
    (2048, 8192, 8192): (FROM, "8", "kTokenMajor", "kAfterTheSum", "kFirstRows", "128"),
    (8192, 8192, 8192): (FROM, "8", "kTokenMajor", "kAfterTheSum", "kFirstRows", "128"),
    (2048, 8192, 8192, contract.SEPARATE): (FROM, "2", "kTokensByTensor", "kAfterTheSum", "kFirstRows", "0"),
    (4096, 6144, 1024): (FROM, "8", "kTokenMajor", "kAfterTheSum", "kFirstRows", "128"),
    (1024, 5120, 1024): (FROM, "8", "kTokensByTensor", "kAfterTheSum", "kFirstRowsAndNextWave", "0"),
    (512, 32768, 4096): (FROM, "8", "kTokenMajor", "kAfterTheSum", "kFirstRows", "0"),
    (16384, 768, 128): ("warp_per_token", "4", *NONE),
    (8192, 2048, 256): ("warp_per_token", "8", *NONE),
}

# The policy's edges on a GPU of 132 SMs (H100, H200): (shape, dtype, layout, choice).
EDGE_PLANS = [
    # below one wave of four-warp CTAs, and from there (132 x 8 eight-vector CTAs: 1056 rows)
    ((527, 8192, 8192), torch.bfloat16, "fused_qkv", (BELOW, "2", "kTokensByTensor", "kAfterTheSum", "kNothing", "0")),
    ((528, 8192, 8192), torch.bfloat16, "fused_qkv", (FROM, "2", "kTokensByTensor", "kAfterTheSum", "kFirstRows", "0")),
    # three waves: the token-major grid for views of one tensor, not for tensors of their own
    # (6144 + 1024 bf16: a wave of 96-thread, eight-vector CTAs is 132 x 10 = 1320 rows)
    ((1979, 6144, 1024), torch.bfloat16, "fused_qkv", (FROM, "8", "kTokensByTensor", "kAfterTheSum", "kFirstRowsAndNextWave", "0")),
    ((1980, 6144, 1024), torch.bfloat16, "fused_qkv", (FROM, "8", "kTokenMajor", "kAfterTheSum", "kFirstRows", "128")),
    ((1980, 6144, 1024), torch.bfloat16, "separate", (FROM, "8", "kTokensByTensor", "kAfterTheSum", "kFirstRows", "0")),
    # like rows: within 2x of each other in width, 4097 to 8192 bf16 elements
    ((1536, 8192, 4096), torch.bfloat16, "separate", (FROM, "2", "kTokensByTensor", "kAfterTheSum", "kFirstRows", "0")),
    ((1536, 8192, 4088), torch.bfloat16, "separate", (FROM, "8", "kTokensByTensor", "kAfterTheSum", "kFirstRowsAndNextWave", "0")),
    # one to three waves at four vectors per thread: the weights held with the row, the next wave warmed
    ((2048, 4096, 4096), torch.bfloat16, "separate", (FROM, "4", "kTokensByTensor", "kWithTheRow", "kFirstRowsAndNextWave", "0")),
    ((2048, 4096, 4096), torch.float32, "separate", (FROM, "2", "kTokensByTensor", "kAfterTheSum", "kFirstRows", "0")),
    # float32 rows past 4096: four warps do not hold them, the block is set at launch
    ((2048, 8192, 8192), torch.float32, "fused_qkv", (FROM, "8", "kTokenMajor", "kAfterTheSum", "kFirstRows", "0")),
    # narrow rows: a warp per token from 18 tokens per vector of a token (768 + 128 bf16: 112 vectors)
    ((2015, 768, 128), torch.bfloat16, "fused_qkv", (BELOW, "1", "kTokensByTensor", "kAfterTheSum", "kNothing", "0")),
    ((2016, 768, 128), torch.bfloat16, "fused_qkv", ("warp_per_token", "4", *NONE)),
    # rows wider than the registers hold: staged where the shared memory takes them
    ((3, 65536, 8), torch.bfloat16, "fused_qkv", ("staged_row", "-", *NONE)),
    ((3, 65536, 8), torch.float32, "fused_qkv", ("strided", "-", *NONE)),
    ((3, 32768, 8), torch.bfloat16, "fused_qkv", (BELOW, "8", "kTokensByTensor", "kAfterTheSum", "kNothing", "0")),
]


def choice_of_plan(plan: dict) -> tuple:
    """A plan's choice (`describe`'s path and template arguments)."""
    args = dict(arg.split("=", 1) for arg in plan["template_arguments"].split(", "))
    short = lambda key: args.get(key, "-").split("::")[-1]  # noqa: E731
    return (plan["path"], args.get("kVecsPerThread", args.get("kVecsPerLane", "-")), short("kGridOrder"),
            short("kWeights"), short("kWarm"), args.get("kBlockThreads", "-"))


GRID_ORDERS = ("kTokensByTensor", "kTokenMajor")
WEIGHTS = ("kAfterTheSum", "kWithTheRow")
WARMS = ("kNothing", "kFirstRows", "kFirstRowsAndNextWave")


def launched_choices(names) -> list[tuple]:
    """The choices of the cross_head_norm kernels among profiler kernel names (the path of a CTA per
    row is left as "cta_per_row": the launched kernel does not say which side of a wave it was)."""
    found = []
    for name in names:
        args = [a.strip() for a in name.split(">(")[0].split("<", 1)[1].split(",")] if "<" in name else []
        value = lambda arg: int(re.sub(r"^\([^()]*\)", "", arg))  # noqa: E731  "(ns::Warm)1" -> 1
        if "cross_head_norm_tuned_kernel" in name:
            vecs, order, weights, warm, block = (value(a) for a in args[2:7])
            found.append(("cta_per_row", str(vecs), GRID_ORDERS[order], WEIGHTS[weights], WARMS[warm], str(block)))
        elif "cross_head_norm_v7_kernel" in name:
            found.append(("warp_per_token", str(value(args[2])), *NONE))
        elif "cross_head_norm_staged_kernel" in name:
            found.append(("staged_row", "-", *NONE))
        elif "cross_head_norm_v2_kernel" in name:
            found.append(("strided", "-", *NONE))
    return found


def as_launched(choice: tuple) -> tuple:
    return ("cta_per_row", *choice[1:]) if choice[0] in (BELOW, FROM) else choice
