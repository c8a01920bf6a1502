"""Prefill/decode disaggregation: the per-room coordination each side runs beside its engine."""
