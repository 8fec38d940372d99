"""SGLang backend for the rollout protocol, with an EAGLE-3 draft that specrl keeps training.

Why this module exists: at scale, rollout runs in SGLang, not in the embedded engine. The engine
here turns `/generate` outputs into trajectories (the target's log-prob of every sampled token comes
from `meta_info["output_token_logprobs"]`), syncs the policy into the target runner only, and
hot-swaps the draft into the draft runner only. The concepts it relies on live one per module:

- `rollout.sglang_args`: launch arguments (`sglang_server_args`, `to_cli_args`);
- `rollout.sglang_meta`: speculative counters in `meta_info` (`parse_spec_meta`);
- `rollout.sglang_weights`: which names reach the draft, and the isolation guards;
- `rollout.sglang_transport`: HTTP / in-process transports and the weight-update protocol
  (sessions and `selector` in sglang 0.5.23; legacy servers).

Their public names are re-exported here for callers that import them from this module.
Version notes (what was read, what was run) are in docs/sglang.md.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from draft_models.checkpoint import draft_state_dict_for_sglang, save_draft
from rollout.protocol import EngineCapabilities, RequestIds, Rollout, RolloutStats, SamplingParams, Trajectory
from rollout.sglang_args import SPEC_ALGORITHMS, SGLangArgsError, sglang_server_args, to_cli_args  # noqa: F401
from rollout.sglang_meta import SPEC_KEYS, SpecMetaError, parse_spec_meta  # noqa: F401
from rollout.sglang_transport import (SELECTOR_API_VERSION, EndpointMissing, HTTPTransport,  # noqa: F401
                                      InProcessTransport, check_reply, default_serializer, in_session)
from rollout.sglang_weights import (VOCAB_MAP_NAMES, WeightIsolationError, check_draft_push,  # noqa: F401
                                    check_policy_sync, draft_owned, reaches_draft)


# ---------------------------------------------------------------------------------------------
# /generate outputs -> trajectories
# ---------------------------------------------------------------------------------------------
def sampling_params_for_sglang(params: SamplingParams) -> dict:
    """SGLang's sampling_params dict (top_k -1 disables it in SGLang; 0 does in specrl)."""
    return {"temperature": float(params.temperature), "top_p": float(params.top_p),
            "top_k": int(params.top_k) if params.top_k > 0 else -1,
            "max_new_tokens": int(params.max_new_tokens), "stop_token_ids": list(params.stop_token_ids)}


def tokens_and_logprobs(meta_info: Mapping, output_ids: Sequence[int] | None = None) -> tuple[list[int], list[float]]:
    """Token ids and target log-probs from meta_info["output_token_logprobs"] ([logprob, id, text])."""
    rows = meta_info.get("output_token_logprobs")
    if rows is None:
        raise ValueError("meta_info lacks output_token_logprobs: send the request with return_logprob=true")
    ids, lps = [], []
    for i, row in enumerate(rows):
        if not isinstance(row, (list, tuple)) or len(row) < 2 or row[0] is None:
            raise ValueError(f"output_token_logprobs[{i}]={row!r} is not a [logprob, token_id, ...] entry")
        lps.append(float(row[0]))
        ids.append(int(row[1]))
    if output_ids is not None and list(output_ids) != ids:
        raise ValueError(f"output_ids ({len(output_ids)} tokens) disagree with output_token_logprobs ({len(ids)})")
    return ids, lps


def trajectory_from_output(prompt_ids: Sequence[int], output: Mapping, request_id: int = 0) -> Trajectory:
    meta = output.get("meta_info") or {}
    ids, lps = tokens_and_logprobs(meta, output.get("output_ids"))
    reason = meta.get("finish_reason")
    kind = reason.get("type") if isinstance(reason, Mapping) else reason
    if kind not in ("stop", "length"):
        raise RuntimeError(f"request {request_id} ended with finish_reason {reason!r} (aborted or unfinished)")
    return Trajectory(prompt_ids=list(prompt_ids), token_ids=ids, logprobs=torch.tensor(lps, dtype=torch.float32),
                      finish_reason=kind, request_id=int(request_id), spec=parse_spec_meta(meta))



# ---------------------------------------------------------------------------------------------
# the engine
# ---------------------------------------------------------------------------------------------
WEIGHT_APIS = ("auto", "selector", "legacy")


@dataclass
class SGLangEngineConfig:
    base_url: str | None = None  # a running server / router; None with SGLangEngine.launch
    timeout_s: float = 600.0
    tp_size: int = 1  # update_weights_from_tensor takes one serialized copy per TP rank
    flush_cache: bool = True
    # "selector": sessions + selector (sglang 0.5.23); "legacy": an older server; "auto": ask the
    # server's version once (selector from SELECTOR_API_VERSION on, legacy before it).
    weight_api: str = "auto"
    # Legacy servers only: the request field that keeps a policy sync off the draft on *this* server
    # (e.g. a patched server's "disable_draft_model"). SGLang ignores unknown fields, so name one
    # only if the server is known to honour it.
    legacy_policy_flag: str | None = None
    # Legacy servers only: the request field that sends an update to the draft runner alone.
    legacy_draft_flag: str | None = None
    # Opt-in for a legacy server with no isolation flag: policy syncs go out un-routed, and are
    # still refused when any name would reach the draft (rollout.sglang_weights.reaches_draft).
    allow_unisolated_sync: bool = False
    draft_layers: int = 1  # decoder layers of the served draft (names layers.i, i < this, reach it)
    # Without draft routing, draft names the target also has (lm_head.weight) are refused; True
    # holds them back instead (the engine keeps its old draft lm_head; see last_push_held).
    hold_shared_draft_names: bool = False
    draft_transport: str = "tensor"  # "tensor" (named tensors) or "disk" (export + update_weights_from_disk)
    export_dir: str | None = None  # disk transport: versioned draft folders go here
    load_format: str | None = None
    serializer: Callable[[list[tuple[str, torch.Tensor]]], str] | None = None

    def __post_init__(self) -> None:
        if self.draft_transport not in ("tensor", "disk"):
            raise ValueError(f"draft_transport must be 'tensor' or 'disk', got {self.draft_transport!r}")
        if self.draft_transport == "disk" and not self.export_dir:
            raise ValueError("draft_transport='disk' needs export_dir (a folder the server can read)")
        if self.tp_size <= 0 or self.timeout_s <= 0 or self.draft_layers <= 0:
            raise ValueError("tp_size, timeout_s and draft_layers must be positive")
        if self.weight_api not in WEIGHT_APIS:
            raise ValueError(f"weight_api must be one of {WEIGHT_APIS}, got {self.weight_api!r}")


class SGLangEngine:
    """RolloutEngine over SGLang; the weight isolation rules are in rollout/sglang_weights.py."""

    # features come from the trainer's log-prob forward; the server speculates as it was launched
    capabilities = EngineCapabilities(drafters=("eagle3",))

    def __init__(self, config: SGLangEngineConfig | None = None, transport=None):
        self.config = cfg = config or SGLangEngineConfig()
        if transport is None:
            if not cfg.base_url:
                raise ValueError("SGLangEngine needs config.base_url or a transport (see SGLangEngine.launch)")
            transport = HTTPTransport(cfg.base_url, cfg.timeout_s)
        self.transport = transport
        self.in_process = isinstance(transport, InProcessTransport)
        self.target_param_names: set[str] | None = None  # learned from policy syncs
        self.draft_version: int | None = None
        self.policy_version: int | None = None
        self.last_push_held: list[str] = []
        self.last_push: dict = {}  # the last draft push: {"version", "sent" (names), "held" (names held back)}
        self.request_ids = RequestIds()  # fresh ids for calls that pass none
        self._vocab_maps: dict[str, torch.Tensor] | None = None
        self._pushed: dict[str, torch.Tensor] = {}  # what the engine's draft holds now (CPU copies)
        self.spec = None
        self._api: str | None = None if cfg.weight_api == "auto" else cfg.weight_api

    @classmethod
    def launch(cls, server_args: Mapping, config: SGLangEngineConfig | None = None) -> "SGLangEngine":
        """Start an in-process `sglang.Engine(**server_args)` (sglang imported here, lazily)."""
        try:
            import sglang
        except ImportError as e:
            raise RuntimeError(f"SGLangEngine.launch needs the sglang package ({e}); or connect to a running "
                               f"server with SGLangEngineConfig(base_url=...)") from None
        return cls(config, InProcessTransport(sglang.Engine(**dict(server_args))))

    # -- rollout --------------------------------------------------------------------------
    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams, *,
                 request_ids: Sequence[int] | None = None, capture_features: bool = False) -> Rollout:
        if capture_features:
            raise ValueError("SGLang does not return EAGLE-3 target features; capture them in the trainer's "
                             "log-prob forward (CoTrainConfig.feature_source='trainer')")
        if not prompts:
            return Rollout([], RolloutStats(0.0, 0, temperature=params.temperature))
        ids = self.request_ids.take(request_ids, len(prompts))
        body = {"input_ids": [list(map(int, p)) for p in prompts], "sampling_params": sampling_params_for_sglang(params),
                "return_logprob": True}
        t0 = time.perf_counter()
        out = self.transport.call("generate", body)
        outputs = out if isinstance(out, list) else [out]
        if len(outputs) != len(prompts):
            raise RuntimeError(f"SGLang returned {len(outputs)} outputs for {len(prompts)} prompts")
        trajs = [trajectory_from_output(p, o, r) for p, o, r in zip(prompts, outputs, ids)]
        stats = RolloutStats(wall_s=time.perf_counter() - t0, tokens=sum(len(t.token_ids) for t in trajs),
                             speculated=self.spec is not None, temperature=params.temperature)
        return Rollout(trajs, stats)

    def runs_in_place(self, module) -> bool:
        return False  # the engine holds its own copy of the policy: every update is synced

    def shutdown(self) -> None:
        """Stop an engine started in process (`launch`); a server reached over HTTP is left running."""
        if self.in_process:
            self.transport.engine.shutdown()

    # -- weights --------------------------------------------------------------------------
    @property
    def weight_api(self) -> str:
        """"selector" or "legacy"; asked of the server once when the config says "auto"."""
        if self._api is None:
            version = self.transport.server_version() if hasattr(self.transport, "server_version") else None
            self._api = "selector" if version is not None and version >= SELECTOR_API_VERSION else "legacy"
        return self._api

    def _tensor_body(self, named: list[tuple[str, torch.Tensor]], **fields) -> dict:
        body = {"load_format": self.config.load_format, "flush_cache": self.config.flush_cache, **fields}
        if self.in_process:
            body["named_tensors_local"] = named
        else:
            ser = (self.config.serializer or default_serializer)(named)
            body["serialized_named_tensors"] = [ser] * self.config.tp_size
        return body

    def _send_tensors(self, named, selector: str | None, fields: dict, what: str):
        """One update_weights_from_tensor: in a session for `selector` on the selector API, plain
        (with whatever legacy flag is in `fields`) on a legacy server."""
        if selector is None:
            reply = self.transport.call("update_weights_from_tensor", self._tensor_body(named, **fields))
            check_reply(reply, what)
            return reply
        body = self._tensor_body(named, selector=selector, **fields)
        return in_session(self.transport, selector, lambda: self.transport.call("update_weights_from_tensor", body),
                          what)

    def load_policy_weights(self, state_dict: Mapping[str, torch.Tensor], version: int | None = None) -> None:
        """Policy sync after a trainer step: target runner only, never the draft."""
        cfg, names = self.config, list(state_dict)
        fields = {} if version is None else {"weight_version": str(version)}
        if self.weight_api == "selector":
            selector, isolated = "target", True
        elif cfg.legacy_policy_flag:
            selector, isolated = None, True
            fields[cfg.legacy_policy_flag] = True
        elif cfg.allow_unisolated_sync:
            selector, isolated = None, False
        else:
            raise WeightIsolationError("this SGLang server has no weight-update selector (older than "
                                       f"{'.'.join(map(str, SELECTOR_API_VERSION))}) and no isolation flag is set: "
                                       "a policy sync could overwrite the draft. Set "
                                       "SGLangEngineConfig.legacy_policy_flag to a field the server honours, "
                                       "or allow_unisolated_sync=True to send syncs no draft name is in")
        check_policy_sync(names, isolated=isolated, draft_layers=cfg.draft_layers)
        named = [(n, t.detach()) for n, t in state_dict.items()]
        self._send_tensors(named, selector, fields, "policy sync")
        self.target_param_names = set(names) | (self.target_param_names or set())
        self.policy_version = version

    def push_draft(self, weights, version: int) -> None:
        """Hot-swap fresh draft weights into the engine: SGLang-named tensors, or the Eagle3Draft
        itself (which the disk transport needs). The vocabulary maps d2t/t2d are never re-sent:
        SGLang copies its hot-token map once at start, so a changed map would be ignored; a change
        is refused. What was sent and held back is in `last_push`."""
        cfg = self.config
        draft = weights  # the module, where one was given (the disk transport saves it)
        weights = draft if isinstance(draft, Mapping) else draft_state_dict_for_sglang(draft)
        self._check_vocab_maps(weights)
        self.last_push_held = []
        fields = {"weight_version": f"draft-{version}"}
        selector = "draft" if self.weight_api == "selector" else None
        if selector is None and cfg.legacy_draft_flag:
            fields[cfg.legacy_draft_flag] = True
        routed = selector is not None or bool(cfg.legacy_draft_flag)
        if cfg.draft_transport == "disk":
            if isinstance(draft, Mapping):
                raise ValueError("draft_transport='disk' needs the Eagle3Draft module (save_draft writes its config)")
            if selector is not None or not routed:
                raise WeightIsolationError("update_weights_from_disk has no selector (sglang 0.5.23 loads the folder "
                                           "into every runner): use draft_transport='tensor', or a legacy server "
                                           "with legacy_draft_flag")
            folder = save_draft(draft, Path(cfg.export_dir) / f"draft-v{version}")
            body = {"model_path": str(folder), "load_format": cfg.load_format, **fields}
            check_reply(self.transport.call("update_weights_from_disk", body), "draft push (disk)")
            sent = sorted(weights)
        else:
            named = {n: t for n, t in weights.items() if n not in VOCAB_MAP_NAMES}
            collide = check_draft_push(named, self.target_param_names, routed=routed)
            if collide and not cfg.hold_shared_draft_names:
                raise WeightIsolationError(f"draft push would also overwrite target tensors {collide[:4]}; use a "
                                           f"server with the selector API, legacy_draft_flag or hold_shared_draft_names")
            self.last_push_held = collide
            named = [(n, t.detach().cpu()) for n, t in named.items() if n not in collide]
            self._send_tensors(named, selector, fields, "draft push")
            sent = [n for n, _ in named]
        self._pushed.update({n: weights[n].detach().to("cpu", copy=True) for n in sent})
        self.draft_version = version
        self.last_push = {"version": version, "sent": sent, "held": list(self.last_push_held)}

    # -- the co-training core's draft-receiver interface (rollout.protocol.DraftReceiver) ----------
    def install_draft(self, drafter, policy=None) -> None:
        """Speculate with `drafter` (an "eagle3" rollout.drafters.DrafterSpec): SGLang's
        speculation settings are its launch arguments (`rollout.sglang_args.sglang_server_args(...,
        spec)`), so only the weights move here (pushed as version 0). A per-step policy has no
        SGLang counterpart and is refused, as are drafters other than EAGLE-3."""
        if drafter.method not in self.capabilities.drafters:
            raise ValueError(f"SGLang speculates with EAGLE-3 drafts; got drafter {drafter.method!r}")
        if policy is not None:
            raise ValueError("SGLang speculates as its server arguments say; a per-step policy cannot be installed")
        self.spec = drafter.spec
        self.push_draft(drafter.draft, 0)

    @property
    def speculating(self) -> bool:
        return self.spec is not None

    def set_speculation(self, on: bool) -> None:
        """SGLang speculates as it was launched: there is no switch (capabilities.switch is None)."""
        if not on:
            raise ValueError("an SGLang server speculates as it was launched; it cannot switch its drafter off")

    def draft_weights(self) -> tuple[dict[str, torch.Tensor], int | None]:
        """The draft weights the engine holds (SGLang names, as last pushed) and their version."""
        return dict(self._pushed), self.draft_version

    @property
    def draft_faults(self) -> list[str]:
        """SGLangEngine absorbs no draft-side failure: a failed push raises to the caller (the
        co-training core counts it); SGLang itself keeps serving with its previous draft."""
        return []

    def _check_vocab_maps(self, weights: Mapping[str, torch.Tensor]) -> None:
        maps = {k: weights[k].detach().cpu() for k in VOCAB_MAP_NAMES if k in weights}
        if self._vocab_maps is None:
            self._vocab_maps = maps
            return
        for k, t in maps.items():
            old = self._vocab_maps.get(k)
            if old is not None and not torch.equal(old.to(t.dtype), t):
                raise WeightIsolationError(f"draft push changes the draft vocabulary map {k}; SGLang reads it once "
                                           f"at start: relaunch the engine with the new draft")
