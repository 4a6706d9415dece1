"""The chart's alerts, for real: Prometheus scrapes the real operator and the real trainer through the
chart's own monitors, evaluates the chart's own rules, and Alertmanager notifies a webhook of the test.

Scenarios (DESIGN.md §4, docs/monitoring.md), one trainer run: its first healthy steps alert nothing
and fill every dashboard panel; reward errors fire RLHFJobRewardErrors; a hanging reward fires a stall
alert naming the phase, though the operator restarts the stuck attempt (onStall: Restart), and it
resolves when the restarted attempt completes a step; a trainer restart resets no counter into a false
alert. The operator killed fires RLHFOperatorDown, which resolves when it is back (test_operator_down.py).
"""

from __future__ import annotations

import json
import re
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from monitored import (
    FOR,
    REWARD_ERRORS_WINDOW,
    SCRAPE_INTERVAL_SECONDS,
    Monitored,
    seconds,
)
from rlhf_operator import rayjobs
from support import ROOT, Cluster, RayHead, ray_job_logs, stall_events, step_reports, tiny_job, wait_for

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


def job_status(cluster: Cluster, namespace: str, name: str) -> dict[str, Any]:
    st: dict[str, Any] = (cluster.get("rlhfjob", name, namespace) or {}).get("status", {})
    return st


def ours(m: Monitored, alerts: list[tuple[float, dict[str, Any]]]) -> list[tuple[float, dict[str, Any]]]:
    return [(t, a) for t, a in alerts if a["labels"].get("alertname") in m.alert_names]


def value(m: Monitored, expr: str) -> float | None:
    res = m.stack.query(expr)
    return max(float(r["value"][1]) for r in res) if res else None


DELIVERY_SLACK_SECONDS = 5


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
    # Above the trainer's start-up (30-45 s here; the stall clock starts with the driver), so the only
    # stall is the one the test makes.
    stall_timeout = 60
    doc = tiny_job(name, tiny_model, tmp_path / "ckpt", steps=200, runPolicy={"backoffLimit": 2})
    doc["spec"]["model"]["reward"] = {
        "type": "function",
        "function": f"{HERE / 'control_reward.py'}:reward",
        "onError": "skipSample",
        "timeoutSeconds": 3600,  # a hang stays a hang, never a timed-out reward error
    }
    doc["spec"]["checkpoint"]["intervalSteps"] = 1
    # onStall: Restart, the policy a user running unattended picks: the operator stops the stuck
    # attempt at the stall timeout and restarts it; the alert must still fire and name the phase, and
    # resolve only when the restarted attempt completes a step.
    doc["spec"]["monitoring"].update(stallTimeoutSeconds=stall_timeout, onStall="Restart")
    doc["spec"]["pods"] = {"env": [{"name": "RLHF_TEST_REWARD_CONTROL", "value": str(control)}]}
    cluster.apply(doc, ns)
    try:
        # 0. Healthy steps: no alert, and every query of the chart's dashboards answers while the job runs.
        exprs = dashboard_exprs()
        answered: dict[str, int] = {}  # expr -> most series seen in one query while the job ran

        def healthy() -> dict[str, Any] | None:
            st = job_status(cluster, ns, name)
            assert st.get("phase") != "Failed", st
            if st.get("phase") == "Running" and (st.get("step") or 0) >= 1:
                for _, expr in exprs:
                    n = len(m.stack.query(substitute(expr, ns, name)))
                    answered[expr] = max(answered.get(expr, 0), n)
            return st if (st.get("step") or 0) >= HEALTHY_STEPS else None

        wait_for(healthy, 600, f"{HEALTHY_STEPS} healthy steps", interval=1)
        time.sleep(3 * SCRAPE_INTERVAL_SECONDS)  # the last scrapes and evaluations of the healthy stretch
        empty = [(title, expr) for title, expr in exprs if not answered.get(expr)]
        assert not empty, f"dashboard panels without a series while the job ran: {empty}"
        delivered = ours(m, m.webhook.alerts())
        assert not delivered, f"healthy steps delivered alerts: {[a for _, a in delivered]}"
        # The run really was watched: the trainer's target was discovered and scraped (not only the operator).
        scraped = value(m, f"rlhf_steps_completed_total{{{sel}}}")
        assert scraped is not None and scraped >= HEALTHY_STEPS, scraped
        print(f"healthy: {len(exprs)} dashboard queries all answered; no alert over {scraped:.0f} steps")

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

        # 2. The reward hangs: a stall alert naming the phase reaches the webhook in time, though the
        # operator restarts the stuck attempt at the same threshold.
        stuck_sid = job_status(cluster, ns, name)["submissionId"]
        control.write_text("hang")
        t_hang = time.time()

        def stall_delivered() -> tuple[float, dict[str, Any]] | None:
            for alertname in ("RLHFJobPhaseStuck", "RLHFJobStepStalled"):
                got = [
                    (t, a)
                    for t, a in m.webhook.alerts("firing", alertname=alertname, rlhfjob=name, namespace=ns)
                    if a["labels"].get("phase") == "reward" and t > t_hang
                ]
                if got:
                    return got[0]
            return None

        t_got, alert = wait_for(stall_delivered, stall_timeout + 180, "a stall alert with phase=reward")
        open_stall = job_status(cluster, ns, name).get("openStall")
        assert open_stall and open_stall["phase"] == "reward", job_status(cluster, ns, name)
        stalled_since = datetime.fromisoformat(open_stall["since"].replace("Z", "+00:00")).timestamp()
        delay = t_got - stalled_since
        # Pending at the first evaluation past the timeout, firing `for` later, one scrape of lag each
        # way; plus DELIVERY_SLACK for evaluation and delivery while the operator's restart of the
        # stuck attempt (at the same threshold) loads both cores with the new trainer's start-up.
        bound = stall_timeout + seconds(FOR) + 2 * SCRAPE_INTERVAL_SECONDS + DELIVERY_SLACK_SECONDS
        print(f"stall: {alert['labels']['alertname']} delivered {delay:.1f} s after the stall began "
              f"(bound {bound} s = stallTimeoutSeconds {stall_timeout} + for {FOR} + 2 scrapes "
              f"+ {DELIVERY_SLACK_SECONDS} s delivery)")  # fmt: skip
        assert delay <= bound, (delay, bound)
        # What a user receives: the job, the namespace, the stuck phase and a runbook link.
        anchor = alert["labels"]["alertname"].lower()
        assert alert["annotations"]["runbook_url"].endswith(f"docs/monitoring.md#{anchor}"), alert
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
        early = [a for t, a in m.webhook.alerts("resolved", alertname=alert["labels"]["alertname"], rlhfjob=name)
                 if t > t_got]  # fmt: skip
        assert not early, (
            f"the stall alert resolved with the stuck attempt's restart, before any step: {early}"
        )
        resolved = wait_for(
            lambda: [
                (t, a)
                for t, a in m.webhook.alerts("resolved", alertname=alert["labels"]["alertname"], rlhfjob=name)
                if a["labels"].get("phase") == "reward" and t > t_got
            ],
            600,
            "the stall alert resolved",
        )[0]
        step_done = first_step_after(m, sel, int(open_stall["step"]), since=t_restart)
        assert step_done > t_restart, (step_done, t_restart)
        assert resolved[0] >= step_done, "resolved before the restarted attempt completed a step"
        print(f"recovery: stuck attempt stopped at +0 s; the restarted attempt completed a step at +{step_done - t_restart:.1f} s; "
              f"resolved notification at +{resolved[0] - t_restart:.1f} s ({resolved[0] - step_done:+.1f} s from the step)")  # fmt: skip
        assert resolved[0] - step_done <= seconds(FOR) + 2 * SCRAPE_INTERVAL_SECONDS + 30, resolved

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
        after = value(m, f"rlhf_reward_errors_total{{{sel}}}")
        print(f"restart: rlhf_reward_errors_total {errors_before:.0f} before the restart, {after} after; "
              f"no reward-errors alert over {time.time() - t_restart:.0f} s")  # fmt: skip
        assert st["restarts"] == 1
    finally:
        control.write_text("ok")
        cluster.kubectl("delete", "rlhfjob", name, "-n", ns, "--wait=false", check=False)
