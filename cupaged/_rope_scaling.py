"""Hugging Face's RoPE scalings for :class:`cupaged.RotaryEmbedding`: a ``rope_scaling`` / ``rope_parameters`` dict
validated, and its float64 frequencies and attention factor, with the meaning transformers gives them
(``modeling_rope_utils``: ``_compute_*_parameters``, and ``dynamic_rope_update`` for the length-dependent ones).

Notation: d = rotary_dim, base = rope_theta, default frequencies f_i = base^(-2i / d) for i < d / 2, M =
max_position_embeddings, O = the dict's original_max_position_embeddings if it has one, else M; L = a sequence's
current length (its last position + 1; None: O or less).

    default   f_i
    linear    f_i / factor
    dynamic   NTK: for L > O the base becomes base (factor L / O - (factor - 1))^(d / (d - 2)); else f_i
    yarn      f_i / factor blended into f_i by a linear ramp over i between the correction dimensions of beta_fast
              and beta_slow rotations in O positions (floor / ceil unless truncate is False); factor = M / O when the
              dict has original_max_position_embeddings and M is known; attention factor: the dict's, else
              get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim) when both are set, else
              get_mscale(factor), get_mscale(s, m) = 1 if s <= 1 else 0.1 m ln(s) + 1
    longrope  1 / (ext_i base^(2i / d)), ext = long_factor for L > O, else short_factor; factor = M / O when the dict
              has original_max_position_embeddings and M is known, else the dict's; attention factor: the dict's,
              else 1 if factor <= 1, else sqrt(1 + ln(factor) / ln(O))
    llama3    wavelengths 2 pi / f_i under O / high_freq_factor kept, over O / low_freq_factor divided by factor, the
              band between blended linearly in O / wavelength
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import numpy as np

from cupaged._checks import check_bool, check_float, check_int

__all__ = ["TYPES", "RopeScaling", "resolve"]

TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")
_UNTYPED = {"rope_theta", "partial_rotary_factor", "rope_type", "type"}  # keys a dict without a rope_type may hold
_REQUIRED = {"linear": ("factor",), "dynamic": ("factor",), "yarn": ("factor",),
             "longrope": ("short_factor", "long_factor"),
             "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """A validated scaling: what RotaryEmbedding needs to compute any sequence's frequencies."""

    rope_type: str
    rotary_dim: int
    rope_theta: float
    attention_factor: float = 1.0
    factor: float = 1.0
    original: int | None = None  # O
    values: dict = dataclasses.field(default_factory=dict)  # the type's other parameters, parsed

    @property
    def per_length(self) -> bool:
        return self.rope_type in ("dynamic", "longrope")

    def length_key(self, seq_len: int | None):
        """Which frequencies a sequence of current length ``seq_len`` gets: None (the original ones), "long"
        (longrope past O) or seq_len itself (dynamic past O)."""
        if not self.per_length or seq_len is None or seq_len <= self.original:
            return None
        return "long" if self.rope_type == "longrope" else seq_len

    def frequencies(self, key=None) -> np.ndarray:
        """float64 ``[rotary_dim / 2]`` for a :meth:`length_key`."""
        d, base, kind = self.rotary_dim, self.rope_theta, self.rope_type
        exponent = np.arange(0, d, 2, dtype=np.float64) / d
        if kind == "dynamic" and key is not None:
            base = base * (self.factor * key / self.original - (self.factor - 1)) ** (d / (d - 2))
        if kind == "longrope":
            return 1.0 / (self.values["long_factor" if key else "short_factor"] * base ** exponent)
        freqs = 1.0 / base ** exponent
        if kind == "linear":
            return freqs / self.factor
        if kind == "yarn":
            return _yarn(freqs, d, base, self.factor, self.original, **self.values)
        if kind == "llama3":
            return _llama3(freqs, self.factor, self.original, **self.values)
        return freqs


def _yarn(freqs, d, base, factor, original, beta_fast, beta_slow, truncate):
    def dim(rotations):  # the i whose wavelength makes `rotations` turns in `original` positions, times 2
        return d * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim(beta_fast), dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001  # Hugging Face's guard against a zero-width ramp
    ramp = np.clip((np.arange(d // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)  # 1: interpolated
    return freqs / factor * ramp + freqs * (1 - ramp)


def _llama3(freqs, factor, original, low_freq_factor, high_freq_factor):
    wavelen = 2 * math.pi / freqs
    smooth = (original / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    return np.where(wavelen < original / high_freq_factor, freqs,
                    np.where(wavelen > original / low_freq_factor, freqs / factor,
                             (1 - smooth) * freqs / factor + smooth * freqs))


def _mscale(scale: float, m: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


def _number(s, key, *, positive=True, default=None):
    value = s.get(key)
    return default if value is None else check_float(f"scaling[{key!r}]", value, positive=positive)


def _factors(s, key, half) -> np.ndarray:
    try:
        a = np.array(s[key], dtype=np.float64)
    except (TypeError, ValueError):
        raise TypeError(f"scaling[{key!r}] must be a list of numbers, got {type(s[key]).__name__}") from None
    if a.ndim != 1 or a.shape[0] != half:
        raise ValueError(f"scaling[{key!r}] must be a list of rotary_dim / 2 = {half} numbers, got "
                         f"{a.shape[0] if a.ndim == 1 else f'shape {a.shape}'}")
    if not np.all(np.isfinite(a) & (a > 0)):
        raise ValueError(f"scaling[{key!r}] must hold finite positive numbers, got {a[~(np.isfinite(a) & (a > 0))][0]}")
    return a


def _rotary_dim(head_dim: int, rotary_dim, s: Mapping) -> int:
    """rotary_dim (default head_dim), or int(head_dim * partial_rotary_factor) as Hugging Face computes it."""
    prf = s.get("partial_rotary_factor")
    if prf is not None:
        prf = check_float("scaling['partial_rotary_factor']", prf, positive=True)
        if prf > 1:
            raise ValueError(f"scaling['partial_rotary_factor'] must be in (0, 1], got {prf}")
        derived = int(head_dim * prf)
        if rotary_dim is not None and rotary_dim != derived:
            raise ValueError(f"scaling['partial_rotary_factor']={prf} gives rotary_dim int({head_dim} * {prf}) = "
                             f"{derived}, but rotary_dim={rotary_dim}")
        if rotary_dim is None and (derived < 2 or derived % 2):
            raise ValueError(f"scaling['partial_rotary_factor']={prf} gives rotary_dim int({head_dim} * {prf}) = "
                             f"{derived}: it must be even and >= 2")
        rotary_dim = derived
    rotary_dim = head_dim if rotary_dim is None else check_int("rotary_dim", rotary_dim, 2, head_dim)
    if rotary_dim % 2:
        raise ValueError(f"rotary_dim must be even, got {rotary_dim}")
    return rotary_dim


def _rope_theta(rope_theta, s: Mapping) -> float:
    given = None if rope_theta is None else check_float("rope_theta", rope_theta, positive=True)
    if s.get("rope_theta") is None:
        return 10000.0 if given is None else given
    theta = check_float("scaling['rope_theta']", s["rope_theta"], positive=True)
    if given is not None and given != theta:
        raise ValueError(f"rope_theta={given} differs from scaling['rope_theta']={theta}: give one, or both equal")
    return theta


def resolve(head_dim: int, rotary_dim, rope_theta, scaling, max_position_embeddings) -> RopeScaling:
    """Validate RotaryEmbedding's rotary_dim, rope_theta, scaling and max_position_embeddings (ValueError /
    TypeError naming the argument or the dict's key) and resolve them into a :class:`RopeScaling`."""
    if scaling is not None and not isinstance(scaling, Mapping):
        raise TypeError(f"scaling must be None or Hugging Face's rope_scaling dict, got {type(scaling).__name__}")
    s = dict(scaling or {})
    m = None if max_position_embeddings is None else check_int("max_position_embeddings", max_position_embeddings, 1)
    theta = _rope_theta(rope_theta, s)
    d = _rotary_dim(head_dim, rotary_dim, s)
    if scaling is None:
        return RopeScaling("default", d, theta)
    kind = s["rope_type"] if s.get("rope_type") is not None else s.get("type")
    if kind is None and set(s) <= _UNTYPED:  # transformers' default type; a dict with more keys needs a type
        kind = "default"
    if kind not in TYPES:
        raise ValueError(f"scaling['rope_type'] must be one of {', '.join(map(repr, TYPES))} (Hugging Face's; the "
                         f"legacy key 'type' too), got {kind!r}")
    missing = [k for k in _REQUIRED.get(kind, ()) if s.get(k) is None]
    if missing:
        raise ValueError(f"scaling (rope_type {kind!r}) lacks {', '.join(missing)}")
    if kind == "default":
        return RopeScaling("default", d, theta)
    original = s.get("original_max_position_embeddings")
    if original is not None:
        original = check_int("scaling['original_max_position_embeddings']", original, 1)
    o = original if original is not None else m
    if kind in ("dynamic", "yarn", "longrope") and o is None:
        raise ValueError(f"scaling (rope_type {kind!r}) needs the original context length: max_position_embeddings "
                         "(or scaling['original_max_position_embeddings'])")
    if kind == "linear":
        return RopeScaling(kind, d, theta, factor=_number(s, "factor"))
    if kind == "dynamic":
        if d == 2:
            raise ValueError("rotary_dim must be > 2 for rope_type 'dynamic' (its base exponent is d / (d - 2))")
        return RopeScaling(kind, d, theta, factor=_number(s, "factor"), original=o)
    if kind == "yarn":
        return _resolve_yarn(s, d, theta, m, original, o)
    if kind == "longrope":
        return _resolve_longrope(s, d, theta, m, original, o)
    return _resolve_llama3(s, d, theta, original)


def _resolve_yarn(s, d, theta, m, original, o) -> RopeScaling:
    factor = _number(s, "factor")
    if original is not None and m is not None:  # DeepSeek-V3, gpt-oss: the ratio, not the dict's factor
        factor = m / original
    if theta == 1:
        raise ValueError("rope_theta must not be 1 for rope_type 'yarn' (its correction dimensions divide by ln)")
    values = dict(beta_fast=_number(s, "beta_fast", default=32.0), beta_slow=_number(s, "beta_slow", default=1.0),
                  truncate=True if s.get("truncate") is None else check_bool("scaling['truncate']", s["truncate"]))
    attention = _number(s, "attention_factor")
    if attention is None:
        mscale, mscale_all_dim = (_number(s, k, positive=False, default=0.0) for k in ("mscale", "mscale_all_dim"))
        for key, v in (("mscale", mscale), ("mscale_all_dim", mscale_all_dim)):
            if v < 0:
                raise ValueError(f"scaling[{key!r}] must be >= 0, got {v}")
        attention = (_mscale(factor, mscale) / _mscale(factor, mscale_all_dim) if mscale and mscale_all_dim
                     else _mscale(factor))
    return RopeScaling("yarn", d, theta, attention, factor, o, values)


def _resolve_longrope(s, d, theta, m, original, o) -> RopeScaling:
    values = {k: _factors(s, k, d // 2) for k in ("short_factor", "long_factor")}
    if original is not None and m is not None:  # Phi-3: the ratio of the context lengths
        factor = m / original
    elif s.get("factor") is not None:
        factor = _number(s, "factor")
    else:
        raise ValueError("scaling (rope_type 'longrope') lacks factor (or original_max_position_embeddings with "
                         "max_position_embeddings, whose ratio it is)")
    attention = _number(s, "attention_factor")
    if attention is None:
        if factor > 1 and o == 1:
            raise ValueError("rope_type 'longrope' needs an original context length > 1 (its attention factor "
                             "divides by ln of it), got 1")
        attention = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(o))
    return RopeScaling("longrope", d, theta, attention, factor, o, values)


def _resolve_llama3(s, d, theta, original) -> RopeScaling:
    # Hugging Face's rules (_validate_llama3_parameters): the band between the two wavelength bounds is blended
    # over high - low, so high must exceed low; a factor under 1 would raise the low frequencies
    factor = _number(s, "factor")
    if factor < 1:
        raise ValueError(f"scaling['factor'] must be >= 1, got {factor}")
    low, high = (_number(s, k) for k in ("low_freq_factor", "high_freq_factor"))
    if high <= low:
        raise ValueError(f"scaling['high_freq_factor'] must be greater than scaling['low_freq_factor'], got {high} "
                         f"and {low}")
    return RopeScaling("llama3", d, theta, 1.0, factor, original, dict(low_freq_factor=low, high_freq_factor=high))
