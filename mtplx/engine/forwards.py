"""The forwards of one cycle (MTP head, chained drafts, target verify) over fixed shapes, as
`mx.compile`d graphs where the caches allow, each first run checked against its eager forward."""

from __future__ import annotations

import logging
from functools import partial
from typing import Optional

import mlx.core as mx

from mtplx.models.cache import RaggedKVCache
from mtplx.models.cpu_ops import split_for

log = logging.getLogger("mtplx")


# A compiled graph's first run at each span and shape must match its eager forward to within this
# (|compiled - eager| / (1 + |eager|), every output); fusion's rounding differences are ~1e-6.
GRAPH_CHECK_RTOL = 1e-3


def _graph_inputs(caches) -> Optional[list]:
    """The caches as plain arrays for a compiled forward; None when some cache cannot enter one
    (no graph protocol, or a buffer not allocated yet)."""
    arrays = []
    for c in caches:
        if not hasattr(c, "graph_inputs"):
            return None
        arrays.extend(c.graph_inputs())
    return arrays if all(a is not None for a in arrays) else None


def _graph_outputs(caches) -> tuple:
    return tuple(a for c in caches for a in c.graph_outputs())


def _graph_views(kinds, arrays, offset, span) -> list:
    """Inside a graph: each layer's cache rebuilt from its two arrays."""
    it = iter(arrays)
    return [kind.graph_view([next(it), next(it)], offset, span) for kind in kinds]


def _draft(model, mtp_caches, h_hist, h_last, t_hist, x0, owed):
    """`CycleForwards.draft`'s forward (the input's gather inside it: in a compiled graph it
    costs no dispatch of its own)."""
    D = h_hist.shape[1]
    slot = mx.arange(D + 1)[None, :]
    take = mx.where(slot < owed[:, None], slot, D)
    h_in = mx.take_along_axis(mx.concatenate([h_hist, h_last], axis=1), take[:, :, None], axis=1)
    t_in = mx.take_along_axis(mx.concatenate([t_hist, x0[:, None]], axis=1), take, axis=1)
    g = mx.take_along_axis(model.draft_hidden(h_in, t_in, mtp_caches), owed[:, None, None], axis=1)
    return model.draft_logits(g)[:, 0], g


def _chain(model, mtp_caches, g, d):
    g = model.draft_hidden(g, d[:, None], mtp_caches)
    return model.draft_logits(g)[:, 0], g


class CycleForwards:
    """The forwards of a cycle over fixed shapes: the MTP head over [W, 1 + depth] (owed history
    entries + draft entry), at depth 2-3 the head again over [W, 1] per chained draft, and the
    target verify over [W, 1 + drafts]. They run as `mx.compile`d graphs cached on the lane: each
    cache enters as arrays (KV buffers, or a GDN layer's conv window and state) and comes back as
    arrays (updated buffers, or the GDN capture the commit rolls back from). A graph retraces
    when a KV buffer's capacity grows. With the lane's `span_bucket`, attention reads only the
    buffer's first positions, up to the rows' longest rounded up to the bucket: one graph per
    span, traced when first reached. Eager through the same code when compiling is off or a
    cache cannot enter a graph yet."""

    def __init__(self, lane, caches, mtp_caches, counters=None):
        self.model, self.caches, self.mtp_caches = lane.model, caches, mtp_caches
        self.compiled, self.span_bucket = lane.compiled, lane.span_bucket
        self.counters = counters        # the running lane's LaneCounters: its graphs' traces and first runs
        if self.compiled and "fns" not in lane._graphs:
            model = lane.model
            kinds = [type(c) for c in caches]
            mtp_kinds = [type(c) for c in mtp_caches]

            def draft(span, h_hist, h_last, t_hist, x0, owed, offset, *arrays):
                mc = _graph_views(mtp_kinds, arrays, offset, span)
                return _draft(model, mc, h_hist, h_last, t_hist, x0, owed) + _graph_outputs(mc)

            def chain(span, g, d, offset, *arrays):
                mc = _graph_views(mtp_kinds, arrays, offset, span)
                return _chain(model, mc, g, d) + _graph_outputs(mc)

            def verify(span, tokens, offset, *arrays):   # [W, 2] a cycle's verify, [W, 1] an AR step
                tc = _graph_views(kinds, arrays, offset, span)
                H = model.hidden(tokens, tc)
                return (H, model.logits(H)) + _graph_outputs(tc)

            # one name per input shape, so that a shape first met is a trace, not a retrace
            lane._graphs["fns"] = {"draft": draft, "chain": chain, "verify": verify, "verify3": verify,
                                   "verify4": verify, "ar": verify}
        self._graphs = lane._graphs

    def _run(self, name, caches, T, *args):
        """Run graph `name` over these caches if they can enter it; None otherwise."""
        if not self.compiled or "eager_since" in self._graphs:
            return None
        ragged = [c for c in caches if isinstance(c, RaggedKVCache)]
        for c in ragged:
            c.ensure_capacity(int(c.lengths.max()) + T)
        arrays = _graph_inputs(caches)
        if arrays is None:
            return None
        offset = ragged[0].offset if ragged else mx.zeros((1,), mx.int32)
        span = self._span(caches, ragged, T)
        if span is False:
            return None
        signature = self._note_trace(name, args, arrays)
        graph = self._graphs.get((name, span))
        if graph is None:
            graph = self._graphs[(name, span)] = mx.compile(partial(self._graphs["fns"][name], span))
        out = graph(*args, offset, *arrays)
        checked = self._graphs.setdefault("checked", set())        # (graph, span, input shapes) checked
        if (span,) + signature not in checked:
            checked.add((span,) + signature)
            if self.counters is not None:
                self.counters.graph_first_runs += 1
            out = self._checked(name, span, out, args, offset, arrays)
        return out, offset + T

    def _span(self, caches, ragged, T):
        """The positions a graph's attention reads (None: the whole buffer), or False where the
        rows are so uneven that they attend split by span (cpu_ops), eagerly."""
        if not ragged or not self.span_bucket:
            return None
        spans = ragged[0].lengths + T
        if caches is self.caches and split_for(spans, ragged[0].keys.dtype) is not None:
            return False
        return min(-(-int(spans.max()) // self.span_bucket) * self.span_bucket, ragged[0].keys.shape[2])

    def _note_trace(self, name, args, arrays) -> tuple:
        """The graph's input signature; a signature not seen before is a trace, and a retrace when
        the graph was traced at other shapes (counted on the lane)."""
        traced = self._graphs.setdefault("traced", set())        # (graph, input shapes) seen
        signature = (name,) + tuple(a.shape for a in args + tuple(arrays))
        if signature not in traced:
            if self.counters is not None and any(t[0] == name for t in traced):
                self.counters.graph_retraces += 1
            traced.add(signature)
        return signature

    def _checked(self, name, span, out, args, offset, arrays):
        """A compiled graph's first run at a span and shape, against the same function run eagerly on
        the same arrays (both pure; ~one eager forward, once per graph). On disagreement beyond
        rounding the lane logs it and runs eagerly from then on, and this run takes the eager
        result. Why: one CI run out of four saw a compiled B3 lane decode a row wrongly from the
        cycle where its span crossed 64 (the cause was not found); this turns such a graph into a
        logged fallback instead of a wrong token."""
        ref = self._graphs["fns"][name](span, *args, offset, *arrays)
        mx.eval(out, ref)
        worst = max(float(mx.max(mx.abs(a.astype(mx.float32) - b.astype(mx.float32)) /
                                 (1.0 + mx.abs(b.astype(mx.float32))))) for a, b in zip(out, ref))
        if worst <= GRAPH_CHECK_RTOL:
            return out
        log.error("mtplx: the lane's compiled %s graph (span %s, inputs %s) disagrees with its eager forward "
                  "(relative difference %.3g); the lane runs eagerly from now on", name, span,
                  [tuple(a.shape) for a in args + tuple(arrays)], worst)
        self._graphs["eager_since"] = f"{name} graph at span {span}: relative difference {worst:.3g}"
        self.compiled = False
        return ref

    def draft(self, h_hist, h_last, t_hist, x0, owed):
        """The cycle's first draft logits [W, V] and the head's output [W, 1, H] there: the head over
        [W, 1 + D] = each row's `owed` history entries (of `h_hist` [W, D, H], `t_hist` [W, D]),
        then (h_last, x0) to the end."""
        args = (h_hist, h_last, t_hist, x0, owed)
        T = h_hist.shape[1] + 1
        ran = self._run("draft", self.mtp_caches, T, *args)
        if ran is None:
            return _draft(self.model, self.mtp_caches, *args)
        return tuple(self._absorb(ran, self.mtp_caches, T, 2))

    def chain(self, g, d):
        """The next chained draft's logits [W, V] and the head's output: the head over [W, 1] =
        (its own last output `g`, the last draft `d`)."""
        ran = self._run("chain", self.mtp_caches, 1, g, d)
        if ran is None:
            return _chain(self.model, self.mtp_caches, g, d)
        return tuple(self._absorb(ran, self.mtp_caches, 1, 2))

    def verify(self, tokens, graph: Optional[str] = None):
        """Target hidden [W, T, H] and logits [W, T, V]: T = 1 + depth for [primary, drafts]
        (graphs "verify", "verify3", "verify4"), T = 1 for a plain AR step (graph "ar")."""
        graph = graph or ("verify" if tokens.shape[1] == 2 else f"verify{tokens.shape[1]}")
        ran = self._run(graph, self.caches, tokens.shape[1], tokens)
        if ran is None:
            H = self.model.hidden(tokens, self.caches)
            return H, self.model.logits(H)
        return tuple(self._absorb(ran, self.caches, tokens.shape[1], 2))

    @staticmethod
    def _absorb(ran, caches, T, n_results):
        out, offset = ran
        rest = iter(out[n_results:])
        for c in caches:
            c.absorb_graph(rest, T, offset)
        return out[:n_results]
