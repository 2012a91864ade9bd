"""Sampling config validation and the exactness of speculative acceptance (statistical)."""

import math

import mlx.core as mx
import numpy as np
import pytest

from mtplx.engine.acceptor import speculative_output_marginal, verify_one_token
from mtplx.sampling import SamplerConfig, distribution, sample, token_counts

# Chi-square tests below run at a false-alarm rate of 1e-4 each (critical value from the exact
# survival function for even degrees of freedom), with fixed seeds, so they are deterministic;
# a broken acceptance rule shifts the marginal by far more than the test can miss.
ALPHA = 1e-4


def chi2_sf_even(x: float, df: int) -> float:
    assert df % 2 == 0
    k = df // 2
    return math.exp(-x / 2) * sum((x / 2) ** i / math.factorial(i) for i in range(k))


def chi2_sf(x: float, df: int) -> float:
    """Chi-square survival function for any df (regularized upper incomplete gamma, closed form)."""
    if df % 2 == 0:
        return chi2_sf_even(x, df)
    y = x / 2
    total = math.erfc(math.sqrt(y))
    for i in range(1, (df - 1) // 2 + 1):
        total += math.exp(-y + (i - 0.5) * math.log(y) - math.lgamma(i + 0.5)) if y > 0 else 0.0
    return total


def chi2_test(counts: dict, probs: dict, n_min: float = 5.0) -> tuple:
    """(p-value, df) of observed outcome counts against target probabilities; cells expected
    fewer than n_min times are pooled into one, so the chi-square approximation holds."""
    n = sum(counts.values())
    assert set(counts) <= set(probs), f"outcomes outside the target's support: {set(counts) - set(probs)}"
    big = [c for c in probs if probs[c] * n >= n_min]
    small = [c for c in probs if c not in big]
    obs = [counts.get(c, 0) for c in big] + ([sum(counts.get(c, 0) for c in small)] if small else [])
    exp = [probs[c] * n for c in big] + ([sum(probs[c] for c in small) * n] if small else [])
    stat = sum((o - e) ** 2 / e for o, e in zip(obs, exp))
    return chi2_sf(stat, len(obs) - 1), len(obs) - 1


def chi2_stat(counts: np.ndarray, probs: np.ndarray) -> float:
    n = counts.sum()
    mask = probs > 0
    assert counts[~mask].sum() == 0, "a token outside the target's support was emitted"
    expected = n * probs[mask]
    return float(((counts[mask] - expected) ** 2 / expected).sum())


def spec_draws(p, q, n, seed):
    rng = np.random.default_rng(seed)
    out = np.zeros(p.size, dtype=np.int64)
    for _ in range(n):
        d = sample(q, rng)
        _, tok = verify_one_token(p, q, d, rng)
        out[tok] += 1
    return out


def test_chi2_sf_matches_known_values():
    assert abs(chi2_sf(3.841458820694124, 1) - 0.05) < 1e-9     # the 95% critical value at df 1
    assert abs(chi2_sf(7.814727903251178, 3) - 0.05) < 1e-9
    assert abs(chi2_sf(9.487729036781154, 4) - 0.05) < 1e-9


@pytest.mark.parametrize("case", range(4))
def test_speculative_marginal_matches_target(case):
    rng = np.random.default_rng(100 + case)
    V = 7  # df = 6
    p = rng.dirichlet(np.ones(V) * 0.7)
    q = rng.dirichlet(np.ones(V) * 0.7)
    if case == 3:
        q = np.roll(p, 2)  # draft badly wrong: most drafts rejected, the residual carries p
    np.testing.assert_allclose(speculative_output_marginal(p, q), p, atol=1e-12)
    counts = spec_draws(p, q, 20_000, seed=case)
    assert chi2_sf_even(chi2_stat(counts, p), V - 1) > ALPHA


def test_marginal_with_real_sampler_pipeline():
    """p and q from distribution() with top-k/top-p cuts: supports differ, output still ~ p."""
    rng = np.random.default_rng(5)
    logits_p, logits_q = rng.normal(size=40) * 2, rng.normal(size=40) * 2
    cfg = SamplerConfig(temperature=0.8, top_p=0.9, top_k=6)
    p, q = distribution(logits_p, cfg), distribution(logits_q, cfg)
    counts = spec_draws(p, q, 20_000, seed=11)
    support = p > 0
    df = int(support.sum()) - 1
    if df % 2:  # merge the two rarest support tokens to get an even df for the exact sf
        idx = np.where(support)[0][np.argsort(p[support])[:2]]
        p = p.copy(); counts = counts.copy()
        p[idx[0]] += p[idx[1]]; counts[idx[0]] += counts[idx[1]]
        p[idx[1]] = 0; counts[idx[1]] = 0
        df -= 1
    assert chi2_sf_even(chi2_stat(counts, p), df) > ALPHA


def test_a_wrong_rule_is_detected():
    """The test has power: accepting every draft (a classic bug) fails it."""
    rng = np.random.default_rng(3)
    p, q = rng.dirichlet(np.ones(7)), rng.dirichlet(np.ones(7))
    draws = np.bincount([sample(q, rng) for _ in range(20_000)], minlength=7)
    assert chi2_sf_even(chi2_stat(draws, p), 6) < ALPHA


def test_greedy_distribution_is_argmax_with_lowest_id_ties():
    p = distribution(np.array([1.0, 3.0, 3.0, 0.0]), SamplerConfig(temperature=0.0))
    assert p.tolist() == [0.0, 1.0, 0.0, 0.0]


def test_filters_and_penalties():
    logits = np.log(np.array([0.4, 0.3, 0.2, 0.1]))
    p = distribution(logits, SamplerConfig(temperature=1.0, top_p=1.0, top_k=2))
    np.testing.assert_allclose(p, [4 / 7, 3 / 7, 0, 0])
    p = distribution(logits, SamplerConfig(temperature=1.0, top_p=0.65, top_k=0))
    np.testing.assert_allclose(p, [4 / 7, 3 / 7, 0, 0])
    p = distribution(logits, SamplerConfig(temperature=1.0, top_p=1.0, top_k=0, min_p=0.6))
    np.testing.assert_allclose(p, [4 / 7, 3 / 7, 0, 0])
    counts = token_counts([0, 0], 4)
    cfg = SamplerConfig(temperature=0.0, frequency_penalty=1.0)
    assert distribution(np.array([2.5, 1.0, 0.0, 0.0]), cfg, counts).argmax() == 1


@pytest.mark.parametrize("field,value", [
    ("temperature", -0.1), ("temperature", float("nan")), ("top_p", 0.0), ("top_p", 1.5),
    ("top_k", -1), ("top_k", 2.5), ("min_p", 1.1), ("presence_penalty", 2.5),
    ("frequency_penalty", -3.0), ("temperature", "hot"),
])
def test_sampler_config_validation_names_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplerConfig(**{field: value})


def test_sampler_config_is_hashable_with_mtplx_defaults():
    cfg = SamplerConfig()
    assert (cfg.temperature, cfg.top_p, cfg.top_k, cfg.presence_penalty) == (0.6, 0.95, 20, 0.0)
    assert hash(cfg) == hash(SamplerConfig()) and cfg == SamplerConfig()
    assert SamplerConfig(temperature=0).is_greedy


def test_a_temperature_below_epsilon_decodes_greedy():
    """logits / 1e-320 would overflow to a NaN distribution that always picks the last id."""
    cfg = SamplerConfig(temperature=1e-320)
    assert cfg.is_greedy and cfg == SamplerConfig(temperature=0.0)
    assert distribution(np.array([0.1, 2.0, 1.0]), cfg).argmax() == 1
    assert not SamplerConfig(temperature=2e-5).is_greedy


def _full_sort_reference(logits, cfg):
    """The rules over the whole vocabulary ranked (weight desc, id asc): the reference."""
    x = np.asarray(logits, dtype=np.float32)
    z = np.exp((x - x.max()) * np.float32(1.0 / cfg.temperature))
    order = np.lexsort((np.arange(z.size), -z))
    sorted_z = z[order].astype(np.float64)
    keep_sorted = np.ones(z.size, dtype=bool)
    if cfg.top_p < 1.0:
        cum = np.cumsum(sorted_z)
        keep_sorted[int(np.searchsorted(cum, cfg.top_p * z.sum(dtype=np.float64) * (1 - 1e-12))) + 1:] = False
    if cfg.min_p > 0.0:
        keep_sorted &= sorted_z >= cfg.min_p * sorted_z[0]
    if cfg.top_k > 0:
        keep_sorted[cfg.top_k:] = False
    p = np.zeros(z.size)
    p[order[keep_sorted]] = sorted_z[keep_sorted]
    return p / p.sum()


CONFIGS = [
    SamplerConfig(temperature=1.0, top_p=0.95, top_k=20), SamplerConfig(temperature=1.0, top_p=0.9, top_k=0),
    SamplerConfig(temperature=1.0, top_p=1.0, top_k=0, min_p=0.05),
    SamplerConfig(temperature=1.0, top_p=0.99, top_k=0), SamplerConfig(temperature=1.0, top_p=1.0, top_k=7),
    SamplerConfig(temperature=1.0, top_p=0.5, top_k=300, min_p=0.01),
    SamplerConfig(temperature=0.6, top_p=0.95, top_k=0, min_p=1e-6),
    SamplerConfig(temperature=0.3, top_p=1.0, top_k=5000)]


@pytest.mark.parametrize("cfg", CONFIGS)
def test_candidate_distribution_equals_the_full_sort(cfg):
    """A filtered distribution ranks only the heaviest tokens when that is enough: it must keep
    exactly what ranking the whole vocabulary keeps, with the same probabilities; ties (broken by
    id, as bfloat16 logits make them), flat distributions and real vocabulary sizes included."""
    from mtplx.sampling import row_distribution

    rng = np.random.default_rng(0)
    for trial in range(24):
        V = 248_320 if trial % 8 == 7 else 4096
        logits = rng.normal(scale=[0.1, 1.0, 4.0][trial % 3], size=V).astype(np.float32)
        if trial % 4 == 0:
            logits = np.round(logits, 1)                               # many exact ties
        if trial % 4 == 1:
            logits = np.array(mx.array(logits).astype(mx.bfloat16).astype(mx.float32))   # bf16 ties
        d = row_distribution(logits, cfg)
        ref = _full_sort_reference(logits, cfg)
        assert np.array_equal(np.flatnonzero(d.dense()), np.flatnonzero(ref)), trial
        np.testing.assert_allclose(d.dense(), ref, rtol=1e-12, atol=0)


def test_bfloat16_logits_from_the_device():
    """MLX bfloat16 logits (real checkpoints) are read through a float32 cast on the device."""
    from mtplx.sampling import row_distribution

    logits = mx.array(np.linspace(-3, 3, 1000)).astype(mx.bfloat16)
    d = row_distribution(logits, SamplerConfig(temperature=0.7, top_p=0.9, top_k=0))
    ref = _full_sort_reference(np.array(logits.astype(mx.float32)), SamplerConfig(temperature=0.7, top_p=0.9, top_k=0))
    np.testing.assert_allclose(d.dense(), ref, rtol=1e-12)
    top = np.array(logits.astype(mx.float32))
    assert row_distribution(logits, SamplerConfig(temperature=0.0)).ids.tolist() == [int(np.argmax(top))]
    assert (top == top.max()).sum() > 1          # bf16 ties at the top: the lowest id wins


def test_sparse_and_dense_penalty_counts_agree():
    from mtplx.sampling import row_distribution

    rng = np.random.default_rng(2)
    logits = rng.normal(size=500).astype(np.float32)
    cfg = SamplerConfig(temperature=0.8, top_p=0.9, top_k=0, presence_penalty=0.5, frequency_penalty=0.7)
    toks = [3, 3, 17, int(np.argmax(logits))]
    a = row_distribution(logits, cfg, token_counts(toks, 500)).dense()
    b = row_distribution(logits, cfg, {3: 2, 17: 1, toks[3]: 1}).dense()
    assert np.array_equal(a, b) and a[toks[3]] < distribution(logits, cfg)[toks[3]]


DEVICE_DRAFT_CONFIGS = [SamplerConfig(temperature=1.0, top_p=1.0, top_k=7),
                        SamplerConfig(temperature=0.7, top_p=0.9, top_k=0),
                        SamplerConfig(temperature=1.3, top_p=1.0, top_k=0, min_p=0.05)]


def test_a_device_draw_takes_each_candidate_for_exactly_the_uniforms_its_q_counts():
    """The q the host learns after a device draw is the draw's own: candidate j is taken for
    exactly the integers m in [ceil(2^24 t[j-1]), ceil(2^24 t[j])), checked at both ends of every
    kept candidate's range (and just outside them), so its mass (their count / 2^24) is exact."""
    from mtplx.sampling import UNIFORM_BITS, device_draft_distribution, device_draft_draw, row_distribution

    V, scale = 300, 1 << UNIFORM_BITS
    rng = np.random.default_rng(4)
    logits = rng.normal(scale=2.0, size=(len(DEVICE_DRAFT_CONFIGS), V)).astype(np.float32)
    logits[0, :5] = logits[0].max()                                     # ties at the top
    _, ids, t = device_draft_draw(mx.array(logits), DEVICE_DRAFT_CONFIGS, np.zeros(3, dtype=np.int64))
    ids, t = np.array(ids), np.array(t)
    ms, want = [], []
    for b, cfg in enumerate(DEVICE_DRAFT_CONFIGS):
        q, _ = device_draft_distribution(ids[b], t[b], V, 0)
        assert abs(q.probs.sum() - 1.0) < 1e-15 and set(q.ids) <= set(ids[b].tolist())
        # the draft sampler over the row's heaviest tokens, up to float32 weights and 2^-24 steps
        heaviest = np.full(V, -np.inf, dtype=np.float32)
        heaviest[ids[b]] = logits[b, ids[b]]
        assert np.sort(logits[b])[-len(ids[b])] == logits[b, ids[b]].min()
        np.testing.assert_allclose(q.dense(), row_distribution(heaviest, cfg).dense(), atol=2e-6, err_msg=str(b))
        edges = np.ceil(t[b].astype(np.float64) * scale).astype(np.int64)
        lo = 0
        for j in range(len(edges)):
            assert q.prob(int(ids[b, j])) == max(edges[j] - lo, 0) / scale
            if edges[j] > lo:
                for m in {lo, edges[j] - 1}:
                    ms.append((b, m))
                    want.append(int(ids[b, j]))
                if edges[j] < scale:
                    ms.append((b, int(edges[j])))      # the next kept candidate's first uniform
                    want.append(int(ids[b, j + 1 + np.argmax(edges[j + 1:] > edges[j])]))
                lo = edges[j]
    assert len(ms) > 20 and np.any(t[t < 0.5] * scale % 1)      # thresholds between the 2^-24 steps
    rows = np.array([b for b, _ in ms])
    drafts, _, _ = device_draft_draw(mx.array(logits[rows]), [DEVICE_DRAFT_CONFIGS[b] for b in rows],
                                     np.array([m for _, m in ms]))
    assert np.array(drafts).tolist() == want
    for (b, m), d in zip(ms, want):
        assert device_draft_distribution(ids[b], t[b], V, m)[1] == d


def test_device_draft_thresholds_out_of_order_still_give_the_draws_q():
    """A parallel scan may return thresholds that are not monotone; the draw takes candidate
    #{i: t[i] <= u}, so its q comes from the sorted thresholds."""
    from mtplx.sampling import device_draft_distribution

    ids, t = np.array([9, 5, 7]), np.array([0.5, 0.25, 1.0], dtype=np.float32)
    q, d = device_draft_distribution(ids, t, 10, 0)
    assert q.ids.tolist() == [5, 7, 9] and q.probs.tolist() == [0.25, 0.5, 0.25] and d == 9
    assert device_draft_distribution(ids, t, 10, 1 << 22)[1] == 5          # u = 0.25
    assert device_draft_distribution(ids, t, 10, 1 << 23)[1] == 7          # u = 0.5


def _device_spec_counts(p, draft_logits, cfg, n, seed, q_of=None):
    """Output counts of n device-drawn drafts (uniforms from one RNG) through the accept test
    against p, with the q the host learns (or `q_of(q)`: a wrong one, for the power check)."""
    from mtplx.sampling import device_draft_distribution, device_draft_draw, draft_uniform

    rng = np.random.default_rng(seed)
    m = np.array([draft_uniform(rng) for _ in range(n)])
    logits = mx.broadcast_to(mx.array(draft_logits, dtype=mx.float32), (n, draft_logits.size))
    drafts, ids, t = device_draft_draw(logits, [cfg] * n, m)
    drafts, ids, t = np.array(drafts), np.array(ids), np.array(t)
    counts = np.zeros(p.size, dtype=np.int64)
    for i in range(n):
        q, d = device_draft_distribution(ids[i], t[i], p.size, int(m[i]))
        assert d == drafts[i]
        counts[verify_one_token(p, q if q_of is None else q_of(q), d, rng)[1]] += 1
    return counts


def test_device_drawn_drafts_keep_the_target_distribution():
    """Drafts drawn on the device, verified with the q the host learns afterwards: the output is
    distributed as p (chi-square, df 6); with a wrong q (uniform over its support) the same test
    fails, so it has the power to see a q that is not the draw's."""
    from mtplx.sampling import Distribution

    rng = np.random.default_rng(8)
    p = rng.dirichlet(np.ones(7) * 0.7)
    draft_logits = rng.normal(scale=1.5, size=7)
    cfg = SamplerConfig(temperature=0.9, top_p=0.95, top_k=0)
    counts = _device_spec_counts(p, draft_logits, cfg, 20_000, seed=1)
    assert chi2_sf_even(chi2_stat(counts, p), 6) > ALPHA
    flat = _device_spec_counts(p, draft_logits, cfg, 20_000, seed=1,
                               q_of=lambda q: Distribution(q.ids, np.full(q.ids.size, 1.0 / q.ids.size), q.vocab))
    assert chi2_sf_even(chi2_stat(flat, p), 6) < ALPHA


DEVICE_JUDGED = [SamplerConfig(temperature=0.6, top_p=0.95, top_k=20), SamplerConfig(temperature=1.0, top_p=1.0, top_k=7),
                 SamplerConfig(temperature=1.0, top_p=0.5, top_k=64, min_p=0.01),
                 SamplerConfig(temperature=0.3, top_p=0.99, top_k=40), SamplerConfig(temperature=1.5, top_p=0.9, top_k=1)]


@pytest.mark.parametrize("cfg", DEVICE_JUDGED)
def test_device_target_distribution_equals_the_hosts(cfg):
    """The target distribution sampled rows are judged against on the device (over their heaviest
    candidates) keeps what the host's keeps, at the same probabilities to float32's precision.
    Where they differ it is by the one token on the top-p cut whose mass before it is within
    float32's rounding of top_p (the device sums in float32, the host in float64), and at exact
    ties on the cut (none here: the device may keep another of the tied tokens)."""
    from mtplx.sampling import device_target_candidates, judged_on_device, row_distribution

    assert judged_on_device(cfg)
    rng = np.random.default_rng(1)
    logits = np.stack([rng.normal(scale=s, size=4096) for s in (0.1, 1.0, 4.0)]).astype(np.float32)
    ids, masses = (np.array(a) for a in device_target_candidates(mx.array(logits), [cfg] * 3))
    for b in range(3):
        probs = np.zeros(4096)
        probs[ids[b]] = masses[b]
        ref = row_distribution(logits[b], cfg).dense()
        differ = set(np.flatnonzero(probs)) ^ set(np.flatnonzero(ref))
        if differ:
            weights = np.exp(logits[b].astype(np.float64) - logits[b].max()) ** (1 / cfg.temperature)
            before = (weights[weights > weights[list(differ)[0]]].sum()) / weights.sum()
            assert len(differ) == 1 and abs(before - cfg.top_p) < 1e-5, (b, differ, before)
            both = (probs > 0) & (ref > 0)              # the rest renormalised over what both keep
            probs, ref = np.where(both, probs, 0) / probs[both].sum(), np.where(both, ref, 0) / ref[both].sum()
        np.testing.assert_allclose(probs, ref, rtol=2e-5, atol=1e-9)


def test_device_verdicts_are_the_accept_rule_exactly():
    """The chain judged on the device, over grids of its uniforms (so fractions are exact to the
    grid's step): a draft is kept for a fraction min(1, p/q) of the accept uniforms; the token at
    the first rejection follows the residual max(p - q, 0) normalised, over the draw uniforms;
    after a kept chain the bonus follows p at the next position; no draft past a row's depth is
    ever kept, and a kept first draft with a rejected second one keeps 1."""
    from mtplx.engine.acceptor import device_verdicts

    rng = np.random.default_rng(4)
    V, T, n = 7, 3, 2048
    P = rng.dirichlet(np.ones(V) * 0.8, size=T).astype(np.float32)
    Q = rng.dirichlet(np.ones(V) * 0.8, size=T - 1).astype(np.float32)
    Q[:, 0] = 0.0                                         # a token the drafts never propose
    Q /= Q.sum(axis=1, keepdims=True)
    grid = (np.arange(n, dtype=np.float32) + 0.5) / n

    def run(drafts, u, v, depth):
        N = len(u)
        every = mx.broadcast_to(mx.arange(V, dtype=mx.int32), (N, T, V))      # candidates: the whole vocabulary
        kept, token = device_verdicts(every, mx.array(np.broadcast_to(P, (N, T, V))), every[:, 1:],
                                      mx.array(np.broadcast_to(Q, (N, T - 1, V))),
                                      mx.array(np.broadcast_to(drafts, (N, T - 1)).astype(np.uint32)),
                                      mx.array(u, dtype=mx.float32), mx.array(v, dtype=mx.float32),
                                      mx.array(np.full(N, depth, dtype=np.int32)))
        return np.array(kept), np.array(token)

    def frequencies(tokens):
        return np.bincount(tokens, minlength=V) / len(tokens)

    never = np.ones((n, T), np.float32) * 0.5
    for d in range(1, V):                                 # first draft: kept at min(1, p/q)
        kept, token = run([d, 0], np.stack([grid, grid], 1), never, 1)
        assert set(kept) <= {0, 1}
        assert abs(kept.mean() - min(1.0, P[0, d] / Q[0, d])) <= 1.0 / n, d
        assert (token[kept == 0] != d).all() or P[0, d] > Q[0, d]
    rejected = [d for d in range(1, V) if P[0, d] < Q[0, d]]
    residual = np.maximum(P[0] - Q[0], 0)
    residual /= residual.sum()
    for d in rejected:                                    # the residual at the first rejection
        kept, token = run([d, 0], np.full((n, T - 1), 1 - 0.5 / n), np.stack([grid] * T, 1), 1)
        assert (kept == 0).all() and np.abs(frequencies(token) - residual).max() <= 1.0 / n
    kept, token = run([rejected[0], 0], np.zeros((n, T - 1)), np.stack([grid] * T, 1), 1)   # the bonus
    assert (kept == 1).all() and np.abs(frequencies(token) - P[1]).max() <= 1.0 / n
    d1 = next(d for d in range(1, V) if P[1, d] < Q[1, d])    # kept, then rejected: the residual at 1
    kept, token = run([rejected[0], d1], np.stack([np.zeros(n), np.full(n, 1 - 0.5 / n)], 1),
                      np.stack([grid] * T, 1), 2)
    residual1 = np.maximum(P[1] - Q[1], 0)
    assert (kept == 1).all() and np.abs(frequencies(token) - residual1 / residual1.sum()).max() <= 1.0 / n
    kept, _ = run([rejected[0], d1], np.zeros((n, T - 1)), np.stack([grid] * T, 1), 2)
    assert (kept == 2).all()
