"""Experiments that write JSON and PNG: the drift experiment (`drift.py`, `specrl drift`), speed
sweeps (`speed.py`, `specrl speed`) and the plots both draw (`plots.py`). Timing code lives in
specrl.bench, so the experiments and `specrl bench` share one implementation."""
