"""Per-query-block selection for the learned patterns (``sparse_k``, ``dsa``): ``build_selection``.

For every query block ``[b0, b0 + query_block)`` of the call (blocks are counted by *position*, so
decode and recompute share them) the candidates are the keys with positions in
``[sinks, b0 - window]`` (``pattern.candidate_range``; outside the sinks and the window of the
block's first query, so nothing is counted twice). With at most ``top_k`` candidates all are taken
(weight 1); otherwise:

* ``SparseK`` with a ``SparseKScorer``: key scores ``u`` (query-independent), SparseK weights
  ``p = sparsek(u over the candidates, top_k)``; the ``top_k`` keys with the largest ``u`` (equal
  to the ``top_k`` largest ``p``: ``p`` is monotone in ``u``, and at most ``top_k`` entries reach
  1) are kept with their weights ``p`` (the support of ``p`` can exceed ``top_k`` through
  fractional entries; those past the ``top_k`` largest are dropped). Ties go to the earlier key.
* ``DSA`` with a ``LightningIndexer``: indexer scores of the block's *first* query against every
  candidate, top ``top_k``, weight 1, one selection shared by all KV heads. Only the first query
  is used so that the selection is fixed when the block starts (decode equals recompute). A call
  that starts inside a block (decode) takes the block's indexer query from the memo the indexer
  kept when the block's first query went through it.
* no selector (``selector=None``): the training-free fallback below, hard top-k (weight 1), with a
  one-time warning.

Training-free fallback score (per KV head, query-independent so it needs no state in decode):
``u_j = ||v_j||_2 * (1 + ||k_j - mean_k||_2 / ||mean_k||_2)`` hmm
"""
