"""common.core_lending: a roller's busy file, the trainer's threads from it, stale and malformed files."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from common.core_lending import BusyFlag, CoreLender


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_the_trainer_runs_with_its_threads_minus_those_of_the_rollers_decoding(tmp_path, threads):
    a, b = BusyFlag(tmp_path, "roller0", 2), BusyFlag(tmp_path, "roller1", 1)
    lender = CoreLender(tmp_path, 4)
    assert lender.apply() == 4 and torch.get_num_threads() == 4  # both idle
    a.set(True)
    assert lender.busy_threads() == 2 and lender.apply() == 2 and torch.get_num_threads() == 2
    b.set(True)
    assert lender.apply() == 1  # 4 - 3
    a.set(True)  # no change: nothing written
    BusyFlag(tmp_path, "roller2", 8).set(True)
    assert lender.apply() == 1 and torch.get_num_threads() == 1  # never below one thread
    for flag in (a, b):
        flag.close()
        flag.close()  # idempotent
    assert lender.busy_threads() == 8


def test_a_busy_file_of_a_process_that_is_gone_counts_as_idle(tmp_path, threads):
    code = ("import sys; from common.core_lending import BusyFlag; "
            "BusyFlag(sys.argv[1], 'roller0', 2).set(True)")  # exits busy, as a killed roller would
    subprocess.run([sys.executable, "-c", code, str(tmp_path)], check=True, cwd=os.getcwd())
    assert (tmp_path / "roller0").read_text().split()[0] == "2"
    assert CoreLender(tmp_path, 2).apply() == 2


def test_malformed_or_missing_files_count_as_idle(tmp_path, threads):
    (tmp_path / "junk").write_text("not numbers")
    (tmp_path / "empty").write_text("")
    (tmp_path / "subdir").mkdir()
    assert CoreLender(tmp_path, 3).busy_threads() == 0
    assert CoreLender(tmp_path / "absent", 3).apply() == 3
    with pytest.raises(ValueError, match="max_threads"):
        CoreLender(tmp_path, 0)


def test_the_forward_hook_sets_threads_before_each_forward_and_keeps_the_inputs(tmp_path, threads):
    flag = BusyFlag(tmp_path, "roller0", 1)
    lender = CoreLender(tmp_path, 2)
    seen: list[int] = []
    model = torch.nn.Linear(3, 3)
    model.register_forward_pre_hook(lender.hook)
    model.register_forward_pre_hook(lambda module, args: seen.append(torch.get_num_threads()))
    x = torch.ones(1, 3)
    expected = torch.nn.functional.linear(x, model.weight, model.bias)
    torch.testing.assert_close(model(x), expected)
    flag.set(True)
    model(x)
    flag.set(False)
    model(x)
    assert seen == [2, 1, 2]


class _Probe(torch.autograd.Function):
    """Identity whose backward records the threads it runs with (and may call ``on_backward``)."""

    @staticmethod
    def forward(ctx, x, seen, on_backward):
        ctx.seen, ctx.on_backward = seen, on_backward
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.seen.append(torch.get_num_threads())
        ctx.on_backward()
        return grad, None, None


class _Block(torch.nn.Module):
    def __init__(self, seen: list[int], on_backward):
        super().__init__()
        self.linear, self.seen, self.on_backward = torch.nn.Linear(3, 3), seen, on_backward

    def forward(self, x):
        self.seen.append(torch.get_num_threads())
        return _Probe.apply(self.linear(x), self.seen, self.on_backward)


def test_attached_blocks_re_decide_before_each_forward_and_each_backward(tmp_path, threads):
    """``attach``: a roller turning busy between two blocks' forwards, between forward and backward, or
    between two blocks' backwards changes the threads of the very next block."""
    flag = BusyFlag(tmp_path, "roller0", 1)
    lender = CoreLender(tmp_path, 2)
    seen: list[int] = []
    toggles = iter([lambda: flag.set(False), lambda: None])  # block 1's backward ends the roller's decoding
    second = _Block(seen, lambda: next(toggles)())
    first = _Block(seen, lambda: None)
    model = torch.nn.Sequential(first, torch.nn.Identity(), second)
    lender.attach(model, [first, second])
    first.register_forward_hook(lambda module, args, out: flag.set(True))  # busy from block 1 on
    out = model(torch.ones(2, 3, requires_grad=True))
    assert seen == [2, 1]  # forwards: block 0 idle, block 1 busy
    out.sum().backward()
    assert seen == [2, 1, 1, 2]  # backwards: block 1 still busy, block 0 after the roller went idle
    assert torch.get_num_threads() == 2
