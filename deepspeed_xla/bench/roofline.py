"""A roofline estimate of a step on a TPU generation from a step graph's counted cost (``bench.cost``).

An estimate of what the graph allows, not a measurement: step time ≈ max(FLOPs / peak, HBM bytes / HBM bandwidth)
+ collective bytes on the wire / ICI bandwidth, with the chips' published figures.
"""
from dataclasses import dataclass
from typing import Dict, Optional

from deepspeed_xla.devices.tpu import PEAK_BF16_TFLOPS_PER_CHIP


@dataclass(frozen=True)
class Tpu:
    """One chip's published figures (Google Cloud's page ``source``): peak bf16 FLOP/s, HBM and bidirectional
    inter-chip interconnect bandwidth in bytes/s."""
    name: str
    peak_bf16_flops: float
    hbm_bytes_per_s: float
    ici_bytes_per_s: float
    source: str


# HBM and bidirectional ICI GB/s per chip from the same pages as the device type's peaks
TPUS: Dict[str, Tpu] = {name: Tpu(name, PEAK_BF16_TFLOPS_PER_CHIP[name] * 1e12, hbm * 1e9, ici * 1e9,
                                  f"https://cloud.google.com/tpu/docs/{name}")
                        for name, hbm, ici in (("v5e", 819, 400), ("v5p", 2765, 1200), ("v6e", 1638, 800))}


def wire_bytes(collective: dict, world_size: int) -> float:
    """The bytes one device sends for a collective of ``collective['bytes']`` (the whole tensor) among n devices
    (its replica group, else the whole job) by a ring: all-reduce 2(n−1)/n, all-gather, reduce-scatter and
    all-to-all (n−1)/n, a collective-permute all of it."""
    groups = collective.get("replica_groups")
    n = len(groups[0]) if groups else world_size
    if collective["kind"] == "collective-permute":
        return float(collective["bytes"]) if collective.get("source_target_pairs") else 0.0
    share = (n - 1) / n if n > 1 else 0.0
    return collective["bytes"] * share * (2 if collective["kind"] == "all-reduce" else 1)


def estimate(cost: dict, tpu: Tpu, model_flops: Optional[float], world_size: int = 1) -> dict:
    """The step's estimated seconds on one ``tpu`` chip and the MFU it allows: ``model_flops`` (the analytic FLOPs
    of the tokens one device trains a step) over the estimated time at the chip's peak."""
    compute = cost["dot_flops"] / tpu.peak_bf16_flops
    memory = (cost["bytes_read"] + cost["bytes_written"]) / tpu.hbm_bytes_per_s
    wire = sum(wire_bytes(c, world_size) for c in cost["collectives"])
    step = max(compute, memory) + wire / tpu.ici_bytes_per_s
    return {"tpu": tpu.name, "compute_s": compute, "memory_s": memory, "collective_wire_bytes": wire,
            "collective_s": wire / tpu.ici_bytes_per_s, "step_s": step,
            "mfu": model_flops / (step * tpu.peak_bf16_flops) if model_flops and step else None,
            "source": tpu.source}
