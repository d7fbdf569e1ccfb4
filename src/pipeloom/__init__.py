"""pipeloom: plan and run pipeline-parallel training.

The planning core — IR, costs, simulator, generators — imports no torch, so `import pipeloom`
is fast and works anywhere. Glossary:

device        a pipeline rank (one accelerator)
stage         one model partition (chunk), in data-flow order; S stages in all
micro-batch   a piece of the step's batch; m of them per step
slice         a piece of a micro-batch's sequence; L per micro-batch
op            one unit of compute: F, B, W (maybe in parts), BW or R of a (stage, micro-batch, slice)
schedule      per-device ordered op lists
plan          schedule + model partition + parallel sizes + costs
"""

from pipeloom.costs import Costs
from pipeloom.errors import ConfigError, InfeasibleError, PipeloomError, RuntimeFault, ScheduleError
from pipeloom.ir import FORMAT, Op, OpKind, Schedule, load_schedule, parse_op, save_schedule, validate
from pipeloom.schedules import build_schedule, list_generators
from pipeloom.sim import Timeline, simulate

__version__ = "0.1.0"

__all__ = [
    "FORMAT",
    "ConfigError",
    "Costs",
    "InfeasibleError",
    "Op",
    "OpKind",
    "PipeloomError",
    "RuntimeFault",
    "Schedule",
    "ScheduleError",
    "Timeline",
    "build_schedule",
    "list_generators",
    "load_schedule",
    "parse_op",
    "save_schedule",
    "simulate",
    "validate",
]
