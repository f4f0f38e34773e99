"""The CUDA C sources, and the translation units a build makes of them (no torch, no GPU).

A kernel file of an op in the ladder layout (``<op>/v3_vectors_in_registers.cuh``,
``<op>/tuned.cuh``) defines, in its namespace (``cookbook::<op>::v3``, ``cookbook::<op>::tuned``),
one launcher per dtype and rounding: ``template <DType, Rounding> cudaError_t launch(const Params&,
cudaStream_t)``. It is built as its own extension from small translation units:

* ``binding.cpp`` (host compiler): the op's torch glue, ``<op>/binding.h``, registering the op
  ``cookbook::<op>_<stem>`` (``qk_norm_v3``, ``qk_norm_tuned``);
* one ``<dtype>_<rounding>.cu`` (nvcc) per dtype and rounding, each instantiating one launcher,
  so the kernels of one extension compile in parallel.

`cookbook.cuda` builds them with torch; `cookbook.nvcc_report` compiles the same units with nvcc
alone (CI has no GPU).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

KERNEL_DIR = Path(__file__).resolve().parent

DTYPES = ("kFloat32", "kFloat16", "kBFloat16")  # cookbook::DType, in its order
ROUNDINGS = ("kFused", "kHf")  # cookbook::Rounding, in its order
_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)


@dataclass(frozen=True)
class Extension:
    """One kernel file of an op, built as its own torch extension."""

    op: str  # "qk_norm"
    kernel: str  # its header, relative to kernels_cuda/: "qk_norm/v3_vectors_in_registers.cuh"

    @property
    def stem(self) -> str:
        """"v3" for ``v3_vectors_in_registers.cuh``, "tuned" for ``tuned.cuh``."""
        return Path(self.kernel).stem.split("_")[0]

    @property
    def name(self) -> str:
        """The extension's torch op (``torch.ops.cookbook.<name>``) and library name."""
        return f"{self.op}_{self.stem}"

    @property
    def namespace(self) -> str:
        return f"cookbook::{self.op}::{self.stem}"

    @property
    def explains(self) -> bool:
        """Whether the extension also registers ``cookbook::<name>_explain`` (the tuned kernel's
        host policy, asked on the GPU by `cookbook.explain`)."""
        return self.stem == "tuned"

    def kernel_units(self) -> dict[str, str]:
        """{file name: source} of the nvcc units: one launcher each (and, for the tuned kernel, the
        explain function of the same dtype and rounding)."""
        if self.op == "tp_qk_norm":
            return self._tp_kernel_units()
        units = {}
        for dtype in DTYPES:
            for rounding in ROUNDINGS:
                name = f"{dtype[1:].lower()}_{rounding[1:].lower()}.cu"
                args = f"<cookbook::DType::{dtype}, cookbook::Rounding::{rounding}>"
                units[name] = (
                    f'#include "{self.kernel}"\n'
                    f"template cudaError_t {self.namespace}::launch{args}(\n"
                    f"    const cookbook::{self.op}::Params&, cudaStream_t);\n"
                )
                if self.explains:
                    units[name] += f"template std::string {self.namespace}::explain{args}(const cookbook::{self.op}::Params&);\n"
        return units

    def binding_unit(self) -> str:
        """The source of the host unit: the op's glue, registering ``cookbook::<name>`` (and
        ``cookbook::<name>_explain`` for the tuned kernel)."""
        if self.op == "tp_qk_norm":
            return self._tp_binding_unit()
        unit = f'#include "{self.op}/binding.h"\nCOOKBOOK_{self.op.upper()}_EXTENSION({self.name}, {self.namespace})\n'
        if self.explains:
            unit += f"COOKBOOK_{self.op.upper()}_EXPLAIN({self.name}, {self.namespace})\n"
        return unit

    # tp_qk_norm, a collective, registers a torch op per step of the call it runs
    # (tp_qk_norm/binding.h): rung 1 its two steps around the host's all-reduce (``<name>_sum_sq``,
    # ``<name>_apply``), the fused rungs ``<name>_fused``, the tuned kernel all of them, its absent
    # launch and its explain.
    @property
    def tp_steps(self) -> tuple[str, ...]:
        """The torch ops of a tp_qk_norm extension, after ``<name>_``."""
        if self.stem == "v1":
            return ("sum_sq", "apply")
        if self.stem == "tuned":
            return ("sum_sq", "apply", "fused", "absent", "explain")
        return ("fused",)

    def _tp_kernel_units(self) -> dict[str, str]:
        ns, op = self.namespace, "cookbook::tp_qk_norm"
        units = {}
        for dtype in DTYPES:
            for rounding in ROUNDINGS:
                d, r = f"cookbook::DType::{dtype}", f"cookbook::Rounding::{rounding}"
                lines = [f'#include "{self.kernel}"']
                if "fused" in self.tp_steps:
                    lines.append(f"template cudaError_t {ns}::launch<{d}, {r}>(const {op}::FusedParams&, cudaStream_t);")
                if "apply" in self.tp_steps:
                    lines.append(f"template cudaError_t {ns}::launch_apply<{d}, {r}>(const {op}::ApplyParams&, cudaStream_t);")
                    if rounding == "kFused":
                        lines.append(f"template cudaError_t {ns}::launch_sum_sq<{d}>(const {op}::Params&, float*, cudaStream_t);")
                if "explain" in self.tp_steps:
                    lines.append(f"template std::string {ns}::explain<{d}, {r}>(const {op}::FusedParams&);")
                if "absent" in self.tp_steps and dtype == "kFloat32" and rounding == "kFused":
                    lines.append(f"template cudaError_t {ns}::absent<{d}>({op}::FusedParams, cudaStream_t);")
                units[f"{dtype[1:].lower()}_{rounding[1:].lower()}.cu"] = "\n".join(lines) + "\n"
        return units

    def _tp_binding_unit(self) -> str:
        unit = '#include "tp_qk_norm/binding.h"\n'
        implementation = 0 if self.stem == "tuned" else int(self.stem[1:])  # the header's (params.h)
        if "apply" in self.tp_steps:
            unit += f"COOKBOOK_TP_QK_NORM_PIPELINE({self.name}, {self.namespace})\n"
        if "fused" in self.tp_steps:
            unit += f"COOKBOOK_TP_QK_NORM_FUSED({self.name}, {self.namespace}, {implementation})\n"
        if "absent" in self.tp_steps:
            unit += f"COOKBOOK_TP_QK_NORM_ABSENT({self.name}, {self.namespace})\n"
        if "explain" in self.tp_steps:
            unit += f"COOKBOOK_TP_QK_NORM_EXPLAIN({self.name}, {self.namespace})\n"
        return unit

    def dependencies(self) -> list[Path]:
        """Every source file the extension's units include, directly or not (its build key)."""
        roots = [self.kernel, f"{self.op}/binding.h"]
        seen: dict[str, Path] = {}
        while roots:
            relative = roots.pop()
            path = KERNEL_DIR / relative
            if relative in seen or not path.is_file():
                continue  # a system or CUDA header
            seen[relative] = path
            roots += _INCLUDE.findall(path.read_text())
        return [seen[key] for key in sorted(seen)]
