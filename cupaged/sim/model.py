"""A fixed, documented model of H200 time for a profiled sim launch: a proxy, never a benchmark.

The constants below are the H200's published figures and a few measured ones; only a calibration
on a GPU may change them (never to flatter a kernel). A launch's modeled time is

    launch overhead + sum over the grid's waves of the largest of these terms for that wave:
      unique bytes / HBM bandwidth                       (DRAM-compulsory traffic)
      bytes / min(HBM, Little's law)                     (in-flight bytes per SM x active SMs / latency)
      shared-memory wavefronts per SM / clock            (1 wavefront per clock per SM)
      mma.sync FLOPs per SM / (mma peak / SMs)
      CUDA-core FLOPs per SM / (fp32 peak / SMs)         (the op's declared FLOPs - mma FLOPs)

A wave is as many CTAs as fit on the device at once (SMs x CTAs per SM, the occupancy from the
compile gate's registers and shared memory and the block's threads); the last wave may be partial
(its CTAs spread over min(SMs, CTAs) SMs). Per-CTA figures are the profiled launch's totals over the
CTAs it ran, so a launch profiled on a sample of its CTAs models the whole grid.
"""

from __future__ import annotations

import dataclasses

__all__ = ["GPU", "H200", "ARCH_LIMITS", "ctas_per_sm", "Terms", "wave_time_us", "launch_time_us"]


@dataclasses.dataclass(frozen=True)
class GPU:
    """A GPU's figures for the model (rates per second, sizes in bytes)."""

    name: str
    hbm_bytes_per_s: float            # spec bandwidth
    copy_bytes_per_s: float           # a measured device-to-device copy (printed as a second % column)
    sms: int
    clock_hz: float                   # for the compute terms
    fp32_flops_per_s: float           # FMA = 2 FLOP
    mma_flops_per_s: float            # mma.sync f16/bf16 (2/3 of the wgmma peak)
    memory_latency_s: float
    launch_overhead_s: float
    arch: str                         # the compile gate's architecture for this GPU's occupancy

    @property
    def little_bytes_per_sm(self) -> float:
        """Bytes one SM must keep in flight to saturate HBM: bandwidth x latency / SMs."""
        return self.hbm_bytes_per_s * self.memory_latency_s / self.sms


H200 = GPU(name="H200", hbm_bytes_per_s=4.8e12, copy_bytes_per_s=4.3e12, sms=132, clock_hz=1.83e9,
           fp32_flops_per_s=2 * 128 * 132 * 1.83e9, mma_flops_per_s=660e12, memory_latency_s=0.8e-6,
           launch_overhead_s=2e-6, arch="sm_90")


@dataclasses.dataclass(frozen=True)
class ArchLimits:
    """Per-SM resources that bound occupancy."""

    shared_bytes: int           # usable shared memory per SM
    shared_per_cta_reserved: int  # the driver's reservation per CTA
    registers: int
    threads: int
    ctas: int
    register_unit: int = 256    # registers are allocated per warp in units of 256


ARCH_LIMITS = {
    "sm_80": ArchLimits(shared_bytes=164 * 1024, shared_per_cta_reserved=1024, registers=65536, threads=2048, ctas=32),
    "sm_90": ArchLimits(shared_bytes=228 * 1024, shared_per_cta_reserved=1024, registers=65536, threads=2048, ctas=32),
}


def ctas_per_sm(registers: int, threads: int, shared_bytes: int, arch: str = "sm_90") -> int:
    """CTAs of ``threads`` threads using ``registers`` per thread and ``shared_bytes`` (static +
    dynamic) that fit on one SM of ``arch``; 0 when one does not fit."""
    lim = ARCH_LIMITS[arch]
    warps = -(-threads // 32)
    per_warp = -(-max(registers, 1) * 32 // lim.register_unit) * lim.register_unit
    by_regs = lim.registers // (per_warp * warps)
    by_threads = lim.threads // (warps * 32)
    by_smem = lim.shared_bytes // (shared_bytes + lim.shared_per_cta_reserved)
    return max(0, min(lim.ctas, by_regs, by_threads, by_smem))


@dataclasses.dataclass(frozen=True)
class Terms:
    """Per-CTA figures of a launch (averages over the CTAs profiled)."""

    unique_bytes: float       # distinct global bytes (read + written)
    bytes: float              # requested global bytes
    inflight_bytes: float     # bytes a CTA keeps in flight (max_inflight_bytes_per_cta)
    wavefronts: float         # shared-memory wavefronts
    mma_flops: float
    cuda_core_flops: float


def wave_time_us(t: Terms, ctas: int, gpu: GPU = H200) -> dict:
    """Each term's time in µs for one wave of ``ctas`` CTAs (spread evenly over the SMs)."""
    active = min(gpu.sms, ctas)
    stacked = -(-ctas // active)  # CTAs on a busy SM
    little = t.inflight_bytes * stacked * active / gpu.memory_latency_s
    bw = min(gpu.hbm_bytes_per_s, little) if little > 0 else gpu.hbm_bytes_per_s
    return {
        "hbm": ctas * t.unique_bytes / gpu.hbm_bytes_per_s * 1e6,
        "latency": ctas * t.bytes / bw * 1e6,
        "shared": stacked * t.wavefronts / gpu.clock_hz * 1e6,
        "mma": stacked * t.mma_flops / (gpu.mma_flops_per_s / gpu.sms) * 1e6,
        "fp32": stacked * t.cuda_core_flops / (gpu.fp32_flops_per_s / gpu.sms) * 1e6,
    }


def launch_time_us(t: Terms, ctas: int, per_sm: int, gpu: GPU = H200) -> tuple[float, str, int, dict]:
    """(modeled µs, the term bounding the largest wave, waves, each term summed over the waves) of a
    grid of ``ctas`` CTAs at ``per_sm`` CTAs per SM."""
    per_wave = gpu.sms * max(per_sm, 1)
    full, tail = divmod(ctas, per_wave)
    total, bound = gpu.launch_overhead_s * 1e6, "launch"
    summed = dict.fromkeys(("hbm", "latency", "shared", "mma", "fp32"), 0.0)
    for n, count in ((per_wave, full), (tail, 1 if tail else 0)):
        if not count:
            continue
        terms = wave_time_us(t, n, gpu)
        name = max(terms, key=terms.get)
        total += count * terms[name]
        for k, v in terms.items():
            summed[k] += count * v
        if n == per_wave or not full:
            bound = name if terms[name] > 0 else bound
    return total, bound, full + (1 if tail else 0), summed
