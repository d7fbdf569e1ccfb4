"""The Zero Bubble paper's measured setups (Tables 3 and 6), as Costs.

Times are the profiled T_F, T_B, T_W, T_comm of one pipeline stage (ms) for each model, stage
count and micro-batch count. Memory follows Table 1 per transformer layer: M_B = sb(34h + 5as),
M_W = 32sbh; in units of M_B, M_W = 32h / (34h + 5as) — the common factor sb and the layer count
cancel.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeloom.costs import Costs

__all__ = ["ZBProfile", "ZB_PROFILES", "PAPER_TABLE5"]


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
