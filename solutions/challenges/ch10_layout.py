"""Challenge 10, one way: local search from a layout that fits.

Start from pure data parallelism with ZeRO-1 and selective recomputation; then, as long as
one move makes the predicted step faster (or makes an unfit layout fit), take the best move.
A move trades a factor of 2 between any two of the dimensions (dp, tp within the node, pp,
cp), or changes one knob: the ZeRO stage, the micro-batch, the
recomputation, the virtual stages. Each step costs a dozen ``plan.predict`` calls, not the
thousands of the exhaustive search; starting from each corner of the space (each
model-parallel dimension 1 or a node's width) guards against a local minimum."""
from minipar import plan


def _score(model, cluster, nodes, batch, seq, lay):
    try:
        p = plan.predict(model, cluster, lay, batch, seq, nodes=nodes)
    except ValueError:
        return None
    return (0 if p.fits else 1, p.memory["total"] if not p.fits else p.step_time)


def _moves(lay, per_node):
    dims = ("dp", "tp", "pp", "cp")
    for a in dims:
        for b in dims:
            if a != b and getattr(lay, a) % 2 == 0 and not (b == "tp" and lay.tp * 2 > per_node):
                yield lay.replace(**{a: getattr(lay, a) // 2, b: getattr(lay, b) * 2})
    for z in (0, 1, 2, 3):
        yield lay.replace(zero=z)
    for b in (1, 2, 4):
        yield lay.replace(micro_batch=b)
    for rc in ("none", "selective", "full"):
        yield lay.replace(recompute=rc)
    for v in (1, 2, 4):
        yield lay.replace(v=v, schedule="interleaved" if v > 1 else "1f1b")


def choose(model, cluster, nodes, global_batch, seq_len):
    per_node = plan.CLUSTERS[cluster].gpus_per_node
    n = nodes * per_node
    starts = [plan.Layout(dp=n // (tp * pp * cp), tp=tp, pp=pp, cp=cp, zero=1, recompute=rc)
              for tp in (1, per_node) for pp in (1, per_node) for cp in (1, per_node)
              for rc in ("none", "selective") if tp * pp * cp <= n]  # corners of the space
    best = None
    for lay in starts:
        score = _score(model, cluster, nodes, global_batch, seq_len, lay) or (2, float("inf"))
        while True:
            scored = [(s, m) for m in _moves(lay, per_node)
                      if (s := _score(model, cluster, nodes, global_batch, seq_len, m)) is not None]
            s, m = min(scored, key=lambda t: t[0], default=(None, None))
            if s is None or s >= score:
                break
            score, lay = s, m
        if best is None or score < best[0]:
            best = (score, lay)
    return best[1]
