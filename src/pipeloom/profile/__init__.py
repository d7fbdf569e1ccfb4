"""Measuring the real model on this machine (torch)."""
