"""Consistent-hash ring with versioned membership."""
