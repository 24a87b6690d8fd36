"""Reference of rotary embeddings (kernels_cu/rope.cu): the frequencies and cos/sin table in float64, the rotation
as a complex multiplication (the kernel rotates real pairs), and the fused RoPE + cache write as that rotation
followed by reference.reshape_and_cache_flash."""

from __future__ import annotations

import math

import numpy as np

from cupaged.reference.cache_ops import reshape_and_cache_flash


def inv_freq(rotary_dim, rope_theta=10000.0, scaling=None):
    """float64 frequencies theta^(-2i / rotary_dim); Llama 3 scaling (Hugging Face's rope_scaling) per frequency:
    wavelengths under original / high_freq_factor kept, over original / low_freq_factor divided by factor, the band
    between blended linearly in original / wavelength."""
    freqs = [rope_theta ** (-2.0 * i / rotary_dim) for i in range(rotary_dim // 2)]
    if scaling is None or scaling.get("rope_type", scaling.get("type")) == "default":
        return np.array(freqs)
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
    return np.array(out)


def cos_sin_cache(max_position, freqs):
    """float64 [max_position, rotary_dim]: cosines then sines of position x frequency."""
    angle = np.outer(np.arange(max_position, dtype=np.float64), freqs)
    return np.hstack([np.cos(angle), np.sin(angle)])


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
