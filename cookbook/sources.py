"""What an executed notebook or a results page shows of an op, and a fingerprint of it.

An op's sources are its CUDA C kernels (every file they include, shared headers too), its Numba
kernels and their helpers, its contract, and its registry entries (names, leads, kernel files).
The benchmark records the fingerprint of each op it timed in its pages' metadata, and every
notebook prints the fingerprints of the ops it shows when it starts. tests/test_freshness.py
recomputes them: an executed notebook, or a page it plots, whose fingerprint is not today's shows
kernels or leads that have changed since, and must be run again.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)


def _included(kernel_dir: Path, roots: list[str]) -> list[Path]:
    seen: dict[str, Path] = {}
    while roots:
        relative = roots.pop()
        path = kernel_dir / relative
        if relative in seen or not path.is_file():
            continue
        seen[relative] = path
        roots += _INCLUDE.findall(path.read_text())
    return [seen[key] for key in sorted(seen)]


# Ops whose Numba kernels and contract build on another op's: those files are their sources too.
BUILT_ON = {"qk_norm_rope_cache": ("kernels_numba/qk_norm_rope.py", "cookbook/ops/qk_norm_rope.py")}


def files(op: str) -> list[Path]:
    """The source files of `op` (relative to the checkout), sorted."""
    kernel_dir = ROOT / "kernels_cuda"
    roots = [p.relative_to(kernel_dir).as_posix() for p in sorted((kernel_dir / op).glob("*")) if p.is_file()]
    found = _included(kernel_dir, roots)
    for extra in (f"kernels_numba/{op}.py", "kernels_numba/helpers.py", f"cookbook/ops/{op}.py", *BUILT_ON.get(op, ())):
        if (ROOT / extra).is_file():
            found.append(ROOT / extra)
    return sorted({p.relative_to(ROOT) for p in found})


def registry_text(op: str) -> str:
    from cookbook import registry

    return "\n".join(f"{i.name}|{i.level}|{i.version}|{i.kernel}|{i.target}|{i.lead}" for i in registry.implementations(op))


def fingerprint(op: str) -> str:
    """12 hex digits of a hash of `op`'s sources and registry entries."""
    digest = hashlib.sha256()
    for path in files(op):
        digest.update(path.as_posix().encode() + b"\0" + (ROOT / path).read_bytes() + b"\0")
    digest.update(registry_text(op).encode())
    return digest.hexdigest()[:12]


def fingerprints(ops) -> dict[str, str]:
    return {op: fingerprint(op) for op in ops}
