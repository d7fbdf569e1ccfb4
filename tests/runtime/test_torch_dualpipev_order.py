"""torch's own DualPipeV order (ScheduleDualPipeV), read back through its CSV form, is pipeloom's
`dualpipev` op for op, pairs included, and so simulates to the same makespan."""

from types import SimpleNamespace

import pytest

pytest.importorskip("torch")

from torch.distributed.pipelining.schedules import ScheduleDualPipeV  # noqa: E402

from pipeloom import Costs, build_schedule, simulate  # noqa: E402
from pipeloom.ir.torch_csv import from_torch_csv, to_torch_csv  # noqa: E402


def torch_order_csv(p: int, m: int) -> str:
    """The rows torch computes on each rank (its action strings, OVERLAP_F_B cells included);
    the order needs only the group size and micro-batch count, not real stages."""
    sizes = SimpleNamespace(pp_group_size=p, _n_microbatches=m)
    rows = [ScheduleDualPipeV._calculate_single_rank_operations(sizes, rank) for rank in range(p)]
    return "".join(",".join(str(action) for action in row) + "\n" for row in rows)


@pytest.mark.parametrize("p, m", [(1, 2), (2, 4), (2, 7), (4, 7), (4, 8), (4, 13), (8, 16), (8, 24)])
def test_torch_dualpipev_is_ours(p, m):
    text = torch_order_csv(p, m)
    assert "OVERLAP_F_B" in text or p == 1
    theirs = from_torch_csv(text)
    ours = build_schedule("dualpipev", p, m)
    assert theirs.devices == ours.devices
    assert to_torch_csv(ours) == text
    for costs in (Costs(F=1, B=1, W=1), Costs(F=1, B=1.5, W=0.5, comm=0.2, a2a_F=0.3, a2a_B=0.4)):
        assert simulate(theirs, costs).makespan == simulate(ours, costs).makespan
