"""`python -m pipeloom.train ...` — one rank of a training run, as launched by torchrun.

torchrun sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT (on one node or many); every rank
builds the same schedule from the same arguments. `pipeloom train --nproc N ...` runs the same
thing on this machine without torchrun. Arguments: see `pipeloom train --help`.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

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
        from pipeloom.runtime.training import train_rank

        spec = train_spec_from_args(args, report=True)
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


if __name__ == "__main__":
    sys.exit(main())
