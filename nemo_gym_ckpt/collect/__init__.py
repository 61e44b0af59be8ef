"""Rollout collection: dispatch, the collector as checkpoint controller, its published files, rows."""
