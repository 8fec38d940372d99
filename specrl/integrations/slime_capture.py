"""slime's trainer side, part 1: capture EAGLE-3 records from Megatron's log-prob forward.

Why a module of its own: the capture runs inside the host's forward, so it carries the strictest
rule (never raise into it) and its own memory bound; the layer hooks themselves are
`target_training.megatron_backend.FeatureTaps`, the one Megatron feature tap. Re-exported by
`specrl.integrations.slime`.
"""
from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch

from target_training.config import MoEConfig
from target_training.megatron_backend import FeatureTaps, MegatronBackendError


def default_tap_layers(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's low/mid/high taps for an L-layer target, by the same rule as the MoE policy."""
    return MoEConfig(num_layers=num_layers).feature_layer_ids


def unwrap(chunk):
    """The GPTModel inside DDP / Float16Module wrappers (each exposes the next as `.module`)."""
    m = chunk
    while not hasattr(m, "decoder") and hasattr(m, "module"):
        m = m.module
    if not hasattr(m, "decoder"):
        raise ValueError(f"{type(chunk).__name__} holds no Megatron GPTModel (no .decoder)")
    return m


class FeatureTap:
    """Captures EAGLE-3 training records from the log-prob forward of a Megatron GPTModel.

    The three tap layers are read by `target_training.megatron_backend.FeatureTaps` (the one
    Megatron feature tap); this class adds what slime's forward needs: slime packs sequences into
    batch 1 and passes `packed_seq_params.cu_seqlens_q`, so while armed every forward adds one
    record per packed sequence: input_ids (T,), fused features (T, 3H) in half precision, and a
    loss mask (every token but the first, or only the last `response_lengths[i]` tokens when given).

    Fault isolation: the hooks run inside the host's forward and never raise into it. A capture
    that fails (unexpected shapes, a layer that did not run, ...) disarms the tap, so co-training
    skips that step, and is counted in `faults` with the error in `last_error`. Memory is bounded:
    at most `max_records` records wait to be drained; later ones are dropped and counted in
    `dropped`."""

    def __init__(self, gpt_model, layer_ids: Sequence[int], seq_first: bool = True,
                 feature_dtype: torch.dtype = torch.float16, max_records: int = 4096):
        if max_records <= 0:
            raise ValueError(f"max_records must be positive, got {max_records}")
        self.model, self.layer_ids = gpt_model, tuple(int(i) for i in layer_ids)
        self.seq_first, self.feature_dtype, self.max_records = seq_first, feature_dtype, int(max_records)
        try:
            self.layers = FeatureTaps(gpt_model, self.layer_ids, seq_first=seq_first, when=lambda: self.armed)
        except MegatronBackendError as e:
            raise ValueError(str(e)) from None
        self.armed = False
        self.records: list[dict] = []
        self.response_lengths: list[int] | None = None
        self.faults, self.dropped, self.last_error = 0, 0, None
        self._cursor = 0  # next entry of response_lengths
        self._inputs: tuple | None = None
        self._handles = [gpt_model.register_forward_pre_hook(self._pre_hook, with_kwargs=True),
                         gpt_model.register_forward_hook(self._post_hook)]

    def arm(self) -> None:
        self.armed = True

    def set_response_lengths(self, lengths: Sequence[int] | None) -> None:
        """Response lengths of the next captured sequences, in forward order (a trainer-side patch
        that knows the batch can call this; slime's hook arguments do not carry it)."""
        self.response_lengths = None if lengths is None else [int(n) for n in lengths]
        self._cursor = 0

    def disarm(self) -> None:
        self.armed = False

    def remove(self) -> None:
        self.layers.remove()
        for h in self._handles:
            h.remove()
        self._handles = []

    def _fault(self, e: BaseException) -> None:
        self.faults += 1
        self.last_error = f"{type(e).__name__}: {e}"
        self.disarm()
        self._inputs = None
        self.layers.clear()
        warnings.warn(f"specrl feature tap disabled for this step: {self.last_error}", RuntimeWarning, stacklevel=2)

    def _pre_hook(self, module, args, kwargs):
        if not self.armed:
            return
        try:
            ids = kwargs.get("input_ids", args[0] if args else None)
            psp = kwargs.get("packed_seq_params")
            self._inputs = (ids, getattr(psp, "cu_seqlens_q", None))
            self.layers.clear()
        except Exception as e:  # noqa: BLE001 - never raise into the host forward
            self._fault(e)

    def _post_hook(self, module, args, output):
        if not self.armed or self._inputs is None:
            return
        try:
            self._capture()
        except Exception as e:  # noqa: BLE001 - never raise into the host forward
            self._fault(e)

    def _capture(self) -> None:
        ids, cu = self._inputs
        self._inputs = None
        if len(self.layers.taps) != len(self.layer_ids):
            raise RuntimeError(f"feature tap saw layers {sorted(self.layers.taps)} of {self.layer_ids} in one forward")
        feats = self.layers.features().detach()  # (batch, seq, 3H) when seq_first
        self.layers.clear()
        ids = ids.detach()
        if cu is not None:
            if ids.shape[0] != 1:
                raise ValueError(f"packed sequences need batch 1, got input_ids {tuple(ids.shape)}")
            bounds = [int(x) for x in cu.tolist()]
            spans = [(0, a, b) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
        else:
            spans = [(r, 0, ids.shape[1]) for r in range(ids.shape[0])]
        for row, a, b in spans:
            T = b - a
            mask = torch.zeros(T, dtype=torch.bool)
            if self.response_lengths is not None and self._cursor < len(self.response_lengths):
                mask[T - min(T - 1, self.response_lengths[self._cursor]):] = True
                self._cursor += 1
            else:
                mask[1:] = True
            if len(self.records) >= self.max_records:
                self.dropped += 1
                continue
            self.records.append({"input_ids": ids[row, a:b].cpu(), "loss_mask": mask,
                                 "features": feats[row, a:b].to("cpu", self.feature_dtype), "target_logp": None})

    def drain(self) -> list[dict]:
        out, self.records = self.records, []
        self.set_response_lengths(None)
        return out
