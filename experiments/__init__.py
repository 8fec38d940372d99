"""Experiment scripts (drift, speed sweeps) that write JSON and PNG; the measurement code lives
in specrl.bench so that scripts and the CLI share one implementation."""
