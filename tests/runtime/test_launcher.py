"""`pipeloom train --nproc N --device cuda` spawns one rank per GPU, as torchrun would, and never
starts CUDA itself. What a CPU machine can check of that path: spawned ranks rebuild the spec
from the launcher's flags and train as forked ones do; the launcher refuses in one line, CUDA
untouched, where there is no GPU, and reports a rank's refusal in one line."""

from __future__ import annotations

from functools import partial

import pytest

torch = pytest.importorskip("torch")

from pipeloom.cli import build_parser, main  # noqa: E402
from pipeloom.cli.train import _flags_of, rank_spec, train_spec_from_args  # noqa: E402
from pipeloom.runtime.in_process import run_in_process  # noqa: E402
from pipeloom.runtime.local import run_local  # noqa: E402

pytestmark = pytest.mark.slow

FLAGS = ["train", "--nproc", "2", "zb-v", "-p", "2", "-m", "4", "--steps", "2", "--layers", "4", "--hidden", "32"]


def test_spawned_ranks_rebuild_the_spec_from_the_flags_and_train_as_forked_ones():
    args = build_parser().parse_args(FLAGS)
    spec = train_spec_from_args(args)
    spawned = run_local(spec, recipe=partial(rank_spec, _flags_of(args), None, False))
    here = run_in_process(spec)  # the forked ranks' bits (test_runtime's test_forked_ranks_give_the_in_process_bits)
    assert [r.losses for r in spawned] == [r.losses for r in here] and len(spawned[0].losses) == 2
    assert [r.static_bytes for r in spawned] == [r.static_bytes for r in here]


def test_cuda_without_a_gpu_is_refused_in_one_line_without_starting_cuda(capsys):
    assert main([*FLAGS, "--device", "cuda"]) == 2
    err = capsys.readouterr().err.strip()
    assert "no CUDA GPU" in err and len(err.splitlines()) == 1
    assert not torch.cuda.is_initialized()


def test_the_cuda_launcher_spawns_its_ranks_and_reports_their_refusal(monkeypatch, capsys):
    """The launcher believes in one GPU (patched here); the spawned rank, a fresh process, asks its
    own torch and refuses in one line, which the launcher reports."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    one = ["train", "--nproc", "1", "1f1b", "-p", "1", "-m", "2", "--steps", "1", "--layers", "1", "--device", "cuda"]
    assert main(one) == 2
    err = capsys.readouterr().err.strip()
    assert "rank 0 failed" in err and "no CUDA GPU" in err and len(err.splitlines()) == 1
    assert not torch.cuda.is_initialized()
    two = ["train", "--nproc", "2", "1f1b", "-p", "2", "-m", "2", "--layers", "2", "--device", "cuda"]
    assert main(two) == 2  # more ranks than GPUs
    assert "2 ranks need 2 GPUs, this machine has 1" in capsys.readouterr().err
