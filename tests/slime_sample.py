"""A HAND COPY of slime's `Sample` (fields, defaults, nesting; methods left out), for the slime tests.

Copied from THUDM/slime `slime/utils/types.py` at commit 0d234f3e3a83c81b7d37209994e0b994deacbb24.
slime's own class cannot be installed here: THUDM/slime is not on PyPI (the PyPI package named
`slime` is an unrelated mixed-effects-model library). Its fork Miles, which keeps slime's hook
names, is (`miles-rl`): tests/test_upstream_miles.py checks this copy field by field, and runs
specrl's `generate`, against Miles' real `Sample` in the miles lane (tests/lanes/miles.sh).
Only dataclasses here, so the lane can import it without specrl's trainer-side packages.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any


@dataclass
class Sample:  # slime's Sample (fields only; methods not needed by the contract)
    group_index: int | None = None
    index: int | None = None
    prompt: str | list[dict[str, str]] = ""
    tokens: list[int] = field(default_factory=list)
    multimodal_inputs: dict[str, Any] | None = None
    multimodal_train_inputs: dict[str, Any] | None = None
    response: str = ""
    response_length: int = 0
    label: str | None = None
    reward: float | dict[str, Any] | None = None
    loss_mask: list[int] | None = None
    weight_versions: list[str] = field(default_factory=list)
    rollout_log_probs: list[float] | None = None
    rollout_routed_experts: list[list[int]] | None = None
    remove_sample: bool = False
    teacher_log_probs: list[float] | None = None
    mopd_teacher_log_probs: dict[str, list[float]] | None = None

    class Status(Enum):
        PENDING = "pending"
        COMPLETED = "completed"
        TRUNCATED = "truncated"
        ABORTED = "aborted"
        FAILED = "failed"

    status: Status = Status.PENDING
    metadata: dict = field(default_factory=dict)
    generate_function_path: str | None = None
    train_metadata: dict | None = None
    session_id: str | None = None
    non_generation_time: float = 0.0

    @dataclass
    class SpecInfo:
        spec_accept_token_num: int = 0
        spec_draft_token_num: int = 0
        spec_verify_ct: int = 0
        completion_token_num: int = 0

    spec_info: SpecInfo = field(default_factory=SpecInfo)

    @dataclass
    class PrefixCacheInfo:
        cached_tokens: int = 0
        total_prompt_tokens: int = 0

    prefix_cache_info: PrefixCacheInfo = field(default_factory=PrefixCacheInfo)
