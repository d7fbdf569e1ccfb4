"""Gradient buckets whose gradients are views of one flat buffer: summed in place, like copies."""

import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402

from pipeloom import build_schedule  # noqa: E402
from pipeloom.runtime.gradients import GradientBuckets, reduce_in_process  # noqa: E402


def _replica(rank: int, held=lambda stage: ()):
    """Replica `rank` of a one-stage model on dp = 2: its stage and its gradient buckets."""
    torch.manual_seed(0)
    stage = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    buckets = GradientBuckets(build_schedule("1f1b", 1, 2), 2, [stage], rank, new_group=lambda ranks: None)
    buckets.keep_in_place({id(parameter) for parameter in held(stage)})
    buckets.zero()
    return stage, buckets


def _backward(stage: nn.Module, rank: int, steps: int = 2) -> None:
    """Two micro-batches' gradients accumulated, different on each replica."""
    for microbatch in range(steps):
        inputs = torch.arange(8.0).reshape(2, 4) * (rank + 1) + microbatch
        stage(inputs).square().sum().backward()


def _summed_by_hand() -> dict[str, torch.Tensor]:
    total: dict[str, torch.Tensor] = {}
    for rank in range(2):
        torch.manual_seed(0)
        stage = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
        _backward(stage, rank)
        for name, parameter in stage.named_parameters():
            total[name] = total.get(name, 0) + parameter.grad
    return total


def _reduce_and_check(replicas) -> None:
    """The replicas' buckets summed as the ranks' all-reduces would: every gradient the sum."""
    reduce_in_process([buckets for _, buckets in replicas])
    expected = _summed_by_hand()
    for stage, _ in replicas:
        for name, parameter in stage.named_parameters():
            torch.testing.assert_close(parameter.grad, expected[name], rtol=0, atol=0)


def test_bucketed_gradients_are_views_of_one_buffer_and_sum_in_place():
    replicas = [_replica(rank) for rank in range(2)]
    for rank, (stage, buckets) in enumerate(replicas):
        (store,) = buckets.stores.values()
        flat = store.flat
        for parameter in stage.parameters():
            assert parameter.grad.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
        _backward(stage, rank)
    _reduce_and_check(replicas)
    for stage, buckets in replicas:
        buckets.zero()  # the next step starts from zeros in the same buffer
        assert all(not parameter.grad.any() for parameter in stage.parameters())
        assert next(iter(buckets.stores.values())).flat.abs().sum() == 0


def test_a_bucket_holding_a_parameter_another_buffer_holds_keeps_copying():
    replicas = [_replica(rank, held=lambda stage: [stage[1].bias]) for rank in range(2)]
    for rank, (stage, buckets) in enumerate(replicas):
        assert buckets.stores == {}
        _backward(stage, rank)
    _reduce_and_check(replicas)
