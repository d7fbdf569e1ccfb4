"""`python -m pipeloom.train ...` — one rank of a training run, as launched by torchrun.

torchrun sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT (on one node or many); every rank
builds the same schedule from the same arguments. `pipeloom train --nproc N ...` runs the same
thing on this machine without torchrun. Arguments: see `pipeloom train --help`.

torchrun forwards SIGINT/SIGTERM to every rank; a rank then ends at once with status 128 + n,
rank 0 first removing any half-written checkpoint and printing one line (torchrun adds its own
report). Rank 0 holds and claims the run's --save and --log-dir for the run, as `pipeloom train`
does (`runtime.run_outputs`).
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Sequence
from contextlib import nullcontext

from pipeloom.cli.config_file import config_line, expand_config
from pipeloom.cli.parser import EXIT_BAD_INPUT, Parser
from pipeloom.cli.train import train_spec_from_args, write_train_outputs
from pipeloom.cli.train_args import add_train_arguments, check_train_flags
from pipeloom.errors import PipeloomError

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    parser = Parser(prog="python -m pipeloom.train", description=__doc__.splitlines()[0])
    add_train_arguments(parser)
    parser.set_defaults(train_parser=parser)
    try:
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    except (KeyError, ValueError):
        print("pipeloom.train: error: RANK and WORLD_SIZE are not set; launch with torchrun", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        given = list(sys.argv[1:] if argv is None else argv)
        args = parser.parse_args(expand_config(given, parser, 0, launcher_only=("nproc",)))
        check_train_flags(args)
        from pipeloom.runtime.run_outputs import spec_outputs
        from pipeloom.runtime.training import train_rank

        spec = train_spec_from_args(args, report=True)
        _stop_on_signals(rank, spec.save_dir)
        with spec_outputs(spec) if rank == 0 else nullcontext():
            if rank == 0:
                from pipeloom.runtime.report import data_line

                print(config_line(args, parser), flush=True)
                print(data_line(spec), flush=True)
            result = train_rank(spec, rank, world_size, "env://", gather=True)  # rank 0 prints every rank's figures
        if rank == 0 and result.all_results:
            write_train_outputs(result.all_results, spec, args)
    except PipeloomError as error:
        print(f"pipeloom.train: rank {rank}: error: {error.summary}", file=sys.stderr)
        return EXIT_BAD_INPUT if rank == 0 else 1
    return 0


def _stop_on_signals(rank: int, save_dir: str | None) -> None:
    """SIGINT, SIGTERM and SIGHUP end this rank now (no traceback from wherever it was); rank 0
    first removes `step-N.partial` directories and says why. Exiting from the handler needs no
    collective, so a rank blocked on a peer that has already gone still ends."""
    from pipeloom.runtime.run_outputs import remove_partials

    def stop(signum: int, _frame) -> None:
        if rank == 0:
            remove_partials(save_dir)
            name = signal.Signals(signum).name
            print(f"pipeloom.train: stopped by {name}: only complete checkpoints remain", file=sys.stderr, flush=True)
        os._exit(128 + signum)

    for number in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(number, stop)


if __name__ == "__main__":
    sys.exit(main())
