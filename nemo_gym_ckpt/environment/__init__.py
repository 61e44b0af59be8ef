"""Environment servers: episodes as named steps with boundaries, the base, the participant adapter."""
