"""Diagnostic: which tensor does torch.compile leave wrong for cross_head_norm on CUDA?"""
import torch

import cookbook
from cookbook.ops import cross_head_norm as contract

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
for backend in ("reference", "cuda") if DEVICE == "cuda" else ("reference",):
    for fused in (True, False):
        inputs = contract.make_inputs(64, 4096, 1024, torch.bfloat16, DEVICE, seed=2, fused_qkv=fused)
        original = {k: v.clone() for k, v in inputs.items()}
        eager = {k: v.clone() for k, v in inputs.items()}
        cookbook.cross_head_norm(**eager, backend=backend)
        torch._dynamo.reset()
        step = torch.compile(lambda q, k, q_weight, k_weight: cookbook.cross_head_norm(q, k, q_weight, k_weight, backend=backend), fullgraph=True)
        step(**inputs)
        print(backend, "fused" if fused else "separate",
              {n: (torch.equal(inputs[n], eager[n]), torch.equal(inputs[n], original[n])) for n in ("q", "k")})
