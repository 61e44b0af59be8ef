"""The demo: a reference run against a run that is checkpointed, killed and restored."""
