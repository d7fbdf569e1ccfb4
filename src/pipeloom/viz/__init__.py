"""Outputs for people: trace files and timeline pictures (matplotlib is imported only to plot)."""

from pipeloom.viz.plot import plot_timeline
from pipeloom.viz.trace import chrome_trace, write_chrome_trace

__all__ = ["chrome_trace", "plot_timeline", "write_chrome_trace"]
