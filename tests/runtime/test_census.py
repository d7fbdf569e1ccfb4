"""The census of what a rank holds counts every storage reachable from its objects once, stray
copies included (the pp × tp and pp × dp × ep runs check it against the plan)."""

from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from pipeloom.runtime.census import census  # noqa: E402
from pipeloom.runtime.placement import WeightPlacements  # noqa: E402
from pipeloom.runtime.rank import RankGroups, RankModel, RankServices  # noqa: E402


def test_the_census_counts_every_reachable_storage_once_and_finds_a_hidden_copy():
    layer = torch.nn.Linear(8, 4, bias=False)
    layer.register_buffer("scale", torch.ones(3))
    view = layer.weight.detach()[:2]  # a view: the weight's storage, not counted again
    model = RankModel(
        work=None,
        stages={0: layer},
        names={},
        whole_names=frozenset(),
        placements=WeightPlacements({}),
        precision=None,
        where=None,
    )
    groups = RankGroups(transport=None, buckets=None, mail=None)
    run = SimpleNamespace(model=model, groups=groups, services=RankServices(), result=None, kept=[view])
    held = census(run)
    assert (held.parameters, held.buffers) == (4 * 8 * 4, 3 * 4)

    full = torch.zeros(16, 8)  # a full weight a hook kept alive in its closure
    layer.register_forward_hook(lambda module, args, out: out + full.sum())
    layer.weight.grad = torch.zeros(4, 8)
    assert census(run).parameters == 4 * 8 * 4 * 2 + 16 * 8 * 4
