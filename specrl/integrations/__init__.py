"""Adapters that plug specrl into host RL pipelines (slime, veRL, TRL)."""
