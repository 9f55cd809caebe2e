"""deploy/grafana/satisfice.json: an importable dashboard whose queries ask only for
series a gateway exposes, by labels those series have.

The series come from a real ``gateway.ops.metrics.Metrics`` built in-process as
``gateway/runtime.py`` builds it (the default config's engines, constructed but not
started, and a memory-store cache), with one streamed loop answer recorded through its
``Exchange`` so every labelled series has a sample, then scraped and parsed with
``prometheus_client``'s parser.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from cache import create_store
from cache.semantic_cache import SemanticCache
from cache.settings import CacheSettings
from engines import create_engine
from evaluator.loop import BranchTrace, FirstAnswerTrace, LoopTrace, RoundTrace
from gateway.checks.estimates import LiveEstimates
from gateway.checks.record import CheckRecord
from gateway.config import load_config
from gateway.ops.metrics import Metrics
from gateway.pipeline.exchange import Settled
from gateway.pipeline.outcome import Decision

DASHBOARD = Path(__file__).resolve().parent.parent / "deploy" / "grafana" / "satisfice.json"
DATASOURCE_VARIABLE = "DS_PROMETHEUS"
# Labels Prometheus adds at scrape time, not in the exposition.
SCRAPE_LABELS = frozenset({"job", "instance"})

METRIC = re.compile(r"satisfice_[a-z_]+")
# "sum by (a, b) (" — the only grouping form the dashboard uses.
BY = re.compile(r"\bby\s*\(([^)]*)\)\s*\(")
ANY_BY = re.compile(r"\b(by|without)\s*\(")
SELECTOR = re.compile(r"(satisfice_[a-z_]+)\s*\{([^}]*)\}")
MATCHER = re.compile(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(=~|!~|!=|=)\s*\"")

# Series name -> the label names its samples carry.
Exposed = dict[str, frozenset[str]]


def load() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return data


def all_panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for panel in panels:
        yield panel
        yield from all_panels(panel.get("panels", []))


def query_panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    return [p for p in all_panels(dashboard["panels"]) if p["type"] != "row"]


def expressions(dashboard: dict[str, Any]) -> list[str]:
    """Every PromQL expression: the panels' targets and the query variables'."""
    found = [t["expr"] for p in query_panels(dashboard) for t in p["targets"]]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            query = variable["query"]
            found.append(query["query"] if isinstance(query, dict) else query)
    return found


def argument(expr: str, open_at: int) -> str:
    """The text inside the parenthesis that opens at ``open_at``."""
    depth = 0
    for i in range(open_at, len(expr)):
        depth += {"(": 1, ")": -1}.get(expr[i], 0)
        if depth == 0:
            return expr[open_at + 1 : i]
    raise AssertionError(f"unbalanced parentheses in {expr!r}")


def problems(expr: str, exposed: Exposed) -> list[str]:
    """What in ``expr`` a gateway does not expose: series names, grouping and matcher labels."""
    found: list[str] = []
    for name in METRIC.findall(expr):
        if name not in exposed:
            found.append(f"{name} is not an exposed series")
    if len(ANY_BY.findall(expr)) != len(BY.findall(expr)):
        found.append(f"only the 'sum by (labels) (...)' grouping form is checked: {expr!r}")
    for match in BY.finditer(expr):
        labels = {label.strip() for label in match.group(1).split(",") if label.strip()}
        inner = argument(expr, match.end() - 1)
        names = METRIC.findall(inner)
        if not names:
            found.append(f"by ({match.group(1)}) groups no satisfice series")
        for name in names:
            for label in sorted(labels - exposed.get(name, frozenset()) - SCRAPE_LABELS):
                found.append(f"{name} has no label {label!r} (by ({match.group(1)}))")
    for name, matchers in SELECTOR.findall(expr):
        for label, _ in MATCHER.findall(matchers):
            if label not in exposed.get(name, frozenset()) | SCRAPE_LABELS:
                found.append(f"{name} has no label {label!r} ({{{matchers}}})")
    return found


def _late_loop_decision() -> Decision:
    """A loop answer that missed its deadline, with one round of one branch."""
    branch = BranchTrace(answer="4", tokens=3, finish_reason="stop", confidence=0.9)
    round_ = RoundTrace(
        round=1, branches=[branch], answer="4", probability=0.9, tokens=3, seconds=0.1
    )
    first = FirstAnswerTrace(verdict="confirmed", answer="4", tokens=2, whole_ms=0.5)
    trace = LoopTrace(
        kind="number", rounds=[round_], stop="deadline", fallback="best", confidence=0.9,
        tokens=3, probe_tokens=0, deadline_ms=1.0, elapsed_ms=2.0, first_shown_ms=0.2,
        thought_to_output=1.0, first_answer=first,
    )  # fmt: skip
    return Decision(
        tenant="default", model="auto", route="loop", engine="large", confidence=0.9,
        loop=trace, deadline=time.monotonic() - 1,  # late: an SLA miss
        superseded_ms=0.4,  # it stopped the conversation's last turn
    )  # fmt: skip


def _record_one_request(metrics: Metrics) -> None:
    """One streamed loop answer, settled as every request settles."""
    decision = _late_loop_decision()
    settled = Settled(
        request_id=None, key=None, request=None, policy=None, decision=decision, answer=None,
        status=200, error=None, seconds=0.5, ended=time.monotonic(), first_byte_s=0.1, kept=None,
        first_meaningful_s=0.2,
    )  # fmt: skip
    metrics.settled(settled)


def _record_one_check(metrics: Metrics) -> None:
    """One checked early stop, as the runtime records it and reads it back, and one
    shadow decision of a version in shadow."""
    record = CheckRecord(
        id="c1", at=time.time(), source="shadow", tenant="default", shortcut="early_stop",
        route="loop", model="auto", probability=0.05, policy="shipped", prompt="2+2?",
        answer="4", reference="4", agree=True, confidence=0.95,
    )  # fmt: skip
    metrics.checked(record)
    estimates = {"shipped": LiveEstimates.fold([record])}
    metrics.follow_checks(estimates, lambda: ("shipped", "p-1"), lambda: 0)
    metrics.shadow_decided("p-1", "router", False)


@pytest.fixture(scope="module")
def exposed() -> Exposed:
    """The series a gateway's Metrics exposes, each with its label names."""
    config = load_config()
    models_dir = Path(config.models_dir).expanduser()
    engines = {
        name: create_engine(name, settings, models_dir) for name, settings in config.engines.items()
    }
    cache_settings = CacheSettings()
    cache = SemanticCache(cache_settings, create_store(cache_settings))
    cache.counters.guard_rejections["numbers"] = 1  # a guard's series appears once it vetoed
    metrics = Metrics(engines, cache)
    _record_one_request(metrics)
    _record_one_check(metrics)
    labels: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(metrics.exposition().decode()):
        for sample in family.samples:
            labels.setdefault(sample.name, set()).update(sample.labels)
    return {name: frozenset(names) for name, names in labels.items()}


def test_dashboard_is_json_with_unique_panel_ids() -> None:
    dashboard = load()
    assert dashboard["schemaVersion"] >= 36
    ids = [panel["id"] for panel in all_panels(dashboard["panels"])]
    assert len(ids) == len(set(ids)), f"duplicate panel ids: {sorted(ids)}"
    titles = [panel["title"] for panel in all_panels(dashboard["panels"])]
    assert len(titles) == len(set(titles))


def test_datasource_is_a_variable_every_panel_uses() -> None:
    dashboard = load()
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    datasource = variables[DATASOURCE_VARIABLE]
    assert datasource["type"] == "datasource" and datasource["query"] == "prometheus"
    reference = {"type": "prometheus", "uid": f"${{{DATASOURCE_VARIABLE}}}"}
    panels = query_panels(dashboard)
    assert len(panels) >= 15
    for panel in panels:
        assert panel["datasource"] == reference, panel["title"]
        assert panel["targets"], f"{panel['title']} has no query"
        for target in panel["targets"]:
            assert target["expr"].strip(), panel["title"]
            assert target.get("datasource", reference) == reference, panel["title"]
    refs = [(p["id"], t["refId"]) for p in panels for t in p["targets"]]
    assert len(refs) == len(set(refs))
    for name in ("job", "instance"):
        assert variables[name]["datasource"] == reference


def test_every_query_filters_by_job_and_instance() -> None:
    for panel in query_panels(load()):
        for target in panel["targets"]:
            for _, matchers in SELECTOR.findall(target["expr"]):
                assert 'job=~"$job"' in matchers and 'instance=~"$instance"' in matchers


def test_queries_ask_only_for_exposed_series_and_labels(exposed: Exposed) -> None:
    dashboard = load()
    used: set[str] = set()
    for expr in expressions(dashboard):
        used.update(METRIC.findall(expr))
        assert not problems(expr, exposed), problems(expr, exposed)
    # Every family the gateway exposes has a panel (the _created samples aside).
    families = {re.sub(r"_(total|bucket|sum|count)$", "", name) for name in used}
    exposed_families = {
        re.sub(r"_(total|bucket|sum|count)$", "", name)
        for name in exposed
        if not name.endswith("_created")
    }
    assert exposed_families <= families, sorted(exposed_families - families)


def test_the_check_catches_typos(exposed: Exposed) -> None:
    good = 'sum by (route) (rate(satisfice_requests_total{status="429"}[$__rate_interval]))'
    assert not problems(good, exposed)
    for bad in (
        "sum(rate(satisfice_request_total[$__rate_interval]))",  # name typo
        "sum(rate(satisfice_loop_rounds[$__rate_interval]))",  # a histogram's bare name
        "sum by (rout) (rate(satisfice_requests_total[$__rate_interval]))",  # label typo
        "sum by (engine) (rate(satisfice_sla_misses_total[$__rate_interval]))",  # no label
        'sum(rate(satisfice_requests_total{code="429"}[$__rate_interval]))',  # matcher
        "sum(rate(satisfice_requests_total[$__rate_interval])) by (route)",  # unchecked form
    ):
        assert problems(bad, exposed), bad
