"""Importing the real upstream packages in the lane tests (sglang, verl, miles).

A lane test must FAIL when its lane runs (`SPECRL_LANE` names it) and the package is missing, and
skip elsewhere (the base lane has none of these packages).

sglang 0.5.23 on CPU: its `sglang.srt` modules import torchvision (multimodal configs), and the
torchvision wheel on PyPI is a CUDA build whose C++ ops fail to load against the CPU torch
("operator torchvision::nms does not exist" while torchvision registers fake kernels for them).
`import_sglang` declares the two op schemas torchvision registers unconditionally, so its pure
Python part imports; no torchvision op is ever called by the code under test.
"""
from __future__ import annotations

import importlib
import os

import pytest


def _lane_import(lane: str, module: str):
    if os.environ.get("SPECRL_LANE") == lane:
        return importlib.import_module(module)  # the lane's venv must have it: fail, do not skip
    try:
        return importlib.import_module(module)
    except ImportError as e:
        pytest.skip(f"{module} not installed ({e}); run tests/lanes/{lane}.sh")


def _declare_torchvision_ops() -> None:
    import torch

    try:
        lib = torch.library.Library("torchvision", "DEF")
        lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        lib.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    except RuntimeError:
        return  # declared already (a working torchvision build, or an earlier call)
    _declare_torchvision_ops.lib = lib  # keep the library alive


def import_sglang(module: str):
    """`module` from the installed sglang (the sglang lane installs 0.5.23)."""
    _declare_torchvision_ops()
    return _lane_import("sglang", module)


def import_verl(module: str):
    """`module` from the installed verl (the verl lane installs 0.9.1)."""
    return _lane_import("verl", module)


def import_miles(module: str):
    """`module` from the installed Miles (the miles lane installs miles-rl 0.0.2)."""
    return _lane_import("miles", module)


def import_areal(module: str):
    """`module` from the installed AReaL (the areal lane installs areal 1.0.4 without its dependencies)."""
    return _lane_import("areal", module)
