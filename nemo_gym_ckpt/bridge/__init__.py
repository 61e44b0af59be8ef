"""NeMo Gym's own servers as participants of the mesh: their declarations, their process (docs/verifiers.md)."""
