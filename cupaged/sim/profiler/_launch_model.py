"""``launch.model`` and ``prof.table()``: a profiled sim launch put through the H200 model v2
(cupaged/sim/model.py). The times are a model, never a measurement.

Occupancy needs the kernel's registers and static shared memory for the model GPU's architecture:
ptxas's figures through NVRTC (cupaged/_resource_cache.py), cached per (source, options, kernel,
arch) in the per-user cache like the compile gate's, so a kernel is compiled once per source version.
"""

from __future__ import annotations

import dataclasses

from cupaged.sim import model as _model

__all__ = ["LaunchModel", "model_of", "table"]


@dataclasses.dataclass(frozen=True)
class LaunchModel:
    """The modeled H200 time of one launch (over ``ctas`` CTAs) and the figures behind it."""

    time_us: float
    bound: str                # the term that bounds the largest wave: one of model.TERM_NAMES, or launch
    waves: int
    ctas: int
    ctas_per_sm: int
    registers: int
    shared_bytes: int         # static + dynamic per CTA
    unique_bytes: int         # distinct global bytes read + written, over the whole grid
    bytes: int                # requested global bytes, over the whole grid
    min_bytes: int | None     # the op's declared minimum (None: no op declared this launch)
    flops: int | None         # the op's declared FLOPs
    sector_efficiency: float
    wavefronts: int
    bank_conflicts: int
    terms_us: dict            # each of model.TERM_NAMES, then the mma term's MMA_PARTS: summed over the waves
    warp_instructions: int | None  # warp instructions issued over the whole grid (None: not counted)
    instruction_mix: dict | None   # the launch's instruction_mix, scaled to the whole grid likewise

    @property
    def traffic_ratio(self) -> float | None:
        """Distinct bytes moved / the op's declared minimum (1.0: every byte once)."""
        return self.unique_bytes / self.min_bytes if self.min_bytes else None

    def _pct(self, bytes_per_s: float) -> float | None:
        return None if self.min_bytes is None else 100 * self.min_bytes / (self.time_us * 1e-6) / bytes_per_s

    @property
    def pct_of_peak_bw(self) -> float | None:
        """The declared minimum bytes / modeled time, in % of HBM spec bandwidth (4.8 TB/s)."""
        return self._pct(_model.H200.hbm_bytes_per_s)

    @property
    def pct_of_achievable_bw(self) -> float | None:
        """The same against what an H200 delivers (a measured device-to-device copy, 4.3 TB/s)."""
        return self._pct(_model.H200.achievable_bytes_per_s)

    @property
    def pct_of_copy_bw(self) -> float | None:
        """Model v1's name of ``pct_of_achievable_bw``."""
        return self.pct_of_achievable_bw


def _resources(launch, arch: str) -> tuple[int, int]:
    """(registers per thread, static shared bytes) of the launched kernel, compiled for ``arch``."""
    from cupaged import _resource_cache

    records = _resource_cache.cached_resources("launch", launch.source, (launch.kernel,), launch.options, arch)
    rec = next(r for r in records if r.name_expression == launch.kernel)
    return rec.registers, rec.shared_bytes


def _sector_efficiency(args) -> float:
    weights = [32 * (a.sectors_read + a.sectors_written) for a in args.values()]
    total = sum(weights)
    return sum(a.sector_efficiency * w for a, w in zip(args.values(), weights)) / total if total else 1.0


def _unique_bytes(launch, kinds=("read", "written")) -> float:
    """Distinct bytes of the launch's whole grid. Profiled on a sample of its CTAs, each argument's
    distinct bytes read (written) scale with the CTAs but never past its array: CTAs not profiled
    share bytes with the sampled ones (prefill row tiles re-read one sequence's keys, MLA head tiles
    one latent row), which an L2 holding the working set serves once."""
    scale = launch.ctas / max(launch.ctas_profiled, 1)
    return sum(min(getattr(a, f"unique_bytes_{k}") * scale, a.size or float("inf"))
               for a in launch.args.values() for k in kinds)


def model_of(launch, ctas: int | None = None, gpu: _model.GPU = _model.H200) -> LaunchModel:
    """The model of ``launch`` over ``ctas`` CTAs (default: its grid). Per-CTA figures are the
    profiled CTAs' averages, so a projection passes the CTA count of the production shape."""
    ctas = launch.ctas if ctas is None else int(ctas)
    ran = max(launch.ctas_profiled, 1)
    registers, static = _resources(launch, gpu.arch)
    threads = launch.block[0] * launch.block[1] * launch.block[2]
    shared = static + launch.shared_mem
    per_sm = _model.ctas_per_sm(registers, threads, shared, gpu.arch)
    unique = _unique_bytes(launch) * ran / max(launch.ctas, 1)  # of the CTAs profiled, capped
    requested = sum(a.bytes_read + a.bytes_written for a in launch.args.values())
    counted = getattr(launch, "warp_instructions", None)  # None: not counted, so no issue or mufu term
    mix = (getattr(launch, "instruction_mix", None) or None) if counted is not None else None
    terms = _model.Terms(unique_bytes=unique / ran, bytes=requested / ran,
                         inflight_bytes=launch.max_inflight_bytes_per_cta, wavefronts=launch.shared.wavefronts / ran,
                         mma_flops=launch.mma_flops / ran, warp_instructions=(counted or 0) / ran,
                         mufu_instructions=(mix or {}).get("mufu", 0) / ran,
                         gmma_flops=getattr(launch, "gmma_flops", 0) / ran,
                         gmma_fp8_flops=getattr(launch, "gmma_fp8_flops", 0) / ran)
    time_us, bound, waves, terms_us = _model.launch_time_us(terms, ctas, per_sm, gpu)
    scale = ctas / ran
    declared = launch.declared
    min_bytes = flops = None
    if declared is not None:  # the op's minimum for its whole grid, scaled like the profiled figures
        min_bytes = round(declared.min_bytes * ctas / max(launch.ctas, 1))
        flops = round(declared.flops * ctas / max(launch.ctas, 1))
    return LaunchModel(time_us, bound, waves, ctas, per_sm, registers, shared, round(unique * scale),
                       round(requested * scale), min_bytes, flops, _sector_efficiency(launch.args),
                       round(launch.shared.wavefronts * scale), round(launch.shared.bank_conflicts * scale), terms_us,
                       None if counted is None else round(counted * scale),
                       None if mix is None else {k: round(v * scale) for k, v in mix.items()})


def _bytes(n) -> str:
    if n is None:
        return "-"
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def table(launches) -> str:
    """One row per launch: kernel | grid×block | unique bytes read | minimum bytes | ratio | sector
    eff. | smem conflicts | CTAs/SM | issue µs | bound | modeled µs | modeled % of peak; then a
    note for each reason a launch's instructions were not counted."""
    head = ("kernel", "grid×block", "unique bytes read", "minimum bytes", "ratio", "sector eff.", "smem conflicts",
            "CTAs/SM", "issue µs", "bound", "modeled µs", "modeled % of peak")
    rows, uncounted = [], {}
    for launch in launches:
        m = launch.model
        read = _unique_bytes(launch, ("read",)) * m.ctas / max(launch.ctas, 1)
        grid = "×".join(map(str, launch.grid)) + " × " + "×".join(map(str, launch.block))
        name = launch.kernel if len(launch.kernel) <= 64 else launch.kernel[:61] + "..."
        if m.warp_instructions is None:
            note = getattr(launch, "instructions_note", "") or "not counted"
            uncounted.setdefault(note, {})[name] = None  # each kernel once
        rows.append((name, grid, _bytes(round(read)), _bytes(m.min_bytes),
                     "-" if m.traffic_ratio is None else f"{m.traffic_ratio:.2f}", f"{m.sector_efficiency:.2f}",
                     str(m.bank_conflicts), str(m.ctas_per_sm),
                     "-" if m.warp_instructions is None else f"{m.terms_us['issue']:.1f}", m.bound, f"{m.time_us:.1f}",
                     "-" if m.pct_of_peak_bw is None else
                     f"{m.pct_of_peak_bw:.0f}% ({m.pct_of_achievable_bw:.0f}% of achievable)"))
    widths = [max(len(r[i]) for r in rows + [head]) for i in range(len(head))]
    lines = [" | ".join(c.ljust(w) for c, w in zip(r, widths)) for r in [head] + rows]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    lines.append("Modeled µs is the H200 model v2 (cupaged/sim/model.py) applied to the sim's counts: a proxy, not a "
                 "measurement. Ratio = distinct bytes read + written / the op's declared minimum; % of peak = that "
                 "minimum / modeled time / 4.8 TB/s (the spec), % of achievable the same / 4.3 TB/s (a measured "
                 "device-to-device copy). Issue µs = warp instructions on the busiest SM / (4 × clock), summed over "
                 "the waves.")
    for note, names in uncounted.items():
        lines.append(f"Instructions not counted ({note}): the issue and mufu terms are 0 for {', '.join(names)}.")
    return "\n".join(lines)
