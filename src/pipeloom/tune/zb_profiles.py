"""The Zero Bubble paper's measured setups (Tables 3 and 6), as Costs.

Times are the profiled T_F, T_B, T_W, T_comm of one pipeline stage (ms) for each model, stage
count and micro-batch count. Memory follows Table 1 per transformer layer: M_B = sb(34h + 5as),
M_W = 32sbh; in units of M_B, M_W = 32h / (34h + 5as) — the common factor sb and the layer count
cancel.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeloom.costs import Costs

__all__ = ["ZBProfile", "ZB_PROFILES", "PAPER_TABLE5", "AUTHORS_V", "table6_profile"]


@dataclass(frozen=True)
class ZBProfile:
    model: str
    num_devices: int
    num_microbatches: int
    T_F: float
    T_B: float
    T_W: float
    T_comm: float
    hidden: int
    heads: int
    layers: int
    seq_len: int = 1024

    @property
    def interleaved_chunks(self) -> int:
        """Chunks per device for 1F1B-I, which the paper runs with one layer per chunk."""
        return max(1, round(self.layers / self.num_devices))

    @property
    def costs(self) -> Costs:
        """One stage's costs in units of M_B."""
        m_w = 32 * self.hidden / (34 * self.hidden + 5 * self.heads * self.seq_len)
        return Costs(F=self.T_F, B=self.T_B, W=self.T_W, comm=self.T_comm, M_B=1.0, M_W=m_w)


_MODELS = {"1.5B": (2304, 24, 22), "6.2B": (4096, 32, 30), "14.6B": (5120, 40, 46), "28.3B": (6144, 48, 62)}
_TABLE6 = [
    ("1.5B", 8, 24, 18.522, 18.086, 9.337, 0.601),
    ("1.5B", 8, 32, 18.513, 18.086, 9.331, 0.626),
    ("1.5B", 8, 64, 18.546, 18.097, 9.321, 0.762),
    ("6.2B", 8, 24, 29.718, 29.444, 19.927, 0.527),
    ("6.2B", 8, 32, 29.802, 29.428, 19.530, 0.577),
    ("6.2B", 8, 64, 29.935, 29.621, 19.388, 0.535),
    ("14.6B", 16, 48, 11.347, 11.248, 8.132, 0.377),
    ("14.6B", 16, 64, 11.307, 11.254, 8.101, 0.379),
    ("14.6B", 16, 128, 11.325, 11.308, 8.109, 0.378),
    ("28.3B", 32, 96, 10.419, 10.207, 7.715, 0.408),
    ("28.3B", 32, 128, 10.408, 10.204, 7.703, 0.408),
    ("28.3B", 32, 256, 10.402, 10.248, 7.698, 0.460),
]
ZB_PROFILES = [ZBProfile(name, p, m, f, b, w, c, *_MODELS[name]) for name, p, m, f, b, w, c in _TABLE6]

PAPER_TABLE5 = {
    # (model, m): bubble rates of 1F1B, 1F1B-I, ZB-H1, ZB-H2, ZB-1p, ZB-2p as printed (4 decimals)
    ("1.5B", 24): (0.2431, 0.1055, 0.1585, 0.1083, 0.1585, 0.0433),
    ("1.5B", 32): (0.1985, 0.0818, 0.1242, 0.0837, 0.1242, 0.0039),
    ("1.5B", 64): (0.1240, 0.0443, 0.0674, 0.0444, 0.0674, 0.0026),
    ("6.2B", 24): (0.2347, 0.0808, 0.1323, 0.0698, 0.1323, 0.0029),
    ("6.2B", 32): (0.1898, 0.0628, 0.1045, 0.0559, 0.1045, 0.0022),
    ("6.2B", 64): (0.1091, 0.0320, 0.0554, 0.0294, 0.0554, 0.0010),
    ("14.6B", 48): (0.2552, 0.1104, 0.1397, 0.0672, 0.1397, 0.0066),
    ("14.6B", 64): (0.2082, 0.0852, 0.1088, 0.0516, 0.1088, 0.0054),
    ("14.6B", 128): (0.1251, 0.0445, 0.0576, 0.0266, 0.0576, 0.0028),
    ("28.3B", 96): (0.2646, 0.1493, 0.1421, 0.0641, 0.1421, 0.0038),
    ("28.3B", 128): (0.2168, 0.1164, 0.1106, 0.0490, 0.1106, 0.0029),
    ("28.3B", 256): (0.1352, 0.0624, 0.0594, 0.0257, 0.0594, 0.0018),
}
"""Columns: 1f1b, interleaved, zb-h1, zb-h2, zb-1p, zb-2p."""

AUTHORS_V = {
    # (model, m): authors' schedule -> (bubble rate, peak activation memory in M_B)
    ("1.5B", 24): {"ZB-V": (0.0703, 8.0), "ZB-V@2p": (0.0076, 13.86), "V-Half": (0.1702, 5.0), "V-Min": (0.3353, 4.0)},
    ("1.5B", 32): {"ZB-V": (0.0543, 8.0), "ZB-V@2p": (0.0059, 15.88), "V-Half": (0.1339, 5.0), "V-Min": (0.3103, 4.0)},
    ("1.5B", 64): {"ZB-V": (0.0298, 8.0), "ZB-V@2p": (0.0031, 15.83), "V-Half": (0.0737, 5.0), "V-Min": (0.2758, 4.0)},
    ("6.2B", 24): {"ZB-V": (0.0403, 8.0), "ZB-V@2p": (0.0039, 14.92), "V-Half": (0.1447, 5.0), "V-Min": (0.2721, 4.0)},
    ("6.2B", 32): {"ZB-V": (0.0326, 8.0), "ZB-V@2p": (0.0032, 16.0), "V-Half": (0.1145, 5.0), "V-Min": (0.2496, 4.0)},
    ("6.2B", 64): {"ZB-V": (0.0166, 8.0), "ZB-V@2p": (0.0015, 16.0), "V-Half": (0.0607, 5.0), "V-Min": (0.2013, 4.0)},
    ("14.6B", 48): {
        "ZB-V": (0.0498, 16.0),
        "ZB-V@2p": (0.0038, 30.12),
        "V-Half": (0.1682, 9.0),
        "V-Min": (0.2927, 6.0),
    },
    ("14.6B", 64): {
        "ZB-V": (0.0381, 16.0),
        "ZB-V@2p": (0.0027, 31.92),
        "V-Half": (0.1318, 9.0),
        "V-Min": (0.2615, 6.0),
    },
    ("14.6B", 128): {
        "ZB-V": (0.0195, 16.0),
        "ZB-V@2p": (0.0013, 31.92),
        "V-Half": (0.0706, 9.0),
        "V-Min": (0.2085, 6.0),
    },
    ("28.3B", 96): {
        "ZB-V": (0.0531, 32.0),
        "ZB-V@2p": (0.0019, 60.81),
        "V-Half": (0.178, 17.0),
        "V-Min": (0.3027, 12.0),
    },
    ("28.3B", 128): {
        "ZB-V": (0.0404, 32.0),
        "ZB-V@2p": (0.0014, 63.84),
        "V-Half": (0.1398, 17.0),
        "V-Min": (0.2712, 12.0),
    },
    ("28.3B", 256): {
        "ZB-V": (0.022, 32.0),
        "ZB-V@2p": (0.0007, 63.91),
        "V-Half": (0.0765, 17.0),
        "V-Min": (0.2242, 12.0),
    },
}
"""The V family's authors' own schedules on Table 6's profiles, as pipeloom's simulator times them.

Obtained by running their public scheduler code (sail-sg/zero-bubble-pipeline-parallelism at
commit 064369d: `zbv.py` for ZB-V — under its default p·M_B, and under 2p·M_B as "ZB-V@2p" —
and `zbv_greedy.py` for V-Half and V-Min) on each profile's T_F, T_B, T_W, T_comm and M_W, given
both as whole-stage and as per-chunk times (the better kept), and simulating the orders it
returns. The 1.5B m=24 row is the issue's table (0.0703, 0.1702, 0.3353). Reference data for
comparisons, as PAPER_TABLE5 is; none of pipeloom's schedules reads it."""


def table6_profile(num_devices: int, num_microbatches: int, costs: Costs) -> ZBProfile | None:
    """The Table 6 profile these are, if any: the same p and m, and T_F, T_B, T_W, T_comm, M_B and
    M_W as given (to 0.5 %, so values typed with three decimals match)."""
    keys = ("F", "B", "W", "comm", "M_B", "M_W")
    for prof in ZB_PROFILES:
        if (prof.num_devices, prof.num_microbatches) != (num_devices, num_microbatches):
            continue
        theirs = prof.costs
        if all(_close(getattr(costs, key), getattr(theirs, key)) for key in keys):
            return prof
    return None


def _close(ours, theirs) -> bool:
    return isinstance(ours, (int, float)) and abs(ours - theirs) <= 5e-3 * abs(theirs)
