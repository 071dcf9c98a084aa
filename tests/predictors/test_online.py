"""Learning from the running job (issue 43): the refit arithmetic by hand, the online wrapper's
cache / observe / refit / re-forecast cycle on a fake classifier, the uncertainty forecasts and
TD-Pipe's use of them, the job loop's glue, and eval by prompt source."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from batchinfer.engine.request import FinishReason, Request, SamplingParams
from batchinfer.predictors.base import (Forecast, LengthPredictor, LengthQuery, MeanPredictor,
                                        class_forecasts)
from batchinfer.predictors.history import HistoryRecord, history_record
from batchinfer.predictors.online import OnlineLengthPredictor
from batchinfer.predictors.online_fit import (censored_means, fit_online, global_scale,
                                              recalibrated_means, ridge_loo, truncated_mean)
from batchinfer.runner.predictor_setup import apply_forecast, learn, wrap_online
from batchinfer.runner.recipe import PredictorConfig
from batchinfer.strategies.tdpipe.policy import forecast_length


# --- the refit arithmetic -------------------------------------------------------------------------
def test_global_scale_shrinks_to_one_with_few_examples():
    prior = np.full(4, 100.0)
    actual = np.full(4, 200.0)
    assert global_scale(actual, prior, 0.0) == pytest.approx(2.0)
    # 4 examples at ratio 2 against 4 pseudo-examples at ratio 1: (800 + 400) / (400 + 400)
    assert global_scale(actual, prior, 4.0) == pytest.approx(1.5)
    many = global_scale(np.full(400, 200.0), np.full(400, 100.0), 4.0)
    assert 1.95 < many < 2.0
    assert global_scale(np.array([]), np.array([]), 4.0) == 1.0


def test_censored_scale_truncates_both_sides_at_the_horizon():
    assert truncated_mean(np.array([100.0]), np.array([np.inf]))[0] == pytest.approx(100.0)
    assert truncated_mean(np.array([100.0]), np.array([0.0]))[0] == pytest.approx(0.0)
    assert truncated_mean(np.array([100.0]), np.array([100.0]))[0] == pytest.approx(
        100 * (1 - np.exp(-1)))
    # two short replies finished; eight still decode, already past the prior's 100 tokens
    prior = np.full(10, 100.0)
    known = np.array([20.0, 20.0] + [150.0] * 8)
    finished_only = global_scale(known[:2], prior[:2], 0.0)
    assert finished_only == pytest.approx(0.2)              # what learning from the first reads
    horizons = known.copy()
    censored = global_scale(known, prior, 0.0, horizons)
    expected = known.sum() / (2 * 100 * (1 - np.exp(-0.2)) + 8 * 100 * (1 - np.exp(-1.5)))
    assert censored == pytest.approx(expected) and censored > 1.5
    # a long-finished short reply watched for long says more than one that just ended
    watched = global_scale(np.array([20.0]), np.array([100.0]), 0.0, np.array([500.0]))
    just = global_scale(np.array([20.0]), np.array([100.0]), 0.0, np.array([20.0]))
    assert watched < just


def test_the_token_clock_follows_the_decoding_requests():
    online = OnlineLengthPredictor(MeanPredictor(50.0))
    online._advance_clock({"a": 10, "b": 20})                             # noqa: SLF001
    online._advance_clock({"a": 30, "b": 44, "c": 5})                     # noqa: SLF001
    assert online._clock == pytest.approx(22.0)                           # noqa: SLF001


def test_class_means_blend_the_job_with_the_rescaled_prior():
    actual = np.array([10.0, 30.0, 300.0])
    classes = np.array([0, 0, 1])
    means = recalibrated_means(actual, classes, [15.0, 200.0, 480.0], scale=1.0, prior_weight=2)
    assert means[0] == pytest.approx((40 + 2 * 15) / 4)
    assert means[1] == pytest.approx((300 + 2 * 200) / 3)
    assert means[2] == pytest.approx(480.0)                 # no example: the prior's mean
    scaled = recalibrated_means(actual, classes, [15.0, 200.0, 480.0], 1.5, 2)
    assert scaled[2] == pytest.approx(720.0)


def test_censored_means_are_the_exponential_posterior_of_each_class():
    # class 0: two finished (10, 30) and one decoding at 50; class 1: one decoding at 40 only
    known = np.array([10.0, 30.0, 50.0, 40.0])
    cens = np.array([False, False, True, True])
    cls = np.array([0, 0, 0, 1])
    means, labels = censored_means(known, cens, np.full(4, np.inf), cls, [20.0, 300.0], 1.5, 2.0)
    # uncapped: (tokens watched + tau * s * m) / (finished + tau)
    assert means[0] == pytest.approx((10 + 30 + 50 + 2 * 30) / (2 + 2))
    assert means[1] == pytest.approx((40 + 2 * 450) / (0 + 2))
    assert labels[:2] == pytest.approx([10, 30])                 # finished: their own length
    assert labels[2] == pytest.approx(50 + means[0]) and labels[3] == pytest.approx(40 + means[1])
    # with a cap, the fixed point: m = (sum of E[min(L, cap) | L > g] + tau s m0) / (n + tau)
    capped, lab = censored_means(known, cens, np.full(4, 100.0), cls, [20.0, 300.0], 1.5, 2.0)
    for k in (0, 1):
        members = cls == k
        assert capped[k] == pytest.approx((lab[members].sum() + 2 * [30, 450][k])
                                          / (members.sum() + 2), rel=1e-4)
    assert lab[3] <= 100 and capped[1] < means[1]


@pytest.mark.parametrize("tau", [32.0, 0.0])
def test_censored_means_reach_the_fixed_point_when_almost_all_are_still_decoding(tau):
    """995 requests decoding at 300 tokens, 5 finished at 100: the exact mean without caps is
    (tokens watched + tau m0) / (finished + tau), which an EM iteration from the prior takes
    thousands of steps to reach (it gave 1,399 for 1,434 at tau 32 and 3,991 for 9,970 at 0)."""
    known = np.array([100.0] * 5 + [300.0] * 995)
    cens = np.array([False] * 5 + [True] * 995)
    cls = np.zeros(1000, dtype=np.int64)
    exact = (known.sum() + tau * 200.0) / (5 + tau)
    means, _ = censored_means(known, cens, np.full(1000, np.inf), cls, [200.0], 1.0, tau)
    assert means[0] == pytest.approx(exact, rel=1e-9)
    capped, labels = censored_means(known, cens, np.full(1000, 2000.0), cls, [200.0], 1.0, tau)
    assert capped[0] < exact
    assert capped[0] == pytest.approx((labels.sum() + tau * 200.0) / (1000 + tau), rel=1e-6)


def test_censored_class_means_learn_a_class_the_prior_put_too_long():
    """The first 40% of a job to finish, and the rest still decoding: every reply averages 100
    tokens whatever its class, but the prior says 25 and 300 (its classes do not separate this
    source). Labelling a decoding request g + the prior's (rescaled) class mean keeps class 1
    near the prior; the job's own censored estimate finds it."""
    rng = np.random.default_rng(3)
    n = 400
    cls = rng.integers(0, 2, n)
    lengths = np.minimum(rng.exponential(100.0, n), 512.0)
    t = np.quantile(lengths, 0.4)                       # all admitted at once, watched t tokens
    done = lengths <= t
    known = np.where(done, lengths, t)
    prior_means = [25.0, 300.0]
    prior = np.asarray(prior_means)[cls]
    args = (known, prior, cls, prior_means, None)
    kw = dict(prior_weight=8.0, use_head=False, horizons=known, censored=~done,
              caps=np.full(n, 512.0))
    job = fit_online(*args, **kw)                       # the default: prior worth 32 finished
    old = fit_online(*args, **kw, impute="prior")
    truth = [lengths[cls == k].mean() for k in (0, 1)]
    assert old.class_means[1] > 2.5 * truth[1]          # the earlier rule: pinned to the prior
    assert job.class_means[1] < 0.65 * old.class_means[1]
    light = fit_online(*args, **kw, tail_weight=8.0)     # a lighter prior: the job's own means
    assert light.class_means == pytest.approx(truth, rel=0.3)
    forecast_job = job.predict(prior, cls, None).sum()
    forecast_old = old.predict(prior, cls, None).sum()
    assert abs(forecast_job - lengths.sum()) < 0.5 * abs(forecast_old - lengths.sum())
    # no decoding request: the class means are recalibrated_means, whatever `impute` says
    plain = fit_online(lengths, prior, cls, prior_means, None, 8.0, use_head=False)
    assert plain.class_means == pytest.approx(
        recalibrated_means(lengths, cls, prior_means, plain.scale, 8.0))
    with pytest.raises(ValueError):
        fit_online(*args, **kw, impute="median")


def test_ridge_turns_on_for_a_signal_and_stays_off_for_noise():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((80, 16))
    signal = 50 * x[:, 3] + rng.normal(0, 5, 80)
    lam, w, loo, rmse = ridge_loo(x, signal)
    assert w is not None and lam is not None
    assert rmse < 0.3 * np.sqrt(np.mean(signal ** 2))
    assert int(np.argmax(np.abs(w))) == 3
    noise = rng.normal(0, 50, 80)
    lam, w, _, rmse = ridge_loo(rng.standard_normal((80, 16)), noise)
    # pure noise: no lam predicts held-out rows better than 0, or only marginally
    assert w is None or rmse > 0.95 * np.sqrt(np.mean(noise ** 2))
    assert ridge_loo(x[:5], signal[:5])[1] is None           # too few examples: no head


def test_the_head_needs_a_gain_beyond_one_standard_error():
    """40 dimensions of noise on 60 rows: the least LOO error turns a head on with a gain of a
    few percent in most draws; the one-standard-error rule keeps it off in most, and where it
    does turn one on, regularises it at least as hard. A real signal still gets its head."""
    on_min = on_se = 0
    for seed in range(20):
        rng = np.random.default_rng(seed)
        x, r = rng.standard_normal((60, 40)), rng.normal(0, 50, 60)
        lam_min, w_min, _, _ = ridge_loo(x, r, se=0.0)
        lam_se, w_se, _, _ = ridge_loo(x, r)
        on_min += w_min is not None
        on_se += w_se is not None
        if w_se is not None:
            assert lam_se >= lam_min
    assert on_min >= 12 and on_se <= on_min // 2
    rng = np.random.default_rng(0)
    x = rng.standard_normal((80, 16))
    lam, w, _, _ = ridge_loo(x, 50 * x[:, 3] + rng.normal(0, 5, 80))
    assert w is not None and int(np.argmax(np.abs(w))) == 3


def test_fit_online_recovers_a_shift_and_a_feature():
    rng = np.random.default_rng(1)
    n = 120
    x = rng.standard_normal((n, 8))
    cls = rng.integers(0, 2, n)
    prior_means = [20.0, 200.0]
    prior = np.asarray(prior_means)[cls]
    actual = 2 * prior + 40 * x[:, 0] + rng.normal(0, 4, n)   # replies twice as long, + a feature
    fit = fit_online(actual, prior, cls, prior_means, x, prior_weight=4, percentiles=(75,))
    assert fit.scale == pytest.approx(2.0, rel=0.1)
    assert fit.class_means == pytest.approx([40.0, 400.0], abs=15)   # + the feature's noise
    assert fit.weights is not None and fit.loo_rmse < fit.loo_rmse_prior / 3
    pred = fit.predict(prior, cls, x)
    assert np.sqrt(np.mean((pred - actual) ** 2)) < 15
    upper = fit.upper(pred, 75)
    assert np.all(upper >= pred) and 0.6 < np.mean(actual <= upper) < 0.9
    classes_only = fit_online(actual, prior, cls, prior_means, x, 4, use_head=False)
    assert classes_only.weights is None and classes_only.loo_rmse is None


# --- uncertainty --------------------------------------------------------------------------------
def test_class_forecasts_upper_percentile_and_confidence():
    means, edges = [5.0, 50.0, 300.0], [0.0, 20.0, 120.0]
    probs = np.array([[0.9, 0.08, 0.02],       # sure: short
                      [0.4, 0.35, 0.25],       # unsure: P75 falls in class 1
                      [0.1, 0.2, 0.7]])        # last class: no upper edge -> max_tokens
    qs = [LengthQuery("a", max_tokens=500), LengthQuery("b", max_tokens=500),
          LengthQuery("c", max_tokens=400)]
    f = class_forecasts(probs, means, edges, qs, 75.0)
    assert f[0] == Forecast(5, 20, pytest.approx(0.9))
    assert f[1].point == 5 and f[1].upper == 120 and f[1].confidence == pytest.approx(0.4)
    assert f[2].point == 300 and f[2].upper == 400
    # the upper forecast is never below the point, and capped at max_tokens
    g = class_forecasts(probs[2:], means, edges, [LengthQuery("c", max_tokens=100)], 10.0)
    assert g[0].point == 100 and g[0].upper == 100


def test_tdpipe_get_predict_len_reads_the_upper_forecast_only_when_unsure():
    params = SimpleNamespace(unsure_upper_forecast=True, unsure_confidence=0.5)
    req = SimpleNamespace(predicted_output_len=40, predicted_output_upper=200,
                          predicted_confidence=0.3)
    assert forecast_length(req, params) == 200
    req.predicted_confidence = 0.8
    assert forecast_length(req, params) == 40
    req.predicted_confidence = None                         # a predictor that cannot say
    assert forecast_length(req, params) == 40
    req.predicted_confidence = 0.3
    assert forecast_length(req, SimpleNamespace(unsure_upper_forecast=False,
                                                unsure_confidence=0.5)) == 40
    req.predicted_output_len = None                          # no forecast at all: max_tokens
    assert forecast_length(req, params) is None


def test_tdpipe_scheduler_plans_an_unsure_request_for_its_upper_forecast():
    from batchinfer.engine.kv_cache import BlockManager
    from batchinfer.engine.request import Sequence
    from batchinfer.strategies.tdpipe.scheduler import TDPipeParams

    request = Request("r", list(range(10)), SamplingParams(max_tokens=500),
                      predicted_output_len=40, predicted_output_upper=300,
                      predicted_confidence=0.2)
    seq = Sequence(request=request)
    for on, expected in ((True, 300), (False, 40)):
        params = TDPipeParams(unsure_upper_forecast=on, intensity_switch=False)
        scheduler = params.make_scheduler(BlockManager(num_blocks=64, block_size=16), 2048, 2)
        assert scheduler.predicted_remaining(seq) == expected


# --- the online wrapper -------------------------------------------------------------------------
class FakeClassifier(LengthPredictor):
    """A two-class 'BERT': the embedding is the text's two numbers, the class follows the first."""

    name = "bert"
    means = np.array([10.0, 100.0])
    edges = [0.0, 50.0]

    def predict_queries(self, queries):
        return [f.point for f in self.forecast_queries(queries)]

    def features(self, texts):
        x = np.array([[float(t.split()[0]), float(t.split()[1])] for t in texts],
                     dtype=np.float32)
        p_long = np.where(x[:, 0] > 5, 0.7, 0.2)
        return x, np.stack([1 - p_long, p_long], axis=1)

    def forecast_queries(self, queries):
        _, probs = self.features([q.text for q in queries])
        return class_forecasts(probs, self.means, self.edges, queries, self.upper_percentile)


def _req(i: int, value: float, max_tokens: int = 1000, second: float = 0.0) -> Request:
    return Request(f"r{i}", [1, 2], SamplingParams(max_tokens=max_tokens),
                   prompt=f"{value} {second}")


def test_online_predictor_learns_from_finished_requests_and_reforecasts_the_rest():
    online = OnlineLengthPredictor(FakeClassifier(), refit_every=10, min_examples=10,
                                   prior_weight=2.0, censored=False)
    rng = np.random.default_rng(0)
    values, seconds = rng.uniform(0, 10, 80), rng.uniform(0, 10, 80)
    requests = [_req(i, v, second=w) for i, (v, w) in enumerate(zip(values, seconds))]
    # replies twice the prior's class means, plus what only the embedding shows
    truth = {r.request_id: int(2 * (10 if v <= 5 else 100) + 20 * w)
             for r, v, w in zip(requests, values, seconds)}
    first = online.forecast(requests)
    for r, f in zip(requests, first):
        apply_forecast(r, f)
    assert {f.point for f in first} == {10, 100}
    assert not online.due()
    for r in requests[:19]:
        assert online.observe(r.request_id, truth[r.request_id])
    assert online.due()
    changed = online.update()
    assert online.refits == 1 and online.fit is not None and online.fit.examples == 19
    pending = requests[19:]
    assert {id(r) for r, _ in changed} <= {id(r) for r in pending}
    for r, f in changed:
        apply_forecast(r, f)
    err_before = abs(sum(f.point for f in first[19:]) - sum(truth[r.request_id] for r in pending))
    err_after = abs(sum(r.predicted_output_len for r in pending)
                    - sum(truth[r.request_id] for r in pending))
    assert err_after < 0.3 * err_before
    per_request = np.mean([abs(r.predicted_output_len - truth[r.request_id]) for r in pending])
    classes_only = OnlineLengthPredictor(FakeClassifier(), refit_every=10, min_examples=10,
                                         prior_weight=2.0, censored=False, head=False)
    classes_only.forecast(requests)
    for r in requests[:19]:
        classes_only.observe(r.request_id, truth[r.request_id])
    classes_only.update()
    plain = classes_only.forecast(pending)
    per_request_classes = np.mean([abs(f.point - truth[r.request_id])
                                   for r, f in zip(pending, plain)])
    assert per_request < 0.9 * per_request_classes   # the head read the embedding
    assert not online.observe("never-forecast", 3)
    online.forget(pending[0].request_id)
    assert not online.observe(pending[0].request_id, 3)
    stats = online.stats()["online"]
    assert stats["refits"] == 1 and stats["examples"] == 19 and stats["fit"]["head"]
    assert stats["timeline"][0]["finished"] == 19
    # a new request is forecast with what the job taught it, capped at its max_tokens
    new = online.forecast([_req(99, 9.0, second=5.0), _req(100, 9.0, max_tokens=50)])
    assert abs(new[0].point - 300) < 40 and new[1].point == 50


class CutFakeClassifier(FakeClassifier):
    """FakeClassifier whose long class's 20 training outputs were all cut at 100 tokens, the
    tail past them of mean 50 (classes.cut_tail's fields)."""

    cut_tail = {"cap": 100.0, "cut": 20, "tail_from": 50.0, "tail_mean": 50.0,
                "members": [20, 20], "uncut_mean": [10.0, 0.0], "cut_at": [[], [[100.0, 20]]]}

    def forecast_queries(self, queries):
        _, probs = self.features([q.text for q in queries])
        return class_forecasts(probs, self.means, self.edges, queries, self.upper_percentile,
                               self.cut_tail)


def test_the_online_priors_read_past_the_training_cap(monkeypatch):
    """A request allowed more than the training's cut outputs got starts from (and is refit
    toward) its class's mean read past the cut, E[min(100 + X, 400)] = 100 + 50 (1 - e^-6), not
    the 100 the cut outputs were counted at; one allowed 100 starts at 100."""
    import batchinfer.predictors.online as online_module

    priors_seen = []
    fit = online_module.fit_online

    def spy(actual, prior, classes, prior_means, *args, **kwargs):
        priors_seen.append(list(prior_means))
        return fit(actual, prior, classes, prior_means, *args, **kwargs)

    monkeypatch.setattr(online_module, "fit_online", spy)
    online = OnlineLengthPredictor(CutFakeClassifier(), refit_every=4, min_examples=4,
                                   prior_weight=2.0)
    past = 100 + 50 * (1 - np.exp(-6))
    long_requests = [_req(i, 9.0, max_tokens=400) for i in range(6)]
    capped = _req(99, 9.0, max_tokens=100)
    forecasts = online.forecast(long_requests + [capped])
    assert [f.point for f in forecasts] == [round(past)] * 6 + [100]
    assert online._pending["r0"].prior == pytest.approx(past)
    for r in long_requests[:4]:
        online.observe(r.request_id, 150)
    online.update({r.request_id: 120 for r in long_requests[4:]})
    assert online.fit is not None and priors_seen == [[10.0, pytest.approx(past)]]


def test_censored_requests_keep_the_short_ones_from_pulling_forecasts_down():
    def run(censored: bool) -> float:
        online = OnlineLengthPredictor(FakeClassifier(), refit_every=1, min_examples=1,
                                       prior_weight=1.0, head=False, censored=censored)
        requests = [_req(i, 9.0) for i in range(40)]         # all class 1 (prior mean 100)
        for r, f in zip(requests, online.forecast(requests)):
            apply_forecast(r, f)
        online.observe("r0", 20)                              # the first to end are the short
        online.update()
        online.observe("r1", 20)
        # 37 are still decoding, already past 150 tokens; the last one still waits
        progress = {r.request_id: 150 for r in requests[2:-1]}
        for r, f in online.update(progress):
            apply_forecast(r, f)
            if r.request_id in progress:    # a decoding request: never before its next token
                assert f.point >= 151
        return requests[-1].predicted_output_len

    assert run(censored=False) < 60
    assert run(censored=True) > 120


def test_a_new_upper_forecast_reaches_the_scheduler_even_when_the_point_stays():
    online = OnlineLengthPredictor(FakeClassifier(), refit_every=1, min_examples=1,
                                   prior_weight=1.0, head=False, censored=False)
    requests = [_req(i, 9.0) for i in range(3)]
    online.forecast(requests)
    entry = online._pending["r2"]
    entry.current_upper = -1                  # as if the last one sent had another upper
    online.observe("r0", 100)
    changed = dict((r.request_id, f) for r, f in online.update())
    assert "r2" in changed and changed["r2"].upper == entry.current_upper != -1


def test_online_mean_predictor_recalibrates_its_mean():
    online = OnlineLengthPredictor(MeanPredictor(50.0), refit_every=4, min_examples=4,
                                   prior_weight=1.0, censored=False)
    requests = [_req(i, 0) for i in range(10)]
    assert [f.point for f in online.forecast(requests)] == [50] * 10
    for r in requests[:4]:
        online.observe(r.request_id, 150)
    changed = online.update()
    assert len(changed) == 6 and all(f.point == 130 for _, f in changed)   # (600+50)/(200+50)*50


def test_a_failing_refit_keeps_the_last_forecasts(caplog):
    online = OnlineLengthPredictor(FakeClassifier(), refit_every=1, min_examples=1)
    requests = [_req(i, 1.0) for i in range(3)]
    online.forecast(requests)
    online.observe("r0", 5)
    online._done[0].actual = "not a number"                 # noqa: SLF001 - break the data
    assert online.update() == [] and "refit failed" in caplog.text
    assert online.refits == 1 and online.fit is None


def test_finishes_keep_the_newest_examples_and_the_error_timeline_per_window():
    """What observe keeps is bounded (the newest max_examples, one row per timeline window),
    and the running timeline is accumulated_error over each window of the finishing order."""
    from batchinfer.predictors.classes import accumulated_error

    online = OnlineLengthPredictor(MeanPredictor(50.0), refit_every=1, min_examples=1,
                                   max_examples=5, censored=False)   # windows of 32
    requests = [_req(i, 0, max_tokens=10_000) for i in range(75)]
    online.forecast(requests)
    rng = np.random.default_rng(3)
    finished = []                                   # (first, last, actual, t) as they finish
    for n, r in enumerate(requests):
        actual = int(rng.integers(1, 400))
        last = online.current(r.request_id)
        assert online.observe(r.request_id, actual, now=0.5 * n)
        finished.append((50, last, actual, 0.5 * n))
        if n % 7 == 6:
            online.update()                         # the forecasts move between finishes
    assert [d.actual for d in online._done] == [f[2] for f in finished[-5:]]  # noqa: SLF001
    expected = []
    for start in range(0, len(finished), 32):
        part = finished[start:start + 32]
        first, last, actual = (np.array([p[k] for p in part], dtype=np.float64) for k in range(3))
        expected.append({"finished": start + len(part), "t": round(part[-1][3], 2),
                         "error_online": round(accumulated_error(last, actual, len(part)), 4),
                         "error_prior": round(accumulated_error(first, actual, len(part)), 4)})
    assert len({f[1] for f in finished}) > 1 and [e["finished"] for e in expected] == [32, 64, 75]
    assert online.timeline() == expected
    assert online.stats()["online"]["timeline"] == expected


# --- the job loop's glue ------------------------------------------------------------------------
def test_learn_observes_finished_forgets_aborted_and_never_raises(caplog):
    online = OnlineLengthPredictor(MeanPredictor(50.0), refit_every=1, min_examples=1,
                                   censored=True)
    requests = [_req(i, 0) for i in range(3)]
    for r, f in zip(requests, online.forecast(requests)):
        apply_forecast(r, f)
    engine = SimpleNamespace(progress=lambda: {"r2": 7})
    outs = [SimpleNamespace(request_id="r0", output_token_ids=[0] * 90,
                            finish_reason=FinishReason.STOP),
            SimpleNamespace(request_id="r1", output_token_ids=[],
                            finish_reason=FinishReason.ABORT)]
    learn(online, engine, outs, now=1.0)
    assert online.refits == 1 and len(online._done) == 1                  # noqa: SLF001
    assert requests[2].predicted_output_len > 50                          # re-forecast
    learn(online, engine, [SimpleNamespace(request_id="r2")], now=2.0)    # broken output
    assert "online length predictor" in caplog.text
    learn(MeanPredictor(5.0), engine, outs, None)                         # not online: nothing


def test_the_recipe_wraps_bert_and_mean_only():
    cfg = PredictorConfig(name="none")
    mean = wrap_online(MeanPredictor(5.0), cfg)
    assert isinstance(mean, OnlineLengthPredictor) and mean.refit_every == 16
    assert mean.impute == "job" and mean.tail_weight == 32.0 and mean.head_se == 1.0
    assert wrap_online(MeanPredictor(5.0), PredictorConfig(name="none", online_head_se=0)
                       ).head_se == 0.0
    earlier = wrap_online(MeanPredictor(5.0), PredictorConfig(name="none", online_impute="prior",
                                                              online_tail_prior_weight=4))
    assert earlier.impute == "prior" and earlier.tail_weight == 4.0
    with pytest.raises(ValueError):
        PredictorConfig(online_impute="median")
    assert mean.describe()["online"]
    off = wrap_online(MeanPredictor(5.0), PredictorConfig(name="none", online=False,
                                                      upper_percentile=90))
    assert isinstance(off, MeanPredictor) and off.upper_percentile == 90
    oracle = SimpleNamespace(name="oracle", upper_percentile=75)
    assert wrap_online(oracle, cfg) is oracle
    with pytest.raises(ValueError):
        PredictorConfig(upper_percentile=100)
    with pytest.raises(ValueError):
        PredictorConfig(online_refit_every=0)


# --- history sources and eval by source ---------------------------------------------------------
def test_history_records_carry_their_source():
    line = history_record("q", "hi", 3, 4, "stop", "m", 10, 5, source="sharegpt")
    assert line["source"] == "sharegpt"
    assert "source" not in history_record("q", "hi", 3, 4, "stop", "m", 10)


def test_eval_by_source_splits_in_and_out_of_distribution():
    from batchinfer.predictors.train import evaluate_by_source, source_name, training_sources

    class Fixed:
        card = {"classes": {"edges": [0.0, 50.0], "means": [10.0, 100.0], "train_mean": 40.0,
                            "majority_class": 0}}

        def predict_class_ids(self, texts):
            return np.array([1 if t.startswith("long") else 0 for t in texts])

    def rec(i, text, out, source=None):
        return HistoryRecord(f"q{i}", text, f"h{i}", 3, out, "stop", "m", 512, source=source)

    records = ([rec(i, "short", 10) for i in range(10)]
               + [rec(10 + i, "long", 100, "web") for i in range(10)]
               + [rec(20 + i, "short", 300, "web") for i in range(10)])
    assert source_name(records[0]) == "-" and source_name(records[-1]) == "web"
    split = {"train": {records[0].key}}
    trained_on = training_sources({"data": {}}, records, split)
    assert trained_on == {"-"}
    assert training_sources({"data": {"prompt_sources": ["a"]}}, records, split) == {"a"}
    assert training_sources({"data": {}}, records, {}) is None
    out = evaluate_by_source(Fixed(), records, trained_on, group_sizes=(1, 10))
    assert out["sources"]["-"]["in_distribution"] is True
    assert out["sources"]["web"]["in_distribution"] is False
    assert out["in_distribution"]["class_accuracy"] == 1.0
    assert out["out_of_distribution"]["records"] == 20
    assert out["out_of_distribution"]["class_accuracy"] == 0.5
    unknown = evaluate_by_source(Fixed(), records, None, group_sizes=(1,))
    assert "in_distribution" not in unknown and unknown["sources"]["web"]["in_distribution"] is None


def test_refits_keep_to_their_time_budget():
    online = OnlineLengthPredictor(MeanPredictor(50.0), refit_every=1, min_examples=1)
    requests = [_req(i, 0) for i in range(4)]
    online.forecast(requests)
    online.observe("r0", 10)
    assert online.due()
    online.update()
    online.observe("r1", 10)
    online._last_refit_cost = 60.0          # noqa: SLF001 - a refit that took a minute
    assert not online.due()                  # next one only after 100 minutes (1% budget)
    online.time_budget = None
    assert online.due()


def test_the_forecast_error_plot():
    from batchinfer.runner.report.plots import plot_forecast_error

    png = plot_forecast_error([{"finished": 64, "t": 1.0, "error_online": 0.2,
                                "error_prior": 0.3}])
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert plot_forecast_error([]) is None


def test_the_report_counts_every_finished_request_not_the_examples_kept():
    """The report said "N refits on 1024 finished requests" for a job of thousands: the
    examples kept (the newest max_examples), not the requests that finished."""
    from batchinfer.runner.report.report import _online_lines

    online = OnlineLengthPredictor(MeanPredictor(50.0), refit_every=4, min_examples=1,
                                   max_examples=5, censored=False)
    requests = [_req(i, 0, max_tokens=10_000) for i in range(12)]
    online.forecast(requests)
    for n, r in enumerate(requests):
        online.observe(r.request_id, 10 + n)
    stats = online.stats()["online"]
    assert stats["finished"] == 12 and stats["examples"] == 5
    line = _online_lines(stats)[0]
    assert "on 12 finished requests (the newest 5 kept to learn from)" in line
    assert "on 5 finished" not in line


def test_min_examples_past_the_examples_kept_still_refits():
    """online_min_examples is finished requests before the first refit: above max_examples
    (the newest kept) it never refit, since the kept examples never reach it."""
    online = OnlineLengthPredictor(MeanPredictor(50.0), refit_every=1, min_examples=8,
                                   max_examples=5, censored=False, time_budget=None)
    requests = [_req(i, 0, max_tokens=10_000) for i in range(8)]
    online.forecast(requests)
    for n, r in enumerate(requests):
        assert not online.due()
        online.observe(r.request_id, 10 + n)
    assert online.due()
