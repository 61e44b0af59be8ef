"""Processes from config: the launcher, the head server, what a server child does."""
