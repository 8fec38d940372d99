"""One `rollout.protocol.DraftReceiver` over every engine of a job that serves the same draft.

Why: a pipeline that launches its engines itself (slime's SGLang servers, one per node or
replica) has one draft but several receivers, and the co-training core pushes to one. Every call
goes to each engine in turn; a push that fails on some of them is still tried on the others and
then raises one error naming them, so the core counts one fault and pushes the next version to
all of them again.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


class DraftFanout:
    """install_draft / set_speculation / push_draft on every engine; draft_weights and draft_version of the first
    (all hold the same version unless a push failed, which raised); draft_faults of all."""

    def __init__(self, engines: Sequence):
        if not engines:
            raise ValueError("DraftFanout needs at least one engine (the job's inference servers)")
        self.engines = list(engines)

    @property
    def capabilities(self):
        """What every engine can do (the first one's: a job's engines are alike)."""
        return self.engines[0].capabilities

    def install_draft(self, drafter, policy=None) -> None:
        self._each(lambda e: e.install_draft(drafter, policy), "draft install")

    def set_speculation(self, on: bool) -> None:
        self._each(lambda e: e.set_speculation(on), "speculation switch")

    @property
    def speculating(self) -> bool:
        return self.engines[0].speculating

    def push_draft(self, weights: dict[str, torch.Tensor], version: int) -> None:
        self._each(lambda e: e.push_draft(weights, version), f"draft push (version {version})")

    def draft_weights(self) -> tuple[dict[str, torch.Tensor], int | None]:
        return self.engines[0].draft_weights()

    @property
    def draft_version(self) -> int | None:
        return self.engines[0].draft_version

    @property
    def draft_faults(self) -> list[str]:
        return [line for e in self.engines for line in e.draft_faults]

    def _each(self, call: Callable, what: str) -> None:
        failed = []
        for i, engine in enumerate(self.engines):
            try:
                call(engine)
            except Exception as err:  # noqa: BLE001 - try the other engines, then report all
                first = str(err).splitlines()[0] if str(err) else ""
                failed.append(f"engine {i} ({getattr(getattr(engine, 'config', None), 'base_url', '?')}): "
                              f"{type(err).__name__}: {first}")
        if failed:
            raise RuntimeError(f"{what} failed on {len(failed)} of {len(self.engines)} engines: {'; '.join(failed)}")
