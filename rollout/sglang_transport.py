"""How specrl talks to SGLang: HTTP or an in-process `sglang.Engine`, and the weight-update protocol.

Why one place: a policy sync and a draft push are each one exchange whose shape depends on the
server's version, and getting it wrong is silent (SGLang's HTTP schema ignores unknown fields).

The protocol read from sglang 0.5.23 (`entrypoints/http_server.py`, `managers/io_struct.py`,
`managers/scheduler_components/weight_updater.py`):
- `POST /begin_weight_update {"selector": S}` opens a session (one at a time), then
  `POST /update_weights_from_tensor {..., "selector": S}` loads named tensors into the runners S
  names ("target", "draft" or "all"), then `POST /end_weight_update {}` closes it. An update sent
  with no open session fails ("must run between begin_weight_update() and end_weight_update()").
- `update_weights_from_disk` has no `selector` and loads the folder into every runner.
- The in-process `Engine.begin_weight_update(selector)` exists, but
  `Engine.update_weights_from_tensor(named_tensors, load_format, flush_cache)` takes no selector;
  specrl then sends sglang's own `UpdateWeightsFromTensorReqInput` through the engine's tokenizer
  manager, the same call the Engine method makes, with the selector set.

Older servers (no session endpoints, no `selector`) are "legacy": a policy sync is isolated only
by a request field the user names (`SGLangEngineConfig.legacy_policy_flag`, e.g. a patched
server's `disable_draft_model`), else refused unless the user opts in and the loader guard passes.
"""
from __future__ import annotations

import inspect
import json
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping

import torch

from rollout.sglang_weights import WeightIsolationError

# First version read with sessions and `selector` on weight updates; "auto" trusts the selector
# API from this version on (older ones are treated as legacy, see module docstring).
SELECTOR_API_VERSION = (0, 5, 23)


class EndpointMissing(RuntimeError):
    """The server has no such endpoint (HTTP 404): an older SGLang."""


def parse_version(text: str) -> tuple[int, ...]:
    """(0, 5, 23) from "0.5.23" / "0.5.23.post1" / "0.5.23rc1" (the leading numeric fields)."""
    out = []
    for part in str(text).split("."):
        digits = ""
        for ch in part:
            if not ch.isdigit():
                break
            digits += ch
        if not digits:
            break
        out.append(int(digits))
        if len(digits) != len(part):
            break
    if not out:
        raise ValueError(f"cannot read a version from {text!r}")
    return tuple(out)


class HTTPTransport:
    """JSON to a running SGLang server or router (stdlib urllib, no extra dependency)."""

    def __init__(self, base_url: str, timeout_s: float = 600.0):
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must start with http:// or https://, got {base_url!r}")
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s

    def _send(self, endpoint: str, data: bytes | None, method: str):
        req = urllib.request.Request(f"{self.base_url}/{endpoint}", data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                return json.loads(resp.read().decode() or "null")
        except urllib.error.HTTPError as e:
            detail = e.read().decode(errors="replace")[:200]
            if e.code == 404:
                raise EndpointMissing(f"SGLang has no /{endpoint} (HTTP 404)") from None
            try:  # SGLang answers a refused weight update with HTTP 400 and {"success": false, ...}
                body = json.loads(detail)
                if isinstance(body, dict) and "success" in body:
                    return body
            except ValueError:
                pass
            raise RuntimeError(f"SGLang {endpoint} failed: HTTP {e.code} {detail}") from None
        except urllib.error.URLError as e:
            raise RuntimeError(f"SGLang {endpoint} unreachable at {self.base_url}: {e.reason}") from None

    def call(self, endpoint: str, body: dict):
        return self._send(endpoint, json.dumps(body).encode(), "POST")

    def server_version(self) -> tuple[int, ...] | None:
        """The server's version from /server_info (or the older /get_server_info); None if absent."""
        for endpoint in ("server_info", "get_server_info"):
            try:
                info = self._send(endpoint, None, "GET")
            except EndpointMissing:
                continue
            version = info.get("version") if isinstance(info, Mapping) else None
            return parse_version(version) if version else None
        return None


class InProcessTransport:
    """Calls the methods of an in-process `sglang.Engine` with the bodies the HTTP API takes.

    Keyword arguments the installed Engine method does not accept are refused, not dropped: a
    missing `selector` must not silently turn into a sync that reaches the draft. The one known
    gap (0.5.23's `Engine.update_weights_from_tensor` has no `selector`) is bridged as the module
    docstring says."""

    def __init__(self, engine):
        self.engine = engine

    def server_version(self) -> tuple[int, ...] | None:
        try:
            import sglang
        except ImportError:
            return None
        return parse_version(sglang.__version__)

    def call(self, endpoint: str, body: dict):
        body = dict(body)
        if endpoint == "update_weights_from_tensor":
            body["named_tensors"] = body.pop("named_tensors_local")
            body.pop("serialized_named_tensors", None)
        fn = getattr(self.engine, endpoint, None)
        if fn is None:
            raise EndpointMissing(f"sglang.Engine has no {endpoint}")
        accepted = inspect.signature(fn).parameters
        if any(p.kind is p.VAR_KEYWORD for p in accepted.values()):
            return fn(**body)
        unknown = sorted(set(body) - set(accepted))
        if not unknown:
            return fn(**body)
        if endpoint == "update_weights_from_tensor" and "selector" in unknown:
            return self._tensor_update_with_selector(body)  # its request type has every field we send
        raise WeightIsolationError(f"sglang.Engine.{endpoint} does not accept {unknown}")

    def _tensor_update_with_selector(self, body: dict):
        """The request `Engine.update_weights_from_tensor` builds, plus the selector it lacks."""
        eng = self.engine
        needed = ("tokenizer_manager", "loop", "_serialize_tensors_per_rank")
        missing = [a for a in needed if not hasattr(eng, a)]
        if missing:
            raise WeightIsolationError(f"sglang.Engine.update_weights_from_tensor takes no selector and this "
                                       f"Engine lacks {missing} to send one another way")
        from sglang.srt.managers.io_struct import UpdateWeightsFromTensorReqInput  # lazy: sglang is optional

        serialized = eng._serialize_tensors_per_rank(body["named_tensors"], body.get("load_format"))
        fields = {k: v for k, v in body.items() if k != "named_tensors"}
        req = UpdateWeightsFromTensorReqInput(serialized_named_tensors=serialized, **fields)
        return eng.loop.run_until_complete(eng.tokenizer_manager.update_weights_from_tensor(req, None))


def default_serializer(named: list[tuple[str, torch.Tensor]]) -> str:
    """SGLang's own serialization for update_weights_from_tensor over HTTP (needs sglang)."""
    from sglang.srt.utils import MultiprocessingSerializer  # lazy: sglang is optional

    return MultiprocessingSerializer.serialize(named, output_str=True)


def check_reply(resp, what: str) -> None:
    """Raise unless an SGLang reply says success ({"success": true}, (True, msg) or True)."""
    ok = resp.get("success") if isinstance(resp, Mapping) else (resp[0] if isinstance(resp, tuple) else resp)
    if ok is not True:
        msg = resp.get("message") if isinstance(resp, Mapping) else resp
        raise RuntimeError(f"SGLang {what} failed: {msg}")


def in_session(transport, selector: str, send: Callable[[], object], what: str):
    """Run `send` inside a begin/end weight-update session for `selector`; the session is closed
    even when the update fails, so the server is never left holding it."""
    check_reply(transport.call("begin_weight_update", {"selector": selector}), f"{what} (begin_weight_update)")
    try:
        reply = send()
        check_reply(reply, what)
    finally:
        end = transport.call("end_weight_update", {})
    check_reply(end, f"{what} (end_weight_update)")
    return reply
