"""The learned selection by its definition, element by element in Python (small shapes only), and the
comparison of a ``TokenLayout`` with it: shared by ``test_selectors.py`` and ``test_page_selection.py``."""

import torch
from sparse_k.selection.sparsek import sparsek


def brute_force_topk(pattern, u_rows, geometry, Sq, Skv, B, H, weighted):
    """Per row/head/block: candidates from the definition, top-k by score (earlier key wins ties),
    SparseK weights from the plain operator on the candidates only. Returns {(b, h, qpos_block): (idx, w)}."""
    out = {}
    qpos = geometry.q_positions(Sq).expand(B, Sq)
    kpos = geometry.k_positions(Skv).expand(B, Skv)
    valid = geometry.key_valid(Skv).expand(B, Skv)
    for b in range(B):
        blocks = sorted({int(p) // pattern.query_block for p in qpos[b].clamp_min(0).tolist()})
        for blk in blocks:
            b0 = blk * pattern.query_block
            cand = [j for j in range(Skv) if valid[b, j] and pattern.sinks <= kpos[b, j] <= b0 - pattern.window]
            for h in range(H):
                u = u_rows[b, h if u_rows.shape[1] > 1 else 0]
                if u.dim() == 2:  # per-block scores (DSA)
                    u = u[blk - blocks[0]]
                order = sorted(cand, key=lambda j: (-float(u[j]), j))[: pattern.top_k]
                idx = sorted(order)
                w = None
                if weighted and cand:
                    p = sparsek(u[cand].double(), pattern.top_k)
                    pj = dict(zip(cand, p.tolist()))
                    w = [pj[j] for j in idx]
                out[(b, h, blk)] = (idx, w)
    return out


def layout_selection(lay, geometry, Sq, B, H):
    """A ``TokenLayout``'s selection as ``{(b, h, query block): (indices, weights or None)}``, the form of
    ``brute_force_topk``."""
    out = {}
    qpos = geometry.q_positions(Sq).expand(B, Sq)
    for b in range(B):
        blocks = sorted({int(p) // lay.query_block for p in qpos[b].clamp_min(0).tolist()})
        for blk in blocks:
            n = blk - int(lay.first_block[b])
            for h in range(H):
                c = int(lay.counts[b, h, n])
                idx = lay.indices[b, h, n, :c].tolist()
                w = lay.weights[b, h, n, :c].double().tolist() if lay.weights is not None else None
                out[(b, h, blk)] = (idx, w)
    return out


def assert_same_selection(got, want, atol=1e-5):
    """Same blocks, same indices, weights within ``atol``."""
    assert got.keys() == want.keys()
    for key in want:
        gi, gw = got[key]
        wi, ww = want[key]
        assert gi == wi, f"{key}: indices {gi} != {wi}"
        if ww is not None and wi:
            torch.testing.assert_close(torch.tensor(gw), torch.tensor(ww), atol=atol, rtol=0)
