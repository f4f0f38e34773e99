"""One contract module per op: checks, PyTorch reference, inputs, tolerances, bytes moved."""
