"""The consumer: a framework-free attention layer over the paged cache, as an engine author writes it on cupaged.

``Attention`` is an autoregressive model's GQA attention layer (fused or separate QKV projections, QK RMSNorm,
rotary embeddings, self / full / cross attention, output projection), but over a paged KV cache and varlen
batches: ``forward(x, plan, kv_cache, layer)`` takes ``x`` ``[num_tokens, dim]`` for a step mixing prefill chunks
and decode tokens, described by a :class:`cupaged.BatchPlan` from :meth:`cupaged.BlockPool.plan`. Per step and
layer: the projections (``xp.matmul``: cuBLAS on a GPU), QK-norm, then

- ``"self"``: ``rope_and_cache`` (RoPE and the cache write in one launch; ``reshape_and_cache_flash`` without
  RoPE) and causal paged attention (``plan_attention`` / ``run_attention``, memoized on the batch's shape);
- ``"full"``: RoPE and one non-causal ``varlen_attention`` over whole sequences (no cache, no decode);
- ``"cross"``: no RoPE; each request's context keys and values are computed once, on the step that brings its
  context, kept dense in a :class:`ContextCache`, and read by a non-causal ``varlen_attention``.
"""

from __future__ import annotations

import numpy as np

from cupaged._attention_args import MAX_HEAD_SIZE, check_tables
from cupaged._backend import array_module, device_key, host_copy, is_host_array, module_of, to_device
from cupaged._checks import check_bool, check_choice, check_float, check_int, float_dtype, validate_enabled
from cupaged._layer_options import layer_options
from cupaged._layer_weights import expected_shapes, load_weights
from cupaged.attention import KvView, plan_attention, run_attention
from cupaged.cache_ops import reshape_and_cache_flash
from cupaged.cascade import cascade_attention
from cupaged.layer_ops import ContextCache, cache_arrays, cascade_blocks, cascade_level, check_plan_mask, \
    check_positions, device_plan, linear, qk_normalize, rope_cache, rope_positions, rope_rows, validate_plan, \
    whole_sequences
from cupaged.rope import RotaryEmbedding, rope_and_cache
from cupaged.varlen_attention import varlen_attention

__all__ = ["Attention", "ContextCache"]

ATTN_TYPES = ("self", "full", "cross")


class Attention:
    """GQA attention of ``n_heads`` query heads over ``n_kv_heads`` (None: ``n_heads``) key/value heads of
    ``head_dim`` (None: ``dim // n_heads``) on inputs of ``dim``; cross attention reads a context of
    ``context_dim`` (None: ``dim``). ``fuse_qkv``: one ``wqkv`` ``[(n_heads + 2 n_kv_heads) head_dim, dim]``
    (separate weights are concatenated on load). ``use_qk_normalization``: RMSNorm over head_dim (``norm_eps``,
    learnable ``q_norm`` / ``k_norm`` weights) on q and k before RoPE. ``rope``: a :class:`cupaged.RotaryEmbedding`
    for ``"self"`` / ``"full"`` (None: no rotation); ``"cross"`` never rotates. ``dtype``: the weights', the
    inputs' and the KV cache's dtype. ``k_scale`` / ``v_scale`` (attributes, default 1.0): an fp8 cache's scales.

    The model families' options (keyword-only; cupaged/_layer_options.py): ``bias`` (q / k / v / o biases
    ``bq``, ``bk``, ``bv``, ``bo``, or ``bqkv`` with ``wqkv``; no ``bo`` means zero), ``scale`` (the softmax
    scale; None: 1/sqrt(head_dim)), ``softcap`` (logits c·tanh(logits / c)), ``sliding_window`` (W: a query
    at p sees keys in (p − W, p]; "self" only), ``sinks`` (a learned logit per head, loaded as ``sinks``),
    ``alibi`` (None, True for Bloom / MPT's slopes from the head count, or n_heads slopes; not "cross"),
    ``qk_norm`` (None, "rms_head" = ``use_qk_normalization``, "layer_head": LayerNorm over head_dim with
    weights ``[head_dim]`` or per head, "rms_all_heads": RMSNorm over all heads' features with weights of
    n_heads·head_dim / n_kv_heads·head_dim, "l2": x / sqrt(mean(x²) + norm_eps) over head_dim, no weight).
    ``cascade`` ("self"): read the plan's shared prefix blocks (``BatchPlan.shared_prefix_blocks``) once with
    :func:`cupaged.cascade_attention`: True whenever there are some, False never, None when they hold
    >= CASCADE_MIN_TOKENS tokens shared by >= CASCADE_MIN_REQUESTS requests (cupaged/layer_ops.py).
    """

    def __init__(self, n_heads, n_kv_heads, dim, *, head_dim=None, context_dim=None, fuse_qkv=False,
                 use_qk_normalization=False, norm_eps=1e-5, attn_type="self", rope=None, dtype=np.float32,
                 bias=False, scale=None, softcap=None, sliding_window=None, sinks=False, alibi=None, qk_norm=None,
                 cascade=None):
        self.n_heads = check_int("n_heads", n_heads, 1)
        self.n_kv_heads = self.n_heads if n_kv_heads is None else check_int("n_kv_heads", n_kv_heads, 1)
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={n_heads} must be a multiple of n_kv_heads={n_kv_heads}")
        self.dim = check_int("dim", dim, 1)
        self.head_dim = dim // self.n_heads if head_dim is None else check_int("head_dim", head_dim, 1)
        if self.head_dim < 1:
            raise ValueError(f"head_dim: dim={dim} // n_heads={n_heads} is 0; give head_dim")
        if self.head_dim > MAX_HEAD_SIZE:
            raise NotImplementedError(f"head_dim={self.head_dim}: the attention kernels take at most {MAX_HEAD_SIZE}")
        self.context_dim = self.dim if context_dim is None else check_int("context_dim", context_dim, 1)
        self.fuse_qkv = check_bool("fuse_qkv", fuse_qkv)
        self.use_qk_normalization = check_bool("use_qk_normalization", use_qk_normalization)
        self.norm_eps = check_float("norm_eps", norm_eps, positive=True)
        check_choice("attn_type", attn_type, ATTN_TYPES)
        self.attn_type = attn_type
        if rope is not None and not isinstance(rope, RotaryEmbedding):
            raise TypeError(f"rope must be a cupaged.RotaryEmbedding or None, got {type(rope).__name__}")
        if rope is not None and rope.head_dim != self.head_dim:
            raise ValueError(f"rope is for head_dim={rope.head_dim}, the layer's head_dim is {self.head_dim}")
        self.rope = None if attn_type == "cross" else rope
        self.dtype = float_dtype("dtype", dtype)
        if self.fuse_qkv and self.context_dim != self.dim:
            raise ValueError(f"fuse_qkv needs context_dim == dim, got context_dim={self.context_dim}, dim={dim}")
        self.options = layer_options(self.n_heads, self.head_dim, attn_type, bias=bias, scale=scale, softcap=softcap,
                                     sliding_window=sliding_window, sinks=sinks, alibi=alibi, qk_norm=qk_norm,
                                     use_qk_normalization=self.use_qk_normalization)
        self.cascade = None if cascade is None else check_bool("cascade", cascade)
        self.k_scale = self.v_scale = 1.0
        self.q_size, self.kv_size = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        self.weights: dict = {}
        self._slopes: dict = {}  # device_key(xp) -> the ALiBi slopes where that backend's kernels read them

    # -- weights --------------------------------------------------------------------------------

    def expected_shapes(self) -> dict:
        """The ``load_state_dict`` keys this layer takes, with their shapes ``[out_features, in_features]`` (vectors:
        ``[features]``; ``bo`` may be left out; "layer_head" norms also take per-head ``[heads, head_dim]``)."""
        return expected_shapes(self)

    def load_state_dict(self, state_dict) -> None:
        """Weights ``{"wq", "wk", "wv", "wo"}`` or ``{"wqkv", "wo"}`` (matrices ``[out_features, in_features]``:
        y = x · Wᵀ + b), plus the biases, ``"q_norm"`` / ``"k_norm"`` and ``"sinks"`` the options ask for
        (:meth:`expected_shapes`); numpy (the sim) or cupy arrays, cast to the layer's dtype (sinks: float32).
        Separate wq / wk / wv (and bq / bk / bv) are fused when ``fuse_qkv``. Every key and shape is checked before
        anything is kept; a missing or unexpected key is a ``KeyError``."""
        self.weights = load_weights(self, state_dict)

    def state_dict(self) -> dict:
        return dict(self.weights)

    # -- forward ----------------------------------------------------------------------------------

    def forward(self, x, plan, kv_cache=None, layer=0, context=None, *, validate=None):
        """``x`` ``[num_tokens, dim]``, the step's tokens in ``plan``'s order (a :class:`cupaged.BatchPlan`, host
        or device); ``kv_cache``: a :class:`cupaged.KVCache` (NHD / HND) for ``"self"``, a :class:`ContextCache`
        (or None: nothing kept) for ``"cross"``, unused by ``"full"``; ``layer``: its layer index. ``context``
        (cross only): ``{seq_id: [context_len, context_dim]}`` for the sequences whose context is new this step.
        ``validate`` (None: the CUPAGED_VALIDATE environment variable decides): check the plan's contents before
        anything is written (query_start_loc against seq_lens and the tokens, the hints, block tables and
        slot_mapping against the cache, positions against the RoPE cos / sin cache), as the ops do. A host plan's
        positions are checked always. A plan's tree mask (``custom_mask``: speculative decoding) goes to "self"
        layers' paged attention, never through the cascade. Returns ``[num_tokens, dim]``."""
        w = self.weights
        if not w:
            raise RuntimeError("Attention.forward: call load_state_dict first")
        xp = array_module(x=x, weights=w["wo"])
        if x.ndim != 2 or x.shape[1] != self.dim:
            raise ValueError(f"x must be [num_tokens, dim={self.dim}], got shape {tuple(x.shape)}")
        if x.dtype != self.dtype:
            raise TypeError(f"x must have the layer's dtype {self.dtype}, got {x.dtype}")
        if plan is None or not hasattr(plan, "query_start_loc"):
            raise TypeError(f"plan must be a cupaged.BatchPlan, got {type(plan).__name__}")
        if plan.slot_mapping.shape[0] != x.shape[0]:
            raise ValueError(f"x has {x.shape[0]} tokens, plan has {plan.slot_mapping.shape[0]}")
        if context is not None and self.attn_type != "cross":
            raise ValueError(f"context is cross attention's; this layer's attn_type is {self.attn_type!r}")
        check_tables(plan.block_tables, plan.seq_lens, plan.query_start_loc, x.shape[0])
        validate = validate_enabled(validate)
        if self.attn_type == "self":
            cache = cache_arrays(self, kv_cache, layer, plan, xp)
            if validate:
                validate_plan(plan, x.shape[0], kv_cache.num_blocks, kv_cache.block_size)
            if self.rope is not None and (validate or is_host_array(plan.positions)):
                check_positions(plan, kv_cache.block_size)
        else:
            if self.attn_type == "cross":
                if kv_cache is not None and not isinstance(kv_cache, ContextCache):
                    raise TypeError(f"kv_cache must be a cupaged.layers.ContextCache or None for attn_type='cross', "
                                    f"got {type(kv_cache).__name__}")
                layer = check_int("layer", layer, 0)
            if validate:
                validate_plan(plan, x.shape[0])
            if self.attn_type == "full":
                whole_sequences(plan, validate)
        check_plan_mask(plan, self.options, self.attn_type, validate)
        plan = device_plan(plan, xp)
        t = x.shape[0]
        if self.attn_type == "cross":
            q = linear(x, *self._qkv_weights()[0]).reshape(t, self.n_heads, self.head_dim)
            k, v, cu_k, max_k, fresh = self._context_kv(plan, kv_cache, layer, context, xp)
        else:
            q, k, v = self._qkv(x)
        norm = self.options.qk_norm
        q = qk_normalize(q, norm, w.get("q_norm"), self.norm_eps)
        if self.attn_type != "cross":  # the context's keys were normalized when projected
            k = qk_normalize(k, norm, w.get("k_norm"), self.norm_eps)
        out = xp.empty((t, self.n_heads, self.head_dim), self.dtype)
        if t:
            if self.attn_type == "self":
                self._paged(q, k, v, plan, kv_cache, cache, out, validate)
            elif self.attn_type == "full":
                if self.rope is not None:
                    self._rotate_whole(plan, q, k)
                varlen_attention(q, k, v, plan.query_start_loc, plan.query_start_loc, causal=False,
                                 max_seqlen_q=plan.max_query_len, max_seqlen_k=plan.max_query_len, out=out,
                                 validate=validate, **self._softmax_args(xp))
            else:
                varlen_attention(q, k, v, plan.query_start_loc, cu_k, causal=False, max_seqlen_q=plan.max_query_len,
                                 max_seqlen_k=max_k, out=out, validate=validate, **self._softmax_args(xp))
        if self.attn_type == "cross" and kv_cache is not None:  # kept once the step has run
            for seq_id, (ck, cv) in fresh.items():
                kv_cache.put(seq_id, layer, ck, cv)
        return linear(out.reshape(t, self.q_size), w["wo"], w.get("bo"))

    __call__ = forward

    def _softmax_args(self, xp) -> dict:
        """The options every attention op takes: scale, softcap, sinks, ALiBi slopes (on xp's device)."""
        o = self.options
        slopes = None
        if o.alibi_slopes is not None:
            key = device_key(xp)
            slopes = self._slopes.get(key)
            if slopes is None:
                slopes = self._slopes[key] = to_device(xp, o.alibi_slopes, "the layer's ALiBi slopes (run a step "
                                                                           "before capturing)")
        return {"scale": o.scale, "softcap": o.softcap, "sinks": self.weights.get("sinks"), "alibi_slopes": slopes}

    def _rotate_whole(self, plan, q, k):
        """"full" attention's RoPE: one launch, or one a sequence when the frequencies follow each sequence's
        length (``rope.per_length``: the rotation then reads max(positions) + 1 = its length, HF's rule)."""
        if not self.rope.per_length:
            self.rope(plan.positions, q, k)
            return
        starts = host_copy(plan.query_start_loc).tolist()
        for a, b in zip(starts[:-1], starts[1:]):
            if b > a:
                self.rope(plan.positions[a:b], q[a:b], k[a:b])

    def _qkv_weights(self):
        """((wq, bq), (wk, bk), (wv, bv)): the separate matrices and biases (None without), or views of wqkv's and
        bqkv's rows."""
        w = self.weights
        if not self.fuse_qkv:
            return tuple((w[f"w{n}"], w.get(f"b{n}")) for n in "qkv")
        q, kv = self.q_size, self.kv_size
        cut = (slice(0, q), slice(q, q + kv), slice(q + kv, None))
        b = w.get("bqkv")
        return tuple((w["wqkv"][c], None if b is None else b[c]) for c in cut)

    def _qkv(self, x):
        t = x.shape[0]
        if self.fuse_qkv:  # one GEMM; q, k and v are views of its rows
            qkv = linear(x, self.weights["wqkv"], self.weights.get("bqkv"))
            parts = (qkv[:, :self.q_size], qkv[:, self.q_size:self.q_size + self.kv_size],
                     qkv[:, self.q_size + self.kv_size:])
        else:
            parts = tuple(linear(x, w, b) for w, b in self._qkv_weights())
        heads = (self.n_heads, self.n_kv_heads, self.n_kv_heads)
        return tuple(p.reshape(t, h, self.head_dim) for p, h in zip(parts, heads))

    def _paged(self, q, k, v, plan, kv_cache, cache, out, validate):
        key, value = cache
        kvd, layout = kv_cache.kv_cache_dtype, kv_cache.layout
        kv = KvView.paged(key, value, q, kvd, layout)  # planned before the cache write: a plan that raises
        attn = plan_attention(q, kv, plan.block_tables, plan.seq_lens, plan.query_start_loc,  # writes nothing
                              max_query_len=plan.max_query_len, max_seq_len=plan.max_seq_len)
        xp = module_of(q)
        if self.rope is None:
            reshape_and_cache_flash(k, v, key, value, plan.slot_mapping, kvd, self.k_scale, self.v_scale,
                                    layout=layout, validate=validate)
        else:
            if self.rope.per_length:  # each token's row at its own sequence's frequencies
                positions, cos_sin = rope_rows(self.rope, plan, xp)
            else:
                positions = plan.positions
                cos_sin = rope_cache(self.rope, rope_positions(plan, kv_cache.block_size), xp)
            rope_and_cache(q, k, v, positions, cos_sin, key, value, plan.slot_mapping, kvd, self.k_scale,
                           self.v_scale, is_neox_style=self.rope.is_neox_style, layout=layout, validate=validate)
        n = cascade_blocks(plan, kv_cache.block_size, self.cascade, self.options) if plan.custom_mask is None else 0
        if n:  # the shared prefix read once for the batch, then each sequence's own blocks, merged by LSE
            level, tables, lens = cascade_level(plan, n, kv_cache.block_size, xp)
            args = {k: v for k, v in self._softmax_args(xp).items() if k != "alibi_slopes"}
            cascade_attention(q, key, value, [level], tables, lens, plan.query_start_loc, kv_cache_dtype=kvd,
                              k_scale=self.k_scale, v_scale=self.v_scale, layout=layout, out=out, **args)
            return
        run_attention(attn, q, kv, out, None, plan.block_tables, plan.seq_lens, plan.query_start_loc,
                      sliding_window=self.options.sliding_window, k_scale=self.k_scale, v_scale=self.v_scale,
                      custom_mask=plan.custom_mask, mask_indptr=plan.mask_indptr, **self._softmax_args(xp))

    def _context_kv(self, plan, store, layer, context, xp):
        """The batch's context keys and values packed along the token axis, their cu_seqlens and longest length,
        and the new contexts' (projected and k-normed now; the caller keeps them in ``store`` once the step ran),
        the others read back from ``store``."""
        if plan.seq_ids is None:
            raise ValueError("plan.seq_ids is None: cross attention finds each sequence's context by its id "
                             "(plan with BlockPool.plan / plan_decode)")
        context = {} if context is None else dict(context)
        ids = list(plan.seq_ids.tolist() if hasattr(plan.seq_ids, "tolist") else plan.seq_ids)
        for seq_id, c in context.items():
            if seq_id not in ids:
                raise ValueError(f"context[{seq_id!r}]: no such sequence in the plan")
            if array_module(context=c, x=self.weights["wo"]) is not xp or c.ndim != 2 or \
                    c.shape[1] != self.context_dim or c.dtype != self.dtype:
                raise ValueError(f"context[{seq_id!r}] must be a [context_len, {self.context_dim}] {self.dtype} "
                                 f"array on x's backend, got {c.dtype} {tuple(c.shape)}")
        missing = [s for s in ids if s not in context and (store is None or (s, layer) not in store)]
        if missing:
            raise ValueError(f"context: sequence {missing[0]!r} brings no context and none is kept for layer {layer}")
        fresh = {s: self._project_context(context[s]) for s in ids if s in context}
        pairs = [fresh[s] if s in fresh else store.get(s, layer) for s in ids]
        lens = np.array([0] + [p[0].shape[0] for p in pairs], np.int64)
        cu_k = xp.asarray(np.cumsum(lens).astype(np.int32))
        k = xp.concatenate([p[0] for p in pairs]) if pairs else xp.empty((0, self.n_kv_heads, self.head_dim),
                                                                           self.dtype)
        v = xp.concatenate([p[1] for p in pairs]) if pairs else k
        return k, v, cu_k, int(lens.max(initial=0)), fresh

    def _project_context(self, c):
        _, wk, wv = self._qkv_weights()
        shape = (c.shape[0], self.n_kv_heads, self.head_dim)
        k, v = linear(c, *wk).reshape(shape), linear(c, *wv).reshape(shape)
        return qk_normalize(k, self.options.qk_norm, self.weights.get("k_norm"), self.norm_eps), v

