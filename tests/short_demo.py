"""The short demo's command line, shared by the suite's fixture (tests/conftest.py)
and the tests that run the demo as a subprocess. A module of its own: several
test folders have a ``conftest``, so ``from conftest import`` is ambiguous."""

#: The short demo's flags (2 RL steps of 4 groups x 4, 5 warm-up steps, faults on);
#: callers add ``--out``.
SHORT_DEMO_ARGS = (
    "demo", "--steps", "2", "--warmup-steps", "5", "--groups-per-step", "4", "--group-size", "4",
    "--seed", "0", "--quiet", "--timeout", "120",
)
