"""SGLang launch arguments for EAGLE speculation with specrl's draft.

Why a module of its own: every host pipeline (specrl's own launcher, slime's `--sglang-*` flags,
veRL's `engine_kwargs.sglang`) starts SGLang from the same few `ServerArgs` fields, and the
mapping from specrl's `SpecConfig` (chain depth, tree top-k and budget) to SGLang's
`speculative_*` fields must be written once. The field names were read from sglang 0.5.23's
`ServerArgs` (namespaces `spec` and `exec`); the upstream lane parses these arguments with
sglang's own argument parser (tests/test_upstream_sglang.py).
"""
from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping

from rollout.drafters import SpecConfig

SPEC_ALGORITHMS = ("EAGLE3", "EAGLE")


class SGLangArgsError(ValueError):
    """A speculative setting cannot be expressed as SGLang server arguments (one-line message)."""


def sglang_server_args(model_path: str, draft_path: str, spec: SpecConfig, *, algorithm: str = "EAGLE3",
                       cpu_backup: bool = True, extra: Mapping | None = None) -> dict:
    """SGLang `ServerArgs` fields for EAGLE speculation with specrl's draft.

    chain (gamma):  num_steps = gamma, eagle_topk = 1, num_draft_tokens = gamma + 1
    tree (gamma = depth, tree_topk, tree_budget):  num_steps = gamma, eagle_topk = tree_topk,
                    num_draft_tokens = tree_budget + 1 (SGLang counts the verified root token)
    `enable_draft_weights_cpu_backup` keeps the draft's weights across SGLang's memory release
    (RL engines release GPU memory during training; a draft without backup comes back empty).
    `extra` adds other ServerArgs fields; it may not override the derived speculative ones."""
    if not isinstance(spec, SpecConfig):
        raise SGLangArgsError(f"spec must be a rollout.drafters.SpecConfig, got {type(spec).__name__}")
    if algorithm not in SPEC_ALGORITHMS:
        raise SGLangArgsError(f"speculative algorithm must be one of {SPEC_ALGORITHMS}, got {algorithm!r}")
    for name, value in (("model_path", model_path), ("draft_path", draft_path)):
        if not isinstance(value, (str, os.PathLike)) or not str(value).strip():
            raise SGLangArgsError(f"{name} must be a non-empty path, got {value!r}")
    if spec.mode == "chain":
        topk, draft_tokens = 1, spec.gamma + 1
    else:
        if spec.tree_topk < 2:
            raise SGLangArgsError(f"tree mode needs tree_topk >= 2 (tree_topk=1 is a chain), got {spec.tree_topk}")
        most = spec.tree_topk + (spec.gamma - 1) * spec.tree_topk ** 2  # candidates SGLang can rank
        if spec.tree_budget > most:
            raise SGLangArgsError(f"tree_budget={spec.tree_budget} exceeds the {most} candidates a depth-"
                                  f"{spec.gamma}, top-{spec.tree_topk} tree offers")
        topk, draft_tokens = spec.tree_topk, spec.tree_budget + 1
    args = {
        "model_path": str(model_path),
        "speculative_algorithm": algorithm,
        "speculative_draft_model_path": str(draft_path),
        "speculative_num_steps": spec.gamma,
        "speculative_eagle_topk": topk,
        "speculative_num_draft_tokens": draft_tokens,
        "enable_draft_weights_cpu_backup": bool(cpu_backup),
    }
    for key, value in (extra or {}).items():
        if not isinstance(key, str) or not key.isidentifier():
            raise SGLangArgsError(f"extra server argument names must be identifiers, got {key!r}")
        if key in args and args[key] != value:
            raise SGLangArgsError(f"extra sets {key}={value!r}, which contradicts the derived {args[key]!r}")
        args[key] = value
    return args


def to_cli_args(args: Mapping, prefix: str = "--") -> list[str]:
    """Render server args as CLI flags: `speculative_num_steps=4` -> `--speculative-num-steps 4`.
    True is a bare flag, False and None are left out, lists become several values, dicts JSON."""
    out: list[str] = []
    for key, value in args.items():
        if not isinstance(key, str) or not key.isidentifier():
            raise SGLangArgsError(f"server argument names must be identifiers, got {key!r}")
        flag = prefix + key.replace("_", "-")
        if value is None or value is False:
            continue
        if value is True:
            out.append(flag)
        elif isinstance(value, (list, tuple)):
            out.append(flag)
            out.extend(str(v) for v in value)
        elif isinstance(value, dict):
            out.extend([flag, json.dumps(value)])
        elif isinstance(value, float) and not math.isfinite(value):
            raise SGLangArgsError(f"server argument {key} must be finite, got {value}")
        else:
            out.extend([flag, str(value)])
    return out


