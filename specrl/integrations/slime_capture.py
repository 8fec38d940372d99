"""slime's trainer side, part 1: a `rollout.protocol.FeatureSource` over Megatron's log-prob forward.

Why a module of its own: the capture runs inside the host's forward, so it carries the strictest
rule (never raise into it); the layer hooks themselves are
`target_training.megatron_backend.FeatureTaps`, the one Megatron feature tap. Where the records go
(the co-trainer's byte-budgeted `FeatureBuffer`) is decided by whoever registers the hook
(`SpecCoTrainer.attach`). Re-exported by `specrl.integrations.slime`.
"""
from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence

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


class TapOutput:
    """What a feature hook reads of one captured sequence (the slice of `target_training.model.
    ModelOutput` that `FeatureBuffer.logprob_hook` uses): its fused taps, and no logits, since
    Megatron's are vocabulary-parallel; the buffer then stores hard labels."""

    logits = None

    def __init__(self, features: torch.Tensor):
        self._features = features

    def features(self, layer_ids: Sequence[int]) -> torch.Tensor:
        return self._features


class FeatureTap:
    """A FeatureSource over the log-prob forward of a Megatron GPTModel (slime's actor pass).

    `add_feature_hook(layer_ids, hook)` taps the three layers with `FeatureTaps`; while armed,
    every forward calls hook(input_ids (1, T), TapOutput (fused features (1, T, 3H)), loss mask
    (1, T)) once per packed sequence: slime packs sequences into batch 1 and passes
    `packed_seq_params.cu_seqlens_q`. The loss mask covers every token but the first, or only the
    last `response_lengths[i]` tokens when given.

    Fault isolation: the hooks run inside the host's forward and never raise into it. A capture
    or a hook that fails (unexpected shapes, a layer that did not run, an OOM while storing) disarms
    the tap for the rest of the step, warns once, and is counted in `faults` with the error in
    `last_error`; the host's forward returns its own output unchanged."""

    def __init__(self, gpt_model, seq_first: bool = True):
        self.model, self.seq_first = gpt_model, seq_first
        self.layers: FeatureTaps | None = None
        self.layer_ids: tuple[int, ...] = ()
        self.hook: Callable | None = None
        self.armed = False
        self.response_lengths: list[int] | None = None
        self.faults, self.last_error = 0, None
        self._cursor = 0  # next entry of response_lengths
        self._inputs: tuple | None = None
        self._handles = []

    def add_feature_hook(self, layer_ids: tuple[int, ...], hook: Callable) -> None:
        if self.hook is not None:
            raise ValueError("FeatureTap feeds one hook (the co-trainer's buffer); it already has one")
        try:
            self.layers = FeatureTaps(self.model, layer_ids, seq_first=self.seq_first, when=lambda: self.armed)
        except MegatronBackendError as e:
            raise ValueError(str(e)) from None
        self.layer_ids, self.hook = tuple(int(i) for i in layer_ids), hook
        self._handles = [self.model.register_forward_pre_hook(self._pre_hook, with_kwargs=True),
                         self.model.register_forward_hook(self._post_hook)]

    def arm(self) -> None:
        self.armed = self.hook is not None

    def disarm(self) -> None:
        self.armed = False

    def set_response_lengths(self, lengths: Sequence[int] | None) -> None:
        """Response lengths of the next captured sequences, in forward order (a trainer-side patch
        that knows the batch can call this; slime's hook arguments do not carry it)."""
        self.response_lengths = None if lengths is None else [int(n) for n in lengths]
        self._cursor = 0

    def remove(self) -> None:
        if self.layers is not None:
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
        except Exception as e:  # noqa: BLE001 - never raise into the host forward (OOM included)
            self._fault(e)

    def _capture(self) -> None:
        ids, cu = self._inputs
        self._inputs = None
        if len(self.layers.taps) != len(set(self.layer_ids)):
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
            self.hook(ids[row, a:b][None], TapOutput(feats[row, a:b][None]), self._loss_mask(b - a)[None])

    def _loss_mask(self, T: int) -> torch.Tensor:
        mask = torch.zeros(T, dtype=torch.bool)
        if self.response_lengths is not None and self._cursor < len(self.response_lengths):
            mask[T - min(T - 1, self.response_lengths[self._cursor]):] = True
            self._cursor += 1
        else:
            mask[1:] = True
        return mask
