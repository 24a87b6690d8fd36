"""``python -m cupaged demo``: a tiny decoder served with continuous batching on cupaged's kernels.

    model.py        the decoder (embeddings, N x (RMSNorm, cupaged.layers.Attention, RMSNorm, SwiGLU), logits),
                    random weights from a seed;
    engine.py       the serving loop: BlockPool + KVCache, chunked prefill mixed with decode, prefix cache, fork,
                    preemption by recompute;
    speculative.py  ``--speculative K``: draft trees from the decoder's first layer, the tree mask that verifies
                    them, acceptance, and moving the accepted keys and values into place;
    cli.py          the command: arguments, progress bar, closing table, ``--verify`` against a float64 forward
                    (cupaged.reference.layers.decoder_logits).
"""
