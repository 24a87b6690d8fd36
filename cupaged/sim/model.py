"""A fixed, documented model of H200 time for a profiled sim launch (model v2): a proxy, never a benchmark.

The constants below are the H200's published figures and a few measured ones; only a calibration
on a GPU may change them (never to flatter a kernel). A launch's modeled time is

    launch overhead + sum over the grid's waves of the largest of these terms for that wave:
      hbm      unique bytes / achievable bandwidth            (DRAM-compulsory traffic, device-wide)
      latency  bytes / min(achievable, Little's law)          (bytes in flight by the wave's CTAs / latency)
      shared   shared-memory wavefronts per SM / clock        (1 wavefront per clock per SM)
      mma      tensor-core FLOPs per SM / (their peak / SMs), summed as time over the kinds of work:
               mma.sync (HMMA) at 660 TFLOP/s, wgmma (GMMA) at 989 (16-bit inputs: HGMMA) or 1979 (fp8: QGMMA)
      issue    warp instructions per SM / (4 x clock)         (4 schedulers, 1 warp instruction per clock each)
      mufu     MUFU warp instructions per SM x 2 / clock      (32 lanes at 16 per clock per SM on sm_90)

"Per SM" is the load of the busiest SM of the wave. A wave is as many CTAs as fit on the device at
once (SMs x CTAs per SM, the occupancy from ptxas's registers (for ``GPU.arch``) and shared memory and the
block's threads); the last wave may be partial: its ``n`` CTAs spread over min(SMs, n) SMs, so its
busiest SM holds ceil(n / min(SMs, n)) CTAs and the per-SM terms (shared, mma, issue, mufu) are that
SM's load. HBM is shared by the whole device: the hbm term is the wave's own bytes, so summed over
the waves it is exactly the launch's unique bytes / achievable bandwidth, and a partial wave pays for
its few CTAs through the latency term (Little's law over the CTAs it has in flight, never more).

Why these terms: HBM is priced at what an H200 delivers (a measured device-to-device copy, 4.3 TB/s),
not at its 4.8 TB/s spec, which no kernel reaches. Every warp instruction takes an issue slot, so a
kernel that moves the right bytes can still be bound by the integer and control instructions around
its loads; the FP32 pipes retire 4 warp instructions per clock per SM, as fast as the schedulers
issue, so the issue term covers them (model v1's fp32 term of declared FLOPs is gone). MUFU (exp2,
rcp, rsqrt, sin, cos, lg2) runs at 16 lanes per clock per SM, a quarter of the issue rate.

Hopper (sm_90a): the mma term prices each kind of tensor-core work at its own dense peak and sums the
times (a launch mixing HMMA and GMMA work pays for both); its parts are reported beside the terms
(``MMA_PARTS``: mma_hmma, mma_gmma, mma_gmma_fp8; they add up to mma and never bound a wave on their
own). The instructions around that work — HGMMA / QGMMA, WARPGROUP.ARRIVE / DEPBAR, the bulk and
tensor copies (UBLKCP, UTMALDG, UTMASTG, UTMAPF, UTMACCTL) and the mbarrier operations (SYNCS.*) —
take one issue slot each like any warp instruction. Bytes in flight include the bulk and tensor
copies a CTA has pending (the profiler counts them with its cp.async groups), so a TMA pipeline
meets Little's law like a cp.async one.

Per-CTA figures are the profiled launch's totals over the CTAs it ran, so a launch profiled on a
sample of its CTAs models the whole grid.
"""

from __future__ import annotations

import dataclasses

__all__ = ["GPU", "H200", "TERM_NAMES", "MMA_PARTS", "ARCH_LIMITS", "ctas_per_sm", "Terms", "wave_time_us",
           "launch_time_us"]

TERM_NAMES = ("hbm", "latency", "shared", "mma", "issue", "mufu")
MMA_PARTS = ("mma_hmma", "mma_gmma", "mma_gmma_fp8")  # the mma term's parts: mma.sync, wgmma 16-bit, wgmma fp8


@dataclasses.dataclass(frozen=True)
class GPU:
    """A GPU's figures for the model (rates per second, sizes in bytes)."""

    name: str
    hbm_bytes_per_s: float            # spec bandwidth (the % of peak column)
    achievable_bytes_per_s: float     # a measured device-to-device copy: the hbm and latency terms' bandwidth
    sms: int
    clock_hz: float                   # for the per-SM terms
    issue_per_sm_per_clock: int       # warp schedulers per SM, each issuing one warp instruction per clock
    mufu_lanes_per_sm_per_clock: int  # MUFU results per clock per SM (a warp instruction is 32 lanes)
    mma_flops_per_s: float            # mma.sync f16/bf16 (2/3 of the wgmma peak)
    gmma_flops_per_s: float           # wgmma f16/bf16 inputs, dense
    gmma_fp8_flops_per_s: float       # wgmma fp8 (e4m3 / e5m2) inputs, dense
    memory_latency_s: float
    launch_overhead_s: float
    arch: str                         # the architecture its SASS and occupancy are compiled for

    @property
    def little_bytes_per_sm(self) -> float:
        """Bytes one SM must keep in flight to saturate HBM: achievable bandwidth x latency / SMs."""
        return self.achievable_bytes_per_s * self.memory_latency_s / self.sms


# The tensor-core peaks are NVIDIA's dense (no sparsity) figures for H100 / H200 SXM, the same Hopper SM at the
# same clock: 989 TFLOP/s for bf16 / fp16 and 1979 for fp8 (the datasheets' 1979 / 3958 are with sparsity),
# reached by wgmma only; mma.sync is held to 2/3 of the 16-bit one. An H200 runs sm_90a code (wgmma needs
# it), so its SASS is sm_90a's: for a kernel without those instructions, the same as sm_90's.
H200 = GPU(name="H200", hbm_bytes_per_s=4.8e12, achievable_bytes_per_s=4.3e12, sms=132, clock_hz=1.83e9,
           issue_per_sm_per_clock=4, mufu_lanes_per_sm_per_clock=16, mma_flops_per_s=660e12,
           gmma_flops_per_s=989e12, gmma_fp8_flops_per_s=1979e12,
           memory_latency_s=0.8e-6, launch_overhead_s=2e-6, arch="sm_90a")


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
ARCH_LIMITS["sm_90a"] = ARCH_LIMITS["sm_90"]  # the same SM


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
    mma_flops: float          # mma.sync (HMMA)
    warp_instructions: float  # warp-level SASS instructions issued (0: not counted)
    mufu_instructions: float  # of them on the MUFU pipe
    gmma_flops: float = 0.0      # wgmma with 16-bit inputs (HGMMA)
    gmma_fp8_flops: float = 0.0  # wgmma with fp8 inputs (QGMMA)


def wave_time_us(t: Terms, ctas: int, gpu: GPU = H200) -> dict:
    """Each term's time in µs for one wave of ``ctas`` (> 0) CTAs, spread evenly over the SMs: TERM_NAMES,
    then the mma term's MMA_PARTS."""
    active = min(gpu.sms, ctas)
    busiest = -(-ctas // active)  # CTAs on the busiest SM: the per-SM terms are its load
    little = t.inflight_bytes * ctas / gpu.memory_latency_s
    bw = min(gpu.achievable_bytes_per_s, little) if little > 0 else gpu.achievable_bytes_per_s
    parts = {name: busiest * flops / (peak / gpu.sms) * 1e6 for name, flops, peak in zip(
        MMA_PARTS, (t.mma_flops, t.gmma_flops, t.gmma_fp8_flops),
        (gpu.mma_flops_per_s, gpu.gmma_flops_per_s, gpu.gmma_fp8_flops_per_s))}
    return {
        "hbm": ctas * t.unique_bytes / gpu.achievable_bytes_per_s * 1e6,
        "latency": ctas * t.bytes / bw * 1e6,
        "shared": busiest * t.wavefronts / gpu.clock_hz * 1e6,
        "mma": sum(parts.values()),
        "issue": busiest * t.warp_instructions / (gpu.issue_per_sm_per_clock * gpu.clock_hz) * 1e6,
        "mufu": busiest * t.mufu_instructions * 32 / gpu.mufu_lanes_per_sm_per_clock / gpu.clock_hz * 1e6,
        **parts,
    }


def launch_time_us(t: Terms, ctas: int, per_sm: int, gpu: GPU = H200) -> tuple[float, str, int, dict]:
    """(modeled µs, the term bounding the largest wave, waves, each term summed over the waves: TERM_NAMES,
    then MMA_PARTS) of a grid of ``ctas`` CTAs at ``per_sm`` CTAs per SM."""
    per_wave = gpu.sms * max(per_sm, 1)
    full, tail = divmod(ctas, per_wave)
    total, bound = gpu.launch_overhead_s * 1e6, "launch"
    summed = dict.fromkeys(TERM_NAMES + MMA_PARTS, 0.0)
    for n, count in ((per_wave, full), (tail, 1 if tail else 0)):
        if not count:
            continue
        terms = wave_time_us(t, n, gpu)
        name = max(TERM_NAMES, key=terms.get)  # a part of mma never bounds on its own
        total += count * terms[name]
        for k, v in terms.items():
            summed[k] += count * v
        if n == per_wave or not full:
            bound = name if terms[name] > 0 else bound
    return total, bound, full + (1 if tail else 0), summed
