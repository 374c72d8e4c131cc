"""Evaluation metrics and held-out checks."""
