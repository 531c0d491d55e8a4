"""The tiers of the suite that need a real component (a Slurm cluster, Open MPI, emulated nodes, a second user):
where one is missing, the tier does not run. Outside CI that is a skip, and the run's summary says in one line per
tier which did not run and how to get it; under CI (``CI=true``, as root, where ``make test`` installs everything)
a missing component is a failure, so that a green CI run means every tier ran."""

import os

import pytest

NOT_RUN: dict[str, str] = {}


def strict() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes") and os.geteuid() == 0


def missing(tier: str, reason: str) -> None:
    """End the current test: its tier needs a component that is not here."""
    if strict():
        pytest.fail(f"the {tier} tier cannot run under CI: {reason}", pytrace=False)
    NOT_RUN.setdefault(tier, reason)
    pytest.skip(reason)
