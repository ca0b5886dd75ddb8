"""Swappable operations behind small interfaces: attention backends (ops.attention) chosen through a registry."""
