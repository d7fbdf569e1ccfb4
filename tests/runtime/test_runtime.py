"""The runtime: every schedule trains exactly like one process.

Correctness runs every device in this process (`run_in_process`, the ranks' own code with
messages in memory); forked gloo ranks are kept for what only they show — the transport giving
the same bits, data parallelism, a dead or stalled peer, the CLI and torchrun."""

import gc
import json
import multiprocessing
import os
import re
import signal
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from helpers.runtime import (  # noqa: E402
    assert_matches_reference,
    assert_same_results,
    tiny_spec,
    trains_like_one_process,
)

from pipeloom import Costs, OpKind, Schedule, build_schedule, simulate  # noqa: E402
from pipeloom.errors import ConfigError, RuntimeFault, ScheduleError  # noqa: E402
from pipeloom.models.llama import LlamaConfig  # noqa: E402
from pipeloom.passes import (  # noqa: E402
    apply_checkpoint,
    fold_lone_w,
    fold_w_at_once,
    mario,
    split_backward,
    t_recomp,
    weight_parts,
)
from pipeloom.runtime import local  # noqa: E402
from pipeloom.runtime.in_process import run_in_process  # noqa: E402
from pipeloom.runtime.local import _worker, run_local  # noqa: E402
from pipeloom.runtime.training import TrainSpec, check_spec, train_rank  # noqa: E402

pytestmark = pytest.mark.slow

GENERATORS = {
    "gpipe": {},
    "1f1b": {},
    "interleaved": {"num_chunks": 2},
    "chimera": {},
    "chimera-eager": {},
    "dualpipe": {},
    "dualpipev": {},
    "zb-h1": {},
    "zb-h2": {},
    "zb-auto": {"mem_limit": 3},
    "zb-1p": {},
    "zb-2p": {},
    "zb-v": {},
    "v-half": {},
    "v-min": {},
    "v-auto": {"mem_limit": 2},
    "tpipe": {"num_chunks": 2},
    "svpp": {"num_chunks": 2, "num_slices": 2},
    "terapipe": {"num_slices": 2},
}


spec_for = tiny_spec


FORWARD_ONLY = {"forward"}
"""Generators that train nothing (evaluation runs them: tests/runtime/test_run_features.py)."""


def test_registry_is_covered():
    from pipeloom import list_generators

    assert {g.name for g in list_generators()} == set(GENERATORS) | FORWARD_ONLY


@pytest.mark.parametrize("name", sorted(GENERATORS))
@pytest.mark.parametrize("p, m", [(2, 4), (4, 6)])
def test_every_generator_trains_like_one_process(name, p, m):
    if name == "interleaved" and m % p:
        m = 2 * p
    if name.startswith("chimera") and m % 2:
        m += 1
    if name == "dualpipev":
        m = max(m, 2 * p - 1)
    schedule = build_schedule(name, p, m, **GENERATORS[name])
    trains_like_one_process(spec_for(schedule, steps=2))


@pytest.mark.parametrize(
    "name, options, dp",
    [("chimera", {}, 1), ("dualpipev", {}, 1), ("svpp", {"num_chunks": 2, "num_slices": 2}, 1), ("zb-v", {}, 2)],
)
def test_forked_ranks_give_the_in_process_bits(name, options, dp):
    """The in-process tier is the gloo path without the transport: the same spec forked into
    ranks gives bit-identical parameters and the same losses (Chimera's cross-device sums, a
    V-shape's hand-over in memory, overlapped pairs, slices, data-parallel replicas)."""
    spec = spec_for(build_schedule(name, 2, 4, **options), steps=2, dp=dp)
    forked = run_local(spec)
    assert_same_results(forked, run_in_process(spec))
    if dp > 1:  # each stage's all-reduce started as its last backward ended, the other stage still to run
        for result in forked:
            record, device = result.records[-1], spec.parallelism.layout.coords(result.rank)[1]
            last_end = max(end for _, _, end in record.ops)
            starts = dict(record.grad_sync_starts)
            assert sorted(starts) == sorted((s,) for s in spec.schedule.stages_on(device))
            assert min(starts.values()) < last_end


def test_forked_ranks_leave_the_launchers_objects_out_of_their_collections(monkeypatch, tmp_path):
    """A rank's full collection would walk every object it inherited and copy every page they
    lie on: each rank freezes them as it starts."""
    launchers = [[i] for i in range(50_000)]  # objects the launcher's collector tracks (lists always are)

    def noting(spec, rank, *args, **kwargs):
        (tmp_path / f"rank{rank}").write_text(str(len(gc.get_objects())))
        return train_rank(spec, rank, *args, **kwargs)

    monkeypatch.setattr(local, "train_rank", noting)
    run_local(spec_for(build_schedule("1f1b", 2, 2), steps=1))
    tracked = [int((tmp_path / f"rank{rank}").read_text()) for rank in range(2)]
    assert max(tracked) < len(launchers) / 10  # what the rank made itself, not what it inherited


def test_in_process_refuses_what_needs_ranks():
    with pytest.raises(ConfigError, match="ZeRO, clipping need one process per rank; use run_local"):
        run_in_process(spec_for(build_schedule("1f1b", 2, 4), dp=2, zero=1, clip_norm=1.0))


def test_in_process_takes_a_cuda_spec_with_every_device_on_one_gpu(monkeypatch):
    """As far as a CPU can follow it: the spec is accepted (no GPU: refused for that reason only),
    and with the GPU stood in for by the CPU, every rank of a DualPipeV schedule — pairs, W, two
    stages a device — runs on the one device the spec names and trains like one process."""
    schedule = build_schedule("dualpipev", 2, 4)
    spec = spec_for(schedule, steps=2, device="cuda", backend="nccl")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="no CUDA GPU"):
            run_in_process(spec)
    import pipeloom.runtime.rank as rank_module
    import pipeloom.runtime.spec_checks as checks

    placed: list[str] = []

    def one_gpu(spec):
        placed.append(spec.torch_device_type)
        return torch.device("cpu")

    monkeypatch.setattr(checks.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(rank_module, "torch_device_of", one_gpu)
    results = run_in_process(spec)
    assert placed == ["cuda"] * 2
    assert_matches_reference(spec_for(schedule, steps=2), results)


def test_checkpointed_overlapped_pairs_train_like_one_process():
    """Each R runs just before the pair whose backward needs it; the pair's forward is checkpointed."""
    schedule = apply_checkpoint(build_schedule("dualpipev", 2, 4))
    assert any(op.overlap_next and op.ckpt for _, _, op in schedule.ops())
    assert_matches_reference(spec_for(schedule, steps=2), run_in_process(spec_for(schedule, steps=2)))


def test_split_and_concatenated_weight_gradients_match_fused():
    fused = build_schedule("1f1b", 2, 4)
    spec = spec_for(fused, steps=2)
    for split in (split_backward(fused, "after"), split_backward(fused, "deferred", batch=True)):
        for concat in (False, True):
            results = run_in_process(spec_for(split, steps=2, concat_w=concat))
            assert_matches_reference(spec, results)


def test_checkpointing_recomputes_once_and_holds_what_the_simulator_predicts():
    base = build_schedule("1f1b", 4, 8)
    plain = run_in_process(spec_for(base, steps=1))
    kept = None
    for checkpointed in (apply_checkpoint(base), mario(base, Costs(F=1, B=2, R=1))):
        results = run_in_process(spec_for(checkpointed, steps=1))
        assert_matches_reference(spec_for(base, steps=1), results)
        for device, result in enumerate(results):
            planned = sum(op.kind is OpKind.R for op in checkpointed.devices[device])
            assert result.records[0].recomputes == planned
        # The simulator, given the bytes one forward and one kept input take per stage, predicts
        # the ratio of peak stash bytes between the checkpointed and the plain schedule.
        forward = [plain[s].records[0].entry_bytes[f"{s}F0"] for s in range(4)]
        kept = kept or [results[s].records[0].entry_bytes[f"{s}F0c"] for s in range(4)]  # from full checkpointing
        costs = Costs(M_B=forward, M_ckpt=kept)
        predicted_plain = simulate(base, costs).peak_activation_memory
        predicted = simulate(checkpointed, costs).peak_activation_memory
        for device in range(4):
            measured_ratio = results[device].records[0].peak_stash_bytes / plain[device].records[0].peak_stash_bytes
            predicted_ratio = predicted[device] / predicted_plain[device]
            assert measured_ratio == pytest.approx(predicted_ratio, rel=0.05), (checkpointed.name, device)
            assert results[device].records[0].peak_stash_bytes <= plain[device].records[0].peak_stash_bytes


def test_partial_recompute_trains_like_one_process_and_holds_what_the_simulator_predicts():
    """Megatron's --recompute-num-layers: a checkpointed forward drops only its stage's first k
    layers; the simulator's recompute_fraction = k / layers predicts what the stash then holds."""
    config = LlamaConfig(layers=8, hidden=32, heads=2, ffn=64, vocab=64, seq_len=16)
    base = build_schedule("1f1b", 2, 4)
    checkpointed = apply_checkpoint(base)
    plain = run_in_process(TrainSpec(base, config=config, steps=1))
    full = run_in_process(TrainSpec(checkpointed, config=config, steps=1))
    forward = [plain[s].records[0].entry_bytes[f"{s}F0"] for s in range(2)]
    kept = [full[s].records[0].entry_bytes[f"{s}F0c"] for s in range(2)]
    for layers in (1, 3):
        spec = TrainSpec(checkpointed, config=config, steps=2, recompute_layers=layers)
        results = run_in_process(spec)
        assert_matches_reference(TrainSpec(base, config=config, steps=2), results)
        assert [r.records[0].recomputes for r in results] == [4, 4]
        costs = Costs(M_B=forward, M_ckpt=kept, recompute_fraction=layers / 4)
        predicted, predicted_plain = (simulate(s, costs).peak_activation_memory for s in (checkpointed, base))
        measured = results[0].records[0].peak_stash_bytes / plain[0].records[0].peak_stash_bytes
        assert measured == pytest.approx(predicted[0] / predicted_plain[0], rel=0.05)
        assert full[0].records[0].peak_stash_bytes < results[0].records[0].peak_stash_bytes
        assert results[0].records[0].peak_stash_bytes < plain[0].records[0].peak_stash_bytes


def test_tpipe_with_trecomp_trains_like_one_process_and_holds_what_the_simulator_predicts():
    base = build_schedule("tpipe", 2, 6)
    recomputed = t_recomp(base)
    plain = run_in_process(spec_for(base, steps=1))
    results = run_in_process(spec_for(recomputed, steps=1))
    assert_matches_reference(spec_for(base, steps=1), results)
    entries = [plain[s % 2].records[0].entry_bytes[f"{s}F0"] for s in range(4)]
    kept = [results[s % 2].records[0].entry_bytes.get(f"{s}F0c", 0) for s in range(4)]
    costs = Costs(M_B=entries, M_ckpt=[kept[s] if s < 2 else 0 for s in range(4)])
    predicted_plain = simulate(base, costs).peak_activation_memory
    predicted = simulate(recomputed, costs).peak_activation_memory
    for device in range(2):
        measured = results[device].records[0].peak_stash_bytes / plain[device].records[0].peak_stash_bytes
        assert measured == pytest.approx(predicted[device] / predicted_plain[device], rel=0.05)
        assert measured < 1


def mlp_blocks():
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(7)
    try:
        return [torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh()) for _ in range(4)]
    finally:
        torch.random.set_rng_state(generator_state)


def regression_batch(rows, step):
    generator = torch.Generator().manual_seed(100 + step)
    x = torch.randn(rows, 8, generator=generator)
    return x, x.flip(-1)


def mlp_workload(last: Callable[[], torch.nn.Module] | None = None):
    """The MLP blocks on the regression data, with `last()` appended when given (a block that
    marks, kills or stalls a rank)."""
    from pipeloom.models.workload import blocks_workload

    def blocks():
        return [*mlp_blocks(), *([last()] if last is not None else [])]

    return blocks_workload(blocks, regression_batch, torch.nn.functional.mse_loss, (3, 8), microbatch_size=3)


def test_any_list_of_blocks_trains_like_one_process():
    work = mlp_workload()
    for schedule in (build_schedule("1f1b", 2, 4), build_schedule("zb-h1", 4, 4)):
        spec = TrainSpec(schedule, steps=2, workload=work)
        assert_matches_reference(spec, run_in_process(spec))


@pytest.mark.parametrize("name", ["1f1b", "chimera"])
def test_data_parallel_times_pipeline_matches_reference(name):
    """Chimera's two copies of a stage and the data-parallel copies all reduce together."""
    spec = spec_for(build_schedule(name, 2, 4), steps=2, dp=2)
    assert_matches_reference(spec, run_local(spec))


class _MarksItsCalls(torch.nn.Module):
    """Passes its input through; each call on rank 1 leaves a file: training has begun there."""

    def __init__(self, directory: str) -> None:
        super().__init__()
        self.marker = Path(directory, "rank1-trains")

    def forward(self, x):
        import torch.distributed as dist

        if dist.is_initialized() and dist.get_rank() == 1:
            self.marker.touch()
        return x


def test_a_killed_rank_makes_the_others_fail_without_hanging():
    with tempfile.TemporaryDirectory() as directory:
        work = mlp_workload(lambda: _MarksItsCalls(directory))
        spec = TrainSpec(build_schedule("1f1b", 2, 4), steps=10_000, workload=work, timeout_s=30)
        context = multiprocessing.get_context("fork")
        ranks = [context.Process(target=_worker, args=(spec, rank, 2, directory)) for rank in range(2)]
        for process in ranks:
            process.start()
        deadline = time.monotonic() + 60
        while not Path(directory, "rank1-trains").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.2)  # a few steps in: both ranks past the rendezvous
        assert all(process.is_alive() for process in ranks)
        os.kill(ranks[1].pid, signal.SIGKILL)
        ranks[0].join(45)
        assert not ranks[0].is_alive(), "the surviving rank hung"
        assert ranks[0].exitcode not in (0, None)
        reason = Path(directory, "rank0.error").read_text()
        # who failed, and on whom it waited: the peer of a receive or send, or the ranks of a collective
        assert reason.startswith("rank 0") and re.search(r"rank 1\b|ranks \[0, 1\]", reason), reason


class _OnRankOne(torch.nn.Module):
    """Passes its input through; on rank 1, from its fourth call on (a few steps in, both ranks past
    the rendezvous), first does `act`: kill the rank outright, or stall it."""

    def __init__(self, act) -> None:
        super().__init__()
        self.act, self.calls = act, 0

    def forward(self, x):
        import torch.distributed as dist

        self.calls += 1
        if dist.is_initialized() and dist.get_rank() == 1 and self.calls > 3:
            self.act()
        return x


def _killed() -> None:  # as the OOM killer ends a process: no handler, no reason on file
    os.kill(os.getpid(), signal.SIGKILL)


def _stalled() -> None:
    time.sleep(600)


def _crashed() -> None:  # as a fault inside a C library ends a process
    import ctypes

    ctypes.string_at(0)


def test_a_rank_killed_outright_is_the_one_reported():
    """Its peer then fails on the closed connection and leaves a reason; the launcher used to
    report that echo ("rank 0 failed") and not the rank that was killed."""
    work = mlp_workload(lambda: _OnRankOne(_killed))
    with pytest.raises(RuntimeFault, match=r"^rank 1 failed: killed by SIGKILL$"):
        run_local(TrainSpec(build_schedule("1f1b", 2, 4), steps=3, workload=work, timeout_s=30), timeout_s=120)


def test_a_rank_that_crashes_is_reported_with_the_frame_it_died_in():
    """A segmentation fault leaves no reason on file: the rank's own stacks, written as it died,
    say where (the innermost frame, and the innermost of pipeloom's on the way to it)."""
    work = mlp_workload(lambda: _OnRankOne(_crashed))
    where = r"in string_at \(__init__\.py:\d+\) from \w+ \(\w+\.py:\d+\)"
    with pytest.raises(RuntimeFault, match=rf"^rank 1 failed: killed by SIGSEGV {where}$"):
        run_local(TrainSpec(build_schedule("1f1b", 2, 4), steps=3, workload=work, timeout_s=30), timeout_s=120)


def test_a_stalled_rank_makes_the_others_fail_within_the_timeout():
    work = mlp_workload(lambda: _OnRankOne(_stalled))
    spec = TrainSpec(build_schedule("1f1b", 2, 4), steps=3, workload=work, timeout_s=1.5)
    began = time.monotonic()
    with pytest.raises(RuntimeFault) as failure:
        run_local(spec, timeout_s=120)
    assert time.monotonic() - began < 60, "the stalled peer was not detected by the timeout"
    reason = str(failure.value)
    assert reason.startswith("rank 0 failed: rank 0") and "from rank 1" in reason, reason


def test_the_run_deadline_grows_with_its_steps_and_evaluations():
    """The Python API ended any run longer than 300 s as "did not finish", and the CLI one with
    many evaluation batches: both now allow the per-step deadline for each step and each held-out
    batch their evaluations run."""
    from pipeloom.runtime.local import run_deadline_s

    schedule = build_schedule("1f1b", 2, 2)
    assert run_deadline_s(TrainSpec(schedule, steps=1000)) == 60.0 * 1000
    evaluated = TrainSpec(schedule, steps=10, timeout_s=2.0, eval_every=2, eval_batches=50)
    assert run_deadline_s(evaluated) == 2.0 * (10 + 5 * 50)


def test_bad_runs_are_refused_before_any_compute():
    with pytest.raises(ConfigError, match="world size 3 does not match p × dp × tp = 2 × 1 × 1 = 2"):
        check_spec(spec_for(build_schedule("1f1b", 2, 2)), world_size=3)
    with pytest.raises(ConfigError, match="cannot be cut into 8 stages"):
        check_spec(TrainSpec(build_schedule("zb-v", 4, 4), config=LlamaConfig(layers=4)))
    with pytest.raises(ConfigError, match="does not split into 3 equal slices"):
        check_spec(spec_for(build_schedule("svpp", 2, 2, num_slices=3)))
    broken = Schedule.from_text("0F0 0BW0\n1BW0 1F0")  # deadlocks
    with pytest.raises(ScheduleError, match="deadlock"):
        check_spec(spec_for(broken))


def test_cli_train_writes_summary_and_trace(tmp_path):
    from pipeloom.cli import main

    summary, trace = tmp_path / "s.json", tmp_path / "t.json"
    argv = ["train", "--nproc", "2", "--schedule", "1f1b", "-p", "2", "-m", "2", "--steps", "2", "--layers", "2"]
    assert main([*argv, "--summary", str(summary), "--trace", str(trace)]) == 0
    facts = json.loads(summary.read_text())
    assert len(facts["losses"]) == 2 and len(facts["peak_stash_bytes"]) == 2 and facts["recomputes"] == [0, 0]
    events = json.loads(trace.read_text())["traceEvents"]
    assert {e["tid"] for e in events if e["ph"] == "X"} == {0, 1}
    assert main(["train", "--nproc", "3", "--schedule", "1f1b", "-p", "2", "-m", "2"]) == 2


def test_torchrun_launch(tmp_path, monkeypatch, capsys):
    """torchrun (its entry point forked here; its ranks fresh interpreters, as it starts them)."""
    import socket

    from torch.distributed.run import main as torchrun

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    summary = tmp_path / "s.json"
    argv = ["--nproc-per-node", "2", "--master-port", str(port), "-m", "pipeloom.train", "--schedule", "zb-v"]
    argv += ["-p", "2", "-m", "4", "--steps", "2", "--summary", str(summary)]
    code, out, err = _ForkedCommand(torchrun, argv).end(timeout_s=120)
    assert code == 0, err[-2000:]
    assert "step 1: loss" in out
    assert "median step" in out and out.count("\n   1  ") == 1  # rank 0 prints every rank's row
    assert len(json.loads(summary.read_text())["losses"]) == 2
    from pipeloom.train import (
        main as rank_main,  # started by hand, not by torchrun (in this process: no import to wait for)
    )

    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    assert rank_main(["--schedule", "1f1b"]) == 2 and "launch with torchrun" in capsys.readouterr().err


@pytest.mark.parametrize("kind", list(OpKind))
def test_every_op_kind_has_a_runtime_handler(kind):
    from pipeloom.runtime.executor import DeviceExecutor

    executor = object.__new__(DeviceExecutor)  # the dispatch reads no state
    assert callable(DeviceExecutor._handler(executor, kind))
    with pytest.raises(AssertionError):
        DeviceExecutor._handler(executor, "X")


LAUNCH = ["train", "--nproc", "2", "--schedule", "1f1b", "-p", "2", "-m", "2", "--steps", "100000"]


@pytest.mark.parametrize("stop", ["TERM", "INT", "HUP"])
def test_a_signal_to_the_launcher_stops_every_rank_in_one_line(tmp_path, stop):
    """`kill -TERM` on `pipeloom train --nproc 2` left both ranks training as orphans; Ctrl-C
    printed a traceback per process and left a half-written checkpoint; SIGHUP (the terminal
    closing) was not handled. Now the launcher stops every rank, says so in one line, removes
    any `.partial`, and exits 128 + the signal."""
    from pipeloom.cli import main

    save = tmp_path / "ck"
    launcher = _ForkedCommand(main, [*LAUNCH, "--save", str(save), "--save-every", "1"])
    launcher.read_until("step 2:")  # training, and saving every step
    number = signal.Signals[f"SIG{stop}"]
    if number == signal.SIGINT:
        os.killpg(launcher.pid, number)  # what the terminal sends the whole group
    else:
        os.kill(launcher.pid, number)
    code, _, err = launcher.end(timeout_s=10)
    assert code == 128 + number
    assert err.strip() == f"pipeloom: stopped by SIG{stop}: every rank ended; only complete checkpoints remain"
    assert _processes_of_session(launcher.pid) == []  # its forked ranks too
    assert not list(save.glob("*.partial")) and list(save.glob("step-*"))


def test_the_ranks_of_a_launcher_killed_outright_end_and_leave_no_files(tmp_path):
    """SIGKILL (the OOM killer, a preemption) runs no handler in the launcher: its ranks, orphaned,
    used to train on and keep its temporary directory. They now end within a moment, and the
    directory goes with them."""
    from pipeloom.cli import main

    scratch = tmp_path / "tmp"  # the launcher's temporary directory goes here: TMPDIR
    scratch.mkdir()
    launcher = _ForkedCommand(main, LAUNCH, {"TMPDIR": str(scratch)})
    launcher.read_until("step 2:")
    assert len(run_files := list(scratch.glob("pipeloom-*"))) == 1, run_files  # the ranks' store, stacks, results
    os.kill(launcher.pid, signal.SIGKILL)
    code, _, _ = launcher.end(timeout_s=10)  # its stdout closes once the ranks holding it have ended
    assert code == -signal.SIGKILL
    deadline = time.monotonic() + 10
    while _processes_of_session(launcher.pid) or run_files[0].exists():
        assert time.monotonic() < deadline, (_processes_of_session(launcher.pid), run_files)
        time.sleep(0.05)


def test_a_signal_torchrun_forwards_ends_a_rank_in_one_line(tmp_path):
    """torchrun forwards SIGTERM to its ranks: a rank (here one started as torchrun starts it)
    ends at once with 143, rank 0 removing half-written checkpoints and printing one line."""
    import socket

    from pipeloom.train import main

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    environment = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}
    save = tmp_path / "ck"
    argv = ["--schedule", "1f1b", "-p", "1", "-m", "2", "--steps", "100000", "--save", str(save), "--save-every", "1"]
    rank = _ForkedCommand(main, argv, {**environment, "MASTER_PORT": str(port)})
    rank.read_until("step 2:")
    (save / "step-999.partial").mkdir()  # as a write cut short by the signal would leave it
    os.kill(rank.pid, signal.SIGTERM)
    code, _, err = rank.end(timeout_s=10)
    assert code == 143
    assert err.strip() == "pipeloom.train: stopped by SIGTERM: only complete checkpoints remain"
    assert not list(save.glob("*.partial")) and list(save.glob("step-*"))


class _ForkedCommand:
    """A command-line entry point run in a forked child of this process, in a session of its own,
    as a shell would start it: what a fresh interpreter would do, without importing torch again.
    Its stdout and stderr come back through pipes; signals and exit statuses are a process's."""

    def __init__(self, entry, argv: list[str], environment: dict[str, str] | None = None) -> None:
        import sys

        out_read, out_write = os.pipe()
        err_read, err_write = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:  # the child: never returns into the test session
            code = 1
            try:
                os.setsid()
                os.dup2(out_write, 1)
                os.dup2(err_write, 2)
                for fd in (out_read, out_write, err_read, err_write):
                    os.close(fd)
                sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
                sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
                signal.signal(signal.SIGINT, signal.default_int_handler)  # a test worker may ignore it
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                os.environ.update(environment or {})
                tempfile.tempdir = None  # read TMPDIR anew, as a fresh interpreter would
                code = entry(argv) or 0  # torchrun's returns None
            except SystemExit as ended:  # as the interpreter reads it: None is 0, a message is 1
                code = 0 if ended.code is None else ended.code if isinstance(ended.code, int) else 1
            except BaseException:  # noqa: BLE001 — as an interpreter would: the traceback, status 1
                import traceback

                traceback.print_exc()
            finally:  # nothing may raise past here: the child would go on running the test session
                for stream in (sys.stdout, sys.stderr):
                    try:
                        stream.flush()
                    except BaseException:  # noqa: BLE001, S110 — a reader gone: nothing left to tell
                        pass
                os._exit(code)
        os.close(out_write)
        os.close(err_write)
        self._out, self._err = out_read, err_read
        self._printed = b""

    def read_until(self, text: str) -> None:
        """Wait until its stdout holds `text`."""
        while text.encode() not in self._printed:
            chunk = os.read(self._out, 65536)
            assert chunk, f"the command ended before printing {text!r}"
            self._printed += chunk

    def end(self, timeout_s: float) -> tuple[int, str, str]:
        """Its exit status, all its stdout and its stderr, once it (and whatever it started that
        holds them) has ended — within `timeout_s`."""
        import selectors

        deadline = time.monotonic() + timeout_s
        printed = {self._out: [self._printed], self._err: []}
        selector = selectors.DefaultSelector()
        for fd in printed:
            selector.register(fd, selectors.EVENT_READ)
        while selector.get_map():
            if time.monotonic() > deadline:
                os.killpg(self.pid, signal.SIGKILL)  # its session: no test leaves processes behind
                raise AssertionError(f"the command did not end within {timeout_s:g} s")
            for key, _ in selector.select(timeout=0.05):
                if chunk := os.read(key.fd, 65536):
                    printed[key.fd].append(chunk)
                else:
                    selector.unregister(key.fd)
                    os.close(key.fd)
        while (ended := os.waitpid(self.pid, os.WNOHANG))[0] == 0:
            assert time.monotonic() < deadline, "the command did not end"
            time.sleep(0.02)
        out, err = (b"".join(printed[fd]).decode(errors="replace") for fd in (self._out, self._err))
        return os.waitstatus_to_exitcode(ended[1]), out, err


def _processes_of_session(session: int) -> list[int]:
    """Pids of the processes still in `session` (from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit():
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                if int(fields[3]) == session and fields[0] != "Z":
                    found.append(int(entry.name))
        except (OSError, IndexError, ValueError):  # ended while we looked
            continue
    return found


class _DeviceLikeClock:
    """A clock that, like CUDA events, cannot be read until the device has passed its marks:
    marks count up, each 1 ms apart, and reading one before the step's read of the device fails."""

    immediate = False

    def __init__(self) -> None:
        self.count, self.readable = 0, False

    def mark(self) -> int:
        self.count += 1
        return self.count

    def seconds(self, began: int, ended: int) -> float:
        assert self.readable, "read before the step's read of the device"
        return (ended - began) * 1e-3


def test_a_device_clock_times_ops_and_phases_read_only_after_the_steps_read(monkeypatch):
    """On a GPU the ops, the stash and the step's phases are marked by CUDA events and read at
    the step's end, after its one read of the device: every time comes from the clock, none is
    read earlier (a host clock around a kernel would read its launch)."""
    from pipeloom.runtime import executor as executor_module
    from pipeloom.runtime.rank import RankRun

    clock = _DeviceLikeClock()
    monkeypatch.setattr(executor_module, "clock_for", lambda device: clock)
    settle_step = RankRun.settle_step

    def reading(self, record, shares):  # the step's read of the device; its marks are passed after it
        loss = settle_step(self, record, shares)
        clock.readable = True
        return loss

    def next_step(self, step):
        clock.readable = False
        return begin_step(self, step)

    begin_step = RankRun.begin_step
    monkeypatch.setattr(RankRun, "settle_step", reading)
    monkeypatch.setattr(RankRun, "begin_step", next_step)
    results = run_in_process(tiny_spec(build_schedule("zb-h1", 2, 4), steps=2))
    for result in results:
        for record in result.records:
            assert record.marks is None and len(record.ops) == 3 * 4  # F, B and W of each micro-batch
            for _, start, end in record.ops:
                assert 0 < start < end and round(start * 1e3, 6).is_integer()  # whole marks, 1 ms apart
            assert all(moment > 0 for moment, _ in record.stash)
        for phases in result.phase_seconds:
            assert phases["pipeline"] > 0 and round(phases["pipeline"] * 1e3, 6).is_integer()


@pytest.mark.parametrize(
    "schedule",
    [
        build_schedule("zb-h1", 2, 4),
        build_schedule("zb-v", 2, 4, costs=Costs(F=1, B=1, W=1)),
        weight_parts(build_schedule("1f1b", 2, 4), Costs(F=1, B=1, W=1), parts=2),
    ],
    ids=["zb-h1", "zb-v", "1f1b+wparts"],
)
def test_the_stash_counts_what_a_b_leaves_for_its_w_as_the_simulator_does(schedule):
    """A split B frees its forward's stash but its linears' inputs and output gradients wait
    for W (the simulator's M_W; a W in k parts frees 1/k each; a W folded into its B leaves
    nothing). Given the bytes one forward and one B left per stage, the simulator predicts every
    device's peak to the byte."""
    results = run_in_process(tiny_spec(schedule, steps=1))
    records = [result.records[0] for result in results]
    stages = range(schedule.num_stages)
    device_of = {s: d for d in range(schedule.num_devices) for s in schedule.stages_on(d)}
    forward = [records[device_of[s]].entry_bytes[f"{s}F0"] for s in stages]
    # zb-h1's first device runs each W right after its B: folded into it, nothing waits
    pending = [records[device_of[s]].pending_w_bytes.get(f"{s}B0", 0) for s in stages]
    assert any(pending) and all(w < f for w, f in zip(pending, forward))  # part of the stash, and output gradients
    predicted = simulate(schedule, Costs(M_B=forward, M_W=pending)).peak_activation_memory
    assert [record.peak_stash_bytes for record in records] == predicted
    without = simulate(schedule, Costs(M_B=forward)).peak_activation_memory
    assert any(p > q for p, q in zip(predicted, without))  # the pending W raise some device's peak
    for record in records:
        assert record.stash[-1][1] == 0  # every W freed what its B left


def test_a_lone_device_runs_each_w_inside_its_b_as_the_folded_schedule_says():
    """One device holds the pipeline (a V over two stages, its W deferred): nothing waits for a
    B there, so the runtime runs each whole W inside its B and holds no weight gradient pending.
    The schedule as written would be predicted to hold them; folded (`fold_lone_w`, as `tune`
    writes such plans) it is predicted to the byte — and kept apart (the profiler's
    `separate_w`), the written one is."""
    deferred = split_backward(build_schedule("interleaved", 1, 4, num_chunks=2), "deferred")
    folded = fold_lone_w(deferred)
    assert [op.kind for op in folded.devices[0]].count(OpKind.W) == 0
    kept = run_in_process(tiny_spec(deferred, steps=1, separate_w=True))[0].records[0]
    forward = [kept.entry_bytes[f"{s}F0"] for s in range(2)]
    pending = [kept.pending_w_bytes[f"{s}B0"] for s in range(2)]
    costs = Costs(M_B=forward, M_W=pending)
    assert kept.peak_stash_bytes == simulate(deferred, costs).peak_activation_memory[0]
    measured = run_in_process(tiny_spec(deferred, steps=1))[0].records[0].peak_stash_bytes
    assert measured == simulate(folded, costs).peak_activation_memory[0]
    assert measured < simulate(deferred, costs).peak_activation_memory[0]


def test_a_w_right_after_its_b_runs_inside_it_as_the_folded_schedule_says():
    """zb-h1's first device runs each W right after its B, its second defers them: the runtime
    runs the first device's inside their B, one autograd pass, nothing held pending, as
    `fold_w_at_once` writes the plan — whose simulated peaks are the measured ones to the byte."""
    schedule = build_schedule("zb-h1", 2, 4)
    folded = fold_w_at_once(schedule)
    assert [{op.kind for op in ops} for ops in folded.devices] == [
        {OpKind.F, OpKind.BW},
        {OpKind.F, OpKind.B, OpKind.W},
    ]
    kept = run_in_process(tiny_spec(schedule, steps=1, separate_w=True))  # every W apart: what each B leaves
    forward = [kept[s].records[0].entry_bytes[f"{s}F0"] for s in range(2)]
    pending = [kept[s].records[0].pending_w_bytes[f"{s}B0"] for s in range(2)]
    costs = Costs(M_B=forward, M_W=pending)
    run = run_in_process(tiny_spec(schedule, steps=1))
    assert [result.records[0].peak_stash_bytes for result in run] == simulate(folded, costs).peak_activation_memory
    assert run[0].records[0].pending_w_bytes == {} and run[1].records[0].pending_w_bytes


def test_a_budgeted_schedule_told_what_its_bs_leave_for_their_ws_keeps_its_limit_as_measured():
    """zb-auto under a limit between its W-free and W-full peaks: given the bytes a B leaves
    queued for its W (measured here, as `profile` does), the schedule it builds peaks within the
    limit on every device as the runtime's stash record measures it, and as predicted to the
    byte; built believing a W frees nothing, it peaks above the limit when run."""
    p, m = 2, 6
    probe = run_in_process(tiny_spec(build_schedule("zb-h1", p, m), steps=1, separate_w=True))
    forward = [probe[s].records[0].entry_bytes[f"{s}F0"] for s in range(p)]
    pending = [max(probe[s].records[0].pending_w_bytes.values()) for s in range(p)]
    costs = Costs(F=1, B=1, W=1, M_B=forward, M_W=pending)
    w_free = Costs(F=1, B=1, W=1, M_B=forward)
    unlimited = build_schedule("zb-auto", p, m, costs=costs)
    full, free = (simulate(unlimited, c).peak_activation_memory for c in (costs, w_free))
    limit = [(a + b) / 2 for a, b in zip(full, free)]
    assert all(b < a for a, b in zip(full, free))  # the pending W are what separates the two

    def measured(schedule) -> list[int]:
        return [result.records[0].peak_stash_bytes for result in run_in_process(tiny_spec(schedule, steps=1))]

    budgeted = build_schedule("zb-auto", p, m, costs=costs, mem_limit=limit)
    peaks = measured(budgeted)
    assert peaks == simulate(budgeted, costs).peak_activation_memory
    assert all(peak <= bound for peak, bound in zip(peaks, limit))
    believed = build_schedule("zb-auto", p, m, costs=w_free, mem_limit=limit)
    assert any(peak > bound for peak, bound in zip(measured(believed), limit))
