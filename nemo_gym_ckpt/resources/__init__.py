"""Resources servers: the base, the session table, the participant adapter."""
