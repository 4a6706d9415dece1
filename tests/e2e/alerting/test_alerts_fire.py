"""The chart's alerts, for real: Prometheus scrapes the real operator and the real trainer through the
chart's own monitors, evaluates the chart's own rules, and Alertmanager notifies a webhook of the test.

Scenarios (DESIGN.md §4, docs/monitoring.md), one trainer run: its first healthy steps alert nothing
but RLHFJobWeightSyncSlow (the test's threshold, 0.1 %, makes every step's sync "slow") and fill every
dashboard panel; reward errors fire RLHFJobRewardErrors; a hanging reward fires RLHFJobStepStalled
naming the phase, though the operator restarts the stuck attempt (onStall: Restart), and it resolves
when the restarted attempt completes a step; RLHFJobPhaseStuck fires after it while the stuck attempt
is still scraped and resolves when that attempt is gone; a trainer restart resets no counter into a
false alert; with no restart left, the trainer's end fails the job and fires RLHFJobFailed, resolved
when the job is deleted. The operator killed fires RLHFOperatorDown, which resolves when it is back
(test_operator_down.py). Every delivery bound is derived from the configured intervals (monitored.py).
"""

from __future__ import annotations

import json
import re
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from rlhf_api.constants import SHUTDOWN_MARGIN_SECONDS
from rlhf_api.spec import RunPolicySpec
from rlhf_operator import rayjobs
from testkit.monitored import (
    EVALUATION_INTERVAL_SECONDS,
    FOR,
    RECONCILE_INTERVAL_SECONDS,
    REWARD_ERRORS_WINDOW,
    SCRAPE_INTERVAL_SECONDS,
    WEIGHT_SYNC_SHARE_THRESHOLD,
    Monitored,
    firing_bound,
    resolved_bound,
    seconds,
)
from testkit.support import (
    ROOT,
    Cluster,
    RayHead,
    job_status,
    ray_job_logs,
    stall_events,
    step_reports,
    tiny_job,
    wait_for,
)

pytestmark = pytest.mark.alerting

HERE = Path(__file__).resolve().parent
DASHBOARDS = sorted((ROOT / "charts" / "rlhf-operator" / "dashboards").glob("*.json"))
# Grafana's $__rate_interval is max(4 x scrape interval, scrape interval + query step); with a 1 s
# scrape and a live panel that is a few seconds: 10 s keeps two samples in every window.
RATE_INTERVAL = "10s"


def dashboard_exprs() -> list[tuple[str, str]]:
    """(panel title, expr) of every query of the chart's Grafana dashboards."""

    def panels(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [p for x in items for p in [x, *panels(x.get("panels", []))]]

    out = []
    for path in DASHBOARDS:
        for p in panels(json.loads(path.read_text())["panels"]):
            out += [(str(p.get("title")), str(t["expr"])) for t in p.get("targets", []) if t.get("expr")]
    assert out, f"no PromQL in {DASHBOARDS}"
    return out


def substitute(expr: str, namespace: str, rlhfjob: str) -> str:
    out = (
        expr.replace("$namespace", namespace)
        .replace("$rlhfjob", rlhfjob)
        .replace("$__rate_interval", RATE_INTERVAL)
    )
    assert "$" not in out, f"a template variable is left in {out}"
    return out


def ours(m: Monitored, alerts: list[tuple[float, dict[str, Any]]]) -> list[tuple[float, dict[str, Any]]]:
    return [(t, a) for t, a in alerts if a["labels"].get("alertname") in m.alert_names]


def value(m: Monitored, expr: str, at: float | None = None) -> float | None:
    res = m.stack.query(expr, at)
    return max(float(r["value"][1]) for r in res) if res else None


def unix(stamp: str) -> float:
    """An RFC 3339 time (Kubernetes' `...Z`, Alertmanager's with up to 9 fractional digits) as Unix time."""
    m = re.fullmatch(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:\.(\d+))?(Z|[+-]\d\d:\d\d)", stamp)
    assert m, stamp
    base = datetime.fromisoformat(m.group(1) + ("+00:00" if m.group(3) == "Z" else m.group(3)))
    return base.timestamp() + (float(f"0.{m.group(2)}") if m.group(2) else 0.0)


def rule_for(m: Monitored, alertname: str) -> str:
    """The `for` of `alertname` as the chart rendered it for this test."""
    rule = next(r for g in m.rule["spec"]["groups"] for r in g["rules"] if r.get("alert") == alertname)
    return str(rule.get("for", "0s"))


STALLED, STUCK, SYNC_SLOW, FAILED = (
    "RLHFJobStepStalled",
    "RLHFJobPhaseStuck",
    "RLHFJobWeightSyncSlow",
    "RLHFJobFailed",
)
# How long Ray's job supervisor lets a stopped driver run before its SIGKILL (RAY_JOB_STOP_WAIT_TIME_S,
# manifests.stop_budget_seconds): the job's grace period (the default here) less the shutdown margin.
# A driver stuck in a phase never reaches the step boundary where it would exit, so it lives this long.
STOP_BUDGET_SECONDS = (
    RunPolicySpec.model_fields["termination_grace_period_seconds"].default - SHUTDOWN_MARGIN_SECONDS
)


def first_step_after(m: Monitored, sel: str, step: int, since: float) -> float:
    """When the first step after `step` completed, from the raw samples Prometheus scraped.

    The latest `rlhf_last_step_completed_timestamp_seconds` is not it: by the time the alert resolves
    the restarted attempt may have completed a second step. Each scrape carries both series with one
    timestamp, so the first scrape whose step counter passed `step` holds that step's completion time.
    """
    window = f"[{int(time.time() - since) + 60}s]"
    counts = m.stack.query(f"rlhf_steps_completed_total{{{sel}}}{window}")
    stamps = m.stack.query(f"rlhf_last_step_completed_timestamp_seconds{{{sel}}}{window}")
    assert counts and stamps, (counts, stamps)
    done_at = {t: float(v) for series in stamps for t, v in series["values"]}
    after = sorted((t, float(v)) for series in counts for t, v in series["values"] if float(v) > step)
    assert after, f"no scrape saw a step after {step}"
    t, count = after[0]
    # A scrape every second against steps ~2 s apart: the first scrape past `step` must see step+1
    # itself; if it saw a later one, the time read here would be that later step's and prove nothing.
    assert count == step + 1, f"the first scrape after step {step} already saw {count} steps"
    return done_at[t]


# The healthy stretch at the start of the run: long enough for a wrong alert (`for` 5 s here) to fire.
HEALTHY_STEPS = 5


def test_healthy_steps_alert_nothing_then_stall_reward_errors_and_a_restart_notify_as_a_user_sees_them(
    cluster: Cluster, ray_head: RayHead, monitored: Monitored, tiny_model: Path, tmp_path: Path
) -> None:
    ns, name, m = monitored.namespace, "stuck", monitored
    sel = f'namespace="{ns}", rlhfjob="{name}"'
    control = tmp_path / "reward-mode"
    control.write_text("ok")
    # The steps' stall timeout; each attempt's start-up and first step (60-90 s here, more on a busy
    # machine; the stall clock starts with the driver) get startupTimeoutSeconds, so the only stall is the
    # one the test makes, and a restarted attempt's start-up is no second one.
    stall_timeout, startup_timeout = 30, 600
    # backoffLimit 1: the on-stall restart uses it, so the trainer's next end fails the job (RLHFJobFailed).
    doc = tiny_job(name, tiny_model, tmp_path / "ckpt", steps=200, lean=True, runPolicy={"backoffLimit": 1})
    doc["spec"]["model"]["reward"] = {
        "type": "function",
        "function": f"{HERE.parents[1] / 'testkit' / 'control_reward.py'}:reward",
        "onError": "skipSample",
        "timeoutSeconds": 3600,  # a hang stays a hang, never a timed-out reward error
    }
    doc["spec"]["checkpoint"]["intervalSteps"] = 1
    # onStall: Restart, the policy a user running unattended picks: the operator stops the stuck
    # attempt at the stall timeout and restarts it; the alert must still fire and name the phase, and
    # resolve only when the restarted attempt completes a step.
    doc["spec"]["monitoring"].update(
        stallTimeoutSeconds=stall_timeout, startupTimeoutSeconds=startup_timeout, onStall="Restart"
    )
    doc["spec"]["pods"] = {"env": [{"name": "RLHF_TEST_REWARD_CONTROL", "value": str(control)}]}
    t_apply = time.time()
    cluster.apply(doc, ns)
    try:
        # 0. Healthy steps: no alert, and every query of the chart's dashboards answers while the job runs.
        exprs = dashboard_exprs()
        answered: dict[str, int] = {}  # expr -> most series seen in one query while the job ran

        def healthy() -> dict[str, Any] | None:
            st = job_status(cluster, ns, name)
            assert st.get("phase") not in ("Failed", "Stalled", "Restarting"), json.dumps(st, indent=1)
            assert not st.get("restarts"), json.dumps(st, indent=1)
            if st.get("phase") == "Running" and (st.get("step") or 0) >= 1:
                for _, expr in exprs:
                    n = len(m.stack.query(substitute(expr, ns, name)))
                    answered[expr] = max(answered.get(expr, 0), n)
            return st if (st.get("step") or 0) >= HEALTHY_STEPS else None

        wait_for(healthy, 600, f"{HEALTHY_STEPS} healthy steps", interval=1)
        time.sleep(3 * SCRAPE_INTERVAL_SECONDS)  # the last scrapes and evaluations of the healthy stretch
        empty = [(title, expr) for title, expr in exprs if not answered.get(expr)]
        assert not empty, f"dashboard panels without a series while the job ran: {empty}"
        delivered = [(t, a) for t, a in ours(m, m.webhook.alerts()) if a["labels"]["alertname"] != SYNC_SLOW]
        assert not delivered, f"healthy steps delivered alerts: {[a for _, a in delivered]}"
        # The run really was watched: the trainer's target was discovered and scraped (not only the operator).
        scraped = value(m, f"rlhf_steps_completed_total{{{sel}}}")
        assert scraped is not None and scraped >= HEALTHY_STEPS, scraped
        print(
            f"healthy: {len(exprs)} dashboard queries all answered; no alert but {SYNC_SLOW} over {scraped:.0f} steps"
        )

        # RLHFJobWeightSyncSlow for real, with the test's threshold (WEIGHT_SYNC_SHARE_THRESHOLD, the
        # chart's `for` shortened): step 1 sets rlhf_step_phase_seconds, the next scrape brings it.
        step1 = first_step_after(m, sel, 0, since=t_apply)
        sync_bound = firing_bound(rule_for(m, SYNC_SLOW), seen_after=SCRAPE_INTERVAL_SECONDS)
        sync_labels = {"alertname": SYNC_SLOW, "rlhfjob": name, "namespace": ns}
        t_sync, sync_alert = wait_for(
            lambda: m.webhook.alerts("firing", **sync_labels),
            max(step1 + sync_bound - time.time(), 0) + 5,
            f"{SYNC_SLOW} delivered",
        )[0]
        assert sync_alert["labels"]["phase"] == "weight_sync", sync_alert
        assert sync_alert["annotations"]["runbook_url"].endswith("docs/monitoring.md#rlhfjobweightsyncslow")
        share = value(m, f'max(rlhf_step_phase_seconds{{{sel}, phase="weight_sync"}}) / '
                         f"max(rlhf_step_seconds{{{sel}}})")  # fmt: skip
        assert share is not None and share > WEIGHT_SYNC_SHARE_THRESHOLD, share
        print(f"weight sync: {SYNC_SLOW} delivered {t_sync - step1:.1f} s after step 1 completed "
              f"(bound {sync_bound:.0f} s); share {share:.2%}, test threshold {WEIGHT_SYNC_SHARE_THRESHOLD:.1%}: "
              f"{sync_alert['annotations']['summary']}")  # fmt: skip
        assert t_sync - step1 <= sync_bound, (t_sync - step1, sync_bound)

        # 1. Reward errors on some samples: RLHFJobRewardErrors fires with the job's labels.
        control.write_text("raise")
        t_raise = time.time()
        labels = {"alertname": "RLHFJobRewardErrors", "rlhfjob": name, "namespace": ns}
        fired = wait_for(lambda: m.webhook.alerts("firing", **labels), 180, "RLHFJobRewardErrors delivered")
        control.write_text("ok")
        assert fired[0][1]["labels"]["phase"] == "reward", fired
        assert (value(m, f"rlhf_reward_errors_total{{{sel}}}") or 0) > 0
        print(
            f"reward errors: raised at +0 s, RLHFJobRewardErrors delivered at +{fired[0][0] - t_raise:.1f} s"
        )
        wait_for(lambda: m.webhook.alerts("resolved", **labels), 120, "RLHFJobRewardErrors resolved")
        errors_before = value(m, f"rlhf_reward_errors_total{{{sel}}}")
        assert errors_before and errors_before > 0

        # 2. The reward hangs. By the rules (docs/monitoring.md), with the last step completed at t_last
        # and the reward phase started g later: RLHFJobStepStalled's condition holds from
        # t_last + stallTimeoutSeconds, RLHFJobPhaseStuck's from g later, on the same samples, so
        # StepStalled is the alert the stall must fire, and first. The operator stops the stuck attempt
        # at the same threshold; StepStalled stays firing through that on the operator's open stall,
        # while PhaseStuck's condition lasts only as long as the stuck trainer is scraped (Ray SIGKILLs
        # it STOP_BUDGET_SECONDS after the stop: it never reaches a step boundary to exit at).
        stuck_sid = job_status(cluster, ns, name)["submissionId"]
        control.write_text("hang")
        t_hang = time.time()

        def firing(alertname: str) -> list[tuple[float, dict[str, Any]]]:
            got = m.webhook.alerts("firing", alertname=alertname, rlhfjob=name, namespace=ns)
            return [(t, a) for t, a in got if t > t_hang]

        # (The step in progress at t_hang completes within seconds; then the bound below applies.)
        t_got, alert = wait_for(
            lambda: firing(STALLED), stall_timeout + firing_bound(FOR) + 30, f"{STALLED} delivered"
        )[0]
        assert alert["labels"]["phase"] == "reward", alert
        open_stall = job_status(cluster, ns, name).get("openStall")
        assert open_stall and open_stall["phase"] == "reward", job_status(cluster, ns, name)
        # The last step before the stall, from the stuck trainer's own samples (to the millisecond;
        # status.openStall.since is the same moment to the second).
        t_last = first_step_after(m, sel, int(open_stall["step"]) - 1, since=t_hang - 60)
        since = unix(open_stall["since"])
        assert since <= t_last < since + 1, (open_stall, t_last)
        delay = t_got - t_last
        # `time() - last step > stallTimeoutSeconds` over a series scraped long before: no scrape lag.
        bound = stall_timeout + firing_bound(FOR)
        print(f"stall: {STALLED} delivered {delay:.1f} s after the last step (bound {bound:.0f} s = "
              f"stallTimeoutSeconds {stall_timeout} + firing_bound(for {FOR}) {firing_bound(FOR):.0f} s)")  # fmt: skip
        assert delay <= bound, (delay, bound)
        # What a user receives: the job, the namespace, the stuck phase and a runbook link.
        assert alert["annotations"]["runbook_url"].endswith("docs/monitoring.md#rlhfjobstepstalled"), alert
        assert (
            f"{ns}/{name}" in alert["annotations"]["summary"] and "reward" in alert["annotations"]["summary"]
        )
        (tmp_path / "stall-alert.json").write_text(json.dumps(alert, indent=2))
        print(f"--- delivered stall alert ---\n{json.dumps(alert, indent=2)}")

        # 3. The operator stops the stuck attempt and restarts the job; only once the stuck attempt is
        # gone does the reward work again (so the step that ends the stall is the restarted attempt's),
        # and only after that step is the resolved notification sent.
        st = wait_for(
            lambda: (((s := job_status(cluster, ns, name)).get("restarts") or 0) >= 1 and s) or None,
            120,
            "the operator's on-stall restart",
        )
        with rayjobs.RayJobsClient(ray_head.dashboard_url) as rj:

            def stuck_attempt_gone() -> bool | None:
                info = rj.get(stuck_sid)
                return (info is not None and info.status in rayjobs.TERMINAL) or None

            wait_for(stuck_attempt_gone, 120, f"the stuck attempt {stuck_sid} stopped")
        t_restart = time.time()
        assert job_status(cluster, ns, name).get("openStall"), "the stall closed with the stuck attempt's end"
        control.write_text("ok")

        # RLHFJobPhaseStuck, as the rules say: its condition held from the reward phase's start +
        # stallTimeoutSeconds until the stuck trainer's last scrape (the restarted attempt is not
        # submitted before the stuck one ended, so every sample up to now is the stuck attempt's).
        reward_started = value(m, f'rlhf_phase_started_timestamp_seconds{{{sel}, phase="reward"}}', at=t_got)
        assert reward_started is not None and t_last <= reward_started < t_got, (t_last, reward_started)
        window = f"[{int(t_restart - t_hang) + 60}s]"
        samples = m.stack.query(f'rlhf_phase_in_progress{{{sel}, phase="reward"}}{window}', at=t_restart)
        # (value 1: a restarted driver's series would start at 0, its reward phase after its start-up)
        last_scraped = max(float(t) for series in samples for t, v in series["values"] if v == "1")
        held = last_scraped - (reward_started + stall_timeout)
        # Firing needs the condition at two evaluations `for` apart (firing_bound's derivation).
        must_fire = held >= seconds(FOR) + 2 * EVALUATION_INTERVAL_SECONDS
        print(f"phase stuck: the reward phase started {reward_started - t_last:.1f} s after the last step; its "
              f"condition held {held:.1f} s until the stuck trainer's last scrape (Ray's stop budget "
              f"{STOP_BUDGET_SECONDS} s): {STUCK} must {'' if must_fire else 'not '}fire")  # fmt: skip
        if must_fire:
            t_stuck, stuck = wait_for(lambda: firing(STUCK), 30, f"{STUCK} delivered")[0]
            assert stuck["labels"]["phase"] == "reward", stuck
            assert stuck["annotations"]["runbook_url"].endswith("docs/monitoring.md#rlhfjobphasestuck"), stuck
            # The same samples make StepStalled's condition true first (or in the same evaluation).
            assert unix(stuck["startsAt"]) >= unix(alert["startsAt"]), (stuck["startsAt"], alert["startsAt"])
            stuck_bound = stall_timeout + firing_bound(FOR)
            print(f"phase stuck: {STUCK} delivered {t_stuck - reward_started:.1f} s after the reward phase "
                  f"started (bound {stuck_bound:.0f} s), {t_stuck - t_got:+.1f} s from {STALLED}")  # fmt: skip
            assert t_stuck - reward_started <= stuck_bound, (t_stuck - reward_started, stuck_bound)
            # Its series went with the stuck trainer: resolved then, not at the restarted attempt's step.
            stuck_resolved = wait_for(
                lambda: [
                    (t, a)
                    for t, a in m.webhook.alerts("resolved", alertname=STUCK, rlhfjob=name, namespace=ns)
                    if t > t_stuck
                ],
                resolved_bound(SCRAPE_INTERVAL_SECONDS) + 30,
                f"{STUCK} resolved",
            )[0]
            gone_bound = resolved_bound(SCRAPE_INTERVAL_SECONDS)
            print(f"phase stuck: resolved {stuck_resolved[0] - last_scraped:.1f} s after the stuck trainer's "
                  f"last scrape (bound {gone_bound:.0f} s)")  # fmt: skip
            assert 0 < stuck_resolved[0] - last_scraped <= gone_bound, (stuck_resolved[0], last_scraped)
        else:
            time.sleep(resolved_bound(SCRAPE_INTERVAL_SECONDS))  # anything evaluated before the end arrives
            assert not firing(STUCK), f"{STUCK} fired though its condition held {held:.1f} s (< for {FOR})"

        early = [a for t, a in m.webhook.alerts("resolved", alertname=STALLED, rlhfjob=name)
                 if t > t_got]  # fmt: skip
        assert not early, (
            f"the stall alert resolved with the stuck attempt's restart, before any step: {early}"
        )
        resolved = wait_for(
            lambda: [
                (t, a)
                for t, a in m.webhook.alerts("resolved", alertname=STALLED, rlhfjob=name)
                if a["labels"].get("phase") == "reward" and t > t_got
            ],
            600,
            "the stall alert resolved",
        )[0]
        step_done = first_step_after(m, sel, int(open_stall["step"]), since=t_restart)
        assert step_done > t_restart, (step_done, t_restart)
        assert resolved[0] >= step_done, "resolved before the restarted attempt completed a step"
        if must_fire:
            assert stuck_resolved[0] < step_done, (f"{STUCK} resolved only with the restarted attempt's step",
                                                   stuck_resolved[0], step_done)  # fmt: skip
        # The operator sees the step at its next reconcile (scraping the trainer itself, every
        # monitoring.scrapeIntervalSeconds = 1 s here) and drops the open stall; the next scrape of the
        # operator and of the trainer then shows no stall.
        step_bound = resolved_bound(RECONCILE_INTERVAL_SECONDS + 2 * SCRAPE_INTERVAL_SECONDS)
        print(f"recovery: stuck attempt stopped at +0 s; the restarted attempt completed a step at +{step_done - t_restart:.1f} s; "
              f"resolved notification at +{resolved[0] - t_restart:.1f} s ({resolved[0] - step_done:+.1f} s from the step, "
              f"bound {step_bound:.0f} s)")  # fmt: skip
        assert resolved[0] - step_done <= step_bound, (resolved[0] - step_done, step_bound)

        # The operator's side of the same stall: a Warning Event naming the phase, and the restarted
        # attempt resumed from the stuck attempt's last checkpoint (one a step), so no completed step
        # ran again and none was skipped.
        warnings = stall_events(cluster, ns, name)
        assert any(e["type"] == "Warning" and "reward" in e["message"] for e in warnings), warnings
        sid = job_status(cluster, ns, name)["submissionId"]
        assert sid != stuck_sid, "the restart submitted no new attempt"
        before = [r["step"] for r in step_reports(ray_job_logs(stuck_sid))]
        logs = ray_job_logs(sid)
        resumed = re.search(r"resumed from \S+ \(step (\d+)\)", logs)
        assert resumed, logs[-3000:]
        after = [r["step"] for r in step_reports(logs)]
        assert before == list(range(1, len(before) + 1)), before
        assert int(resumed.group(1)) == before[-1], (before, resumed.group(0))
        assert after and after == list(range(before[-1] + 1, before[-1] + 1 + len(after))), (before, after)
        print(f"resume: the stuck attempt completed steps 1-{before[-1]}; the restarted one resumed from "
              f"step {resumed.group(1)} and ran {after[0]}-{after[-1]}")  # fmt: skip

        # 4. The restart started the trainer's counters again: neither rate() nor increase() may read
        # that as new reward errors.
        time.sleep(seconds(REWARD_ERRORS_WINDOW) + 5)  # the window now spans the restart
        false_alarm = [a for t, a in m.webhook.alerts("firing", **labels) if t > t_restart]
        assert not false_alarm, f"reward-errors alert after a restart without errors: {false_alarm}"
        span = time.time() - t_restart
        for fn in ("increase", "rate"):
            q = f"max_over_time(sum({fn}(rlhf_reward_errors_total{{{sel}}}[{REWARD_ERRORS_WINDOW}]))[{span:.0f}s:1s])"
            got = value(m, q)
            assert got == 0, (q, got)
        errors_after = value(m, f"rlhf_reward_errors_total{{{sel}}}")
        print(f"restart: rlhf_reward_errors_total {errors_before:.0f} before the restart, {errors_after} after; "
              f"no reward-errors alert over {time.time() - t_restart:.0f} s")  # fmt: skip
        assert st["restarts"] == 1

        # 5. No restart left (backoffLimit 1, used by the stall): the trainer's Ray job ends from outside,
        # as a crashed driver's would, and the operator sets the job Failed; RLHFJobFailed (the chart's
        # own `for`) reaches the webhook, keeps firing while the failed job exists, and resolves when
        # it is deleted.
        failed = {"alertname": FAILED, "rlhfjob": name, "namespace": ns}
        assert not m.webhook.alerts(**failed), m.webhook.alerts(**failed)
        with rayjobs.RayJobsClient(ray_head.dashboard_url) as rj:
            assert rj.stop(sid), f"stopping {sid}"
        st = wait_for(
            lambda: s if (s := job_status(cluster, ns, name)).get("phase") == "Failed" else None,
            120,
            "the job Failed",
        )
        cond = next(c for c in st["conditions"] if c["type"] == "Failed")
        assert cond["status"] == "True" and cond["reason"] == "BackoffLimitExceeded", st
        # The operator sets rlhf_operator_job_phase{phase="Failed"} in the reconcile that decides it
        # (the condition's time, to the second: +1 s); the next scrape brings it.
        failed_bound = firing_bound(rule_for(m, FAILED), seen_after=1 + SCRAPE_INTERVAL_SECONDS)
        t_failed = unix(cond["lastTransitionTime"])
        t_fired, fired_failed = wait_for(
            lambda: m.webhook.alerts("firing", **failed), failed_bound + 30, f"{FAILED} delivered"
        )[0]
        assert fired_failed["annotations"]["runbook_url"].endswith("docs/monitoring.md#rlhfjobfailed")
        assert f"{ns}/{name}" in fired_failed["annotations"]["summary"], fired_failed
        assert not m.webhook.alerts("resolved", **failed), (
            "RLHFJobFailed resolved while the failed job exists"
        )
        cluster.kubectl("delete", "rlhfjob", name, "-n", ns, "--wait=true", "--timeout=60s")
        t_deleted = time.time()
        # The operator's deletion handler drops the job's series (before the finalizer goes, or a
        # reconcile later); the next scrape shows it gone.
        deleted_bound = resolved_bound(RECONCILE_INTERVAL_SECONDS + SCRAPE_INTERVAL_SECONDS)
        t_gone = wait_for(
            lambda: m.webhook.alerts("resolved", **failed), deleted_bound + 30, f"{FAILED} resolved"
        )[0][0]
        print(f"failed: {FAILED} delivered {t_fired - t_failed:.1f} s after the operator set Failed (bound "
              f"{failed_bound:.0f} s); resolved {t_gone - t_deleted:.1f} s after the deletion (bound {deleted_bound:.0f} s)")  # fmt: skip
        assert t_fired - t_failed <= failed_bound, (t_fired - t_failed, failed_bound)
        assert t_gone - t_deleted <= deleted_bound, (t_gone - t_deleted, deleted_bound)
    finally:
        control.write_text("ok")
        cluster.kubectl("delete", "rlhfjob", name, "-n", ns, "--wait=false", check=False)
