"""Tests for raygpt.ops: global norm, AdamW, stochastic rounding (reference and Triton)."""
