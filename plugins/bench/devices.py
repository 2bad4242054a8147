"""Published peak figures of accelerators, for the roofline cost model's hardware what-ifs."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from .costmodel import json_number


@dataclass(frozen=True)
class DeviceSpec:
    """Published peak figures of a device. ``peak_flops`` maps a dtype name to dense FLOP/s
    (no structured sparsity: the datasheets' "with sparsity" figures are halved); ``mem_bw``
    is bytes/s; ``source`` names the document the figures come from."""

    key: str
    name: str
    kind: str                          # "cuda", "cpu", ...
    peak_flops: Mapping[str, float]
    mem_bw: float
    memory_gib: float
    source: str = ""

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "peak_flops": dict(self.peak_flops)}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> DeviceSpec:
        for k in ("key", "name", "kind"):
            if not isinstance(d.get(k), str):
                raise ValueError(f"{k}: must be a string, got {d.get(k)!r}")
        pf = d.get("peak_flops")
        if not isinstance(pf, dict) or not pf or not all(
                isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0
                for v in pf.values()):
            raise ValueError(f"peak_flops: must map dtype names to positive FLOP/s, got {pf!r}")
        bw = json_number(d, "mem_bw")
        if bw <= 0:
            raise ValueError(f"mem_bw: must be > 0, got {bw!r}")
        return cls(key=d["key"], name=d["name"], kind=d["kind"],
                   peak_flops={str(k): float(v) for k, v in pf.items()}, mem_bw=bw,
                   memory_gib=json_number(d, "memory_gib"), source=str(d.get("source", "")))


def _dev(key: str, name: str, bf16_tf: float, fp32_tf: float, tb_s: float, gib: float,
         source: str, fp16_tf: float | None = None) -> DeviceSpec:
    t = 1e12
    return DeviceSpec(key, name, "cuda", {"bfloat16": bf16_tf * t,
                                          "float16": (fp16_tf or bf16_tf) * t,
                                          "float32": fp32_tf * t}, tb_s * t, gib, source)


# Dense tensor-core BF16/FP16 and non-tensor FP32 (not TF32) peaks, memory bandwidth and capacity
# as printed on NVIDIA's datasheets (capacity in the datasheet's GB, used as GiB).
DEVICES: dict[str, DeviceSpec] = {d.key: d for d in (
    _dev("h100-sxm", "NVIDIA H100 SXM", 989, 67, 3.35, 80,
         "NVIDIA H100 Tensor Core GPU datasheet (SXM; 1,979 TFLOPS BF16 with sparsity)"),
    _dev("h100-pcie", "NVIDIA H100 PCIe", 756, 51, 2.0, 80,
         "NVIDIA H100 Tensor Core GPU datasheet (PCIe; 1,513 TFLOPS BF16 with sparsity)"),
    _dev("h200", "NVIDIA H200 SXM", 989, 67, 4.8, 141,
         "NVIDIA H200 Tensor Core GPU datasheet (SXM; 1,979 TFLOPS BF16 with sparsity)"),
    _dev("a100-sxm-80gb", "NVIDIA A100 SXM 80GB", 312, 19.5, 2.039, 80,
         "NVIDIA A100 Tensor Core GPU datasheet (80GB SXM; 624 TFLOPS BF16 with sparsity)"),
    _dev("l4", "NVIDIA L4", 121, 30.3, 0.3, 24,
         "NVIDIA L4 Tensor Core GPU datasheet (242 TFLOPS BF16 with sparsity)"),
    _dev("rtx-4070-laptop", "NVIDIA GeForce RTX 4070 Laptop GPU", 31.2, 15.6, 0.256, 8,
         "approximate: 4608 CUDA cores at a 1695 MHz boost clock (TGP-dependent; TechPowerUp "
         "GPU database), FP16/BF16 tensor with FP32 accumulate at 2x FP32 (Ada GeForce); "
         "128-bit GDDR6 at 16 Gbps"),
)}
