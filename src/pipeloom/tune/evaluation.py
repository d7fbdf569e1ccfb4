"""What the tuner knows of one candidate (`Evaluation`) and of a whole search (`TuneResult`), and
how an evaluation travels back from a worker process without its bulk."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from pipeloom.costs import Costs
from pipeloom.ir.schedule import Schedule
from pipeloom.passes.offload import OffloadTimeline, simulate_offload, t_offload
from pipeloom.sim.simulate import Timeline, simulate
from pipeloom.tune.measures import StaticOption
from pipeloom.tune.space import Candidate
from pipeloom.tune.topology import Split

__all__ = ["Evaluation", "SplitOutcome", "TuneResult", "offload_lanes", "packed", "restore"]


@dataclass
class Evaluation:
    candidate: Candidate
    feasible: bool = False
    reason: str = ""
    """Why it was rejected or pruned; empty when it fits."""
    partition: list[int] = field(default_factory=list)
    costs: Costs | None = None
    schedule: Schedule | None = None
    timeline: Timeline | None = None
    offload: OffloadTimeline | None = None
    pipeline_time: float = math.inf
    allreduce_time: float = 0.0
    optimizer_time: float = 0.0
    overhead_time: float = 0.0
    """The rest of a step: the batch, zeroing the gradient buffers the replicas sum, the loss all-reduce."""
    noise_time: float = 0.0
    """The part of `pipeline_time` that the ranks' step-to-step speed noise adds to the median
    step (`tune.speed_noise`; 0 without a measured profile)."""
    static_memory: list[float] = field(default_factory=list)
    peak_memory: list[float] = field(default_factory=list)
    host_memory: list[float] = field(default_factory=list)
    """Per device, what its host holds for offloaded stages (empty: nothing offloaded)."""
    host_short: float = 0.0
    """The host memory per device that offloading would have needed, where the host's limit ruled
    it out (0: it did not)."""
    unfit: list[tuple[str, float, str]] = field(default_factory=list)
    """(plan, step time, why) of the pass chains tried here that did not fit."""
    extrapolated: tuple[str, ...] = ()
    """Why its costs lie beyond what the profile measured (`tune.confidence.measured_first`);
    empty: measured (or an analytic cost model, which measures nothing)."""
    options: list[StaticOption] = field(default_factory=list, repr=False)
    """The static-memory measures, in the order they are tried, with their costs; the first is
    ZeRO-0 (none)."""

    @property
    def step_time(self) -> float:
        return self.pipeline_time + self.allreduce_time + self.optimizer_time + self.overhead_time

    @property
    def bubble_rate(self) -> float:
        return self.timeline.bubble_rate if self.timeline else math.nan

    @property
    def static_option(self) -> StaticOption | None:
        """The static-memory measure this plan took."""
        offload_all = "offload-all" in self.candidate.passes
        chosen = [o for o in self.options if o.zero == self.candidate.zero and o.offload_all == offload_all]
        return chosen[0] if chosen else None


@dataclass(frozen=True)
class SplitOutcome:
    """What one split (tp, cp, ep) came to in a search."""

    split: Split
    cost_model: object
    """The cost model that priced its plans (`CostModel.with_split`)."""
    fastest: Evaluation | None
    """Its fastest plan simulated (None: every plan was pruned by its bound, or none fits)."""
    floor: float
    """The least step its plans' lower bounds allowed, ms (inf: none fits)."""


@dataclass
class TuneResult:
    ranked: list[Evaluation]
    """Plans that fit, fastest first (at most `keep`)."""
    rejected: list[Evaluation]
    """Candidates that do not fit, with the reason."""
    global_batch: int
    memory: float
    evaluated: int = 0
    pruned: int = 0
    host_memory: float = math.inf
    """The host memory per device the plans had to fit."""
    bands: list[float] = field(default_factory=list)
    """Per ranked plan, ± ms around its step from the profile's confidence (`tune.confidence`;
    zeros from a cost model that measured nothing)."""
    tie_note: str = ""
    """What the ranking did with plans within the noise of each other (empty: none were)."""
    extrapolation_note: str = ""
    """What the ranking did with plans priced beyond the profile (empty: there were none)."""
    splits: list[SplitOutcome] = field(default_factory=list)
    """Each split the search weighed (`tune --explain` compares the best's with its neighbours)."""

    @property
    def best(self) -> Evaluation:
        return self.ranked[0]

    def cost_model_of(self, evaluation: Evaluation):
        """The cost model that priced `evaluation` (its split's)."""
        return next(outcome.cost_model for outcome in self.splits if outcome.split == evaluation.candidate.split)

    def throughput(self, evaluation: Evaluation) -> float:
        """Samples per second."""
        return self.global_batch / (evaluation.step_time / 1e3)


def packed(result: tuple[Evaluation, bool], threshold: float) -> tuple[Evaluation, bool]:
    """What a worker sends back: timelines are left out (the search ranks on the step and
    peaks; `restore` rebuilds them for the plans it keeps), and so is the schedule of a plan
    that cannot enter the ranking: one no faster than `threshold`, the step of the last plan
    ranked. The search ranks a plan faster by any margin, so none is allowed here: with a 1e-9 ms
    margin a plan just under the threshold could be ranked without its schedule, and `restore`
    failed (once, tuning from the README's quick profile on a busy machine)."""
    evaluation, kept = result
    evaluation.timeline = evaluation.offload = None
    if not (evaluation.feasible and evaluation.step_time < threshold):
        evaluation.schedule = None
    return evaluation, kept


def restore(evaluation: Evaluation) -> None:
    """The timeline (and offload lanes) of a kept plan whose worker left them out."""
    if evaluation.timeline is not None:
        return
    schedule, costs, passes = evaluation.schedule, evaluation.costs, evaluation.candidate.passes
    assert schedule is not None and costs is not None, "only evaluations that were simulated are kept"
    evaluation.offload = offload_lanes(schedule, costs, passes)
    evaluation.timeline = evaluation.offload.timeline if evaluation.offload else simulate(schedule, costs)


def offload_lanes(schedule: Schedule, costs: Costs, passes: Sequence[str]) -> OffloadTimeline | None:
    """The host's offload lanes beside `schedule` where `passes` offload (T-Offload picks its
    stages; "offload-all" takes every stage's optimizer), else None."""
    if "offload" not in passes and "offload-all" not in passes:
        return None
    stages = range(schedule.num_stages) if "offload-all" in passes else None
    return simulate_offload(t_offload(schedule, stages), costs)
