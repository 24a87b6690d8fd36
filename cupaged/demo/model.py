"""The demo's tiny decoder: token embeddings, ``n_layers`` x (RMSNorm -> :class:`cupaged.layers.Attention` ->
RMSNorm -> SwiGLU MLP) with residuals, a final RMSNorm and the output head. Random weights from a seed (no
downloads); the float64 twin of its forward is cupaged.reference.layers.decoder_logits.

``family`` picks the attention of a model family (``FAMILIES``): "llama" (QK RMSNorm, as Qwen3 / OLMo have it),
"qwen2" (q / k / v biases), "gemma2" (local layers with a sliding window alternating with global ones, logit
softcap 50, the scale of query_pre_attn_scalar = dim / n_heads), "gpt-oss" (q / k / v / o biases, attention sinks,
alternating windows, YaRN RoPE). The layers read the shared system prompt's blocks once a step through cascade
attention whenever every running request holds them (``cascade=True``; windowed layers do not)."""

from __future__ import annotations

import copy
import dataclasses

import numpy as np

from cupaged.layer_ops import linear, rms_norm
from cupaged.layers import Attention
from cupaged.rope import RotaryEmbedding

__all__ = ["FAMILIES", "DecoderConfig", "TinyDecoder", "random_weights"]

FAMILIES = ("llama", "qwen2", "gemma2", "gpt-oss")
WINDOW = 32  # the local layers' sliding window (tokens): shorter than the demo's prompts


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
    vocab_size: int = 512
    dim: int = 256
    n_layers: int = 2
    n_heads: int = 8
    n_kv_heads: int = 2
    head_dim: int = 64
    hidden_dim: int = 512
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    family: str = "llama"

    def rope(self) -> RotaryEmbedding:
        if self.family == "gpt-oss":  # YaRN over a short original context, so it shows at the demo's lengths
            yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32.0,
                    "beta_slow": 1.0, "truncate": False}
            return RotaryEmbedding(self.head_dim, rope_theta=150000.0, scaling=yarn, max_position_embeddings=256)
        return RotaryEmbedding(self.head_dim, rope_theta=self.rope_theta)

    def attention_options(self, layer: int) -> dict:
        """Layer ``layer``'s :class:`cupaged.layers.Attention` options for the family (even layers are local)."""
        window = WINDOW if layer % 2 == 0 else None
        return {"llama": {"qk_norm": "rms_head"},
                "qwen2": {"bias": True},
                "gemma2": {"sliding_window": window, "softcap": 50.0, "scale": (self.dim / self.n_heads) ** -0.5},
                "gpt-oss": {"bias": True, "sinks": True, "sliding_window": window}}[self.family]


def random_weights(config: DecoderConfig, seed: int) -> dict:
    """float32 numpy weights, ``[out_features, in_features]`` matrices drawn N(0, 1 / in_features) (O(1)
    activations and logits), norm weights near 1; separate wq / wk / wv (the layer fuses them on load)."""
    rng = np.random.default_rng(seed)
    c = config

    def mat(out_features, in_features):
        return (rng.standard_normal((out_features, in_features)) / np.sqrt(in_features)).astype(np.float32)

    def norm(n):
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    def vec(n):
        return (0.5 * rng.standard_normal(n)).astype(np.float32)

    q, kv = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    w = {"embed": rng.standard_normal((c.vocab_size, c.dim)).astype(np.float32)}
    for i in range(c.n_layers):
        p, o = f"layers.{i}.", c.attention_options(i)
        w.update({p + "attn_norm": norm(c.dim), p + "attn.wq": mat(q, c.dim), p + "attn.wk": mat(kv, c.dim),
                  p + "attn.wv": mat(kv, c.dim), p + "attn.wo": mat(c.dim, q),
                  p + "mlp_norm": norm(c.dim), p + "w1": mat(c.hidden_dim, c.dim), p + "w3": mat(c.hidden_dim, c.dim),
                  p + "w2": mat(c.dim, c.hidden_dim)})
        if o.get("qk_norm"):
            w.update({p + "attn.q_norm": norm(c.head_dim), p + "attn.k_norm": norm(c.head_dim)})
        if o.get("bias"):  # gpt-oss has an output bias too; Qwen2 has none (the layer reads a missing bo as 0)
            w.update({p + "attn.bq": vec(q), p + "attn.bk": vec(kv), p + "attn.bv": vec(kv)})
            if o.get("sinks"):
                w[p + "attn.bo"] = vec(c.dim)
        if o.get("sinks"):
            w[p + "attn.sinks"] = (rng.standard_normal(c.n_heads) + 1.0).astype(np.float32)
    w["norm"], w["output"] = norm(c.dim), mat(c.vocab_size, c.dim)
    return w


class TinyDecoder:
    """The decoder on ``xp`` (numpy: the sim; cupy: the GPU) in ``dtype``: ``forward(token_ids, plan, kv_cache)``
    runs one step of a :class:`cupaged.BatchPlan` through every layer (each writes its keys and values into
    ``kv_cache`` and attends over it) and returns the hidden states; ``logits(hidden)`` the output head."""

    def __init__(self, config: DecoderConfig, weights: dict, xp=np, dtype=np.float32):
        self.config, self.xp, self.dtype = config, xp, np.dtype(dtype)
        def put(a):
            return xp.asarray(a).astype(self.dtype)

        self.w = {k: put(v) for k, v in weights.items() if not k.startswith("layers.") or ".attn." not in k}
        rope = config.rope()  # one object: the layers share its cos / sin cache
        self.layers = []
        for i in range(config.n_layers):
            attn = Attention(config.n_heads, config.n_kv_heads, config.dim, head_dim=config.head_dim, fuse_qkv=True,
                             norm_eps=config.norm_eps, rope=rope, dtype=self.dtype, cascade=True,
                             **config.attention_options(i))
            prefix = f"layers.{i}.attn."
            attn.load_state_dict({k[len(prefix):]: xp.asarray(v) if k.endswith("sinks") else put(v)  # float32 logits
                                  for k, v in weights.items() if k.startswith(prefix)})
            self.layers.append(attn)

    def first_layers(self, n_layers: int) -> TinyDecoder:
        """The decoder cut after its first ``n_layers`` layers, sharing this one's weights and layer objects
        (embeddings, those layers, the final norm and the head): a cheaper draft model for speculative decoding,
        whose keys and values are this decoder's first layers' (it reads and writes the same cache layers)."""
        draft = copy.copy(self)
        draft.config = dataclasses.replace(self.config, n_layers=n_layers)
        draft.layers = self.layers[:n_layers]
        return draft

    def forward(self, token_ids, plan, kv_cache):
        c, w = self.config, self.w
        h = w["embed"][token_ids]
        for i, attn in enumerate(self.layers):
            p = f"layers.{i}."
            h = h + attn.forward(rms_norm(h, w[p + "attn_norm"], c.norm_eps), plan, kv_cache, i)
            a = rms_norm(h, w[p + "mlp_norm"], c.norm_eps)
            gate, up = linear(a, w[p + "w1"]), linear(a, w[p + "w3"])
            h = h + linear((gate / (1.0 + self.xp.exp(-gate)) * up).astype(self.dtype), w[p + "w2"])
        return h

    def logits(self, hidden):
        """float32 ``[rows, vocab_size]`` of the given hidden rows."""
        return linear(rms_norm(hidden, self.w["norm"], self.config.norm_eps), self.w["output"]).astype(np.float32)
