"""Torch-specific pieces of keras_dist (replicated steps, rank gating)."""
