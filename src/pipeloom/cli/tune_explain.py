"""`tune --explain`: why the plan `tune` chose beat the others — its tp, cp and ep against their
neighbours on the links each group spans, its static-memory measure, and each runner-up's loss."""

from __future__ import annotations

import math
from dataclasses import replace

from pipeloom.provenance import byte_size

__all__ = ["explain", "split_lines", "static_measures_line"]


def explain(result, memory: float, cost_model) -> str:
    """`tune --explain`: why the best plan's split beat its neighbours, which static-memory
    measure it needs, why no pipeline (where it has none), and why each runner-up lost."""
    best = result.best
    lines = ["", *split_lines(result), static_measures_line(best, memory)]
    if best.candidate.pp == 1:
        lines.append(no_pipeline_line(result, memory, cost_model))
    lines += ["", "why the others lost:"]
    for e in result.ranked[1:]:
        lines.append(f"  {e.candidate.label}: {_lost_on(e, best)}")
    unfit = {label: (step, why) for e in result.ranked + result.rejected for label, step, why in e.unfit}
    faster = sorted((step, label, why) for label, (step, why) in unfit.items() if step < best.step_time)
    for step, label, why in faster[:5]:
        lines.append(f"  {label}: memory, would be {1 - step / best.step_time:.1%} faster but {why[8:]}")
    if lines[-1] == "why the others lost:":
        lines.append("  (no other candidate came close)")
    return "\n".join(lines)


def _lost_on(e, best) -> str:
    """Why a ranked plan is not first: slower, or — predicted faster — priced beyond the profile,
    or within the profile's noise of the first and less robust (`tune.confidence`)."""
    if e.step_time >= best.step_time:
        return f"time, {e.step_time / best.step_time - 1:+.1%} step time"
    faster = f"predicted {1 - e.step_time / best.step_time:.1%} faster"
    if e.extrapolated and not best.extrapolated:
        return f"beyond the profile, {faster} but priced on {'; '.join(e.extrapolated)}"
    from pipeloom.provenance import byte_size
    from pipeloom.tune.confidence import robustness

    (best_memory, best_pp), (memory, pp) = robustness(best), robustness(e)
    why = (
        f"less peak memory ({byte_size(best_memory)} against {byte_size(memory)})"
        if best_memory < memory
        else f"fewer pipeline ranks ({best_pp} against {pp})"
    )
    return f"near-tie, {faster}, within the profile's noise of the first, which needs {why}"


def no_pipeline_line(result, memory: float, cost_model) -> str:
    """Why pure data parallelism won: what the best pipeline would cost here, and where."""
    from pipeloom.tune.search import evaluate
    from pipeloom.tune.space import Candidate

    best = result.best
    piped = next((e for e in result.ranked if e.candidate.pp > 1), None)
    if piped is None and best.candidate.dp % 2 == 0:  # the shortest pipeline on the same devices
        dp = best.candidate.dp // 2
        batch = best.candidate.micro_batch * best.candidate.num_microbatches * best.candidate.dp
        mbs = best.candidate.micro_batch
        candidate = Candidate("1f1b", 2, dp, mbs, batch // (dp * mbs), split=best.candidate.split)
        piped = evaluate(candidate, cost_model, memory)
    if piped is None or not piped.feasible:
        return "why no pipeline: no pipelined plan fits here"
    return (
        f"why no pipeline: the best pipeline here, {piped.candidate.label}, takes {piped.step_time:.1f} ms per step "
        f"({piped.step_time / best.step_time - 1:+.1%}): its devices idle {piped.bubble_rate:.0%} of the pipeline, "
        f"more than the all-reduce it shrinks saves ({best.allreduce_time:.1f} → {piped.allreduce_time:.1f} ms)"
    )


def static_measures_line(evaluation, memory: float) -> str:
    """Which static-memory measure a plan needs, what it saves over none, and what it costs."""
    chosen, options = evaluation.static_option, evaluation.options
    if chosen is None or not options:
        return "static memory: as planned by the cost model"
    plain = options[0]
    plain_size, own = byte_size(max(plain.static_memory), 2), byte_size(max(evaluation.static_memory), 2)
    if chosen is plain:
        return (
            f"static memory: no measure needed — fp32 weights and AdamW on every replica, {own} per device at "
            f"most (ZeRO-0), within {byte_size(memory, 2)}"
        )
    extra = chosen.allreduce_time + chosen.optimizer_time - plain.allreduce_time - plain.optimizer_time
    if chosen.offload_all:
        extra += evaluation.offload.delay if evaluation.offload else 0.0
        what = "every stage's fp32 master weights and AdamW on the host, stepped in bubbles"
    elif chosen.zero == 1:
        what = f"bf16 weights, fp32 master weights and AdamW sharded over dp={evaluation.candidate.dp}"
    else:
        what = f"bf16 weights and gradients, master weights, AdamW and the fp32 gradient reduce-scattered over dp={evaluation.candidate.dp}"
    if chosen.offload_all:
        price = f"costing {extra:.2f} ms per step (host copies and steps outside the bubbles)"
    elif extra > 0:
        price = f"costing {extra:.2f} ms per step (the all-gather of the weights outweighs the 1/dp optimizer step)"
    else:
        price = f"saving {-extra:.2f} ms per step (the 1/dp optimizer step outweighs the all-gather of the weights)"
    return (
        f"static memory: {chosen.label} — {what}: {own} per device at most instead of {plain_size} under "
        f"ZeRO-0, {price}"
    )


def split_lines(result) -> list[str]:
    """Why the best plan's split (tp, cp, ep) beat the splits one step away in each dimension:
    each one's fastest plan, or the least its plans' bounds allowed, and the links its groups
    span; [] when the search weighed one split."""
    outcomes = {outcome.split: outcome for outcome in result.splits}
    if len(outcomes) < 2:
        return []
    best = result.best
    mine = best.candidate.split
    searched = "; ".join(
        f"{name} {', '.join(map(str, sorted({getattr(split, name) for split in outcomes})))}"
        for name in ("tp", "cp", "ep")
    )
    lines = [f"why {mine.label or 'tp=1 cp=1'} (searched {searched}): {_split_facts(outcomes[mine].cost_model, best)}"]
    for name in ("tp", "cp", "ep"):
        values = sorted({getattr(split, name) for split in outcomes})
        index = values.index(getattr(mine, name))
        for value in values[max(index - 1, 0) : index] + values[index + 1 : index + 2]:
            neighbour = outcomes.get(replace(mine, **{name: value}))
            if neighbour is not None:
                lines.append(f"  {name}={value}: {_neighbour(neighbour, best, result)}")
    return lines + [""]


def _neighbour(outcome, best, result) -> str:
    if outcome.fastest is not None:
        e = outcome.fastest
        return (
            f"{e.step_time / best.step_time - 1:+.1%} step time at best ({e.candidate.label}, {e.step_time:.1f} ms): "
            f"{_split_facts(outcome.cost_model, e)}"
        )
    if math.isfinite(outcome.floor):
        return (
            f"at least {outcome.floor / best.step_time - 1:+.1%} step time ({outcome.floor:.1f} ms, its plans' lower "
            "bound: none came close enough to simulate)"
        )
    why = next((e.reason for e in result.rejected if e.candidate.split == outcome.split), "no plan of it fits")
    return f"none fits ({why})"


def _split_facts(cost_model, evaluation) -> str:
    """The links a plan's groups span and what a layer's exchanges cost on them, beside its compute."""
    candidate = evaluation.candidate
    split, mbs = candidate.split, candidate.micro_batch
    links = cost_model.links(candidate.dp, candidate.pp) if hasattr(cost_model, "links") else {}
    sizes = {"tp": split.tp, "cp": split.cp, "ep": split.ep, "dp": candidate.dp * split.cp, "pp": candidate.pp}
    spans = [
        f"{'pipeline' if name == 'pp' else name + ' group'} of {sizes[name]} on {links[name].describe()}"
        for name in ("tp", "cp", "ep", "dp", "pp")
        if name in links and sizes[name] > 1
    ]
    exchanges = cost_model.exchange_times(mbs) if hasattr(cost_model, "exchange_times") else {}
    layer = cost_model.layer_time(mbs)
    exchanged = sum(forward + backward for forward, backward in exchanges.values())
    what = {"tp": "tp collectives", "cp": "K/V exchange"}
    per_layer = ", ".join(
        [f"compute {layer - exchanged:.2f} ms"]
        + [f"{what[name]} {forward + backward:.2f} ms" for name, (forward, backward) in exchanges.items()]
    )
    return "; ".join(spans + [f"a layer's F+B+W on a micro-batch of {mbs}: {per_layer}"])
