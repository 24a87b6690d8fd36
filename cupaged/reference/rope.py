"""Reference of rotary embeddings (kernels_cu/rope.cu): the frequencies and cos/sin table in float64, the rotation
as a complex multiplication (the kernel rotates real pairs), and the fused RoPE + cache write as that rotation
followed by reference.reshape_and_cache_flash.

The frequency scalings are Hugging Face's (``modeling_rope_utils.py``: ``rope_scaling`` / ``rope_parameters``), one
frequency at a time: "default", "linear", "dynamic" (NTK), "yarn", "longrope", "llama3". With d = rotary_dim,
base = rope_theta and O the original context (``original_max_position_embeddings`` of the dict, else the model's
``max_position_embeddings``)."""

from __future__ import annotations

import math

import numpy as np

from cupaged.reference.cache_ops import reshape_and_cache_flash

ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")


def _rope_type(scaling):
    """Hugging Face's key, then its legacy name; a dict naming neither is the default rotation."""
    if scaling is None:
        return "default"
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise NotImplementedError(f"scaling rope_type={kind!r}: the reference knows {', '.join(ROPE_TYPES)}")
    return kind


def _original(scaling, max_position_embeddings):
    """O: the dict's original_max_position_embeddings, else the model's max_position_embeddings (may be None)."""
    original = scaling.get("original_max_position_embeddings")
    return max_position_embeddings if original is None else original


def _yarn_factor(scaling, max_position_embeddings):
    """YaRN's scale: M / O when the dict names O (DeepSeek-V3's rule) and M is known, else the dict's factor."""
    original = scaling.get("original_max_position_embeddings")
    if original is not None and max_position_embeddings is not None:
        return max_position_embeddings / original
    return scaling["factor"]


def _default(rotary_dim, base):
    return [base ** (-2.0 * i / rotary_dim) for i in range(rotary_dim // 2)]


def _llama3(freqs, scaling):
    """Per frequency: wavelengths under original / high_freq_factor kept, over original / low_freq_factor divided by
    factor, the band between blended linearly in original / wavelength."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    out = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < old / high:
            out.append(f)
        elif wavelen > old / low:
            out.append(f / factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append((1 - smooth) * f / factor + smooth * f)
    return out


def _dynamic(rotary_dim, base, scaling, seq_len, original):
    """NTK: past O the base grows to base * (factor * L / O - (factor - 1)) ^ (d / (d - 2)) for the current length
    L; up to O (or with no length given) the default frequencies."""
    if seq_len is None:
        return _default(rotary_dim, base)
    if original is None:
        raise ValueError("dynamic scaling needs original_max_position_embeddings or max_position_embeddings")
    if seq_len <= original:
        return _default(rotary_dim, base)
    factor = scaling["factor"]
    grown = base * ((factor * seq_len / original) - (factor - 1)) ** (rotary_dim / (rotary_dim - 2))
    return _default(rotary_dim, grown)


def _yarn(rotary_dim, base, scaling, max_position_embeddings):
    """YaRN: frequency i interpolated (divided by the factor) or extrapolated (kept), blended by a linear ramp over
    i between the dimensions where a frequency turns beta_fast and beta_slow times over O."""
    original = _original(scaling, max_position_embeddings)
    if original is None:
        raise ValueError("yarn scaling needs original_max_position_embeddings or max_position_embeddings")
    factor = _yarn_factor(scaling, max_position_embeddings)
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations):  # the pair i whose wavelength 2 pi base^(2i/d) fits `rotations` times in O
        return rotary_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)  # Hugging Face clamps to d - 1, not d / 2 - 1
    if low == high:
        high += 0.001
    out = []
    for i, extrapolated in enumerate(_default(rotary_dim, base)):
        ramp = min(max((i - low) / (high - low), 0.0), 1.0)
        extrapolation_share = 1.0 - ramp
        interpolated = 1.0 / (factor * base ** (2.0 * i / rotary_dim))
        out.append(interpolated * (1.0 - extrapolation_share) + extrapolated * extrapolation_share)
    return out


def _longrope(rotary_dim, base, scaling, seq_len, original):
    """LongRoPE: frequency i divided by long_factor[i] once the current length passes O, else by short_factor[i]."""
    if seq_len is not None and original is None:
        raise ValueError("longrope scaling needs original_max_position_embeddings or max_position_embeddings")
    long = seq_len is not None and seq_len > original
    ext = scaling["long_factor" if long else "short_factor"]
    if len(ext) != rotary_dim // 2:
        raise ValueError(f"longrope factors must have rotary_dim / 2 = {rotary_dim // 2} entries, got {len(ext)}")
    return [f / e for f, e in zip(_default(rotary_dim, base), ext)]


def inv_freq(rotary_dim, rope_theta=10000.0, scaling=None, *, seq_len=None, max_position_embeddings=None):
    """float64 ``[rotary_dim / 2]`` frequencies theta^(-2i / rotary_dim), scaled as ``scaling`` (Hugging Face's
    ``rope_scaling`` dict; its "rope_theta" overrides ``rope_theta``) says. ``seq_len``: the sequence's current
    length (dynamic and longrope depend on it); ``max_position_embeddings``: the model's (M)."""
    kind = _rope_type(scaling)
    if scaling is not None and scaling.get("rope_theta") is not None:
        rope_theta = scaling["rope_theta"]
    if kind == "default":
        return np.array(_default(rotary_dim, rope_theta))
    original = _original(scaling, max_position_embeddings)
    if kind == "linear":
        freqs = [f / scaling["factor"] for f in _default(rotary_dim, rope_theta)]
    elif kind == "dynamic":
        freqs = _dynamic(rotary_dim, rope_theta, scaling, seq_len, original)
    elif kind == "yarn":
        freqs = _yarn(rotary_dim, rope_theta, scaling, max_position_embeddings)
    elif kind == "longrope":
        freqs = _longrope(rotary_dim, rope_theta, scaling, seq_len, original)
    else:
        freqs = _llama3(_default(rotary_dim, rope_theta), scaling)
    return np.array(freqs, dtype=np.float64)


def _mscale(scale, mscale=1.0):
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def attention_factor(scaling=None, *, max_position_embeddings=None):
    """The factor Hugging Face multiplies cos and sin by: 1 but for yarn (the dict's attention_factor, else
    0.1 ln(factor) + 1, DeepSeek's mscale / mscale_all_dim ratio when both are set) and longrope (the dict's
    attention_factor, else sqrt(1 + ln(factor) / ln(O)), factor = M / O when the dict names O)."""
    kind = _rope_type(scaling)
    if kind not in ("yarn", "longrope"):
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    if kind == "yarn":
        factor = _yarn_factor(scaling, max_position_embeddings)
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            return _mscale(factor, mscale) / _mscale(factor, mscale_all_dim)
        return _mscale(factor)
    original = _original(scaling, max_position_embeddings)
    if scaling.get("original_max_position_embeddings") is not None and max_position_embeddings is not None:
        factor = max_position_embeddings / original
    else:
        factor = scaling.get("factor")
    if factor is None:
        raise ValueError("longrope's attention factor needs attention_factor, factor, or "
                         "original_max_position_embeddings with max_position_embeddings")
    if factor <= 1:
        return 1.0
    if original is None:
        raise ValueError("longrope's attention factor needs original_max_position_embeddings or "
                         "max_position_embeddings")
    return math.sqrt(1 + math.log(factor) / math.log(original))


def cos_sin_cache(max_position, freqs, attention_factor=1.0):
    """float64 [max_position, rotary_dim]: cosines then sines of position x frequency, times attention_factor."""
    angle = np.outer(np.arange(max_position, dtype=np.float64), np.asarray(freqs, np.float64))
    return np.hstack([np.cos(angle), np.sin(angle)]) * attention_factor


def rotate(x, positions, cos_sin, *, is_neox_style=True):
    """x [num_tokens, heads, head_size] rotated (float64) over its first rotary_dim dims with the given cos/sin table
    (float32 or float64 [max_position, rotary_dim]): each pair as the complex number x1 + i x2 times e^{i angle}."""
    x = np.asarray(x, np.float64).copy()
    table = np.asarray(cos_sin, np.float64)[np.asarray(positions).astype(np.int64)]  # [tokens, rotary_dim]
    half = table.shape[1] // 2
    rot = table[:, :half] + 1j * table[:, half:]  # e^{i angle}
    if is_neox_style:
        a, b = np.arange(half), np.arange(half) + half
    else:
        a, b = np.arange(0, 2 * half, 2), np.arange(1, 2 * half, 2)
    z = (x[..., a] + 1j * x[..., b]) * rot[:, None, :]
    x[..., a], x[..., b] = z.real, z.imag
    return x


def rope_and_cache(q, k, v, positions, cos_sin_cache, key_cache, value_cache, slot_mapping, kv_cache_dtype="auto",
                   k_scale=1.0, v_scale=1.0, *, is_neox_style=True, layout="NHD"):
    """(q rotated, k rotated, key_cache, value_cache): q and k rotated in float64 then rounded to their dtype, and the
    rounded k with v written into copies of the caches as reshape_and_cache_flash writes them."""
    dtype = np.asarray(q).dtype
    q_rot = rotate(q, positions, cos_sin_cache, is_neox_style=is_neox_style).astype(dtype)
    k_rot = rotate(k, positions, cos_sin_cache, is_neox_style=is_neox_style).astype(dtype)
    kc, vc = reshape_and_cache_flash(k_rot, np.asarray(v), key_cache, value_cache, slot_mapping, kv_cache_dtype,
                                     k_scale, v_scale, layout=layout)
    return q_rot, k_rot, kc, vc
