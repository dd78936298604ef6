"""`--device auto` picks cuda when torch sees a GPU and cpu otherwise, for every command that
takes --device; other device names pass through unchanged."""

from __future__ import annotations

import pytest
import torch

from poslens import cli
from poslens.limits import resolve_device


@pytest.mark.parametrize("available,want", [(False, "cpu"), (True, "cuda")])
def test_auto_follows_cuda_availability(
    available: bool, want: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: available)
    assert resolve_device("auto") == want
    assert resolve_device("cpu") == "cpu" and resolve_device("cuda:1") == "cuda:1"


@pytest.mark.parametrize(
    "argv",
    [
        ["train", "--out", "o"],
        ["analyze", "ckpt", "--out", "o"],
        ["sae", "train", "ckpt", "--out", "o"],
        ["study", "--out", "o"],
    ],
)
def test_every_device_flag_resolves_auto_before_the_command_runs(
    argv: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    seen: list[str] = []
    parser = cli.build_parser()
    args = parser.parse_args([*argv, "--device", "auto"])
    monkeypatch.setattr(cli, "build_parser", lambda: _Fixed(args, seen))
    assert cli.main([]) == 0
    assert seen == ["cpu"]


class _Fixed:
    """A parser stand-in returning pre-parsed args whose command records the device it got."""

    def __init__(self, args: object, seen: list[str]) -> None:
        self.args, self.seen = args, seen

    def parse_args(self, argv: object) -> object:
        self.args.fn = lambda a: self.seen.append(a.device) or 0  # type: ignore[attr-defined]
        return self.args
