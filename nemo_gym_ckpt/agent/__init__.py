"""Agent servers as checkpoint participants: loop state per activation, exported at boundaries."""
