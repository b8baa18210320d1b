"""Distillation: data made by the target itself, and (later) drafter training."""
