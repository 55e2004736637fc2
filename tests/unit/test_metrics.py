"""Every series of the daemons follows one naming scheme and carries a ``service`` label."""

from __future__ import annotations

import re

from prometheus_client import REGISTRY

from framework import metrics

_NAME = re.compile(r"txbox_(publisher|receiver|worker|collector)_[a-z_]+_(total|seconds|bytes|rows|messages)")


def test_every_txbox_series_is_named_daemon_what_unit_and_labelled_with_its_service() -> None:
    families = [m for m in vars(metrics).values() if hasattr(m, "_labelnames") and hasattr(m, "_name")]
    assert len(families) >= 20
    for family in families:
        # prometheus_client keeps a counter's name without its _total suffix
        name = family._name + ("_total" if family._type == "counter" else "")
        assert _NAME.fullmatch(name), name
        assert "service" in family._labelnames, name


def test_no_txbox_series_lives_outside_the_metrics_module() -> None:
    import framework.dead_letters.collector
    import framework.receiver
    import framework.relay
    import framework.worker  # noqa: F401 - their import registers whatever they define

    ours = {f._name for f in vars(metrics).values() if hasattr(f, "_name") and hasattr(f, "_labelnames")}
    registered = {name for name in REGISTRY._names_to_collectors if name.startswith("txbox_")}
    counted = {n for n in registered if any(n == o or n.startswith(o + "_") for o in ours)}
    assert registered == counted
