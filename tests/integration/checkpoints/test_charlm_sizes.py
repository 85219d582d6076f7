"""examples/charlm.py's --size: the 200m preset is ~200M parameters, flags override a preset.

The model is built on the meta device: its shapes without its memory.
"""

from __future__ import annotations

import pytest
import torch

from examples.charlm import CharLM, parse_args


def parameters(argv: list[str]) -> int:
    args = parse_args(["--checkpoint-dir", "/unused", *argv])
    with torch.device("meta"):
        model = CharLM(block_size=args.block_size, n_layer=args.n_layer, n_head=args.n_head,
                       d_model=args.d_model)
    return sum(p.numel() for p in model.parameters())


def test_the_200m_size_is_about_200_million_parameters() -> None:
    assert parameters(["--size", "200m"]) == pytest.approx(200e6, rel=0.05)


def test_the_default_size_is_the_small_model() -> None:
    assert parameters([]) == parameters(["--size", "small"]) < 5e6


def test_a_flag_overrides_the_preset() -> None:
    args = parse_args(["--checkpoint-dir", "/unused", "--size", "200m", "--n-layer", "2"])
    assert (args.n_layer, args.d_model, args.block_size) == (2, 1024, 512)
