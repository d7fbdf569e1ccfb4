"""One rank of a training run, in three parts: set-up, a step, teardown.

`RankRun.set_up` builds what a rank needs — its stages (split for W), the gradient buckets, the
optimizer (replicated, sharded, host-stepped), the executor and its mailbox, the optimizer sync —
from the spec; `begin_step` and `end_step` frame the pipeline (batch and zeroing before it;
fault injection, reduction, clipping and the optimizer step after it); `tear_down` collects what
the rank reports. Two drivers use it: `training.train_rank`, one process per rank over
torch.distributed, and `in_process.run_in_process`, every device of a replica in this process
with messages in memory. The two differ only in the transport they hand in (`Transport`), so
the in-process tier tests the very code the ranks run.

Ranks sit on a pp × dp × tp grid (`layout.RankLayout`, tensor parallelism innermost). Every rank
builds the whole model on the meta device, keeps the stages its device hosts, cuts them (its
tensor- and expert-parallel shards) and only then makes them real (`models.materialise`: from
the weight files, or each unit's seeded initialisation), so all replicas start identical and no
rank ever holds more than its part. A workload without a meta build (`Workload.skeleton`) is
built whole and its other stages dropped. A step feeds
replica k the micro-batches k·m .. k·m+m−1 of the step's batch; the ranks of a tensor-parallel
group all see the same ones.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from pipeloom.errors import ConfigError
from pipeloom.models.context_parallel import ContextShard
from pipeloom.models.materialise import materialise
from pipeloom.models.workload import Workload, global_names, replica_microbatches
from pipeloom.runtime.boundary import StageProbe
from pipeloom.runtime.census import census, peak_resident_bytes
from pipeloom.runtime.clocks import clock_for
from pipeloom.runtime.comm import MessagePlan, plan_messages
from pipeloom.runtime.evaluation import Evaluation, perplexity
from pipeloom.runtime.executor import DeviceExecutor
from pipeloom.runtime.expert_parallel import ExpertExchange, expert_parameter_ids, shard_experts
from pipeloom.runtime.gradients import GradientBuckets, grad_of
from pipeloom.runtime.lr_schedule import LearningRate
from pipeloom.runtime.mailbox import Mail
from pipeloom.runtime.offload import HostOffload
from pipeloom.runtime.optimizer_sync import OptimizerSync
from pipeloom.runtime.placement import ModelWeights, WeightPlacements
from pipeloom.runtime.precision import LossScaler, Precision
from pipeloom.runtime.probe import probe_boundaries
from pipeloom.runtime.rank_checkpoints import resume_rank, save_rank
from pipeloom.runtime.rank_setup import (
    Transport,
    context_share,
    cut_stages,
    hosted_stages,
    leaves_of,
    mailbox_of,
    optimizer_sync,
    progress_of,
    steppers,
    torch_device_of,
    zero_overlap,
)
from pipeloom.runtime.run_log import RunLog
from pipeloom.runtime.run_services import evaluation_of, learning_rate_of, run_log_of, step_facts
from pipeloom.runtime.spec import RankResult, TrainSpec
from pipeloom.runtime.static_report import rank_static_bytes
from pipeloom.runtime.step_state import StepRecord
from pipeloom.runtime.tensor_parallel import TensorParallel, loss_parallel
from pipeloom.runtime.zero import JointSteppers, ReplicatedAdamW, ShardedAdamW

__all__ = ["RankRun", "Transport", "torch_device_of"]


@dataclass(kw_only=True)
class RankModel:
    """What a rank trains: the workload, its hosted stages (cut), each weight's name in the whole
    model (what checkpoints key by) and placement, the compute type and the torch device."""

    work: Workload
    stages: dict[int, torch.nn.Module]
    names: dict[int, dict[str, str]]
    """Per hosted stage: each parameter's name in the whole model."""
    whole_names: frozenset[str]
    """Every weight's name in the whole model, a tied one once (what a checkpoint may hold)."""
    placements: WeightPlacements
    """Where each weight this rank holds lives (what every feature asks of its shards)."""
    precision: Precision
    where: torch.device
    context: ContextShard | None = None
    """Under context parallelism, this rank's share of every sequence (`models.context_parallel`)."""


@dataclass(kw_only=True)
class RankGroups:
    """Whom a rank talks to: its transport, gradient buckets and mailbox, and its tensor- and
    expert-parallel groups (with tp > 1, ep > 1)."""

    transport: Transport
    buckets: GradientBuckets
    mail: Mail
    tensor: TensorParallel | None = None
    experts: ExpertExchange | None = None


@dataclass(kw_only=True)
class RankOptimizer:
    """How a rank steps its weights: the device's optimizer, the host's (offloaded stages), both
    as one, the fp16 loss scale, the global-norm sync and the learning-rate schedule."""

    stepper: ReplicatedAdamW | ShardedAdamW | JointSteppers
    host: HostOffload | None
    joint: ReplicatedAdamW | ShardedAdamW | JointSteppers
    """The device's and the host's stepped as one."""
    holders: list
    """What a checkpoint saves besides the weights."""
    parameters: list
    """The parameters the device's optimizer steps."""
    learning: LearningRate
    scaler: LossScaler | None = None
    sync: OptimizerSync | None = None


@dataclass(kw_only=True)
class RankServices:
    """What a rank runs besides its steps: the live step line, the held-out evaluation, the log."""

    progress: Callable[[int | None], None] | None = None
    evaluation: Evaluation | None = None
    log: RunLog | None = None


@dataclass(kw_only=True)
class RankRun:
    """One rank of a run, in parts; `set_up` builds it, a driver steps it (`training`, `in_process`)."""

    spec: TrainSpec
    rank: int
    model: RankModel
    groups: RankGroups
    optimizer: RankOptimizer
    services: RankServices
    executor: DeviceExecutor
    result: RankResult
    first_step: int = 0
    _began: float = 0.0
    _marks: dict[str, Any] = field(default_factory=dict)
    """The step's phases as the executor's clock marks them (`clocks`): read at its end."""

    @property
    def device(self) -> int:
        return self.spec.parallelism.layout.coords(self.rank)[1]

    @property
    def replica(self) -> int:
        return self.spec.parallelism.layout.coords(self.rank)[0]

    # -- set-up ----------------------------------------------------------------------------------

    @classmethod
    def set_up(
        cls,
        spec: TrainSpec,
        rank: int,
        transport: Transport,
        plan: MessagePlan | None = None,
        probe: StageProbe | None = None,
    ) -> RankRun:
        """`plan` and `probe` are the same on every rank: a driver of several ranks passes them once."""
        parallel, optimizer = spec.parallelism, spec.optimizer
        schedule, work, layout = parallel.schedule, spec.resolved_workload(), parallel.layout
        replica, device, tp_index = layout.coords(rank)
        where, precision = torch_device_of(spec), Precision(optimizer.dtype)
        mesh = layout.mesh(where.type) if transport.distributed else None
        tensor = (
            TensorParallel(mesh["tp"], parallel.sequence_parallel) if mesh is not None and parallel.tp > 1 else None
        )
        skeleton = work.skeleton(schedule.num_stages) if work.skeleton is not None else None
        all_stages = skeleton.stages if skeleton is not None else work.build(schedule.num_stages)
        names = dict(enumerate(global_names(all_stages)))
        probe = probe or probe_boundaries(schedule, work, all_stages, precision)
        weights = ModelWeights(schedule, all_stages, names)
        routed = work.experts if parallel.ep > 1 else None
        buckets = GradientBuckets(
            schedule,
            parallel.replicas,
            all_stages,
            rank,
            across_replicas=parallel.zero == 0,
            new_group=transport.new_group,
            layout=layout,
            experts=expert_parameter_ids(all_stages, routed.modules) if routed else (),
            ep=parallel.ep,
        )
        stages, queue = hosted_stages(schedule, all_stages, device, where)
        experts, expert_dp_group = None, None
        if routed is not None:
            if mesh is None:
                raise ConfigError(
                    "train: --ep exchanges tokens over torch.distributed; run ranks (--nproc), not in process"
                )
            expert_mesh = layout.expert_mesh(where.type, parallel.ep)
            ep_mesh = expert_mesh["ep"]
            expert_dp_group = expert_mesh["edp"].get_group()
            experts = ExpertExchange(
                ep_mesh.get_group(), parallel.ep, replica % parallel.ep, routed.num_experts, clock_for(where), ep_mesh
            )
            buckets.rebind(shard_experts(stages, routed.modules, experts))
        context = None
        if parallel.cp > 1:  # before the tensor-parallel cut: its sequence shards are of this share
            context, probe = context_share(parallel, work, stages, probe, replica, where)
        loss = work.loss
        if tensor is not None:
            group = [layout.rank(replica, device, t) for t in range(parallel.tp)]
            probe, loss = cut_stages(parallel, work, tensor, stages, buckets, group, probe)
        if skeleton is not None:  # only now, cut, do this rank's tensors become real
            cuts = {**(experts.cuts if experts else {}), **(tensor.cuts if tensor else {})}
            materialise(skeleton, stages.values(), cuts, where)
            del skeleton, cuts
        for part in (experts, tensor):
            if part is not None:
                part.set_up_done()
        placements = weights.place(stages, names, device, tensor, experts, parallel.zero, parallel.offload_stages)
        groups = {"dp": mesh["dp"].get_group() if mesh is not None else None, "edp": expert_dp_group}
        ep_index = experts.index if experts is not None else 0
        host, stepper, parameters = steppers(
            parallel, optimizer, placements, stages, device, tp_index, precision, groups, ep_index
        )
        stores = [part.store for part in (host, *leaves_of(stepper)) if isinstance(part, HostOffload | ShardedAdamW)]
        buckets.keep_in_place({id(parameter) for store in stores for parameter in store.parameters})
        mail = mailbox_of(parallel, transport, plan or plan_messages(schedule), device, replica, tp_index, probe, where)
        executor = DeviceExecutor(
            schedule,
            device,
            stages,
            queue,
            mail,
            loss=loss,
            loss_context=loss_parallel if tensor is not None else None,
            loss_scale=1.0 / (schedule.num_microbatches * parallel.replicas * schedule.num_slices),
            concat_w=parallel.concat_w,
            device_type=where,
            before_forward=host.reload if host else None,
            precision=precision,
            recompute_layers=spec.model.recompute_layers,
            interleave_pairs=experts is not None,
            compiled=spec.compile,
            separate_w=spec.separate_w,
        )
        if transport.distributed and parallel.overlap_grad_sync:
            zero_sums = zero_overlap(stepper, stages, buckets)
            executor.after_ops = buckets.watch(schedule, device, zero_sums)
        scaler = (
            LossScaler(optimizer.initial_loss_scale, optimizer.loss_scale_growth_interval)
            if optimizer.dtype == "fp16"
            else None
        )
        optimizers = JointSteppers(host, stepper) if host is not None else stepper  # the host's starts first
        sync = optimizer_sync(optimizer, parallel, optimizers, device, replica, scaler, tensor, experts, placements)
        m, b = schedule.num_microbatches, work.microbatch_size
        result = RankResult(rank, sample_tokens=work.sample_tokens, samples_per_step=parallel.dp * m * b)
        result.forward_flops = m * sum(probe.forward_flops[s] for s in stages)
        run = cls(
            spec=spec,
            rank=rank,
            model=RankModel(
                work=work,
                stages=stages,
                names={s: names[s] for s in stages},
                whole_names=frozenset(weights.shape),
                placements=placements,
                precision=precision,
                where=where,
                context=context,
            ),
            groups=RankGroups(transport=transport, buckets=buckets, mail=mail, tensor=tensor, experts=experts),
            optimizer=RankOptimizer(
                stepper=stepper,
                host=host,
                joint=optimizers,
                holders=[stepper] + ([host] if host is not None else []),
                parameters=parameters,
                scaler=scaler,
                sync=sync,
                learning=learning_rate_of(spec, stepper, host),
            ),
            services=RankServices(
                progress=progress_of(spec, rank, result),
                evaluation=evaluation_of(
                    spec, transport, executor, probe, (replica, device, tp_index), where, b, context
                ),
                log=run_log_of(spec, rank),
            ),
            executor=executor,
            result=result,
        )
        if spec.checkpoints.resume_from is not None:
            resume_rank(run)
        if where.type == "cuda":
            torch.cuda.reset_peak_memory_stats(where)
        return run

    # -- a step ----------------------------------------------------------------------------------

    def begin_step(self, step: int) -> tuple[list, list]:
        """This replica's micro-batches of `step`, with gradients zeroed: (inputs, targets)."""
        self._began, self._marks = time.perf_counter(), {}
        m, b = self.spec.schedule.num_microbatches, self.model.work.microbatch_size
        samples = self.spec.parallelism.layout.samples_of(self.replica)[0]
        micro_inputs, micro_targets = replica_microbatches(
            self.model.work.batch, step, self.spec.dp, samples, m, b, self.model.where, self.model.context
        )
        self.optimizer.joint.zero_grad()
        self.groups.buckets.zero()
        if self.groups.tensor is not None:
            self.groups.tensor.sent_bytes = 0
        if self.model.context is not None:
            self.model.context.sent_bytes = 0
        if self.groups.experts is not None:
            self.groups.experts.traffic.reset(self.groups.experts.num_experts)
        if self.optimizer.scaler is not None:
            self.executor.grad_scale = self.optimizer.scaler.scale
            self.result.loss_scales.append(self.optimizer.scaler.scale)
        self.result.learning_rates.append(self.optimizer.learning.current)
        self._marks["piped"] = self.executor.clock.mark()
        return micro_inputs, micro_targets

    def pipeline_done(self) -> None:
        self._marks["reducing"] = self.executor.clock.mark()

    def step_optimizer(self, step: int, reduce: Callable[[str, Callable[[], None]], None]) -> None:
        """After the gradient buckets are summed: faults (tests), ZeRO's reduction, unscaling,
        recording, the optimizer step (or the sync's, which may skip or roll back)."""
        _inject_faults(self.spec.gradient_faults, step, self.model.stages)
        reduce("the data-parallel reduction of the sharded gradients", self.optimizer.joint.reduce)
        self._marks["stepping"] = self.executor.clock.mark()
        if self.optimizer.scaler is not None:
            self.optimizer.joint.scale(1.0 / self.optimizer.scaler.scale)
        if self.spec.record_gradients:  # tests only: kept on the host, overwritten once a step
            self.result.gradients = {
                s: {
                    n: self.model.placements.whole(t, grad).detach().float().cpu().clone()
                    for n, t in module.named_parameters()
                    if (grad := grad_of(t)) is not None
                }
                for s, module in self.model.stages.items()
            }
        if self.optimizer.sync is not None:  # the host steps offloaded stages while this rank goes on
            self.optimizer.sync.step(step)
        else:
            self.optimizer.joint.step()
        self.optimizer.learning.step()
        self._marks["stepped"] = self.executor.clock.mark()

    def end_step(self, step: int, record: StepRecord, loss: float) -> None:
        """Book the step (its loss summed over every rank) and save a checkpoint when one is due."""
        marks, result = self._marks, self.result
        record.settle()  # after the step's read of the device: a GPU has passed its events
        record.grad_sync_starts = tuple((stages, when - record.began) for stages, when in self.groups.buckets.started)
        if self.groups.tensor is not None:
            record.tp_sent_bytes = self.groups.tensor.sent_bytes
        if self.model.context is not None:
            record.kv_sent_bytes = self.model.context.sent_bytes
        if self.groups.experts is not None:
            traffic = self.groups.experts.traffic
            traffic.settle(self.groups.experts.clock)  # after the step's read of the device: its events are passed
            record.a2a_sent_bytes, record.expert_tokens = traffic.sent_bytes, tuple(traffic.tokens)
            record.a2a_ms, record.a2a_exposed_ms = 1e3 * traffic.flight_s, 1e3 * traffic.exposed_s
            record.a2a_forward_ms = 1e3 * traffic.forward_flight_s
            record.a2a_overlapped_ms = 1e3 * traffic.overlapped_flight_s
        result.losses.append(loss)
        result.step_seconds.append(time.perf_counter() - self._began)  # wall time: the step ended with a read
        seconds = self.executor.clock.seconds
        result.phase_seconds.append(
            {
                "pipeline": seconds(marks["piped"], marks["reducing"]),
                "allreduce": seconds(marks["reducing"], marks["stepping"]),
                "optimizer": seconds(marks["stepping"], marks["stepped"]),
                "overhead": result.step_seconds[-1] - seconds(marks["piped"], marks["stepped"]),
            }
        )
        result.records.append(record)
        if self.services.progress is not None:
            self.services.progress(step)
        if self.services.log is not None:
            self.services.log.step(
                step + 1, step_facts(result, record, result.learning_rates[-1], self.spec.peak_tflops)
            )
        checkpoints = self.spec.checkpoints
        done = step + 1
        if checkpoints.every and checkpoints.directory and (done % checkpoints.every == 0 or done == self.spec.steps):
            save_rank(self, checkpoints.directory, done)

    def end_evaluation(self, step: int, loss: float, seconds: float) -> None:
        """Book the held-out loss after step `step` (summed over the ranks, mean over batches)
        and the evaluation's wall time."""
        self.result.eval_losses.append((step + 1, loss))
        self.result.eval_seconds.append(seconds)
        if self.services.log is not None:
            self.services.log.step(step + 1, {"eval_loss": loss, "eval_perplexity": perplexity(loss)})
        if self.spec.report and self.rank == 0:
            print(f"eval after {step + 1} steps: loss {loss:.4f}, perplexity {perplexity(loss):.2f}", flush=True)

    # -- teardown --------------------------------------------------------------------------------

    def tear_down(self) -> RankResult:
        result = self.result
        if self.optimizer.sync is not None:
            result.rollbacks, result.skipped_steps = self.optimizer.sync.rollbacks, self.optimizer.sync.skipped
            result.grad_norms = self.optimizer.sync.norms
        if self.services.progress is not None:
            self.services.progress(None)
        if self.services.log is not None:
            self.services.log.close()
        if self.optimizer.host is not None:
            self.optimizer.host.finish()
            result.offload_events = self.optimizer.host.events
        if self.model.where.type == "cuda":
            result.peak_memory_bytes = int(torch.cuda.max_memory_allocated(self.model.where))
        result.static_bytes, result.planned_static_bytes = rank_static_bytes(
            self.spec.parallelism,
            self.optimizer.stepper,
            self.optimizer.host,
            self.optimizer.parameters,
            self.model.precision,
        )
        result.placements = self.model.placements.records()
        result.held_bytes = census(self).to_dict()
        result.peak_host_bytes = peak_resident_bytes()
        if self.spec.return_parameters:  # once, after the last step: the final weights, on the host
            result.parameters = {
                s: {n: self.model.placements.whole(t, t.detach()).cpu().clone() for n, t in module.named_parameters()}
                for s, module in self.model.stages.items()
            }
        return result

    def loss_shares(self, record: StepRecord) -> torch.Tensor:
        """[what this rank adds to the step's loss summed over every rank, this device's own
        loss], float64 on the device: the last stage's loss, counted by one rank of its tensor-
        parallel group (all of them computed it). The caller sums the first over the ranks."""
        own = record.loss_sum
        if own is None:  # no last stage here
            own = torch.zeros((), dtype=torch.float64, device=self.model.where)
        counted = own if self.groups.tensor is None or self.groups.tensor.index == 0 else torch.zeros_like(own)
        return torch.stack((counted, own))

    def settle_step(self, record: StepRecord, shares: torch.Tensor) -> float:
        """The step's one read of the device, after the pipeline and the optimizer: the loss
        (`shares` from `loss_shares`, its first summed over the ranks) and the optimizer sync's
        decisions, in one transfer. Returns the step's loss."""
        parts = [shares, *(self.optimizer.sync.to_read() if self.optimizer.sync is not None else [])]
        # the step's only read of the device (once a step, after the optimizer: no op waits on it)
        values = torch.cat([part.reshape(-1).to(torch.float64) for part in parts]).tolist()
        record.loss, record.loss_sum = values[1], None  # the record goes to the report: no device tensor
        if self.optimizer.sync is not None:
            self.optimizer.sync.settle(values[2:])
        return values[0]


def _inject_faults(faults: tuple[tuple[int, int, str, float], ...], step: int, stages: dict) -> None:
    """Tests' gradient faults: (step, stage, "nan", "inf" or "scale", factor)."""
    for when, stage, kind, factor in faults:
        if when != step or stage not in stages:
            continue
        grads = [grad for t in stages[stage].parameters() if (grad := grad_of(t)) is not None]
        if kind == "nan":
            grads[0].view(-1)[0] = float("nan")
        elif kind == "inf":
            grads[0].view(-1)[0] = float("inf")
        else:
            for grad in grads:
                grad.mul_(factor)
