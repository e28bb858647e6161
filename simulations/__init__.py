"""Rebalancing simulations on a virtual clock, driving the real ring and engine."""
