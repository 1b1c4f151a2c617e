"""model.compile: which blocks are found, how they are bound, and what the monitor reports (dynamo's eager
backend: capture and guards without code generation, so that this stays cheap)."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch import nn

from trainer.models.compiling import CompileMonitor, compile_denoiser, recompile_limit, repeated_blocks


class Block(nn.Module):
    def __init__(self, width: int = 4):
        super().__init__()
        self.inner = nn.Linear(width, width)
        self.parts = nn.ModuleList([nn.Linear(width, width), nn.Linear(width, width)])  # inside a block: not taken

    def forward(self, x):
        return self.parts[1](self.parts[0](self.inner(x).relu()))


class Down(nn.Module):
    def __init__(self):
        super().__init__()
        self.resnets = nn.ModuleList([Block(), Block()])


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block(), Block()])
        self.mixed = nn.ModuleList([Down(), nn.Identity()])  # mixed classes: looked into, not taken
        self.heads = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])  # leaves: not blocks

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def test_repeated_blocks_are_the_outermost_uniform_lists_of_non_leaves():
    net = Net()
    found = repeated_blocks(net)
    assert found == [*net.blocks, *net.mixed[0].resnets]
    assert repeated_blocks(net, declared=(Down,)) == [net.mixed[0]]


def test_compiled_blocks_share_one_function_and_copies_bind_their_own_weights():
    torch.manual_seed(0)
    net = Net()
    x = torch.randn(3, 4)
    expected = net(x)
    compiled = compile_denoiser(net, "blocks", backend="eager")
    assert len({b.forward.__func__ for b in compiled}) == 1
    assert [n for n, _ in net.state_dict().items()] == [n for n, _ in Net().state_dict().items()]
    torch.testing.assert_close(net(x), expected, rtol=0, atol=0)
    twin = copy.deepcopy(net)
    with torch.no_grad():
        for p in twin.parameters():
            p.mul_(2)
    assert not torch.equal(twin(x), net(x))  # the copy calls its own weights, not the original's
    torch.testing.assert_close(net(x), expected, rtol=0, atol=0)


def test_the_monitor_counts_recompiles_and_warns_at_a_fallback_to_eager(caplog):
    torch._dynamo.reset()
    net = Net()
    monitor = CompileMonitor(limit=1)
    compile_denoiser(net, "blocks", recompile_limit=1, backend="eager")
    x = torch.randn(2, 4, requires_grad=True)  # every block then sees an input that requires grad: one variant
    net(x)
    assert monitor.report()["compile_fallbacks"] == 0
    with caplog.at_level(logging.WARNING):
        with torch.no_grad():  # grad mode is guarded: a second variant, over the limit of 1
            net(x)
    report = monitor.report()
    assert report["compile_graphs"] >= 1 and report["compile_fallbacks"] == 1
    assert any("runs eagerly" in r.getMessage() and "recompile limit 1" in r.getMessage() for r in caplog.records)


def test_recompile_limit_counts_the_run_s_variants():
    # batch sizes {8, 10} with CFG doubling {8, 10, 16, 20}: 4 x grad x train mode x LoRA on/off = 32, doubled
    assert recompile_limit([8, 10, 8], reference_view=True) == 64
    assert recompile_limit([1], reference_view=False) == 16  # {1, 2} x grad x train mode = 8, doubled


def test_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="model.compile='fast': use one of none, blocks, full"):
        compile_denoiser(Net(), "fast")


class Widths(nn.Module):
    """One block class at two widths (a UNet's resnets), then one width three times (transformer blocks)."""

    def __init__(self):
        super().__init__()
        self.unet = nn.ModuleList([Block(4), Block(6)])
        self.transformer = nn.ModuleList([Wide(), Wide(), Wide()])


class Wide(Block):
    def forward(self, x):  # its own code: dynamo keeps compiled variants per code object
        return self.parts[0](self.inner(x).relu())


def test_blocks_of_several_widths_compile_for_static_shapes():
    """A block class at several widths compiles one graph per shape (inductor fails on a UNet's symbolic sizes)
    with a limit per instance; a class of one width becomes dynamic at its second shape, as torch does."""
    torch._dynamo.reset()
    net = Widths()
    monitor = CompileMonitor(limit=4)
    compile_denoiser(net, "blocks", recompile_limit=4, backend="eager")
    for batch in (1, 2, 3, 5):
        net.unet[0](torch.randn(batch, 4))
    static = monitor.report()["compile_graphs"]
    for batch in (1, 2, 3, 5):
        net.transformer[0](torch.randn(batch, 4))
    report = monitor.report()
    assert static == 4 and report["compile_graphs"] - static == 2, report  # dynamic from batch 2 on: 1, then s0
    assert report["compile_fallbacks"] == 0  # 4 shapes of the static class within its limit of 4 x 2 instances
