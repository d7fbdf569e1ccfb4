"""A plan: what `tune` chose and `train --plan` runs — exchange format ``pipeloom.plan/1``.

    {"format": "pipeloom.plan/1",
     "model": {...ModelSpec...}, "cost_model": {"source": ..., ...},
     "devices": 8, "pp": 4, "dp": 2, "tp": 1, "cp": 1, "micro_batch_size": 2, "global_batch": 64,
     "num_microbatches": 16, "scheme": "1f1b", "chunks": 1, "slices": 1, "passes": ["mario"],
     "zero": 0, "offload_stages": [],
     "partition": [3, 4, 4, 3], "layout": "Ettt|tttt|tttt|tttL",
     "schedule": {...pipeloom.schedule/1...}, "costs": {...Costs keys...},
     "inputs": {"data": {...pipeloom.provenance record...} or null, "dtype": "bf16" or null,
                "device": "cpu" or null, "threads": 1 or null},
     "predicted": {"step_time_ms": ..., "pipeline_ms": ..., "allreduce_ms": ..., "optimizer_ms": ..., "overhead_ms": ...,
                   "throughput": ..., "bubble_rate": ..., "peak_memory": [...], "static_memory": [...],
                   "peak_activation_memory": [...]}}

Times are milliseconds, memory bytes, throughput samples per second. Readers ignore extra keys.
`cp` is the context-parallel size (each stage's sequence split over cp ranks; absent from older
plans: 1); the model's `expert_parallel` is the plan's ep. `zero` is the ZeRO level of the static
memory and `offload_stages` the stages whose optimizer the host steps (`pipeloom.static_memory`);
both are absent from older plans and default to none.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from os import PathLike
from typing import Any

from pipeloom.costs import Costs
from pipeloom.errors import ConfigError
from pipeloom.files import read_json
from pipeloom.ir.schedule import Schedule
from pipeloom.tune.confidence import band, figure_errors, sensitivities
from pipeloom.tune.cost_model import CostModel
from pipeloom.tune.partition import layout_string
from pipeloom.tune.presets import ModelSpec, model_from_config
from pipeloom.tune.run_inputs import RunInputs
from pipeloom.tune.search import Evaluation, TuneResult, evaluate_schedule
from pipeloom.tune.space import Candidate
from pipeloom.tune.topology import Split

__all__ = ["PLAN_FORMAT", "Plan", "plan_from_evaluation", "repriced"]

PLAN_FORMAT = "pipeloom.plan/1"


@dataclass(frozen=True)
class Plan:
    model: ModelSpec
    cost_model: dict
    devices: int
    pp: int
    dp: int
    tp: int
    micro_batch_size: int
    global_batch: int
    scheme: str
    chunks: int
    slices: int
    passes: tuple[str, ...]
    partition: tuple[int, ...]
    schedule: Schedule
    costs: Costs
    predicted: dict
    zero: int = 0
    offload_stages: tuple[int, ...] = ()
    sequence_parallel: bool = False
    """With tp > 1: the plan was priced with sequence parallelism (`tune --sequence-parallel`)."""
    inputs: RunInputs = RunInputs()
    """The run's data, and what its costs were measured on (`tune.run_inputs`); all None: not
    recorded (older plans, or no profile priced it)."""
    cp: int = 1
    """Context-parallel ranks per stage: each holds 1/cp of every sequence."""

    @property
    def num_microbatches(self) -> int:
        return self.schedule.num_microbatches

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": PLAN_FORMAT,
            "model": self.model.to_dict(),
            "cost_model": self.cost_model,
            "devices": self.devices,
            "pp": self.pp,
            "dp": self.dp,
            "tp": self.tp,
            "cp": self.cp,
            "sequence_parallel": self.sequence_parallel,
            "micro_batch_size": self.micro_batch_size,
            "global_batch": self.global_batch,
            "num_microbatches": self.num_microbatches,
            "scheme": self.scheme,
            "chunks": self.chunks,
            "slices": self.slices,
            "passes": list(self.passes),
            "zero": self.zero,
            "offload_stages": list(self.offload_stages),
            "partition": list(self.partition),
            "layout": layout_string(self.partition),
            "schedule": self.schedule.to_dict(),
            "costs": self.costs.to_dict(),
            "predicted": self.predicted,
            "inputs": self.inputs.to_dict(),
        }

    def save(self, path: str | PathLike[str]) -> None:
        with open(path, "w", encoding="utf-8") as handle:
            json.dump(self.to_dict(), handle, indent=1)
            handle.write("\n")

    @classmethod
    def load(cls, path: str | PathLike[str]) -> Plan:
        data = read_json(path, "plan", ConfigError)
        try:
            plan = cls.from_dict(data)
        except KeyError as error:
            raise ConfigError(f"plan {str(path)!r} lacks the field {error.args[0]!r} of {PLAN_FORMAT}") from None
        except ConfigError as error:  # before ValueError, which it is too
            raise ConfigError(f"plan {str(path)!r}: {error.summary}") from None
        except (TypeError, ValueError) as error:
            raise ConfigError(f"plan {str(path)!r} is not a {PLAN_FORMAT} file: {error}") from None
        plan.check(f"plan {str(path)!r}")
        return plan

    def check(self, where: str = "plan") -> None:
        """The fields agree with each other: the schedule with pp and the partition, the grid
        with the devices, the micro-batches with the global batch, the measures with the stages."""
        schedule = self.schedule
        facts = [
            ("pp", self.pp, schedule.num_devices, "devices in its schedule"),
            ("devices", self.devices, self.pp * self.dp * self.cp * self.tp, "pp × dp × cp × tp"),
            ("partition", len(self.partition), schedule.num_stages, "stages in its schedule"),
            ("partition", sum(self.partition), self.model.layers, "layers of its model"),
            ("global_batch", self.global_batch, schedule.num_microbatches * self.dp * self.micro_batch_size,
             "micro-batches × dp × micro_batch_size"),
        ]  # fmt: skip
        for field, value, expected, what in facts:
            if value != expected:
                raise ConfigError(f"{where}: field {field!r} is {value}, but the plan's {what} make {expected}")
        self._check_scheme(where)
        for name, value in (("tp", self.tp), ("cp", self.cp)):
            priced = self.cost_model.get(name, value)
            if priced != value:
                raise ConfigError(
                    f"{where}: field {name!r} is {value}, but its costs and predictions were made for {name} = "
                    f"{priced}: plan it again with `pipeloom tune --{name} {value}`"
                )
        if self.zero not in (0, 1, 2):
            raise ConfigError(f"{where}: field 'zero' must be 0, 1 or 2, got {self.zero}")
        bad = [s for s in self.offload_stages if not 0 <= s < schedule.num_stages]
        if bad:
            raise ConfigError(
                f"{where}: field 'offload_stages' names stages {bad} outside 0..{schedule.num_stages - 1}"
            )

    def _check_scheme(self, where: str) -> None:
        """`scheme` names what the stored schedule is (a generator, then its passes): a plan runs
        its schedule, so an edited scheme would only mislabel the run."""
        from pipeloom.tune.space import GENERATOR_OF

        if self.scheme not in GENERATOR_OF:
            raise ConfigError(f"{where}: field 'scheme' is {self.scheme!r}, not one of {', '.join(GENERATOR_OF)}")
        built_by = self.schedule.name.split("+")[0]
        if built_by != GENERATOR_OF[self.scheme]:
            raise ConfigError(
                f"{where}: field 'scheme' is {self.scheme!r}, but its schedule was built by {built_by!r}; a plan runs "
                f"the schedule it stores, so to run {self.scheme} plan it: `pipeloom tune --schemes {self.scheme}`"
            )

    @classmethod
    def from_dict(cls, data: dict) -> Plan:
        found = data.get("format") if isinstance(data, dict) else None
        if isinstance(found, str) and found.startswith("pipeloom.profile/"):
            raise ConfigError(
                f"a profile ({found}), not a plan: `pipeloom tune --costs PROFILE ...` makes a plan of it"
            )
        if found != PLAN_FORMAT:
            raise ConfigError(f"not a {PLAN_FORMAT} plan (format: {found!r})")
        return cls(
            model=model_from_config(data["model"]),
            cost_model=dict(data.get("cost_model", {})),
            devices=int(data["devices"]),
            pp=int(data["pp"]),
            dp=int(data["dp"]),
            tp=int(data.get("tp", 1)),
            cp=int(data.get("cp", 1)),
            micro_batch_size=int(data["micro_batch_size"]),
            global_batch=int(data["global_batch"]),
            scheme=str(data["scheme"]),
            chunks=int(data.get("chunks", 1)),
            slices=int(data.get("slices", 1)),
            passes=tuple(data.get("passes", ())),
            partition=tuple(int(n) for n in data["partition"]),
            schedule=Schedule.from_dict(data["schedule"]),
            costs=Costs.from_mapping(data["costs"]),
            predicted=dict(data.get("predicted", {})),
            zero=int(data.get("zero", 0)),
            offload_stages=tuple(int(s) for s in data.get("offload_stages", ())),
            sequence_parallel=bool(data.get("sequence_parallel", False)),
            inputs=RunInputs.from_dict(data.get("inputs", {}), "plan"),
        )


def plan_from_evaluation(evaluation: Evaluation, result: TuneResult, model: ModelSpec, cost_model: dict) -> Plan:
    """The plan of a ranked evaluation: its split's tp and cp, and `model` with its ep."""
    candidate = evaluation.candidate
    split = candidate.split
    if model.expert_parallel != split.ep:
        model = replace(model, expert_parallel=split.ep)
    timeline, schedule, costs = evaluation.timeline, evaluation.schedule, evaluation.costs
    assert timeline is not None and schedule is not None and costs is not None, "a plan is made of a kept evaluation"
    return Plan(
        model=model,
        cost_model=cost_model,
        devices=candidate.devices,
        pp=candidate.pp,
        dp=candidate.dp,
        tp=split.tp,
        cp=split.cp,
        micro_batch_size=candidate.micro_batch,
        global_batch=result.global_batch,
        scheme=candidate.scheme,
        chunks=candidate.chunks,
        slices=candidate.slices,
        passes=candidate.passes,
        partition=tuple(evaluation.partition),
        schedule=schedule,
        costs=costs,
        predicted=_predicted(evaluation, result.global_batch) | _band(evaluation, result),
        zero=candidate.zero,
        offload_stages=tuple(evaluation.offload.plan.stages) if evaluation.offload else (),
        sequence_parallel=bool(cost_model.get("sequence_parallel", False)),
    )


def repriced(plan: Plan, cost_model: CostModel) -> Plan:
    """The plan as another cost model (another profile of the machine) prices it: its own
    schedule, partition and static measure, timed again (`search.evaluate_schedule`), with that
    model's costs; `predicted` also has "band_ms", ± ms around the step from that profile's
    confidence (`tune.confidence`)."""
    candidate = Candidate(
        plan.scheme, plan.pp, plan.dp, plan.micro_batch_size, plan.num_microbatches,
        plan.chunks, plan.slices, plan.passes, plan.zero, Split(plan.tp, plan.cp, plan.model.expert_parallel),
    )  # fmt: skip
    evaluation = evaluate_schedule(candidate, cost_model, list(plan.partition), plan.schedule)
    moves = sensitivities(evaluation, figure_errors(cost_model, plan.micro_batch_size, plan.partition))
    assert evaluation.costs is not None, "evaluate_schedule simulates the schedule"
    return replace(
        plan,
        cost_model=cost_model.to_dict(),
        costs=evaluation.costs,
        predicted=_predicted(evaluation, plan.global_batch) | {"band_ms": band(moves)},
    )


def _band(evaluation: Evaluation, result: TuneResult) -> dict:
    """{"band_ms": ± ms around the step from the profile's confidence} where the search gave the
    plan one (`TuneResult.bands`), else {}."""
    bands = [b for e, b in zip(result.ranked, result.bands) if e is evaluation and b > 0]
    return {"band_ms": bands[0]} if bands else {}


def _predicted(evaluation: Evaluation, global_batch: int) -> dict:
    timeline = evaluation.timeline
    assert timeline is not None, "a plan is made of a simulated evaluation"
    return {
        "step_time_ms": evaluation.step_time,
        "pipeline_ms": evaluation.pipeline_time,
        "allreduce_ms": evaluation.allreduce_time,
        "optimizer_ms": evaluation.optimizer_time,
        "overhead_ms": evaluation.overhead_time,
        "speed_noise_ms": evaluation.noise_time,
        "throughput": global_batch / (evaluation.step_time / 1e3),
        "bubble_rate": timeline.bubble_rate,
        "peak_memory": list(evaluation.peak_memory),
        "static_memory": list(evaluation.static_memory),
        "peak_activation_memory": list(timeline.peak_activation_memory),
        "host_memory": list(evaluation.host_memory) or [0.0] * evaluation.candidate.pp,
    }
