"""Which tensor names a weight update can write into an SGLang EAGLE-3 draft, and the guards that
keep a policy sync out of the draft and a draft push out of the policy.

Why: in RL the policy is synced into the rollout engine after every trainer step, and the draft
is pushed after every draft update. In sglang 0.5.23 both travel through the same
`update_weights_from_tensor` request; its `selector` field ("target", "draft", "all"; default
"all") picks the runners that load it. With "all" (or on a server that predates `selector`) the
draft runner loads every name its loader resolves. If a policy tensor lands in the draft, the
draft keeps running with wrong weights and accept length collapses silently (2.71 -> 1.00 in one
pipeline), so a sync that could do that is refused before anything is sent.

What the draft loader resolves (read from sglang 0.5.23's
`sglang/srt/models/llama_eagle3.py::LlamaForCausalLMEagle3.load_weights`, restated here, not
copied): the legacy words `midlayer`, `aux_norm_low/mid/high` are rewritten to `layers.0`,
`fc_norm.0/1/2` wherever they occur in a name; a name containing `d2t` replaces the draft's
hot-token map and one containing `t2d` is dropped; `.q_proj/.k_proj/.v_proj` become shards of
`.qkv_proj` and `.gate_proj/.up_proj` shards of `.gate_up_proj`; the result is looked up as is
or with a `model.` prefix among the draft's parameters. So a Llama policy's `lm_head.weight`,
`model.norm.weight`, `model.embed_tokens.weight` and all of `model.layers.0.*` reach the draft.
The upstream lane checks `reaches_draft` against the real loader over stand-in parameters
(tests/test_upstream_sglang.py).
"""
from __future__ import annotations

import re
from collections.abc import Iterable

VOCAB_MAP_NAMES = ("d2t", "t2d")  # EAGLE-3 draft vocabulary maps (buffers, fixed for a run)

# Legacy words the loader rewrites wherever they occur in a name (old SpecForge/EAGLE layouts).
_LEGACY_WORDS = (("midlayer", "layers.0"), ("aux_norm_low", "fc_norm.0"),
                 ("aux_norm_mid", "fc_norm.1"), ("aux_norm_high", "fc_norm.2"))
# Per-projection names the loader stores as shards of one fused parameter (first match wins).
_FUSED = ((".q_proj", ".qkv_proj"), (".k_proj", ".qkv_proj"), (".v_proj", ".qkv_proj"),
          (".gate_proj", ".gate_up_proj"), (".up_proj", ".gate_up_proj"))
# Parameters outside the decoder layers of an EAGLE-3 draft, relative to its `model.` module.
_DRAFT_TOP = ("fc.weight", "fc.bias", "input_norm.weight", "embed_tokens.weight", "norm.weight")
_FC_NORM = re.compile(r"fc_norm\.\d+\.weight")


class WeightIsolationError(ValueError):
    """A weight update would write policy tensors into the draft or draft tensors into the policy."""


def draft_param_name(name: str, *, draft_layers: int = 1) -> str | None:
    """The draft parameter SGLang's EAGLE-3 loader writes `name` into, or None when it drops it.

    Returns "hot_token_id" for names the loader reads as the vocabulary map d2t. Decoder-layer
    names are matched by layer index only (any `layers.i.*` with i < draft_layers counts), which
    is a superset of the draft's real parameters: a guard built on it can refuse a harmless name,
    never pass a harmful one."""
    for old, new in _LEGACY_WORDS:
        name = name.replace(old, new)
    if "d2t" in name:
        return "hot_token_id"
    if "t2d" in name:
        return None
    for part, fused in _FUSED:
        if part in name:
            name = name.replace(part, fused)
            break
    if name == "lm_head.weight":
        return name
    inner = name.removeprefix("model.")
    if inner in _DRAFT_TOP or _FC_NORM.fullmatch(inner):
        return "model." + inner
    m = re.match(r"layers\.(\d+)\.", inner)
    if m and int(m.group(1)) < draft_layers:
        return "model." + inner
    return None


def reaches_draft(names: Iterable[str], *, draft_layers: int = 1) -> list[str]:
    """The names an un-routed update (selector "all") would also load into the draft."""
    return [n for n in names if draft_param_name(n, draft_layers=draft_layers) is not None]


def draft_owned(name: str) -> bool:
    """True for tensors only an EAGLE-3 draft has (fc, its feature norms, midlayer, vocabulary maps):
    a policy state dict that carries one was merged with the draft somewhere upstream."""
    n = name.removeprefix("model.")
    return (n.startswith(("fc.", "midlayer.", "fc_norm.", "aux_norm_")) or ".hidden_norm." in n
            or any(m in name for m in VOCAB_MAP_NAMES))


def check_policy_sync(names: Iterable[str], *, isolated: bool, draft_layers: int = 1) -> None:
    """Refuse a policy sync that could write into the draft.

    Draft-only tensors in a policy state dict are always refused. When the request is not
    `isolated` (not sent with selector="target" nor an isolation flag the server is known to
    honour), every name the draft loader resolves is refused too (`reaches_draft`)."""
    names = list(names)
    foreign = [n for n in names if draft_owned(n)]
    if foreign:
        raise WeightIsolationError(f"policy sync carries draft tensors {foreign[:4]}; push the draft separately")
    if not isolated:
        shared = reaches_draft(names, draft_layers=draft_layers)
        if shared:
            raise WeightIsolationError(
                f"policy sync would also overwrite the draft's {shared[:4]} ({len(shared)} names the EAGLE-3 "
                f"loader resolves): send it with selector='target' or an isolation flag the server honours")


def check_draft_push(names: Iterable[str], target_names: Iterable[str] | None, *, routed: bool) -> list[str]:
    """Names of a draft push that the target would also load; raise unless the push is `routed`
    to the draft only. Unknown target names (None) cannot be proven safe and are refused too."""
    names = list(names)
    if routed:
        return []
    if target_names is None:
        raise WeightIsolationError("draft push: target parameter names unknown (sync the policy first or set "
                                   "SGLangEngine.target_param_names), cannot prove the target is untouched")
    target = set(target_names)
    return [n for n in names if n in target]
