"""Measuring: memory tracking, step timing, FLOPs, per-block profiles, fake-tensor estimates."""
