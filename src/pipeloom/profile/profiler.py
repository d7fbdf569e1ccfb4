"""Measure the real model on this machine, as the plans will run it (Mario §5.2).

Each probe trains the model for a few steps with the pipeloom runtime on forked gloo ranks (or,
`--device cuda`, every stage in this process on the one GPU); its schedule runs every pass the
simulator knows — F, B and W split, the last micro-batch checkpointed so that R and a
checkpointed F's stash appear too. Every layout a plan may hold is measured one way
(`layouts`): the plain probes, and those in slices, on tp ranks, or on replicas sharing out a
mixture's experts. The probes take turns, a round of each at a time, under one policy
(`steadiness`): warm-up left out, a round in which another process took the cores run again, a
step in a slow spell of the host left out of every median, rounds until the medians settle. p2p
and the collectives are measured on their own (`links`), and the probes' phases give what the
runtime adds beyond the ops (`overheads`).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch

from pipeloom.costs import Costs
from pipeloom.errors import ConfigError, RuntimeFault
from pipeloom.models.llama import build_stages, llama_config
from pipeloom.profile.layouts import EP, REPLICA_ROUNDS, layout_spec, measure_layout, replica_waits
from pipeloom.profile.links import in_process_links, measure_links, ping_seconds
from pipeloom.profile.overheads import linear_fit, op_overhead_ms, serial_op_overhead_ms
from pipeloom.profile.probe_rounds import OP_KINDS, Probe, ProbeModel, Turns, probe_schedule
from pipeloom.profile.steadiness import Contention
from pipeloom.profile_format import DeviceInfo, Layout, LinearCost, Noise, Overheads, Params, Profile, ReplicaWait
from pipeloom.tune.pool import default_jobs
from pipeloom.tune.presets import ModelSpec
from pipeloom.tune.profiled import ProfiledCostModel

__all__ = ["profile_model", "ping_seconds", "probe_schedule"]

STATIC_BYTES_PER_PARAM = 16
"""fp32 weights, gradients and AdamW's two moments: what the runtime holds per parameter."""


def profile_model(
    model: ModelSpec,
    micro_batches: Sequence[int] = (1, 2),
    layer_counts: Sequence[int] = (1, 2, 3),
    steps: int = 4,
    threads: int = 1,
    progress: Callable[[int, int], None] | None = None,
    workload_for: Callable[[int, int], object] | None = None,
    dtype: str = "fp32",
    max_rounds: int = 4,
    allow_busy: bool = False,
    tensor_parallel: Sequence[tuple[int, bool]] = (),
    context_parallel: Sequence[int] = (),
    slices: Sequence[int] = (),
    device: str = "cpu",
    in_process: bool | None = None,
) -> Profile:
    """The profile of `model`'s decoder, or of `workload_for(layers, micro-batch size)`'s model
    (a Hugging Face one: `models.hf.hf_workload`). Each probe times `steps` steps a round, in at
    most `max_rounds` rounds. RuntimeFault if the machine is too busy to measure, unless
    `allow_busy`. Measured beside the plain layout: `tensor_parallel`'s (tp, sequence parallel)
    layouts, `context_parallel`'s cp sizes, `slices`' slice counts, and a mixture's experts
    shared out. `in_process` (by default on "cuda"): every stage of a probe on the one device,
    each op timed by its events, so no layout that needs ranks of its own, and no replicas'
    wait (they run one after the other)."""
    in_process = device == "cuda" if in_process is None else in_process
    mixture = workload_for is not None and getattr(workload_for(1, 1), "experts", None) is not None
    if in_process:
        _check_in_process(device, bool(tensor_parallel or context_parallel), mixture, dtype)
    if (tensor_parallel or context_parallel) and workload_for is None:
        raise ConfigError(
            "profile: tensor and context parallelism are measured on Hugging Face models (--model hf:DIR)"
        )
    ranked = [Layout(tp, sequence_parallel) for tp, sequence_parallel in tensor_parallel]
    ranked += [Layout(cp=cp) for cp in context_parallel]
    ranked += [Layout(ep=EP)] if mixture and not in_process else []
    total = len(micro_batches) * len(layer_counts) * max_rounds * (1 + len(slices) + len(ranked)) + 1
    busy = Contention(allow=allow_busy)
    checked = busy if device == "cpu" else None  # a GPU's kernels run beside their host thread's CPU time
    probed = ProbeModel(model, steps, threads, workload_for, dtype, None if device == "cpu" else device)
    done = [0]

    def tick() -> None:
        done[0] += 1
        if progress:
            progress(min(done[0], total - 1), total)

    from pipeloom.runtime.spec_checks import check_spec

    for layout in [Layout(), *(Layout(slices=count) for count in slices), *ranked]:  # refused before any probe runs
        spec = layout_spec(layout, probed, max(micro_batches), max(layer_counts))
        check_spec(spec, spec.parallelism.layout.world_size, on_this_device=False)
    turns = Turns(max_rounds, busy=checked, tick=tick, in_process=in_process)
    plain, measured = measure_layout(Layout(), probed, micro_batches, layer_counts, turns)
    layouts = {Layout(): plain}
    for layout in [Layout(slices=count) for count in slices] + ranked:
        layouts[layout] = measure_layout(layout, probed, micro_batches, layer_counts, turns)[0]
    if not in_process:  # the replicas' waits, at the plans' size: the least fixed cost per pipeline ms
        largest = (max(micro_batches), max(layer_counts))
        paired = turns.fixed(min(REPLICA_ROUNDS, max_rounds))
        for layout in [Layout(), *(layout for layout in ranked if layout.ep > 1)]:
            layouts[layout] = replace(layouts[layout], waits=replica_waits(layout, probed, *largest, paired))
    if progress:
        progress(total, total)
    forked = not in_process and device == "cpu"
    crowded = crowded_probes([Layout(), *ranked], threads, default_jobs()) if forked else None
    profile = Profile(
        model=model,
        device=_device_info(device, threads, dtype, in_process),
        dtype=dtype,
        params=_params(model, workload_for),
        static_bytes_per_param=STATIC_BYTES_PER_PARAM,
        links=in_process_links(torch.device(device)) if in_process else measure_links(),
        overheads=Overheads(LinearCost(0.0)),  # fitted below, from the probes priced by this profile
        layouts=layouts,
        noise=_noise(measured, checked),
        warnings=tuple(text for text in (busy.warning(), crowded) if text),
    )
    profile = replace(profile, overheads=_runtime_overheads(profile, measured, in_process))
    try:  # what `tune` will refuse is never written: the fits are constrained, this is the proof
        Profile.from_dict(profile.to_dict())
    except ConfigError as error:
        raise RuntimeFault(
            f"{error.summary} — the measurements did not settle into usable numbers; "
            "profile again on a quieter machine, or with more --steps"
        ) from None
    return profile


def _check_in_process(device: str, split: bool, mixture: bool, dtype: str) -> None:
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("profile --device cuda: torch sees no CUDA device here")
    if dtype == "fp16":
        raise ConfigError("profile: fp16's loss scaling is measured on ranks of their own, not in one process")
    if split:
        raise ConfigError(
            "profile: tensor and context parallelism are measured on ranks of their own, not in one process (--tp, --cp)"
        )
    if mixture:
        raise ConfigError(
            "profile: a mixture of experts' all-to-alls are measured on ranks of their own, not in one process"
        )


def crowded_probes(layouts: Sequence[Layout], threads: int, cores: int) -> str | None:
    """What to say where a layout's probes ran more ranks × threads than the machine has cores
    (`profile --tp 4` on two): its ranks shared the cores, so its ops read slower than on ranks
    of a core each — what `tune` assumes of a plan (`cli.tune.shared_cores`)."""
    ranks = {layout.key: layout.stages * layout.tp * layout.ep * layout.cp for layout in layouts}
    crowded = [key for key, count in ranks.items() if count * threads > cores]
    if not crowded:
        return None
    named = ", ".join(f"{key} ({ranks[key]} ranks)" for key in crowded)
    return (
        f"the probes of {named} ran {threads} thread(s) a rank on {cores} cores: their ranks shared the cores, so "
        "their ops read slower than a rank of its own cores runs them"
    )


def _device_info(device: str, threads: int, dtype: str, in_process: bool) -> DeviceInfo:
    if device == "cuda":
        return DeviceInfo("cuda", f"{torch.cuda.get_device_name()}, every stage in one process, {dtype}")
    where = "every rank in one process" if in_process else "per rank"
    return DeviceInfo("cpu", f"cpu, {threads} thread(s) {where}, {dtype}", threads, default_jobs())


def _runtime_overheads(profile: Profile, measured: dict, in_process: bool) -> Overheads:
    """Per-op overhead, optimizer step and step overhead, from every probe's phases (a probe run
    `in_process` ran its ops one after another)."""
    model = ProfiledCostModel(profile)
    epsilons, optimizer, rest = [], [], []
    fit = serial_op_overhead_ms if in_process else op_overhead_ms
    for (mbs, n), probe in measured.items():
        p = probe.schedule.num_devices
        costs = _probe_costs(probe, p, model.stage_costs([n] * p, mbs, p, 1))
        epsilons.append(fit(probe.schedule, costs, probe.median("pipeline")))
        optimizer.append((model.stage_params([n] * p)[0], probe.median("optimizer")))
        rest.append(probe.median("overhead"))
    base, per_param = linear_fit(optimizer)
    return Overheads(
        op_ms=max(0.0, statistics.median(epsilons)),
        optimizer=LinearCost(base, per_param),
        step=step_overhead(statistics.median(rest), profile.plain.waits.get(0), model),
    )


def step_overhead(plain_ms: float, wait: ReplicaWait | None, model: ProfiledCostModel) -> LinearCost:
    """The rest of a step: the plain probes' (no replicas, no gradient buffers to zero) as its
    base, and per parameter the replicas' probe's excess over it, that probe's one stage holding
    every parameter (each summed, so each zeroed) once."""
    if wait is None:  # measured in one process: no replicas waiting
        return LinearCost(plain_ms)
    zeroed = model.stage_params([wait.layers])[0] - model.tied_params()
    return LinearCost(plain_ms, max(0.0, wait.overhead_ms - plain_ms) / zeroed)


def _probe_costs(probe: Probe, p: int, fitted: Costs) -> Costs:
    """The probe's own measured op times per stage (not the fit's), with the fitted rest."""
    times: dict[str, Any] = {
        kind: [probe.median(f"{kind}@{rank}") for rank in range(p)]
        for kind in OP_KINDS
        if all(f"{kind}@{rank}" in probe.values for rank in range(p))
    }
    return replace(fitted, **times)


def _noise(measured: dict, busy: Contention | None) -> Noise:
    """How noisy the machine was: the op times' spread over probes, the rounds they took, and
    what the contention check saw (None: nothing judged, on a GPU)."""
    spreads = [probe.spread for probe in measured.values()]
    noise = Noise(
        median_spread=statistics.median(spreads),
        worst_spread=max(spreads),
        rounds=sum(probe.rounds for probe in measured.values()),
        probes=len(measured),
        steady_share=statistics.median(probe.steady for probe in measured.values()),
        unsettled=sum(1 for probe in measured.values() if not all(m.stable for m in probe.values.values())),
    )
    return busy.described(noise) if busy is not None else noise


def _params(model: ModelSpec, workload_for=None) -> Params:
    """Parameters of one decoder layer (a MoE layer's routed experts and their block apart), of
    the first stage's extras (embeddings) and of the last stage's (final norm and head; a tied
    head counts on both ends, and `tied` says how much of them is one object where a device
    hosts both)."""
    if workload_for is None:
        stage = build_stages(llama_config(model, 1, 1), 1, seed=0)[0]
    else:
        stage = workload_for(1, 1).build(1)[0]

    def count(*modules) -> int:
        return sum(t.numel() for module in modules if module is not None for t in module.parameters())

    first = count(stage.embed, getattr(stage, "positions", None))
    # a MoE layer's routed experts, which expert parallelism shares out, and their block, which tp does not cut
    block = getattr(stage.layers[0], "mlp", None)
    experts = getattr(block, "experts", None)
    head = {id(t) for t in stage.head.parameters()} if stage.head is not None else set()
    embed = list(stage.embed.parameters()) if stage.embed is not None else []
    tied: int = sum(t.numel() for t in embed if id(t) in head)  # one object at both ends
    last = count(stage.norm, stage.head)
    routed = count(experts) if experts else 0
    return Params(count(stage.layers[0]), first, last, routed, tied, count(block) if experts else 0)
